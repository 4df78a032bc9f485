"""Where each token's K and V lie inside one layer of vLLM's paged KV cache.

vLLM (0.32) hands a connector one 4-D tensor per layer, its logical view [B, H, N, C]:
kernel blocks, KV heads, token slots per block, and a content axis of K and V together.
How K and V are placed inside a block belongs to the attention backend in use: FlashAttention
and FlashInfer split C into K then V with the view's own strides; the CPU backend packs K and V
per instruction set (K transposed into tiles on the AVX-512 path, interleaved pairs with AMX).
kvd does not hard-code any of these. At register_kv_caches it asks the backend itself: it writes
known values through the layer's own reshape-and-cache op (``impl.do_kv_cache_update``, the op
vLLM writes every new token with) into a scratch cache of two blocks that has the layer's shape
and stride order, reads back where each value landed, and keeps that map (a TokenLayout).

A backend whose op is not a per-element copy (a quantized KV cache, a layout with scales) gives
no one-to-one map and is refused with an error naming it; so is a backend without a separate
cache-update op. Never a guessed layout.

Without vLLM (kvd's own tests drive the connector with a stand-in), caches are taken as vLLM's
logical view with FlashAttention's split: C = [K | V], each head_dim wide (logical_layout).
"""

from __future__ import annotations

import dataclasses

import numpy as np


class UnsupportedLayoutError(ValueError):
    """vLLM's cache for a layer is in a form kvd cannot address token by token."""


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """One layer's cache addressing. All offsets are in elements of the cache's dtype, from the
    first element of the layer's tensor (its storage offset)."""
    backend: str            # the attention backend's name (vLLM's get_name(), e.g. CPU_ATTN)
    block_tokens: int       # token slots per kernel block (N of the [B, H, N, C] view)
    block_stride: int       # elements between kernel block b and b + 1
    offsets: np.ndarray     # int64 [block_tokens, 2 (K, V), heads, head_dim]: an element's
                            # offset from the start of its kernel block
    span: int               # elements from the first to one past the last the tensor addresses

    def element_offsets(self, kernel_blocks, slots):
        """int64 [len(slots), 2, heads, head_dim]: where the K/V of each (kernel block, slot)
        pair lies."""
        kernel_blocks = np.asarray(kernel_blocks, np.int64)
        slots = np.asarray(slots, np.int64)
        return kernel_blocks[:, None, None, None] * self.block_stride + self.offsets[slots]


def _span(shape, strides):
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def _element_strides(cache):
    if hasattr(cache, "stride") and callable(cache.stride):  # torch
        return tuple(int(s) for s in cache.stride())
    return tuple(s // cache.itemsize for s in cache.strides)


def logical_layout(cache, head_size, backend="logical [B, H, N, K|V]"):
    """FlashAttention's split of vLLM's [B, H, N, C] view: K at C[0:head_size], V after it."""
    if len(cache.shape) != 4 or cache.shape[3] != 2 * head_size:
        raise UnsupportedLayoutError(
            f"{backend}: expected a [num_blocks, num_kv_heads, block_size, 2 * {head_size}] "
            f"cache, got {tuple(cache.shape)}")
    _, heads, tokens, _ = (int(x) for x in cache.shape)
    sb, sh, sn, sc = _element_strides(cache)
    n = np.arange(tokens)[:, None, None, None]
    kv = np.arange(2)[None, :, None, None]
    h = np.arange(heads)[None, None, :, None]
    d = np.arange(head_size)[None, None, None, :]
    offsets = n * sn + h * sh + (kv * head_size + d) * sc
    return TokenLayout(backend, tokens, sb, offsets.astype(np.int64),
                       _span(cache.shape, _element_strides(cache)))


def probe_layout(layer, cache, head_size):
    """The layout of `cache` (one layer's [B, H, N, C] torch tensor) as `layer`'s attention
    backend writes it: known values go through layer.impl.do_kv_cache_update into a scratch
    cache of two blocks with the same shape per block, dtype, device and stride order, and the
    value each element received tells which (token slot, K/V, head, dim) it holds.
    Raises UnsupportedLayoutError naming the backend where that gives no one-to-one map."""
    import torch

    backend = _backend_name(layer)
    if not hasattr(layer, "impl") or not hasattr(layer.impl, "do_kv_cache_update"):
        raise UnsupportedLayoutError(f"attention backend {backend}: no separate KV cache update "
                                     "op to learn its layout from")
    if getattr(getattr(layer, "attn_backend", None), "forward_includes_kv_cache_update", False):
        raise UnsupportedLayoutError(f"attention backend {backend} writes the KV cache inside "
                                     "its forward: no separate op to learn its layout from")
    if len(cache.shape) != 4:
        raise UnsupportedLayoutError(f"attention backend {backend}: a {len(cache.shape)}-D "
                                     f"cache {tuple(cache.shape)}, not vLLM's [B, H, N, C] view")
    _, heads, tokens, content = (int(x) for x in cache.shape)
    strides = _element_strides(cache)
    # The scratch keeps the layer's physical dim order (the op may read strides).
    order = sorted(range(4), key=lambda d: -strides[d])
    shape = (2, heads, tokens, content)
    physical = torch.zeros([shape[d] for d in order], dtype=cache.dtype, device=cache.device)
    scratch = physical.permute([order.index(d) for d in range(4)])
    count = 2 * tokens * heads * head_size
    ids = torch.arange(1, count + 1, dtype=torch.int64).reshape(2, tokens, heads, head_size)
    slots = torch.arange(tokens, 2 * tokens, dtype=torch.int64, device=cache.device)
    codes = torch.zeros(shape, dtype=torch.int64)
    try:
        for bit in range(count.bit_length()):
            physical.zero_()
            k = ((ids[0] >> bit) & 1).to(cache.dtype).to(cache.device)
            v = ((ids[1] >> bit) & 1).to(cache.dtype).to(cache.device)
            layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
            codes |= (scratch.to("cpu").float() != 0).to(torch.int64) << bit
    except Exception as e:  # noqa: BLE001 - any failure of the op is a refusal naming it
        raise UnsupportedLayoutError(f"attention backend {backend}: its KV cache update op "
                                     f"failed on a probe ({type(e).__name__}: {e})") from e
    codes = codes.numpy()
    if codes[0].any():
        raise UnsupportedLayoutError(f"attention backend {backend}: writing slots of block 1 "
                                     "changed block 0: blocks are not independent")
    block = codes[1].reshape(-1)
    written = np.flatnonzero(block)
    found = np.sort(block[written])
    if len(written) != count or not np.array_equal(found, np.arange(1, count + 1)):
        raise UnsupportedLayoutError(
            f"attention backend {backend} (kv_cache_dtype "
            f"{getattr(layer, 'kv_cache_dtype', '?')}): its KV cache update is not a copy of "
            f"each element to one place ({len(written)} elements written for {count} values)")
    h, n, c = np.unravel_index(written, (heads, tokens, content))
    where = np.empty(count, np.int64)
    where[block[written] - 1] = h * strides[1] + n * strides[2] + c * strides[3]
    offsets = where.reshape(2, tokens, heads, head_size).transpose(1, 0, 2, 3)
    return TokenLayout(backend, tokens, strides[0], np.ascontiguousarray(offsets),
                       _span(cache.shape, strides))


def _backend_name(layer):
    backend = getattr(layer, "attn_backend", None)
    if backend is not None and hasattr(backend, "get_name"):
        return backend.get_name()
    impl = getattr(layer, "impl", None)
    return type(impl).__name__ if impl is not None else type(layer).__name__
