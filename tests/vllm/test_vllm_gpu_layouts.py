"""kvd's vLLM connector on vLLM's GPU attention backends, FlashAttention and FlashInfer, checked
against vLLM's own layout code, on the CPU.

Everything that decides where a token's K and V lie is vLLM 0.32's own code, as its GPU model
runner calls it: the attention layers (vLLM's Attention with the backend's impl), their KV cache
specs (get_kv_cache_spec, customize_attention_spec), the KV cache config for a physical layout
(get_kv_cache_config_from_groups: every KVCacheLayout, NHD and HND ones alike), the kernel block
sizes (prepare_kernel_block_sizes: FlashInfer splits 128-token blocks into 64-token kernel
blocks), the tensors a connector's register_kv_caches receives (allocate_kv_cache), and the
writes of K and V (the impl's do_kv_cache_update, which splits the [B, H, N, C] view into the
key and value caches it hands the reshape_and_cache_flash op).

That op is a CUDA kernel the CPU wheel lacks. Where it is missing, this test registers it for
CPU tensors with the kernel's contract (vLLM's csrc/cache_kernels.cu): token i goes to
key_cache[slot // block_size, slot % block_size] and the same of value_cache, through the
tensors' block, slot and head strides, the head_size axis contiguous. On a GPU the same
do_kv_cache_update runs the real kernel, and so does kvd's connector, which learns each layer's
layout by calling it on a scratch cache (kvd/vllm_layout.py: probe_layout).

Checked per backend, layout and block size:
- the layout the connector learns addresses exactly the elements of the key and value views
  vLLM's do_kv_cache_update hands the op, for every kernel block, slot, head and dim;
- a 512-token request written by vLLM's do_kv_cache_update into scattered blocks is saved by
  the connector into kvd's chunks token by token (read back with a second kvd client), and
  loaded back (511 tokens: the load ends inside a block, in-step and async) into zeroed caches,
  which then equal caches vLLM wrote with those 511 tokens, element for element.

FlashInfer's backend module imports the flashinfer package: deploy/setup-vllm.sh installs it
into a folder of its own that only this test puts on its path (ctest: PYTHONPATH); without it
the FlashInfer cases skip and say so.
"""

import importlib
import logging
import time
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

import kvd  # noqa: E402
import kvd.vllm as kvd_vllm  # noqa: E402
from kvd.vllm import KvdConnector, KvdConnectorMetadata, RequestPlan  # noqa: E402
from kvd_daemon import KvdDaemon  # noqa: E402
from vllm import _custom_ops  # noqa: E402
from vllm.config import (CacheConfig, KVTransferConfig, VllmConfig,  # noqa: E402
                         set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backends import flash_attn  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_kv_cache_config_from_groups,  # noqa: E402
                                         get_kv_cache_groups)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import (AttentionGroup, allocate_kv_cache,  # noqa: E402
                                  customize_attention_spec, prepare_kernel_block_sizes,
                                  select_common_block_size)

LAYERS, Q_HEADS, KV_HEADS, HEAD = 2, 4, 2, 16
KVD_MODEL = "tiny-f16"   # float16: vLLM's KV cache dtype for "auto" without a model config
MODELS = f"""\
  - name: {KVD_MODEL}
    layout: {{layers: {LAYERS}, kv_heads: {KV_HEADS}, q_heads: {Q_HEADS}, head_dim: {HEAD},
             dtype: float16, rope: {{theta: 10000, pairing: halves, scaling: none}}}}
"""
CHUNK = 256     # the daemon's chunk_tokens
PROMPT = 512    # two chunks
LOADED = PROMPT - 1  # vLLM computes a fully cached prompt's last token itself

# ---- the reshape_and_cache_flash op for CPU tensors (the CUDA kernel's contract) ----
_recorded = []   # (key_cache, value_cache) of each call while recording
_recording = False
_library = None  # keeps the CPU registration alive


