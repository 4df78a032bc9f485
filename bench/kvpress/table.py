#!/usr/bin/env python3
"""One table of kvd-quality's methods and kvpress's presses on the same segments.

    table.py KVD_OUT KVPRESS_OUT [--against sink_recent] [--bootstrap 2000] [--equal-bytes]

KVD_OUT is a kvd-quality --out folder (results.csv, segments.csv), KVPRESS_OUT a
run_presses.py --out folder. Each method is shown at each p_c as perplexity / its own engine's
full-cache perplexity (so the two engines' small full-cache difference cancels), with the stored
fraction of raw K+V bytes, and paired against one kvd method: the ratio of the two
perplexity ratios with a 95% bootstrap interval over segments (resampled together). Markdown
on stdout. kvd's stored fraction is its stored_raw column (encoded chunk bytes over raw bfloat16
bytes) where kvd-quality wrote one, else 1 - achieved_p_c; a press's is its kept fraction of
tokens. --equal-bytes prints instead, for each press at each p_c, kvd's best one-shot row
measured in bytes (lowest perplexity over kvd's segments) storing at most the press's bytes,
its perplexity on the press's segments, paired against the press. --kvd-mode chunk-wise takes
kvd's rows from its chunk-wise mode instead (its serving path; the presses stay one-shot, the only
path kvpress has).
"""
import argparse
import csv
import math
import os
import random
from collections import defaultdict


def load_segments(path, has_engine, mode="one-shot"):
    """(method, p_c) -> {segment: (nll, n, full_nll)}; rows of `mode` only."""
    out = defaultdict(dict)
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["mode"] != mode:
                continue
            key = (r["method"], float(r["p_c"]))
            full = float(r["engine_nll_sum"]) if has_engine else None
            out[key][int(r["segment"])] = (float(r["nll_sum"]), int(r["scored_tokens"]), full)
    return out


