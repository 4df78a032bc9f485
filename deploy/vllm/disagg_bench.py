"""Measures disaggregated prefill -> kvd -> decode against the decode instance recomputing.

    python3 disagg_bench.py --prefill URL --decode URL --proxy URL --kvdctl PATH --kvd ADDR \
        [--lengths 1024,2048,4096] [--repeats 3] [--gen 32] [--json OUT]

For each prompt length, `repeats` times with fresh prompts (token ids, so the lengths are
exact):
  recompute  the prompt goes straight to the decode instance, which computes it (nothing of
             it is in kvd): decode TTFT is the time to its first streamed token;
  kvd        the prompt goes to the prefill instance (max_tokens 1: it computes the prompt and
             saves its chunks into kvd), then to the decode instance, which loads them: decode
             TTFT as above; the prefill time and the sum (the request's TTFT) beside it;
  proxy      one request through the proxy, as a client sends it (end-to-end TTFT).
Decode tokens/s is the rate of the streamed tokens after the first. kvd's bytes come from
`kvdctl stats --json` before and after (stored: the model's bytes; moved: the bytes of puts and
gets). Medians are printed as a table; --json writes every sample."""

import argparse
import http.client
import json
import random
import statistics
import subprocess
import time
import urllib.parse


def stream_completion(base, model, prompt, max_tokens):
    """(seconds to the first streamed token, seconds from it to the last, tokens streamed)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{base}: HTTP {r.status}: {r.read()[:500]!r}")
    first = last = None
    tokens = 0
    buf = b""
    while True:
        piece = r.read1(65536)
        if not piece:
            break
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.strip()[len(b"data: "):]
            if not data or data == b"[DONE]":
                continue
            if json.loads(data)["choices"][0].get("text") is not None:
                now = time.monotonic()
                first = now if first is None else first
                last = now
                tokens += 1
    conn.close()
    if first is None:
        raise RuntimeError(f"{base}: no token streamed")
    return first - t0, last - first, tokens


def complete(base, model, prompt, max_tokens):
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
         "ignore_eos": True}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{base}: HTTP {r.status}: {data[:500]!r}")
    return time.monotonic() - t0


def kvd_bytes(kvdctl, addr, model):
    out = subprocess.run([kvdctl, "--addr", addr, "stats", "--json"], check=True,
                         capture_output=True, text=True).stdout
    s = json.loads(out)
    stored = sum(m["bytes"] for m in s.get("models", []) if m["name"] == model)
    c = s.get("counters", {})
    return stored, c.get("put_bytes", 0), c.get("get_bytes", 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--kvdctl", required=True)
    ap.add_argument("--kvd", required=True, help="kvd's address")
    ap.add_argument("--kvd-model", default="smollm2-135m")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rng = random.Random(0)
    fresh = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    # Warm-up: the first requests of a vLLM process are slower (allocation, first kernels).
    for base in (a.decode, a.prefill):
        complete(base, a.model, fresh(300), 2)
    samples = []
    for n in (int(x) for x in a.lengths.split(",")):
        for rep in range(a.repeats):
            ttft_re, dt_re, tok_re = stream_completion(a.decode, a.model, fresh(n), a.gen)
            p = fresh(n)
            before = kvd_bytes(a.kvdctl, a.kvd, a.kvd_model)
            prefill_s = complete(a.prefill, a.model, p, 1)
            ttft_kvd, dt_kvd, tok_kvd = stream_completion(a.decode, a.model, p, a.gen)
            after = kvd_bytes(a.kvdctl, a.kvd, a.kvd_model)
            proxy_ttft, _, _ = stream_completion(a.proxy, a.model, fresh(n), a.gen)
            samples.append({
                "tokens": n, "repeat": rep, "recompute_ttft_s": ttft_re, "kvd_ttft_s": ttft_kvd,
                "prefill_s": prefill_s, "proxy_ttft_s": proxy_ttft,
                "recompute_tok_s": (tok_re - 1) / dt_re if dt_re > 0 else 0.0,
                "kvd_tok_s": (tok_kvd - 1) / dt_kvd if dt_kvd > 0 else 0.0,
                "stored_bytes": after[0] - before[0], "put_bytes": after[1] - before[1],
                "got_bytes": after[2] - before[2]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)
    med = lambda n, k: statistics.median(s[k] for s in samples if s["tokens"] == n)  # noqa
    mib = 1 << 20
    print(f"{'prompt':>7} {'decode TTFT':>12} {'recompute':>10} {'speed-up':>9} "
          f"{'prefill':>8} {'P+D TTFT':>9} {'via proxy':>10} {'decode tok/s':>13} "
          f"{'stored':>9} {'put':>9} {'got':>9}")
    for n in sorted({s["tokens"] for s in samples}):
        kv, re_ = med(n, "kvd_ttft_s"), med(n, "recompute_ttft_s")
        print(f"{n:>7} {kv * 1e3:>10.0f}ms {re_ * 1e3:>8.0f}ms {re_ / kv:>8.2f}x "
              f"{med(n, 'prefill_s') * 1e3:>6.0f}ms "
              f"{(med(n, 'prefill_s') + kv) * 1e3:>7.0f}ms {med(n, 'proxy_ttft_s') * 1e3:>8.0f}ms "
              f"{med(n, 'kvd_tok_s'):>6.1f} ({med(n, 'recompute_tok_s'):.1f}) "
              f"{med(n, 'stored_bytes') / mib:>6.1f}MiB {med(n, 'put_bytes') / mib:>6.1f}MiB "
              f"{med(n, 'got_bytes') / mib:>6.1f}MiB")
    print(f"medians of {a.repeats}; decode tok/s: with kvd (recomputing); "
          f"{a.gen} tokens generated per request")
    # Every prompt the prefill instance saved must have been loaded by the decode instance: it
    # got at least the bytes kvd stored for it (the stored form: fewer than put when compressed).
    missed = [s for s in samples
              if s["put_bytes"] == 0 or s["stored_bytes"] == 0 or s["got_bytes"] < s["stored_bytes"]]
    if missed:
        raise SystemExit(f"the decode instance did not load what the prefill instance put: "
                         f"{missed}")


if __name__ == "__main__":
    main()
