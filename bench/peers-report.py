#!/usr/bin/env python3
"""Bookkeeping of bench/peers.sh: turns each peer's output into rows of one results file
(tab-separated: round, peer, bytes, clients, op, gbps, p50_us, p99_us, daemon CPU us/op, daemon
context switches/op; "-" where a peer does not give a figure) and prints the medians over rounds
and the issue's goals with their per-round ratios.

  peers-report.py ingest RESULTS ROUND PEER BYTES CLIENTS KIND FILE
      KIND: kvdbench (kvd-bench --json, also --op memcpy), mooncake (peers-mooncake.py),
      redis (redis-benchmark --csv), perftest_bw / perftest_lat (the "Final:" fields of
      run_perftest in bench/lib.sh). Prints a one-line summary of what it added.
  peers-report.py report RESULTS [IDLE_CPU_PERCENT]
"""
import csv
import json
import statistics
import sys
from collections import defaultdict

NA = "-"


def fmt(v, spec):
    return NA if v is None else format(v, spec)


def human(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def ingest(results, rnd, peer, size, clients, kind, path):
    rows = []  # (op, gbps, p50, p99, cpu, ctx)
    text = open(path).read()
    if kind in ("kvdbench", "mooncake"):
        j = json.loads(text)
        if not j.get("ok", False):
            print(f"  {peer}: FAILED: {j.get('error', 'no result')}", file=sys.stderr)
            return 1
        if kind == "kvdbench" and peer.startswith("kvd-shm") and not j.get("shared_memory"):
            print(f"  {peer}: kvd did not grant the shared-memory path", file=sys.stderr)
            return 1
        for op in ("warmup", "put", "get", "lookup", "pingpong", "pingpong_cross_cpu",
                   "memcpy_fresh", "memcpy_warm", "memcpy_spread", "memcpy_scatter"):
            if op in j:
                p = j[op]
                no_gbps = op == "lookup" or op.startswith("pingpong")
                rows.append((op, None if no_gbps else p["gbps"], p["p50_us"],
                             p["p99_us"], p.get("daemon_cpu_us_per_op"),
                             p.get("daemon_ctx_switches_per_op")))
    elif kind == "redis":
        for r in csv.DictReader(l for l in text.splitlines() if l.startswith('"')):
            op = {"SET": "put", "GET": "get"}.get(r["test"])
            if op:
                rows.append((op, float(r["rps"]) * size / 1e9, float(r["p50_latency_ms"]) * 1e3,
                             float(r["p99_latency_ms"]) * 1e3, None, None))
    elif kind == "perftest_bw":
        f = text.split()
        rows.append(("send", float(f[5]) * 1048576 / 1e9, None, None, None, None))
    elif kind == "perftest_lat":
        f = text.split()
        rows.append(("latency", None, float(f[1]), None, None, None))
    else:
        raise SystemExit(f"unknown kind {kind}")
    with open(results, "a") as out:
        for op, gbps, p50, p99, cpu, ctx in rows:
            out.write("\t".join([rnd, peer, str(size), str(clients), op, fmt(gbps, ".4f"),
                                 fmt(p50, ".1f"), fmt(p99, ".1f"), fmt(cpu, ".1f"),
                                 fmt(ctx, ".2f")]) + "\n")
    summary = "; ".join(
        f"{op} " + (f"{gbps:.3f} GB/s " if gbps is not None else "")
        + (f"p50 {p50:.0f} us" if p50 is not None else "")
        + (f" p99 {p99:.0f} us" if p99 is not None else "")
        + (f", daemon {cpu:.0f} us CPU/op" if cpu is not None else "") for op, gbps, p50, p99, cpu, ctx in rows)
    print(f"  round {rnd} {peer:16s} {human(size):>7s} x{clients}: {summary}")
    return 0


def load(results):
    data = defaultdict(lambda: defaultdict(list))  # (peer,size,clients,op) -> field -> [per round]
    for line in open(results):
        rnd, peer, size, clients, op, *vals = line.rstrip("\n").split("\t")
        key = (peer, int(size), int(clients), op)
        for name, v in zip(("gbps", "p50", "p99", "cpu", "ctx"), vals):
            if v != NA:
                data[key][name].append((int(rnd), float(v)))
    return data


def med(pairs):
    return statistics.median(v for _, v in pairs) if pairs else None


def report(results, idle):
    data = load(results)
    print("\n== medians over rounds (GB/s = 1e9 bytes/s; latency per operation) ==")
    print("| peer | size | clients | op | GB/s | p50 us | p99 us | daemon CPU us/op | daemon ctx sw/op | rounds |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key in sorted(data, key=lambda k: (k[1], k[2], k[0], k[3])):
        d = data[key]
        n = max(len(v) for v in d.values())
        print(f"| {key[0]} | {human(key[1])} | {key[2]} | {key[3]} | {fmt(med(d['gbps']), '.3f')} | "
              f"{fmt(med(d['p50']), '.0f')} | {fmt(med(d['p99']), '.0f')} | "
              f"{fmt(med(d['cpu']), '.0f')} | {fmt(med(d['ctx']), '.2f')} | {n} |")

    def ratio(a, b, field, cmp, limit, label,
              note="reference (the goal is judged on the plain tag_bw line)"):
        """Per-round ratio a/b of `field`, their median, and the goal verdict (limit None: a
        reference line without a verdict, `note` in the verdict column)."""
        ra, rb = dict(data.get(a, {}).get(field, [])), dict(data.get(b, {}).get(field, []))
        rounds = sorted(set(ra) & set(rb))
        if not rounds:
            print(f"| {label} | not measured | - | - |")
            return
        per = [ra[r] / rb[r] if rb[r] > 0 else float("inf") for r in rounds]
        m = statistics.median(per)
        if limit is None:
            print(f"| {label} | {', '.join(f'{x:.2f}' for x in per)} | {m:.2f} | {note} |")
            return
        ok = m >= limit if cmp == ">=" else m <= limit
        print(f"| {label} | {', '.join(f'{x:.2f}' for x in per)} | {m:.2f} (goal {cmp} {limit}) | "
              f"{'met' if ok else 'NOT met'} |")

    print("\n== goals (ratio per round, median of the ratios) ==")
    print("| goal | per round | median | verdict |")
    print("| --- | --- | --- | --- |")
    for size in (2 << 20, 32 << 20):
        h = human(size)
        for op in ("put", "get"):
            ratio(("kvd-shm", size, 1, op), ("memcpy", size, 1, "memcpy_warm"), "gbps", ">=", 0.7,
                  f"kvd shm {op} {h} / memcpy (warm)")
        # A put writes a slot whose bytes are no longer in the cache (the chunk evicted longest
        # ago): the copy into as many distinct destinations as the arena holds chunks.
        ratio(("kvd-shm", size, 1, "put"), ("memcpy", size, 1, "memcpy_scatter"), "gbps", ">=",
              0.7, f"kvd shm put {h} / memcpy (scatter destinations)")
        # A get reads one of many stored chunks: the copy from as many distinct sources.
        ratio(("kvd-shm", size, 1, "get"), ("memcpy", size, 1, "memcpy_spread"), "gbps", ">=", 0.7,
              f"kvd shm get {h} / memcpy (spread sources)")
        for op in ("put", "get"):
            ratio(("kvd-shm", size, 1, op), ("mooncake-inproc", size, 1, op), "gbps", ">=", 1.0,
                  f"kvd shm {op} {h} / Mooncake in-process {op}")
        for op in ("put", "get"):
            ratio(("kvd-shm", size, 4, op), ("kvd-shm", size, 1, op), "gbps", ">=", 1.5,
                  f"kvd shm {op} {h}: 4 clients / 1 client")
        # The same scaling for plain copies in the same rounds (kvd-bench --op memcpy with 4
        # threads): how far the machine's cores and memory let four copying clients go at all.
        for op, ref in (("put", "memcpy_scatter"), ("get", "memcpy_spread")):
            ratio(("memcpy", size, 4, ref), ("memcpy", size, 1, ref), "gbps", None, None,
                  f"{ref} {h} (the {op}'s reference): 4 threads / 1 thread",
                  "reference: what the machine gives four copies")
        for op in ("put", "get"):
            ratio(("kvd-ucx", size, 1, op), ("ucx_perftest", size, 1, "send"), "gbps", ">=", 0.8,
                  f"kvd UCX {op} {h} / ucx_perftest tag_bw")
        # The same lanes as kvd's endpoints (peer error handling): what UCX itself does there.
        for op in ("put", "get"):
            ratio(("kvd-ucx", size, 1, op), ("ucx_perftest-e", size, 1, "send"), "gbps", None,
                  None, f"kvd UCX {op} {h} / ucx_perftest tag_bw -e (peer error handling)")
    ratio(("kvd-shm", 64 << 10, 1, "get"), ("redis", 64 << 10, 1, "get"), "p50", "<=", 1.5,
          "64 KiB get p50: kvd shm / redis GET")
    floor_line(data, "pingpong", "p50", [64 << 10],
               "unix socket ping-pong p50 in the 64 KiB runs (the floor under one exchange)")
    floor_line(data, "pingpong_cross_cpu", "p50", [64 << 10],
               "the same ping-pong across two CPUs, p50 (64 KiB runs)")
    worst = worst_per_round(data, "lookup", "p99")
    if worst:
        m = statistics.median(worst)
        print(f"| lookup p99 on the unix socket (worst size per round) | "
              f"{', '.join(f'{x:.0f} us' for x in worst)} | {m:.0f} us (goal < 50 us) | "
              f"{'met' if m < 50 else 'NOT met'} |")
    floor_line(data, "pingpong", "p99", None,
               "unix socket ping-pong p99 in the same runs (worst size per round)")
    floor_line(data, "pingpong_cross_cpu", "p99", None,
               "the same ping-pong across two CPUs, p99 (worst size per round)")
    if idle is not None:
        print(f"| idle daemon CPU | - | {idle:.2f} % of a core (goal < 1 %) | "
              f"{'met' if idle < 1 else 'NOT met'} |")
    report_in_place(data)
    report_lookups(data)


def worst_per_round(data, op, field, sizes=None):
    """Per round, the largest `field` of kvd-shm's 1-client `op` rows over the sizes (all when
    `sizes` is None); rounds in order."""
    per = defaultdict(list)
    for k, d in data.items():
        if k[0] == "kvd-shm" and k[2] == 1 and k[3] == op and (sizes is None or k[1] in sizes):
            for r, v in d[field]:
                per[r].append(v)
    return [max(v) for _, v in sorted(per.items())]


def floor_line(data, op, field, sizes, label):
    """A reference row of the goals table: a ping-pong phase (kvd-bench --pingpong-floor, `op`
    pingpong or pingpong_cross_cpu) measured right before the lookups of the same runs."""
    worst = worst_per_round(data, op, field, sizes)
    if worst:
        print(f"| {label} | {', '.join(f'{x:.0f} us' for x in worst)} | "
              f"{statistics.median(worst):.0f} us | reference (no goal) |")


def report_lookups(data):
    """Lookup latency per size (1 client) next to the ping-pong floor of the same runs."""
    sizes = sorted({k[1] for k in data if k[0] == "kvd-shm" and k[2] == 1 and k[3] == "lookup"})
    if not sizes:
        return
    print("\n== lookups on the unix socket, 1 client, against the floor under one exchange "
          "(a unix socket pair ping-pong right before the lookups, same kvd-bench run: the two "
          "processes where the scheduler puts them, and pinned to two CPUs; per round, then the "
          "median) ==")
    print("| size | lookup p50 us | lookup p99 us | ping-pong p50 us | ping-pong p99 us | "
          "across CPUs p50 us | across CPUs p99 us | lookup p99 / ping-pong p99 |")
    print("| ---: | --- | --- | --- | --- | --- | --- | --- |")
    for size in sizes:
        look = data.get(("kvd-shm", size, 1, "lookup"), {})
        pp = data.get(("kvd-shm", size, 1, "pingpong"), {})
        apart = data.get(("kvd-shm", size, 1, "pingpong_cross_cpu"), {})

        def cell(d, field):
            v = [x for _, x in sorted(d.get(field, []))]
            return f"{', '.join(f'{x:.0f}' for x in v)} ({statistics.median(v):.0f})" if v else NA

        la, pa = dict(look.get("p99", [])), dict(pp.get("p99", []))
        rounds = sorted(set(la) & set(pa))
        per = [la[r] / pa[r] for r in rounds if pa[r] > 0]
        rat = (f"{', '.join(f'{x:.2f}' for x in per)} ({statistics.median(per):.2f})"
               if per else NA)
        print(f"| {human(size)} | {cell(look, 'p50')} | {cell(look, 'p99')} | {cell(pp, 'p50')} | "
              f"{cell(pp, 'p99')} | {cell(apart, 'p50')} | {cell(apart, 'p99')} | {rat} |")


def report_in_place(data):
    """The zero-copy calls (kvd-bench --in-place) against the copying path and the peers."""
    rows = []
    for size in (64 << 10, 2 << 20, 32 << 20):
        h = human(size)
        for op in ("put", "get"):
            a = ("kvd-shm-inplace", size, 1, op)
            for b, label in ((("kvd-shm", size, 1, op), f"kvd shm {op}"),
                             (("memcpy", size, 1, "memcpy_warm"), "memcpy (warm)"),
                             (("memcpy", size, 1, "memcpy_spread"), "memcpy (spread sources)"),
                             (("mooncake-inproc", size, 1, op), f"Mooncake in-process {op}")):
                ra, rb = dict(data.get(a, {}).get("gbps", [])), dict(data.get(b, {}).get("gbps", []))
                rounds = sorted(set(ra) & set(rb))
                if rounds:
                    per = [ra[r] / rb[r] if rb[r] > 0 else float("inf") for r in rounds]
                    rows.append(f"| kvd shm in-place {op} {h} / {label} | "
                                f"{', '.join(f'{x:.2f}' for x in per)} | {statistics.median(per):.2f} |")
    if rows:
        print("\n== zero-copy calls, 1 client (GB/s ratio per round, median of the ratios) ==")
        print("| ratio | per round | median |")
        print("| --- | --- | --- |")
        print("\n".join(rows))




def main():
    if len(sys.argv) >= 9 and sys.argv[1] == "ingest":
        return ingest(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]),
                      sys.argv[7], sys.argv[8])
    if len(sys.argv) in (3, 4) and sys.argv[1] == "report":
        report(sys.argv[2], float(sys.argv[3]) if len(sys.argv) == 4 else None)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