def _reshape_and_cache_flash_cpu(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                 k_scale, v_scale):
    # What the CUDA kernel requires of its arguments, checked rather than assumed: no
    # quantization ("auto", or the cache's own element type named, as the backends'
    # supported_kv_cache_dtypes allow).
    assert kv_cache_dtype in ("auto", str(key_cache.dtype).removeprefix("torch.")), kv_cache_dtype
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert key_cache.stride(0) == value_cache.stride(0)
    assert key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:]
    if _recording:
        _recorded.append((key_cache, value_cache))
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):  # one token per thread block in CUDA
        if slot < 0:
            continue  # a padding token
        key_cache[slot // block_size, slot % block_size] = key[i]
        value_cache[slot // block_size, slot % block_size] = value[i]


def _ensure_op():
    """vLLM's reshape_and_cache_flash op: its own where built (CUDA), else the CPU one above."""
    global _library
    try:
        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018
    except (AttributeError, RuntimeError):
        _library = torch.library.Library("_C_cache_ops", "FRAGMENT")
        _library.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
                        "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, "
                        "Tensor k_scale, Tensor v_scale) -> ()")
        _library.impl("reshape_and_cache_flash", _reshape_and_cache_flash_cpu, "CPU")
    # FlashAttention's module binds the op where flash-attn is built (CUDA, ROCm, XPU), to
    # vLLM's _custom_ops wrapper of it; the CPU wheel builds no flash-attn.
    if not hasattr(flash_attn, "reshape_and_cache_flash"):
        flash_attn.reshape_and_cache_flash = _custom_ops.reshape_and_cache_flash


def _backend(name):
    if name == "FLASH_ATTN":
        return flash_attn.FlashAttentionBackend
    try:
        return importlib.import_module("vllm.v1.attention.backends.flashinfer").FlashInferBackend
    except ImportError as e:
        pytest.skip(f"vLLM's FlashInfer backend does not import ({e}); deploy/setup-vllm.sh "
                    "installs the flashinfer package for this test")


# Backend, vLLM block size: FlashAttention takes any multiple of 16; FlashInfer's kernels take
# 16, 32 and 64 (off Blackwell), so vLLM splits a 128-token block into two kernel blocks.
CASES = [("FLASH_ATTN", 16), ("FLASH_ATTN", 128),
         ("FLASHINFER", 16), ("FLASHINFER", 64), ("FLASHINFER", 128)]


@pytest.fixture(scope="module")
def daemon():
    d = KvdDaemon(node="vllm-gpu-layouts", capacity="64MiB", shared_memory=False,
                  extra_models=MODELS)
    yield d
    d.stop()


class Engine:
    """vLLM's GPU model runner's KV caches and attention layers for one backend, layout and
    block size, with kvd's connector registered on them."""

    def __init__(self, daemon, backend_name, layout, block_size, async_load=False,
                 kvd_model=KVD_MODEL, cache_dtype="auto"):
        _ensure_op()
        backend = _backend(backend_name)
        self.daemon = daemon
        self.block_size = block_size
        self.num_blocks = PROMPT // block_size + 3  # more than the request's: some stay unused
        self.cfg = VllmConfig(
            cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvdConnector", kv_connector_module_path="kvd.vllm",
                kv_role="kv_both", kv_connector_extra_config={
                    "kvd_address": daemon.address, "kvd_model": kvd_model,
                    "kvd_ucx_tls": "sm,tcp", "kvd_net_devices": "lo",
                    "kvd_async_load": async_load,
                    # Byte-exact layouts are what this test checks: a load slower than the
                    # production deadline (2 s) on a busy 2-core runner is a latency event that
                    # vllm_faults covers, not a layout error.
                    "kvd_timeout_ms": 30000}))
        self.cfg.cache_config.kv_cache_layout = layout.name
        self.cfg.cache_config.num_gpu_blocks_override = self.num_blocks
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        with set_current_vllm_config(self.cfg):
            self.layers = {n: Attention(Q_HEADS, HEAD, HEAD ** -0.5, num_kv_heads=KV_HEADS,
                                        cache_config=self.cfg.cache_config, prefix=n,
                                        attn_backend=backend) for n in self.names}
            specs = {n: customize_attention_spec(backend, layer.get_kv_cache_spec(self.cfg))
                     for n, layer in self.layers.items()}
            groups = get_kv_cache_groups(self.cfg, specs)
            self.kv_cache_config = get_kv_cache_config_from_groups(self.cfg, groups, 1 << 30)
            attn_groups = [[AttentionGroup(backend, g.layer_names, g.kv_cache_spec, i)]
                           for i, g in enumerate(groups)]
            kernel_sizes = prepare_kernel_block_sizes(self.kv_cache_config, attn_groups)
            # Where vLLM keeps a block whole that the backend's kernels cannot take, its
            # metadata builders refuse the layout (AttentionGroup.create_metadata_builders).
            if select_common_block_size(kernel_sizes[0], [backend],
                                        [groups[0].kv_cache_spec]) != kernel_sizes[0]:
                pytest.skip(f"vLLM does not run {backend_name} on {layout.name} with "
                            f"{block_size}-token blocks")
            self.kernel_block_size = kernel_sizes[0]
            try:
                self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                                layout, kernel_sizes)
            except ValueError as e:  # a layout whose blocks cannot split into kernel blocks
                pytest.skip(f"vLLM does not run {backend_name} on {layout.name} with "
                            f"{block_size}-token blocks: {e}")
            self.connector = KvdConnector(self.cfg, KVConnectorRole.WORKER, self.kv_cache_config)
            self.connector.register_kv_caches(self.caches)

    def write(self, token_kv, block_ids, tokens):
        """vLLM's attention writing K/V of tokens [0, tokens) of a request with these blocks:
        the layer's do_kv_cache_update with vLLM's slot mapping (kernel block * kernel block
        size + offset, which for kernel blocks b * ratio + j is b * block_size + offset)."""
        pos = torch.arange(tokens)
        slots = torch.as_tensor(block_ids)[pos // self.block_size] * self.block_size \
            + pos % self.block_size
        for i, name in enumerate(self.names):
            layer = self.layers[name]
            k, v = token_kv[i]
            layer.impl.do_kv_cache_update(layer, k[:tokens], v[:tokens], self.caches[name], slots)

    def zero(self):
        for cache in self.caches.values():
            cache.zero_()

    def run(self, plan):
        """One worker step of the connector for one request's plan (vLLM's call order). A step
        whose save or load failed fails with what the connector logged and kvd's log."""
        c = self.connector
        with _Warnings(kvd_vllm._log) as warned:
            c.bind_connector_metadata(KvdConnectorMetadata(requests=[plan]))
            c.start_load_kv(None)
            for name in self.names:
                c.wait_for_layer_load(name)
                c.save_kv_layer(name, self.caches[name], None)
            c.wait_for_save()
            c.clear_connector_metadata()
            deadline = time.monotonic() + 60
            while plan.load_async and plan.req_id in c._async_loads:
                assert time.monotonic() < deadline, "async load did not finish"
                c.get_finished(set())
                time.sleep(0.005)
        failed = sorted(c.get_block_ids_with_load_errors())
        assert not failed and not warned, (
            f"request {plan.req_id}: {len(failed)} blocks failed to load; the connector logged "
            f"{warned}; kvd's log ends:\n{self.daemon.log()[-4000:]}")

    def close(self):
        self.connector.shutdown()


class _Warnings(logging.Handler):
    """The warnings `logger` emits inside the `with` block, as strings."""

    def __init__(self, logger):
        super().__init__(logging.WARNING)
        self.logger, self.messages = logger, []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def vllm_views(engine, name):
    """The key and value caches vLLM's do_kv_cache_update hands reshape_and_cache_flash for
    layer `name` (it writes a token of zeros to slot 0)."""
    global _recording
    layer = engine.layers[name]
    cache = engine.caches[name]
    one = torch.zeros(1, KV_HEADS, HEAD, dtype=cache.dtype)
    _recording, _recorded[:] = True, []
    try:
        layer.impl.do_kv_cache_update(layer, one, one, cache, torch.zeros(1, dtype=torch.int64))
    finally:
        _recording = False
    assert len(_recorded) == 1
    return _recorded.pop()


def expected_offsets(engine, name):
    """int64 [kernel blocks, slots, 2 (K, V), heads, dim]: each element's offset from the
    layer view's first element, read off the views vLLM hands the op."""
    cache = engine.caches[name]
    out = []
    for view in vllm_views(engine, name):
        assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        idx = np.indices(tuple(view.shape), dtype=np.int64)
        out.append(view.storage_offset() - cache.storage_offset()
                   + sum(i * s for i, s in zip(idx, view.stride())))
    return np.stack(out, axis=2)


def token_kv(seed, tokens=PROMPT):
    """Distinct float16 K/V per layer: [(k, v)] each [tokens, kv heads, head dim]."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(tokens, KV_HEADS, HEAD, generator=g).to(torch.float16)
                  for _ in range(2)) for _ in range(LAYERS)]


def layouts():
    return list(KVCacheLayout)


@pytest.mark.parametrize("layout", layouts(), ids=lambda x: x.name)
@pytest.mark.parametrize("backend,block_size", CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_connector_addresses_the_elements_vllm_writes(daemon, backend, block_size, layout):
    engine = Engine(daemon, backend, layout, block_size)
    try:
        for name in engine.names:
            tl = engine.connector._token_layouts[name]
            want = expected_offsets(engine, name)  # [kb, n, kv, h, d]
            kernel_blocks, slots = want.shape[:2]
            assert (tl.backend, tl.block_tokens) == (backend, engine.kernel_block_size)
            assert (kernel_blocks, slots) == tuple(engine.caches[name].shape[:1]) + (
                engine.kernel_block_size,)
            kb, n = np.meshgrid(np.arange(kernel_blocks), np.arange(slots), indexing="ij")
            got = tl.element_offsets(kb.reshape(-1), n.reshape(-1)).reshape(want.shape)
            wrong = np.argwhere(got != want)
            assert len(wrong) == 0, (
                f"{name}: kvd addresses {len(wrong)} of {want.size} elements elsewhere than "
                f"vLLM's do_kv_cache_update, first [kernel block, slot, K/V, head, dim] "
                f"{wrong[0].tolist()}: kvd {got[tuple(wrong[0])]}, vLLM {want[tuple(wrong[0])]}")
    finally:
        engine.close()


@pytest.mark.parametrize("async_load", [False, True], ids=["in-step-load", "async-load"])
@pytest.mark.parametrize("layout", layouts(), ids=lambda x: x.name)
@pytest.mark.parametrize("backend,block_size", CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_save_and_partial_load_round_trip(daemon, backend, block_size, layout, async_load):
    engine = Engine(daemon, backend, layout, block_size, async_load=async_load)
    ref = Engine(daemon, backend, layout, block_size)
    try:
        # A seed per case: each case's chunks are new to kvd (their tokens differ).
        seed = zlib.crc32(f"{backend} {block_size} {layout.name} {async_load}".encode())
        kv = token_kv(seed)
        tokens = [int(t) for t in np.random.default_rng(seed).integers(1, 30000, PROMPT)]
        blocks = PROMPT // block_size
        block_ids = [int(b) for b in np.random.default_rng(seed).permutation(
            engine.num_blocks)[:blocks]]
        engine.write(kv, block_ids, PROMPT)
        engine.run(RequestPlan(f"save-{seed}", tokens, block_ids,
                               save_chunks=list(range(PROMPT // CHUNK))))

        # kvd holds each token's K/V as vLLM's op was given them.
        with kvd.connect(daemon.address, model=KVD_MODEL, ucx_tls="sm,tcp",
                         net_devices="lo") as c:
            hit = c.lookup(c.hash(tokens, include_partial_chunk=False))
            assert hit.matched_chunks == PROMPT // CHUNK
            try:
                for ci in range(PROMPT // CHUNK):
                    buf = np.empty(c.chunk_bytes, np.uint8)
                    c.get(hit.lease_id, ci, buf)
                    stored = buf.view(np.float16).reshape(LAYERS, 2, CHUNK, KV_HEADS, HEAD)
                    for layer in range(LAYERS):
                        for i in range(2):
                            want = kv[layer][i][ci * CHUNK:(ci + 1) * CHUNK].numpy()
                            assert np.array_equal(stored[layer, i], want), (
                                f"chunk {ci} layer {layer} {'KV'[i]}: kvd stored other values "
                                "than vLLM wrote")
            finally:
                c.release(hit.lease_id)

        # A load of 511 tokens into zeroed caches equals vLLM writing those 511 tokens.
        engine.zero()
        engine.run(RequestPlan(f"load-{seed}", tokens, block_ids, load_start=0,
                               load_end=LOADED, load_async=async_load))
        ref.write(kv, block_ids, LOADED)
        for name in engine.names:
            got, want = engine.caches[name].view(torch.int16), ref.caches[name].view(torch.int16)
            assert torch.equal(got, want), (
                f"{name}: after the load, {int((got != want).sum())} elements differ from "
                "vLLM's own writes")
    finally:
        engine.close()
        ref.close()


def test_a_cache_of_another_dtype_than_kvds_model_is_refused(daemon):
    # vLLM's float16 caches under kvd's bfloat16 model (same element size): stored bytes would
    # be read as the other type by every engine sharing the model.
    with pytest.raises(ValueError, match="float16.*bfloat16|bfloat16.*float16"):
        Engine(daemon, "FLASH_ATTN", KVCacheLayout.LBNHC, 16, kvd_model="tiny-bf16")


def test_a_kv_cache_dtype_naming_the_models_own_dtype_is_accepted(daemon):
    # kv_cache_dtype "float16" on kvd's float16 model: vLLM's caches are float16, as with "auto"
    # (the layer says "float16", torch says "torch.float16": the same type).
    engine = Engine(daemon, "FLASH_ATTN", KVCacheLayout.LBNHC, 16, cache_dtype="float16")
    try:
        for name in engine.names:
            assert engine.layers[name].kv_cache_dtype == "float16"
            assert engine.caches[name].dtype == torch.float16
            assert engine.connector._token_layouts[name].backend == "FLASH_ATTN"
    finally:
        engine.close()
