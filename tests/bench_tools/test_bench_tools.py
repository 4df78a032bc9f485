"""The benchmark tools without the peers: kvd-bench --op memcpy, kvd-bench's per-op daemon
counters against a real kvd, the goal arithmetic of bench/peers-report.py, one short
run of bench/peers.sh (kvd's shared-memory path and memcpy only), kvd-cluster-bench's
router-index report and one short run of bench/cluster-staleness.sh (skipped without etcd)."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.environ.get("KVD_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import tied_popen  # noqa: E402  (kvd dies with the test process, however it ends)

KVD = os.environ.get("KVD_BINARY", "kvd")
BENCH = os.environ.get("KVD_BENCH_BINARY", "kvd-bench")
REPORT = os.path.join(ROOT, "bench", "peers-report.py")


def run(args, timeout=60):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def shm_left_behind(before, grace_s=3.0):
    """Names under /dev/shm that were not there `before` and are still there after `grace_s`.
    UCX processes of tests running beside this one (ctest -j) create short-lived names there and
    unlink them at once, so a name only counts as left behind when it stays."""
    deadline = time.monotonic() + grace_s
    while True:
        new = set(os.listdir("/dev/shm")) - before
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.2)


def test_memcpy_reports_fresh_warm_spread_and_scatter_phases():
    # --scatter-bytes 256K: 4 destinations of 64 KiB, 2 per thread, each written in turn.
    for extra in ([], ["--scatter-bytes", "256K"]):
        r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--count", "9", "--concurrency",
                 "2", "--json"] + extra)
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert j["ok"] and j["op"] == "memcpy" and j["concurrency"] == 2
        for phase in ("memcpy_fresh", "memcpy_warm", "memcpy_spread", "memcpy_scatter"):
            p = j[phase]
            assert p["ops"] == 9 and p["bytes"] == 9 * 65536, (phase, extra)
            assert p["gbps"] > 0 and 0 < p["p50_us"] <= p["p99_us"], (phase, extra)


def test_pingpong_reports_one_round_trip_per_op():
    r = run([BENCH, "--op", "pingpong", "--count", "200", "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["ok"] and j["op"] == "pingpong" and j["message_bytes"] == 64
    # Where the scheduler puts the two processes, and pinned to two CPUs (with two to use).
    phases = ["pingpong"] + (["pingpong_cross_cpu"] if len(os.sched_getaffinity(0)) >= 2 else [])
    assert [k for k in j if k.startswith("pingpong")] == phases, j
    for name in phases:
        p = j[name]
        assert p["ops"] == 200 and p["bytes"] == 200 * 2 * 64, name
        assert 0 < p["p50_us"] <= p["p99_us"], name
    # On one CPU there is no cross-CPU phase (and the one phase still runs).
    r = run(["taskset", "-c", str(min(os.sched_getaffinity(0))), BENCH, "--op", "pingpong",
             "--count", "20", "--json"])
    j = json.loads(r.stdout)
    assert r.returncode == 0 and j["pingpong"]["ops"] == 20 and "pingpong_cross_cpu" not in j
    r = run([BENCH, "--op", "pingpong", "--count", "5", "--warmup", "2"])
    assert r.returncode == 2 and "--warmup needs a daemon (not --op pingpong)" in r.stderr


def test_help_names_every_option():
    r = run([BENCH, "--help"])
    assert r.returncode == 0, r.stderr
    for flag in ["--addr", "--ucx-tls", "--net-devices", "--namespace", "--hash-seed",
                 "--client-id", "--timeout-ms", "--model", "--chunk-bytes", "--tokens", "--count",
                 "--concurrency", "--op", "--depth", "--lookup-batch", "--lookup-chain", "--daemon-pid",
                 "--ready-file", "--no-shm", "--verify", "--finite-values", "--retry-busy",
                 "--warmup", "--scatter-bytes", "--json"]:
        assert flag in r.stdout, flag
    r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--count", "lots"])
    assert r.returncode == 2 and "--count" in r.stderr, r.stderr


def test_usage_errors_name_the_problem():
    r = run([BENCH, "--op", "memcpy", "--count", "4"])
    assert r.returncode == 2 and "--op memcpy needs --chunk-bytes" in r.stderr
    r = run([BENCH, "--op", "copy", "--chunk-bytes", "64K"])
    assert r.returncode == 2 and "--op must be put, get, both, memcpy or pingpong" in r.stderr
    # A pid that cannot exist (above the kernel's pid_max).
    r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--daemon-pid", "99999999"])
    assert r.returncode == 2 and "daemon pid 99999999: NOT_FOUND" in r.stderr, r.stderr
    r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--ready-file", "/nonexistent"])
    assert r.returncode == 2 and "cannot read --ready-file /nonexistent" in r.stderr
    # A folder is not a ready file: the same usage error, not an abort.
    r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--ready-file", "/tmp"])
    assert r.returncode == 2 and "cannot read --ready-file /tmp" in r.stderr, r
    r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--warmup", "2"])
    assert r.returncode == 2 and "--warmup needs a daemon" in r.stderr, r.stderr
    r = run([BENCH, "--op", "memcpy", "--chunk-bytes", "64K", "--scatter-bytes", "-1"])
    assert r.returncode == 2 and "--scatter-bytes must be >= 0" in r.stderr, r.stderr
    r = run([BENCH, "--op", "put", "--model", "m", "--chunk-bytes", "64K", "--scatter-bytes",
             "1M"])
    assert r.returncode == 2 and "--scatter-bytes needs --op memcpy" in r.stderr, r.stderr


@contextlib.contextmanager
def start_kvd(tmp_path, cfg):
    """Runs kvd on `cfg` (TCP on an ephemeral port, a unix socket in tmp_path) for the `with`
    block; gives (process, ready-file path, socket path) once kvd is ready."""
    ready = tmp_path / "ready.json"
    proc = tied_popen.popen([KVD, "--config", str(cfg), "--listen", "127.0.0.1:0", "--unix",
                             str(tmp_path / "kvd.sock"), "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "kvd.log", "w"))
    try:
        for _ in range(300):
            if ready.exists() and ready.stat().st_size > 0:
                break
            assert proc.poll() is None, (tmp_path / "kvd.log").read_text()
            time.sleep(0.05)
        yield proc, ready, tmp_path / "kvd.sock"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def kvd(tmp_path):
    cfg = tmp_path / "kvd.yaml"
    # One small model: 8 MiB segments hold its largest chunk (the shared-memory path is on).
    cfg.write_text("models:\n"
                   "  - name: stories260k\n"
                   "    layout: {layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, dtype: float32,\n"
                   "             rope: {theta: 10000, pairing: interleaved, scaling: none}}\n"
                   "tiers:\n  host:\n    capacity: 64MiB\n    segment: 8MiB\n")
    with start_kvd(tmp_path, cfg) as started:
        yield started


def test_daemon_counters_per_op_against_a_real_kvd(kvd):
    proc, ready, sock = kvd
    assert json.loads(ready.read_text())["pid"] == proc.pid
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "256",
             "--count", "20", "--op", "both", "--ready-file", str(ready), "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["daemon_pid"] == proc.pid and j["shared_memory"]
    for phase in ("put", "lookup", "get"):
        p = j[phase]
        assert p["ops"] == 20
        # The daemon served every operation: it ran, and its threads slept and woke between
        # requests (epoll waits), so both counters moved.
        assert p["daemon_cpu_us_per_op"] > 0, r.stdout
        assert p["daemon_ctx_switches_per_op"] > 0, p
        assert p["daemon_cpu_source"] in ("schedstat", "stat")
        assert "daemon_rw_syscalls_per_op" in p
    # Without the option there are no daemon figures.
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "256",
             "--count", "4", "--op", "put", "--json"])
    assert r.returncode == 0 and "daemon_cpu_us_per_op" not in r.stdout


def kvd_counters(sock):
    r = run([os.path.join(os.path.dirname(os.path.abspath(BENCH)), "kvdctl"), "--addr",
             f"unix:{sock}", "--json", "stats"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["counters"]


def test_warmup_is_its_own_phase_with_its_own_keys(kvd):
    proc, ready, sock = kvd
    # 2 threads x 3 warmup rounds (a put and a get each), then the timed phases of 10 chunks:
    # the warmup's keys are not the timed ones (the timed puts store 10 new chunks).
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "64",
             "--count", "10", "--concurrency", "2", "--op", "both", "--warmup", "3", "--verify",
             "--ready-file", str(ready), "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["warmup_rounds"] == 3 and j["shared_memory"]
    chunk = j["chunk_bytes"]
    w = j["warmup"]
    assert w["ops"] == 6 and w["bytes"] == 6 * 2 * chunk
    assert 0 < w["p50_us"] <= w["p99_us"] and w["daemon_cpu_us_per_op"] > 0
    for phase in ("put", "lookup", "get"):
        assert j[phase]["ops"] == 10, j[phase]
    assert j["put"]["bytes"] == 10 * chunk
    # 6 warmup chunks + 10 timed ones, all new: 16 commits, none a dedup of another.
    counters = kvd_counters(sock)
    assert counters["host_commits"] == 16 and counters["host_dedup_puts"] == 0, counters
    # --op get keeps the warmup and drops only the untimed put.
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "64",
             "--count", "4", "--op", "get", "--warmup", "1", "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert "put" not in j and j["warmup"]["ops"] == 1 and j["get"]["ops"] == 4
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "64",
             "--warmup", "-1"])
    assert r.returncode == 2 and "--warmup must be >= 0" in r.stderr, r.stderr


def test_in_place_puts_and_gets_are_byte_exact(kvd):
    proc, ready, sock = kvd
    # Zero-copy calls: 12 chunks written in place and read in place (--verify compares the views
    # with the regenerated bytes), 2 threads; each view's read ended.
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "256",
             "--count", "12", "--concurrency", "2", "--op", "both", "--in-place", "--verify",
             "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["in_place"] and j["shared_memory"]
    for phase in ("put", "lookup", "get"):
        assert j[phase]["ops"] == 12, j[phase]
    assert j["get"]["bytes"] == 12 * j["chunk_bytes"]
    counters = kvd_counters(sock)
    assert counters["host_commits"] == 12 and counters["host_reads_open"] == 0, counters
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "256",
             "--in-place", "--depth", "2"])
    assert r.returncode == 2 and "--in-place needs --depth 1" in r.stderr, r.stderr


def test_lookup_chain_counts_lookup_calls(kvd):
    proc, ready, sock = kvd
    # 20 chunks in chains of 8: 3 Lookup calls (8, 8, 4 chunks); every chunk must be found.
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "16",
             "--count", "20", "--op", "get", "--lookup-chain", "8", "--ready-file", str(ready),
             "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["lookup_chain"] == 8
    assert j["lookup"]["ops"] == 3 and j["get"]["ops"] == 20
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "16",
             "--lookup-chain", "0"])
    assert r.returncode == 2 and "--lookup-chain must be > 0" in r.stderr, r.stderr


def test_lookups_go_round_the_chunks_and_the_floor_comes_right_before_them(kvd):
    proc, ready, sock = kvd
    # 5 chunks, 2 threads (3 and 2 chunks), 23 lookups in all: 12 and 11 calls going round.
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "16",
             "--count", "5", "--concurrency", "2", "--op", "both", "--lookups", "23",
             "--pingpong-floor", "50", "--ready-file", str(ready), "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["lookups"] == 23 and j["pingpong_floor"] == 50
    assert j["lookup"]["ops"] == 23 and j["get"]["ops"] == 5 and j["put"]["ops"] == 5
    for name in ["pingpong"] + (["pingpong_cross_cpu"] if len(os.sched_getaffinity(0)) >= 2
                                else []):
        p = j[name]
        assert p["ops"] == 50 and p["bytes"] == 50 * 2 * 64 and 0 < p["p50_us"] <= p["p99_us"]
        assert "daemon_cpu_us_per_op" not in p  # kvd takes no part in it
    # Without the options: one Lookup per chunk, no floor.
    r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "16",
             "--count", "5", "--op", "both", "--json"])
    j = json.loads(r.stdout)
    assert r.returncode == 0 and j["lookup"]["ops"] == 5 and "pingpong" not in j
    for bad, why in ((["--op", "put", "--lookups", "4"], "need a lookup phase"),
                     (["--op", "put", "--pingpong-floor", "4"], "need a lookup phase"),
                     (["--lookups", "-1"], "--lookups and --pingpong-floor must be >= 0")):
        r = run([BENCH, "--addr", f"unix:{sock}", "--model", "stories260k", "--tokens", "16"] + bad)
        assert r.returncode == 2 and why in r.stderr, (bad, r.stderr)


def test_bench_small_ops_short_run(tmp_path):
    build = os.path.dirname(os.path.dirname(os.path.abspath(BENCH)))
    env = dict(os.environ, KVD_SMALL_ROUNDS="1", KVD_SMALL_COUNT="20",
               KVD_SMALL_RESULTS=str(tmp_path / "results.tsv"))
    shm_before = set(os.listdir("/dev/shm"))
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "small-ops.sh"), build],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    names = {l.split("\t")[1] for l in open(tmp_path / "results.tsv").read().splitlines()}
    for size in (1280, 16384, 65536):
        for way in ("inline", "3-step shm", "3-step ucx"):
            assert f"put {size} {way}" in names, names
    for chain in (1, 16, 64):
        assert f"lookup chain {chain}" in names, names
    assert "unix ping-pong (reference)" in names, names
    if len(os.sched_getaffinity(0)) >= 2:
        assert "unix ping-pong across CPUs (reference)" in names, names
    for size in (16384, 65536):
        for depth in (1, 4, 16):
            assert f"get {size} depth {depth} shm" in names and f"get {size} depth {depth} ucx" in names
    assert "medians over rounds" in r.stdout
    assert not shm_left_behind(shm_before)


@pytest.fixture
def compressing_kvd(tmp_path):
    """kvd with one compressing model (KeyDiff needs no window queries) and a one-chunk pool."""
    cfg = tmp_path / "kvd.yaml"
    cfg.write_text("models:\n"
                   "  - name: stories-keydiff\n"
                   "    layout: {layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, dtype: float32,\n"
                   "             rope: {theta: 10000, pairing: interleaved, scaling: none}}\n"
                   "    compression: {stages: [keydiff], p_c: 0.5, sinks: 4, worker_threads: 1,\n"
                   "                  queue_depth: 1}\n"
                   "tiers:\n  host:\n    capacity: 64MiB\n    segment: 8MiB\n")
    with start_kvd(tmp_path, cfg) as (proc, _, sock):
        yield proc, sock


def test_finite_values_and_retry_busy_against_a_compressing_model(compressing_kvd):
    proc, sock = compressing_kvd
    base = [BENCH, "--addr", f"unix:{sock}", "--model", "stories-keydiff", "--tokens", "256",
            "--op", "put", "--json"]
    # Random bytes hold NaN/Inf floats (1 in 256 values), which kvd refuses to compress.
    r = run(base + ["--count", "1"])
    assert r.returncode == 1, r.stdout
    j = json.loads(r.stdout)
    assert not j["ok"] and "INVALID_ARGUMENT" in j["error"], j
    # --finite-values clears the top exponent bit of every value: kvd compresses them.
    # (One put: the pool releases its admission just after the acknowledgement, so even one
    # client's next put may find it still held.)
    r = run(base + ["--count", "1", "--finite-values"])
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads(r.stdout)
    assert j["ok"] and j["put"]["ops"] == 1 and "busy_retries" not in j["put"]
    # A flood of 8 clients against a pool that admits one chunk at a time: kvd refuses puts
    # (RESOURCE_EXHAUSTED) and --retry-busy retries them until every chunk is stored.
    r = run(base + ["--count", "48", "--concurrency", "8", "--finite-values", "--retry-busy"])
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads(r.stdout)
    assert j["ok"] and j["put"]["ops"] == 48, j
    assert j["put"]["busy_retries"] > 0, j
    assert proc.poll() is None


def write_results(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write("\t".join(str(x) for x in row) + "\n")


def test_report_ratios_medians_and_verdicts(tmp_path):
    two, big = 2 << 20, 32 << 20
    rows = []
    for rnd, (shm_put, memcpy) in enumerate([(7.0, 10.0), (8.0, 10.0), (1.0, 10.0)], 1):
        rows.append((rnd, "kvd-shm", two, 1, "put", shm_put, 100, 200, 50, 1.5))
        rows.append((rnd, "memcpy", two, 1, "memcpy_warm", memcpy, 10, 20, "-", "-"))
        rows.append((rnd, "kvd-shm", two, 1, "get", 3.0, 100, 200, 50, 1.5))
        rows.append((rnd, "memcpy", two, 1, "memcpy_spread", 2.0 + rnd, 10, 20, "-", "-"))
        rows.append((rnd, "memcpy", two, 1, "memcpy_scatter", 7.0 + rnd, 10, 20, "-", "-"))
        rows.append((rnd, "memcpy", two, 4, "memcpy_scatter", 8.0 + rnd, 10, 20, "-", "-"))
        rows.append((rnd, "kvd-shm", 65536, 1, "get", 1.0, 30, 40, 5, 1))
        rows.append((rnd, "redis", 65536, 1, "get", 2.0, 10, 30, "-", "-"))
        rows.append((rnd, "kvd-shm", 65536, 1, "lookup", "-", 20, 40 + rnd, 3, 1))
        rows.append((rnd, "kvd-shm", 65536, 1, "pingpong", "-", 9 + rnd, 20, "-", "-"))
        rows.append((rnd, "kvd-shm", 65536, 1, "pingpong_cross_cpu", "-", 25, 60, "-", "-"))
        rows.append((rnd, "kvd-shm", two, 1, "lookup", "-", 15, 30, 3, 1))
        rows.append((rnd, "kvd-shm", two, 1, "pingpong", "-", 8, 10 * rnd, "-", "-"))
        rows.append((rnd, "kvd-ucx", two, 1, "put", 1.0, 500, 900, 300, 4))
        rows.append((rnd, "ucx_perftest", two, 1, "send", 4.0, "-", "-", "-", "-"))
        rows.append((rnd, "ucx_perftest-e", two, 1, "send", 0.5 * rnd, "-", "-", "-", "-"))
    write_results(tmp_path / "r.tsv", rows)
    r = run([sys.executable, REPORT, "report", str(tmp_path / "r.tsv"), "0.4"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # Per-round ratios 0.70, 0.80, 0.10; their median 0.70 meets ">= 0.7".
    assert "| kvd shm put 2 MiB / memcpy (warm) | 0.70, 0.80, 0.10 | 0.70 (goal >= 0.7) | met |" \
        in out, out
    # 30 us vs 10 us: 3x redis, goal <= 1.5x.
    assert "| 64 KiB get p50: kvd shm / redis GET | 3.00, 3.00, 3.00 | 3.00 (goal <= 1.5) | NOT met |" \
        in out, out
    assert "| lookup p99 on the unix socket (worst size per round) | 41 us, 42 us, 43 us | 42 us" \
        in out, out
    assert "| idle daemon CPU | - | 0.40 % of a core (goal < 1 %) | met |" in out
    # The floor next to the goals: ping-pong p50 of the 64 KiB runs (10, 11, 12 us); p99 the
    # worst size per round (64 KiB's 20 us against 2 MiB's 10, 20 and 30 us).
    assert "| unix socket ping-pong p50 in the 64 KiB runs (the floor under one exchange) | " \
        "10 us, 11 us, 12 us | 11 us | reference (no goal) |" in out, out
    assert "| unix socket ping-pong p99 in the same runs (worst size per round) | " \
        "20 us, 20 us, 30 us | 20 us | reference (no goal) |" in out, out
    assert "| the same ping-pong across two CPUs, p50 (64 KiB runs) | 25 us, 25 us, 25 us | " \
        "25 us | reference (no goal) |" in out, out
    # Per size: lookups against the floor of their own runs (41/20, 42/20, 43/20; 30/10, 30/20,
    # 30/30).
    assert "| 64 KiB | 20, 20, 20 (20) | 41, 42, 43 (42) | 10, 11, 12 (11) | 20, 20, 20 (20) | " \
        "25, 25, 25 (25) | 60, 60, 60 (60) | 2.05, 2.10, 2.15 (2.10) |" in out, out
    assert "| 2 MiB | 15, 15, 15 (15) | 30, 30, 30 (30) | 8, 8, 8 (8) | 10, 20, 30 (20) | - | - | " \
        "3.00, 1.50, 1.00 (1.50) |" in out, out
    assert "| kvd shm get 32 MiB / memcpy (warm) | not measured |" in out
    # 3.0 GB/s against 3, 4 and 5 GB/s: ratios 1.00, 0.75, 0.60, median 0.75.
    assert "| kvd shm get 2 MiB / memcpy (spread sources) | 1.00, 0.75, 0.60 | 0.75 (goal >= 0.7) " \
        "| met |" in out, out
    # The UCX goal is judged against plain tag_bw; tag_bw -e (kvd's lanes) is a reference line.
    assert "| kvd UCX put 2 MiB / ucx_perftest tag_bw | 0.25, 0.25, 0.25 | 0.25 (goal >= 0.8) " \
        "| NOT met |" in out, out
    assert "| kvd UCX put 2 MiB / ucx_perftest tag_bw -e (peer error handling) | 2.00, 1.00, 0.67 " \
        "| 1.00 | reference (the goal is judged on the plain tag_bw line) |" in out, out
    assert "| kvd UCX get 2 MiB / ucx_perftest tag_bw -e (peer error handling) | not measured |" \
        in out, out
    # Four copying threads against one in the same rounds: (9/8, 10/9, 11/10), a reference for
    # the 4-client goals; the spread copy was not measured with 4 threads.
    assert "| memcpy_scatter 2 MiB (the put's reference): 4 threads / 1 thread | 1.12, 1.11, 1.10 " \
        "| 1.11 | reference: what the machine gives four copies |" in out, out
    assert "| memcpy_spread 2 MiB (the get's reference): 4 threads / 1 thread | not measured |" \
        in out, out
    # A put writes a slot not in the cache: 7, 8 and 1 GB/s against 8, 9 and 10 GB/s.
    assert "| kvd shm put 2 MiB / memcpy (scatter destinations) | 0.88, 0.89, 0.10 | 0.88 " \
        "(goal >= 0.7) | met |" in out, out
    # Medians table: the put row's median GB/s is 7.0.
    assert "| kvd-shm | 2 MiB | 1 | put | 7.000 | 100 | 200 | 50 | 1.50 | 3 |" in out, out


def test_bench_peers_short_run(tmp_path):
    build = os.path.dirname(os.path.dirname(os.path.abspath(BENCH)))
    env = dict(os.environ, KVD_PEERS_ROUNDS="1", KVD_PEERS_SIZES="65536", KVD_PEERS_CLIENTS="1",
               KVD_PEERS_SKIP="kvd-ucx ucx_perftest mooncake redis",
               KVD_PEERS_RESULTS=str(tmp_path / "results.tsv"))
    shm_before = set(os.listdir("/dev/shm"))
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "peers.sh"), build],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kvd idle (no client" in r.stdout
    rows = [l.split("\t") for l in open(tmp_path / "results.tsv").read().splitlines()]
    ops = {(row[1], row[4]) for row in rows}
    assert {("kvd-shm", "warmup"), ("kvd-shm", "put"), ("kvd-shm", "get"), ("kvd-shm", "lookup"),
            ("memcpy", "memcpy_fresh"), ("memcpy", "memcpy_warm"),
            ("memcpy", "memcpy_spread"), ("memcpy", "memcpy_scatter"), ("kvd-shm-inplace", "put"),
            ("kvd-shm-inplace", "get"), ("kvd-shm", "pingpong")} <= ops, ops
    lookups = [row for row in rows if row[1] == "kvd-shm" and row[4] == "lookup"]
    assert lookups and lookups[0][6] != "-" and lookups[0][7] != "-", lookups
    assert "| lookup p99 on the unix socket" in r.stdout
    assert "| unix socket ping-pong p99 in the same runs" in r.stdout, r.stdout
    assert "| 64 KiB |" in r.stdout.split("== lookups on the unix socket")[1], r.stdout
    assert "| kvd shm in-place get 64 KiB / kvd shm get |" in r.stdout, r.stdout
    assert not shm_left_behind(shm_before)


def test_cluster_bench_router_index_reports_bytes_per_chunk():
    cluster_bench = os.path.join(os.path.dirname(os.path.abspath(BENCH)), "kvd-cluster-bench")
    r = run([cluster_bench, "--op", "router-index", "--count", "3000", "--holders-per-chunk", "2",
             "--json"])
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["ok"] and j["chunks"] == 3000 and j["nodes"] == 3 and j["holders_per_chunk"] == 2
    for index in ("bitmask", "entries", "prefix_tree"):
        p = j[index]
        # At least the 8-byte block hash each index keys on.
        assert p["heap_bytes_per_chunk"] >= 8, (index, p)
        assert p["heap_mib_per_million_chunks"] == pytest.approx(
            p["heap_bytes_per_chunk"] * 1e6 / 1048576), (index, p)
    r = run([cluster_bench, "--op", "router-index", "--holders-per-chunk", "4"])
    assert r.returncode == 2 and "--holders-per-chunk 1 to --nodes" in r.stderr
    r = run([cluster_bench, "--op", "staleness", "--addr", "127.0.0.1:1"])
    assert r.returncode == 2 and "--op staleness needs --model, --put-addr and --holder" in r.stderr


def test_bench_cluster_staleness_short_run():
    build = os.path.dirname(os.path.dirname(os.path.abspath(BENCH)))
    if not shutil.which("etcd"):
        pytest.skip("etcd not installed (apt-get install etcd-server)")
    env = dict(os.environ, KVD_BENCH_SAMPLES="3", KVD_BENCH_MEMBER_CYCLES="1",
               KVD_BENCH_CHUNKS="2000", KVD_BENCH_BASELINE_CHUNKS="500")
    shm_before = set(os.listdir("/dev/shm"))
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "cluster-staleness.sh"), build],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # (an event may arrive before the acknowledgement reaches the client: a negative time)
    figures = r"p50 +-?[0-9.]+ us, p99 +-?[0-9.]+ us, max +-?[0-9.]+ us"
    for line in ("commit -> b's cluster lookup lists a: +" + figures,
                 "commit -> a's BlockStored at a subscriber: " + figures,
                 "evict  -> b's cluster lookup no longer: +" + figures,
                 "evict  -> a's BlockRemoved at a subscriber: " + figures):
        assert re.search(line, out), (line, out)
    # Cluster lookups see a change with the first lookup after it.
    assert out.count("(lookups needed: at most 1)") == 2, out
    assert re.search(r"cycle 1: c started -> listed at b [0-9.]+ ms .*kill -9 -> gone at b "
                     r"[0-9.]+ ms", out), out
    assert re.search(r"kvd in no cluster: +private memory .* bytes per chunk", out), out
    assert re.search(r"kvd b, a cluster member: +private memory .* bytes per chunk", out), out
    for holders in (1, 3):
        for index in ("bitmask", "entries", "prefix_tree"):
            assert re.search(rf"router index, 3 nodes, {holders} holding each chunk, {index}: +"
                             r"[0-9.]+ bytes per chunk", out), out
    assert not shm_left_behind(shm_before)