def ratio(seg, idx):
    d = sum(seg[i][0] - seg[i][2] for i in idx)
    n = sum(seg[i][1] for i in idx)
    return math.exp(d / n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kvd_out")
    ap.add_argument("kvpress_out")
    ap.add_argument("--against", default="sink_recent")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--pair", action="append", default=[], metavar="A@PC,B@PC",
                    help="also compare A at its p_c with B at its p_c (any rows, either engine), "
                         "e.g. int4@0.75,kvpress:snapkv@0.9; repeatable")
    ap.add_argument("--equal-bytes", action="store_true",
                    help="each press against kvd's best row at no more stored bytes")
    ap.add_argument("--kvd-mode", default="one-shot", choices=["one-shot", "chunk-wise"],
                    help="kvd's rows from this mode (the presses are one-shot)")
    ap.add_argument("--form", choices=["dense", "compact"], default=None,
                    help="--equal-bytes: only rows of this form on both sides (dense: every "
                         "position kept, quantized; compact: tokens evicted)")
    a = ap.parse_args()

    kvd = load_segments(os.path.join(a.kvd_out, "segments.csv"), True, a.kvd_mode)
    stored = {}
    in_bytes = set()  # kvd rows whose stored fraction is measured in bytes
    of_form = set()  # kvd rows of --form (all without it)
    kvd_full = None
    with open(os.path.join(a.kvd_out, "results.csv")) as f:
        for r in csv.DictReader(f):
            if r["method"] == "engine":
                kvd_full = float(r["perplexity"])
            if r["mode"] == a.kvd_mode:
                if a.form is None or r.get("form") == a.form:
                    of_form.add((r["method"], float(r["p_c"])))
                measured = float(r.get("stored_raw") or -1)
                if measured >= 0:
                    in_bytes.add((r["method"], float(r["p_c"])))
                stored[(r["method"], float(r["p_c"]))] = (
                    measured if measured >= 0 else 1 - float(r["achieved_p_c"]))
    not_run = []
    peer_stored = {}  # run_presses.py's measured stored_raw (older runs wrote none)
    with open(os.path.join(a.kvpress_out, "results.csv")) as f:
        for r in csv.DictReader(f):
            if int(r["scored_tokens"]) == 0 and r["method"] not in not_run:
                not_run.append(r["method"])
            if r.get("stored_raw"):
                peer_stored[(r["method"], float(r["p_c"]))] = float(r["stored_raw"])
    kvp = load_segments(os.path.join(a.kvpress_out, "segments.csv"), False)
    full = kvp.pop(("full", 0.0))
    for key, seg in kvp.items():
        for i in seg:
            seg[i] = (seg[i][0], seg[i][1], full[i][0])
        stored[key] = peer_stored.get(key, 1 - key[1])
    hf_full = math.exp(sum(v[0] for v in full.values()) / sum(v[1] for v in full.values()))

    rows = {**{k: v for k, v in kvd.items() if k[0] != "full"}, **kvp}

    def paired(seg, base):
        idx = sorted(set(seg) & set(base))
        boots = []
        for _ in range(a.bootstrap):
            s = [rng.choice(idx) for _ in idx]
            boots.append(ratio(seg, s) / ratio(base, s))
        boots.sort()
        lo = boots[int(0.025 * len(boots))]
        hi = boots[min(len(boots) - 1, int(0.975 * len(boots)))]
        return f"{ratio(seg, idx) / ratio(base, idx):.3f} [{lo:.3f}, {hi:.3f}]"

    if a.equal_bytes:
        rng = random.Random(1)
        print(f"full cache perplexity: kvd reference engine {kvd_full:.6f}, "
              f"transformers (kvpress venv) {hf_full:.6f}\n")
        peers = {k: v for k, v in kvp.items()
                 if a.form is None or (k[1] == 0) == (a.form == "dense")}
        # A peer row at p_c 0 keeps every token (a quantized cache); one above evicts (a press).
        kinds = {k[1] == 0 for k in peers}
        peer = "peer" if len(kinds) > 1 else "quantized cache" if True in kinds else "press"
        print(f"| {peer} at p_c | stored/raw, ppl/full | kvd's best at no more bytes "
              f"({a.kvd_mode}) "
              f"| stored/raw, ppl/full | kvd / {peer}, paired [95% CI] |\n|---|---|---|---|---|")
        for (m, r), seg in sorted(peers.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
            # kvd's best row is chosen on all its segments (its front), and shown on the press's
            # segments only, so both columns cover the same text.
            within = [(ratio(s2, s2.keys()), k) for k, s2 in kvd.items()
                      if k in in_bytes and k in of_form and k[0] != "full"
                      and stored[k] <= stored[(m, r)] + 1e-12]
            if not within:
                print(f"| {m} at {r:g} | {stored[(m, r)]:.3f}, {ratio(seg, seg.keys()):.4f} "
                      "| none | - | - |")
                continue
            best = min(within)[1]
            best_ratio = ratio(kvd[best], [i for i in seg if i in kvd[best]])
            print(f"| {m} at {r:g} | {stored[(m, r)]:.3f}, {ratio(seg, seg.keys()):.4f} "
                  f"| {best[0]} at {best[1]:g} | {stored[best]:.3f}, {best_ratio:.4f} "
                  f"| {paired(kvd[best], seg)} |")
        return

    ratios = sorted({k[1] for k in rows})
    methods = list(dict.fromkeys(k[0] for k in rows))
    rng = random.Random(1)
    print(f"full cache perplexity: kvd reference engine {kvd_full:.6f}, "
          f"transformers (kvpress venv) {hf_full:.6f}\n")
    print("| method | " + " | ".join(f"p_c {r:g}: stored/raw, ppl/full, vs {a.against}"
                                    for r in ratios) + " |")
    print("|---|" + "---|" * len(ratios))
    for m in methods:
        cells = []
        for r in ratios:
            seg = rows.get((m, r))
            if not seg:
                cells.append("-")
                continue
            base = kvd.get((a.against, r))
            cell = f"{stored[(m, r)]:.3f}, {ratio(seg, seg.keys()):.4f}"
            if base and m != a.against:
                cell += ", " + paired(seg, base)
            cells.append(cell)
        print(f"| {m} | " + " | ".join(cells) + " |")
    for m in not_run:
        print(f"| {m} | " + " | ".join("not run (run_presses.py's log says why)" for _ in ratios) + " |")
    if a.pair:
        print("\n| A | B | stored/raw A, B | perplexity A / B, paired |\n|---|---|---|---|")
    for p in a.pair:
        (ma, pa), (mb, pb) = [(x.rsplit("@", 1)[0], float(x.rsplit("@", 1)[1])) for x in p.split(",")]
        sa, sb = rows[(ma, pa)], rows[(mb, pb)]
        print(f"| {ma} at p_c {pa:g} | {mb} at p_c {pb:g} | {stored[(ma, pa)]:.3f}, "
              f"{stored[(mb, pb)]:.3f} | {paired(sa, sb)} |")


if __name__ == "__main__":
    main()
