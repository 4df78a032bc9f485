"""The Prometheus endpoint of a real kvd: every `kvdctl stats` counter is there, values move with
traffic, latency histograms count lookups, puts and gets; `kvdctl stats --watch` redraws."""

import json
import os
import re
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest

import kvd
from kvd_daemon import KvdDaemon

SAMPLE = re.compile(r'^([a-z_]+)\{([^}]*)\} (\S+)$')


@pytest.fixture(scope="module")
def metered():
    d = KvdDaemon(node="metered", extra='metrics: {listen: "127.0.0.1:0"}')
    yield d
    d.stop()


def scrape(daemon):
    with urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        assert labels.pop("node") == "metered"
        samples[(m.group(1), tuple(sorted(labels.items())))] = float(m.group(3))
    return samples, types


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def kvdctl(*args):
    return subprocess.run([os.environ.get("KVDCTL_BINARY", "kvdctl"), *args],
                          capture_output=True, text=True, timeout=30)


def test_metrics_move_with_traffic(metered):
    before, types = scrape(metered)
    assert value(before, "kvd_up") == 1
    for op in ("lookup", "put", "get"):
        assert value(before, "kvd_request_duration_seconds_count", op=op) == 0
    assert types["kvd_request_duration_seconds"] == "histogram"
    assert types["kvd_puts_committed_total"] == "counter"
    assert types["kvd_host_leases_open"] == "gauge"

    c = kvd.connect(metered.address, model="stories260k", ucx_tls="sm,tcp", net_devices="lo",
                    namespace="tenant-a")
    chain = c.hash(np.arange(3 * 256, dtype=np.int32))
    data = np.random.default_rng(0).integers(0, 256, c.chunk_bytes, dtype=np.uint8)
    for h in chain:
        c.put(h, 256, data)
    hit = c.lookup(chain)
    out = np.empty_like(data)
    for i in range(3):
        c.get(hit.lease_id, i, out)
    during, _ = scrape(metered)
    assert value(during, "kvd_host_leases_open") == 1
    c.release(hit.lease_id)
    c.lookup(c.hash(np.arange(10_000, 10_256, dtype=np.int32)))  # a miss
    after, _ = scrape(metered)

    assert value(after, "kvd_request_duration_seconds_count", op="put") == 3
    assert value(after, "kvd_request_duration_seconds_count", op="lookup") == 2
    assert value(after, "kvd_request_duration_seconds_count", op="get") == 3
    for op in ("lookup", "put", "get"):
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                         if k[0] == "kvd_request_duration_seconds_bucket"
                         and dict(k[1])["op"] == op)
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), "buckets must be cumulative"
        assert buckets[-1] == (float("inf"), value(after, "kvd_request_duration_seconds_count",
                                                   op=op))
        assert value(after, "kvd_request_duration_seconds_sum", op=op) > 0
    assert value(after, "kvd_puts_committed_total") == 3
    assert value(after, "kvd_put_bytes_total") == 3 * c.chunk_bytes
    assert value(after, "kvd_gets_total") == 3
    assert value(after, "kvd_tier_chunks", tier="host") == 3
    assert value(after, "kvd_tier_used_bytes", tier="host") == 3 * c.chunk_bytes
    assert value(after, "kvd_tier_hits_total", tier="host") == 1
    assert value(after, "kvd_tier_misses_total", tier="host") == 1
    assert value(after, "kvd_model_chunks", model="stories260k") == 3
    assert value(after, "kvd_namespace_bytes", namespace="tenant-a") == 3 * c.chunk_bytes
    assert value(after, "kvd_host_leases_open") == 0
    assert value(after, "kvd_sessions") == 1
    c.close()

    # Every counter kvdctl stats shows is exported, with the same value.
    r = kvdctl("--addr", metered.address, "--json", "stats")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    final, types = scrape(metered)
    for name, v in stats["counters"].items():
        metric = f"kvd_{name}" if types.get(f"kvd_{name}") == "gauge" else f"kvd_{name}_total"
        assert (metric, ()) in final, f"{name} missing from /metrics"
        if not name.startswith(("frames_", "sessions_")):  # kvdctl's own session moves those
            assert value(final, metric) == v, name


def test_other_paths_and_methods(metered):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{metered.metrics_address}/", timeout=5)
    assert e.value.code == 404 and b"/metrics" in e.value.read()
    req = urllib.request.Request(f"http://{metered.metrics_address}/metrics", data=b"x",
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 405
    scrape(metered)  # still serving


def test_metrics_are_off_by_default(daemon):
    assert daemon.metrics_address == ""


def test_bad_metrics_address_is_a_config_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text('metrics: {listen: "127.0.0.1"}\n')
    r = subprocess.run([os.environ.get("KVD_BINARY", "kvd"), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "metrics.listen" in r.stderr and "127.0.0.1" in r.stderr


def test_kvdctl_stats_watch_redraws(metered):
    p = subprocess.Popen([os.environ.get("KVDCTL_BINARY", "kvdctl"), "--addr",
                          metered.address, "--json", "stats", "--watch"],
                         stdout=subprocess.PIPE, text=True)
    try:
        frames = [json.loads(p.stdout.readline()) for _ in range(3)]
    finally:
        p.kill()
        p.wait()
    assert [f["node"] for f in frames] == ["metered"] * 3
    assert frames[0]["uptime_ms"] < frames[1]["uptime_ms"] < frames[2]["uptime_ms"]
    r = kvdctl("--addr", metered.address, "health", "--watch")
    assert r.returncode == 2 and "--watch" in r.stderr


def test_grafana_dashboard_uses_exported_metrics(metered):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "grafana",
                        "kvd-dashboard.json")
    with open(path) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    _, types = scrape(metered)
    for name in set(re.findall(r"\bkvd_[a-z_]+", " ".join(exprs))):
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        assert family in types, f"the dashboard queries {name}, which kvd does not export"
