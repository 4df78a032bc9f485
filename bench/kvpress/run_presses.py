#!/usr/bin/env python3
"""kvpress presses on kvd-quality's segments, perplexity computed the way kvd-quality does.

Segments: the manifest's eval texts (sha256-checked, missing ones skipped), each tokenized
without special tokens, cut into consecutive non-overlapping (prefix + continuation) pieces taken
round-robin over the texts (tests/quality/harness.cc RoundRobinCuts). Per segment the prefix is
prefilled (compressed by the press, kvpress's compression_ratio = kvd's p_c = fraction of tokens
removed), then the continuation is teacher-forced at positions prefix..prefix+C-2 and tokens
cont[1..C-1] are scored; perplexity = exp(sum of NLL / scored tokens) pooled over segments.

--quant adds transformers' QuantizedCache (optimum-quanto or HQQ backend) as rows that keep every
token: the prefix is prefilled into the quantized cache (the first update quantizes all of it;
checked before the continuation is scored), then the continuation is scored as for the presses.
Their stored fraction is measured from the cache's tensors (quantized_cache_bytes).

Writes <out>/results.csv (method,p_c,scored_tokens,perplexity,seconds,stored_raw) and
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


# --quant's backends: (axis_key, axis_value) closest to kvd's layout, keys per channel over a group
# of tokens and values per token. quanto groups axis -1 as group_size consecutive rows of the
# (batch*heads*tokens, head_dim) view (one channel over group_size consecutive tokens of one head)
# and axis 0 as consecutive elements (one token's head vector). HQQ groups axis 1 as consecutive
# elements (one token's head vector) and axis 0 as a column of the (group_size, -1) view: one
# channel over group_size tokens spaced heads*tokens/head_dim apart (across heads), the only
# per-channel grouping it has.
QUANT_AXES = {"quanto": (-1, 0), "hqq": (0, 1)}
BF16_BYTES = 2


def parse_quant(spec, group, residual):
    """'quanto:int4' -> (row name, QuantizedCache keyword arguments)."""
    backend, _, bits = spec.partition(":")
    if backend not in QUANT_AXES or not bits.startswith("int") or not bits[3:].isdigit():
        raise ValueError(f"bad --quant entry {spec!r} (want BACKEND:intN, BACKEND one of "
                         f"{', '.join(QUANT_AXES)})")
    ak, av = QUANT_AXES[backend]
    kw = dict(backend=backend, nbits=int(bits[3:]), axis_key=ak, axis_value=av,
              q_group_size=group, residual_length=residual)
    return f"tf-{backend}:{bits}-g{group}-r{residual}", kw


def _quantized_parts(q):
    """(packed codes, [scale, zero-point], logical shape) of one quanto or HQQ quantized tensor."""
    if isinstance(q, tuple):  # HQQ: (packed codes, meta)
        codes, meta = q
        return codes, [meta["scale"], meta["zero"]], tuple(meta["shape"])
    data = q._data  # quanto WeightQBitsTensor: PackedTensor of uint8, scale, shift
    return getattr(data, "_data", data), [q._scale, q._shift], tuple(q.shape)


def quantized_cache_bytes(cache, prefix_tokens):
    """(stored bytes, raw bytes, residual tokens) of a transformers QuantizedCache holding a prefix.

    Counts what the backend keeps: the packed codes as stored (their dtype's bytes), each group's
    scale and zero-point at 2 bytes (the backends store them in the cache's dtype, checked here;
    counted as bfloat16 as the raw K+V is), and the residual window (tokens not yet quantized) in
    bfloat16. Raw: keys and values of every layer in bfloat16. Asserts that every layer's
    quantized tensors and residual window together hold exactly prefix_tokens positions.
    """
    stored = raw = 0
    residual = None
    for i, layer in enumerate(cache.layers):
        kept = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
        assert residual in (None, kept), f"layer {i}: {kept} residual tokens, others {residual}"
        residual = kept
        for name, window in (("_quantized_keys", layer.keys), ("_quantized_values", layer.values)):
            q = getattr(layer, name, None)
            assert q is not None, f"layer {i}: no {name}; the prefix is not quantized"
            codes, meta, shape = _quantized_parts(q)
            assert not codes.is_floating_point(), f"layer {i} {name}: codes are {codes.dtype}"
            assert shape[-2] + kept == prefix_tokens, \
                f"layer {i} {name}: {shape[-2]} quantized + {kept} residual != {prefix_tokens}"
            for t in meta:
                assert t.dtype == layer.keys.dtype, f"layer {i} {name}: meta {t.dtype}"
            stored += codes.numel() * codes.element_size()
            stored += sum(t.numel() for t in meta) * BF16_BYTES
            stored += window.numel() * BF16_BYTES
            raw += (math.prod(shape) + window.numel()) * BF16_BYTES
    return stored, raw, residual


def score_segment(model, torch, prefix, cont, press, cache=None, after_prefill=None):
    from transformers import DynamicCache
    P, C = len(prefix), len(cont)
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad():
        ids = torch.tensor([prefix])
        if press is None:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        else:
            with press(model):
                model(input_ids=ids, past_key_values=cache, use_cache=True)
        if after_prefill is not None:
            after_prefill(cache)
        feed = torch.tensor([cont[:-1]])
        pos = torch.arange(P, P + C - 1).unsqueeze(0)
        out = model(input_ids=feed, past_key_values=cache, position_ids=pos, use_cache=True)
        logp = torch.log_softmax(out.logits[0].double(), dim=-1)
        target = torch.tensor(cont[1:])
        nll = -logp.gather(1, target.unsqueeze(1)).sum().item()
    return nll, C - 1


def parse_args(argv=None):
    """The command line (argv, default sys.argv[1:]); paths default to the repository's."""
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
    ap.add_argument("--quant", default="",
                    help="transformers QuantizedCache rows, BACKEND:intN comma separated "
                         "(quanto: int4, int2; hqq: int8, int4, int3, int2, int1)")
    ap.add_argument("--quant-group", type=int, default=64, help="QuantizedCache q_group_size")
    ap.add_argument("--quant-residual", type=int, default=0,
                    help="QuantizedCache residual_length (the prefill is quantized whole at any "
                         "value; it bounds the full-precision window of tokens appended later)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def load_model(args):
    """(torch, tokenizer, model in eval mode) for --model / --gguf at --dtype on --threads."""
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
    return torch, tok, model


def load_segments(args, tok):
    """[(prefix ids, continuation ids)] of the manifest's eval texts; exits when there are none."""
    texts = read_manifest(args.manifest)
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    seg_len = args.prefix + args.continuation
    cuts = round_robin_cuts(ids, seg_len, args.segments)
    if not cuts:
        sys.exit(f"no eval text is long enough for {seg_len} tokens")
    segs = [(c[:args.prefix], c[args.prefix:]) for c in cuts]
    print(f"{len(segs)} segments of {args.prefix} + {args.continuation} tokens from {len(ids)} texts",
          flush=True)
    return segs


class RowRunner:
    """Scores rows over the segments; collects results.csv's rows and segments.csv's seg_rows."""

    def __init__(self, model, torch, segs, prefix):
        self.model, self.torch, self.segs, self.prefix = model, torch, segs, prefix
        self.rows, self.seg_rows = [], []

    def run(self, method, ratio, press, make_cache=None):
        """One row: every segment under press (or a fresh make_cache() cache, measured after the
        prefill); returns its perplexity."""
        t0 = time.time()
        nll_t, n_t, per = 0.0, 0, []
        measured = []  # (stored, raw, residual tokens) of each segment's quantized prefix

        def measure(cache):
            measured.append(quantized_cache_bytes(cache, self.prefix))

        for i, (p, c) in enumerate(self.segs):
            cache = make_cache() if make_cache else None
            hook = measure if make_cache else None
            nll, n = score_segment(self.model, self.torch, p, c, press, cache, hook)
            nll_t += nll
            n_t += n
            per.append((i, nll, n))
        ppl = math.exp(nll_t / n_t)
        dt = time.time() - t0
        stored = 1 - ratio  # a press keeps 1 - p_c of the tokens in bfloat16
        note = ""
        if measured:
            assert len(set(measured)) == 1, f"{method}: segments store different bytes {measured}"
            stored_b, raw_b, residual = measured[0]
            stored = stored_b / raw_b
            note = f"  stored/raw {stored:.4f}, {residual} residual tokens"
        self.rows.append((method, ratio, n_t, ppl, dt, stored))
        for i, nll, n in per:
            self.seg_rows.append((method, "one-shot", ratio, i, nll, n))
        print(f"{method:22s} p_c {ratio:.2f}  ppl {ppl:.6f}  ({dt:.1f} s){note}", flush=True)
        return ppl

    def not_run(self, method, ratio, e):
        """A row that cannot run here: reported (NaN perplexity), not fatal."""
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        print(f"{method} p_c {ratio:.2f}: not run: {type(e).__name__}: {msg}", flush=True)
        self.rows.append((method, ratio, 0, float("nan"), 0.0, 1 - ratio))


def run_rows(args, model, runner):
    """The full-cache row, then each press at each ratio, then each --quant row."""
    runner.run("full", 0.0, None)
    for name in [s for s in args.presses.split(",") if s]:
        for r in [float(x) for x in args.ratios.split(",") if x]:
            try:
                runner.run("kvpress:" + name, r, make_press(name, r, args.window))
            except Exception as e:
                runner.not_run("kvpress:" + name, r, e)
                break
    for spec in [s for s in args.quant.split(",") if s]:
        method, kw = parse_quant(spec, args.quant_group, args.quant_residual)
        try:
            from transformers import QuantizedCache
            runner.run(method, 0.0, None, lambda: QuantizedCache(config=model.config, **kw))
        except AssertionError:
            raise  # the prefix was not held quantized: the row would be wrong, not missing
        except Exception as e:
            runner.not_run(method, 0.0, e)


def write_results(out, rows, seg_rows):
    """<out>/results.csv and <out>/segments.csv (the module docstring's columns)."""
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "p_c", "scored_tokens", "perplexity", "seconds", "stored_raw"])
        for m, r, n, ppl, dt, stored in rows:
            w.writerow([m, f"{r:.4f}", n, f"{ppl:.6f}", f"{dt:.2f}", f"{stored:.6f}"])
    with open(os.path.join(out, "segments.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "mode", "p_c", "segment", "nll_sum", "scored_tokens"])
        for m, mode, r, i, nll, n in seg_rows:
            w.writerow([m, mode, f"{r:.4f}", i, f"{nll:.6f}", n])


def main():
    args = parse_args()
    torch, tok, model = load_model(args)
    segs = load_segments(args, tok)
    os.makedirs(args.out, exist_ok=True)
    runner = RowRunner(model, torch, segs, args.prefix)
    run_rows(args, model, runner)
    write_results(args.out, runner.rows, runner.seg_rows)


if __name__ == "__main__":
    main()
