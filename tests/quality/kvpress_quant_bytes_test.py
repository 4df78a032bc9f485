#!/usr/bin/env python3
"""bench/kvpress/run_presses.py's byte accounting of transformers' QuantizedCache rows.

    kvpress_quant_bytes_test.py   (with the kvpress venv's python; exit 77 without its backends)

A two-layer cache of 3 heads x 128 tokens x 64 dims per layer, quantized with group 64, must count
as stored/raw: (nbits/8 + 2 * 2 / 64) / 2 (packed codes, a bfloat16 scale and zero-point per 64
elements, over bfloat16), HQQ's 3 bits packed 10 to an int32 (3.2 bits), plus a residual window of
full-precision tokens at 2 bytes. It also checks that the prefix is held quantized: the
dequantized prefix differs from the original and a cache whose layer is not quantized is refused.
"""
import importlib.util
import math
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(root, "bench", "kvpress"))
try:
    import torch
    from transformers import LlamaConfig, QuantizedCache
except ImportError as e:
    print(f"SKIP: {e} (run with the kvpress venv's python, bench/quality-peers.sh)")
    sys.exit(77)
for mod in ("optimum.quanto", "hqq"):
    if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
        print(f"SKIP: {mod} not installed (bench/kvpress/requirements.txt)")
        sys.exit(77)
import run_presses  # noqa: E402

H, T, D, GROUP = 3, 128, 64, 64
cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=H,
                  hidden_size=H * D)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def filled(spec, residual_length=0, extra=0):
    name, kw = run_presses.parse_quant(spec, GROUP, residual_length)
    cache = QuantizedCache(config=cfg, **kw)
    torch.manual_seed(0)
    k = [torch.randn(1, H, T, D) for _ in cfg_layers()]
    v = [torch.randn(1, H, T, D) for _ in cfg_layers()]
    for i, layer in enumerate(cache.layers):
        layer.update(k[i], v[i])
        if extra:
            layer.update(torch.randn(1, H, extra, D), torch.randn(1, H, extra, D))
    return name, cache, k, v


def cfg_layers():
    return range(cfg.num_hidden_layers)


# Packed bits per code: HQQ packs 3-bit codes 10 to an int32 (rows padded to a multiple of 10).
EXPECTED_BITS = {"quanto:int4": 4, "quanto:int2": 2, "hqq:int8": 8, "hqq:int4": 4,
                 "hqq:int2": 2}
for spec, bits in EXPECTED_BITS.items():
    name, cache, k, _ = filled(spec)
    stored, raw, residual = run_presses.quantized_cache_bytes(cache, T)
    want = (bits / 8 + 2 * 2 / GROUP) / 2
    check(raw == 2 * cfg.num_hidden_layers * H * T * D * 2, f"{name}: raw {raw} B")
    check(residual == 0, f"{name}: no residual tokens after the prefill ({residual})")
    check(math.isclose(stored / raw, want), f"{name}: stored/raw {stored / raw:.6f} == {want:.6f}")
    layer = cache.layers[0]
    deq = layer._dequantize(layer._quantized_keys)
    err = (deq - k[0]).abs().max().item()
    check(deq.shape == k[0].shape and 0 < err < 2 ** (3 - bits) * 4,
          f"{name}: the prefix's keys are held quantized (max error {err:.4f})")

# A residual window: 128 quantized tokens (the first update quantizes all it gets) + 5 exact ones.
name, cache, _, _ = filled("quanto:int4", residual_length=64, extra=5)
stored, raw, residual = run_presses.quantized_cache_bytes(cache, T + 5)
per_layer_q = 2 * H * T * D * (0.5 + 4 / GROUP)
per_layer_r = 2 * H * 5 * D * 2
check(residual == 5, f"{name}: 5 residual tokens ({residual})")
check(stored == cfg.num_hidden_layers * (per_layer_q + per_layer_r),
      f"{name} + 5 residual tokens: stored {stored} B")

# A cache that is not (fully) quantized is refused.
name, cache, _, _ = filled("hqq:int4")
cache.layers[1]._quantized_values = None
try:
    run_presses.quantized_cache_bytes(cache, T)
    check(False, "a layer without quantized values is refused")
except AssertionError:
    check(True, "a layer without quantized values is refused")
try:
    run_presses.quantized_cache_bytes(filled("hqq:int4")[1], T + 1)
    check(False, "a prefix longer than what the cache holds is refused")
except AssertionError:
    check(True, "a prefix longer than what the cache holds is refused")

sys.exit(1 if failures else 0)
