#!/usr/bin/env python3
"""kvpress presses on kvd-quality's segments, perplexity computed the way kvd-quality does.

Segments: the manifest's eval texts (sha256-checked, missing ones skipped), each tokenized
without special tokens, cut into consecutive non-overlapping (prefix + continuation) pieces taken
round-robin over the texts (tests/quality/harness.cc RoundRobinCuts). Per segment the prefix is
prefilled (compressed by the press, kvpress's compression_ratio = kvd's p_c = fraction of tokens
removed), then the continuation is teacher-forced at positions prefix..prefix+C-2 and tokens
cont[1..C-1] are scored; perplexity = exp(sum of NLL / scored tokens) pooled over segments.

Writes <out>/results.csv (method,p_c,scored_tokens,perplexity,seconds) and
<out>/segments.csv (method,mode,p_c,segment,nll_sum,scored_tokens), the layout of kvd-quality's
segments.csv, so bench/kvpress/table.py can pair them with kvd's methods.
"""
import argparse
import csv
import hashlib
import math
import os
import sys
import time


def read_manifest(path):
    base = os.path.dirname(os.path.abspath(path))
    texts = []
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sha, role, p = line.split(None, 2)
        if role != "eval":
            continue
        if not os.path.isabs(p):
            p = os.path.join(base, p)
        try:
            data = open(p, "rb").read()
        except OSError:
            print(f"warning: {p} missing, skipped", file=sys.stderr)
            continue
        if hashlib.sha256(data).hexdigest() != sha:
            print(f"warning: {p} sha256 mismatch, skipped", file=sys.stderr)
            continue
        texts.append(data.decode("utf-8"))
    return texts


def round_robin_cuts(texts_ids, seg_len, count):
    out, rnd = [], 0
    while len(out) < count:
        any_cut = False
        for ids in texts_ids:
            s = rnd * seg_len
            if s + seg_len <= len(ids) and len(out) < count:
                out.append(ids[s:s + seg_len])
                any_cut = True
        if not any_cut:
            break
        rnd += 1
    return out


# run_presses.py's press names -> (kvpress class name, extra constructor arguments).
PRESSES = {
    "streaming_llm": ("StreamingLLMPress", {}),
    "snapkv": ("SnapKVPress", {"window_size": None}),  # None: the --window
    "keydiff": ("KeyDiffPress", {}),
    "tova": ("TOVAPress", {}),
    "expected_attention": ("ExpectedAttentionPress", {}),
    "knorm": ("KnormPress", {}),
    "kvzip": ("KVzipPress", {}),
    "qfilter": ("QFilterPress", {}),
}


def make_press(name, ratio, window):
    import kvpress
    if name not in PRESSES:
        raise ValueError(f"unknown press {name} (known: {', '.join(PRESSES)})")
    cls, extra = PRESSES[name]
    kw = {k: (window if v is None else v) for k, v in extra.items()}
    return getattr(kvpress, cls)(compression_ratio=ratio, **kw)


def score_segment(model, torch, prefix, cont, press):
    from transformers import DynamicCache
    P, C = len(prefix), len(cont)
    cache = DynamicCache()
    with torch.no_grad():
        ids = torch.tensor([prefix])
        if press is None:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        else:
            with press(model):
                model(input_ids=ids, past_key_values=cache, use_cache=True)
        feed = torch.tensor([cont[:-1]])
        pos = torch.arange(P, P + C - 1).unsqueeze(0)
        out = model(input_ids=feed, past_key_values=cache, position_ids=pos, use_cache=True)
        logp = torch.log_softmax(out.logits[0].double(), dim=-1)
        target = torch.tensor(cont[1:])
        nll = -logp.gather(1, target.unsqueeze(1)).sum().item()
    return nll, C - 1


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(root, "models-cache/SmolLM2-135M-Instruct-hf"))
    ap.add_argument("--gguf", default="",
                    help="load the weights from this GGUF, dequantized to --dtype (the exact "
                         "weights kvd's engine runs; the HF folder holds them rounded to bfloat16)")
    ap.add_argument("--manifest", default=os.path.join(root, "tests/quality/manifest.txt"))
    ap.add_argument("--out", default="kvpress-out")
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--window", type=int, default=32, help="SnapKV observation window")
    ap.add_argument("--ratios", default="0.5,0.75,0.9")
    ap.add_argument("--presses", default="streaming_llm,snapkv,keydiff,tova,expected_attention,kvzip,qfilter")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the logs
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.gguf:
        folder, name = os.path.split(os.path.abspath(args.gguf))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                     attn_implementation="sdpa")
        # Presses that tokenize (KVzip) read the tokenizer from the model's name_or_path.
        model.config.name_or_path = args.model
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                     attn_implementation="sdpa")
    model.eval()

    texts = read_manifest(args.manifest)
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    seg_len = args.prefix + args.continuation
    cuts = round_robin_cuts(ids, seg_len, args.segments)
    if not cuts:
        sys.exit(f"no eval text is long enough for {seg_len} tokens")
    segs = [(c[:args.prefix], c[args.prefix:]) for c in cuts]
    print(f"{len(segs)} segments of {args.prefix} + {args.continuation} tokens from {len(ids)} texts",
          flush=True)

    os.makedirs(args.out, exist_ok=True)
    rows, seg_rows = [], []

    def run(method, ratio, press):
        t0 = time.time()
        nll_t, n_t, per = 0.0, 0, []
        for i, (p, c) in enumerate(segs):
            nll, n = score_segment(model, torch, p, c, press)
            nll_t += nll
            n_t += n
            per.append((i, nll, n))
        ppl = math.exp(nll_t / n_t)
        dt = time.time() - t0
        rows.append((method, ratio, n_t, ppl, dt))
        for i, nll, n in per:
            seg_rows.append((method, "one-shot", ratio, i, nll, n))
        print(f"{method:22s} p_c {ratio:.2f}  ppl {ppl:.6f}  ({dt:.1f} s)", flush=True)
        return ppl

    run("full", 0.0, None)
    for name in [s for s in args.presses.split(",") if s]:
        for r in [float(x) for x in args.ratios.split(",") if x]:
            try:
                run("kvpress:" + name, r, make_press(name, r, args.window))
            except Exception as e:  # a press that cannot run here is reported, not fatal
                msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                print(f"kvpress:{name} p_c {r:.2f}: not run: {type(e).__name__}: {msg}", flush=True)
                rows.append(("kvpress:" + name, r, 0, float("nan"), 0.0))
                break

    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "p_c", "scored_tokens", "perplexity", "seconds"])
        for m, r, n, ppl, dt in rows:
            w.writerow([m, f"{r:.4f}", n, f"{ppl:.6f}", f"{dt:.2f}"])
    with open(os.path.join(args.out, "segments.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "mode", "p_c", "segment", "nll_sum", "scored_tokens"])
        for m, mode, r, i, nll, n in seg_rows:
            w.writerow([m, mode, f"{r:.4f}", i, f"{nll:.6f}", n])


if __name__ == "__main__":
    main()
