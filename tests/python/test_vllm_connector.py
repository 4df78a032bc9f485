"""kvd.vllm.KvdConnector driven the way vLLM's v1 engine drives a KV connector, with a real kvd
underneath and paged KV caches as numpy arrays.

The stand-in below makes vLLM's calls with the same method names, arguments and order as the
v1 engine (written down from vLLM's KVConnectorBase_V1 interface,
vllm/distributed/kv_transfer/kv_connector/v1/base.py, as of vLLM 0.11, and its scheduler and
GPU model runner):
  scheduler, per new request: get_num_new_matched_tokens(request, num_local_computed_tokens)
      -> allocate blocks -> update_state_after_alloc(request, blocks, num_external_tokens)
      (request.num_computed_tokens is set after that call)
  scheduler, per step: build_connector_meta(scheduler_output) with scheduled_new_reqs
      (req_id, prompt_token_ids, block_ids as a tuple of per-group lists, num_computed_tokens),
      scheduled_cached_reqs (req_ids, new_block_ids, num_computed_tokens) and
      num_scheduled_tokens
  worker, per step: bind_connector_metadata -> start_load_kv(forward_context) -> per layer:
      wait_for_layer_load(name), attention writes the step's K/V into the paged cache,
      save_kv_layer(name, kv_layer, attn_metadata) -> wait_for_save() -> get_finished(ids)
      -> clear_connector_metadata()
  scheduler, at the end: request_finished(request, block_ids)
Caches are [2, num_blocks, block_size, num_kv_heads, head_dim] per layer (FlashAttention layout).
"""

import os
import subprocess
import types

import numpy as np
import pytest

import kvd
from kvd.vllm import KvdConnector, KVConnectorRole

LAYERS, HEADS, DIM, BLOCK = 5, 4, 8, 16  # stories260k in the test daemon; vLLM block_size 16


def vllm_config(daemon, **extra):
    cfg = {"kvd_address": daemon.address, "kvd_model": "stories260k", "kvd_ucx_tls": "sm,tcp",
           "kvd_net_devices": "lo", **extra}
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector="KvdConnector",
                                                 kv_connector_module_path="kvd.vllm",
                                                 kv_role="kv_both",
                                                 kv_connector_extra_config=cfg),
        cache_config=types.SimpleNamespace(block_size=BLOCK))


def true_kv(tokens, layer):
    """The K/V a model would compute: a function of the prefix (token ids and positions)."""
    t = np.asarray(tokens, np.float32)
    pos = np.arange(len(tokens), dtype=np.float32)
    base = (np.cumsum(t) % 997)[:, None, None] + pos[:, None, None] * 1e-3
    grid = np.arange(HEADS * DIM, dtype=np.float32).reshape(1, HEADS, DIM)
    return base + grid + 100 * layer, -(base + grid) - 100 * layer


class Engine:
    """One vLLM engine (scheduler + one worker) with its own paged cache."""

    def __init__(self, daemon, num_blocks=128, seed=0):
        self.sched = KvdConnector(vllm_config(daemon), KVConnectorRole.SCHEDULER)
        self.worker = KvdConnector(vllm_config(daemon), KVConnectorRole.WORKER)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.caches = {n: np.full((2, num_blocks, BLOCK, HEADS, DIM), np.nan, np.float32)
                       for n in self.names}
        self.worker.register_kv_caches(self.caches)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.computed_by_model = {}

    def add_request(self, req_id, tokens, num_local_computed=0):
        req = types.SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens),
                                    num_computed_tokens=0, num_tokens=len(tokens))
        ext, is_async = self.sched.get_num_new_matched_tokens(req, num_local_computed)
        assert is_async is False
        nblocks = -(-len(tokens) // BLOCK)
        req.block_ids = [int(self.free.pop()) for _ in range(nblocks)]
        blocks = types.SimpleNamespace(get_block_ids=lambda: (list(req.block_ids),))
        self.sched.update_state_after_alloc(req, blocks, ext)
        req.num_computed_tokens = num_local_computed + ext
        return req, ext

    def step(self, new=(), cached=(), num_scheduled=None, finished=()):
        """One engine step. new: requests scheduled for the first time; cached: (request,
        new_block_ids or None) of requests continuing; num_scheduled: req_id -> tokens."""
        out = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(
                req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                block_ids=(list(r.block_ids),), num_computed_tokens=r.num_computed_tokens)
                for r in new],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[r.request_id for r, _ in cached],
                new_block_ids=[nb for _, nb in cached],
                num_computed_tokens=[r.num_computed_tokens for r, _ in cached]),
            num_scheduled_tokens=dict(num_scheduled))
        meta = self.sched.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(types.SimpleNamespace(virtual_engine=0))
        for layer, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            for r in list(new) + [c[0] for c in cached]:  # attention computes the new tokens
                lo = r.num_computed_tokens
                hi = lo + num_scheduled[r.request_id]
                k, v = true_kv(r.prompt_token_ids[:hi], layer)
                for p in range(lo, hi):
                    b, o = r.block_ids[p // BLOCK], p % BLOCK
                    self.caches[name][0, b, o], self.caches[name][1, b, o] = k[p], v[p]
            self.worker.save_kv_layer(name, self.caches[name], types.SimpleNamespace())
        self.worker.wait_for_save()
        assert self.worker.get_finished(set(finished)) == (None, None)
        self.worker.clear_connector_metadata()
        for r in list(new) + [c[0] for c in cached]:
            r.num_computed_tokens += num_scheduled[r.request_id]

    def finish(self, req):
        assert self.sched.request_finished(req, req.block_ids) == (False, None)

    def cached_kv(self, req, layer, lo, hi):
        name = self.names[layer]
        idx = [(req.block_ids[p // BLOCK], p % BLOCK) for p in range(lo, hi)]
        k = np.stack([self.caches[name][0, b, o] for b, o in idx])
        v = np.stack([self.caches[name][1, b, o] for b, o in idx])
        return k, v

    def close(self):
        self.sched.shutdown()
        self.worker.shutdown()


def prompt(seed, n):
    return list(np.random.default_rng(seed).integers(0, 32000, n))


def stored_chunks(daemon, tokens):
    with kvd.connect(daemon.address, model="stories260k", ucx_tls="sm,tcp",
                     net_devices="lo") as c:
        hit = c.lookup(c.hash(tokens, include_partial_chunk=False))
        if hit.lease_id:
            c.release(hit.lease_id)
        return hit.matched_chunks


def test_prefill_saves_and_another_engine_loads(daemon):
    tokens = prompt(1, 600)
    a = Engine(daemon, seed=1)
    r1, ext = a.add_request("r1", tokens)
    assert ext == 0  # nothing in kvd yet
    a.step(new=[r1], num_scheduled={"r1": 600})
    a.finish(r1)
    assert stored_chunks(daemon, tokens) == 2  # the 88-token tail is not a full chunk

    b = Engine(daemon, seed=2)  # another engine: other block ids, empty cache
    r2, ext = b.add_request("r2", tokens)
    assert ext == 512
    b.step(new=[r2], num_scheduled={"r2": 600 - 512})
    for layer in range(LAYERS):
        k, v = b.cached_kv(r2, layer, 0, 600)
        tk, tv = true_kv(tokens, layer)
        np.testing.assert_array_equal(k, tk)  # loaded tokens are bit-exact copies
        np.testing.assert_array_equal(v, tv)
    b.finish(r2)
    a.close()
    b.close()


def test_full_hit_leaves_one_token_to_compute_and_local_prefix_is_not_reloaded(daemon):
    tokens = prompt(2, 512)
    a = Engine(daemon, seed=3)
    r, _ = a.add_request("p", tokens)
    a.step(new=[r], num_scheduled={"p": 512})
    a.close()

    b = Engine(daemon, seed=4)
    r, ext = b.add_request("full", tokens)
    assert ext == 511  # vLLM must compute the last prompt token itself
    b.step(new=[r], num_scheduled={"full": 1})
    k, _ = b.cached_kv(r, 0, 0, 512)
    np.testing.assert_array_equal(k, true_kv(tokens, 0)[0])

    # A local prefix-cache hit of 256 tokens: only tokens 256.. come from kvd.
    r, ext = b.add_request("local", tokens, num_local_computed=256)
    assert ext == 511 - 256
    b.step(new=[r], num_scheduled={"local": 1})
    k, _ = b.cached_kv(r, 1, 0, 512)
    assert np.isnan(k[:256]).all()  # not touched by the connector (held locally by vLLM)
    np.testing.assert_array_equal(k[256:], true_kv(tokens, 1)[0][256:])
    b.close()


def test_chunked_prefill_saves_each_chunk_once_completed(daemon):
    tokens = prompt(3, 768)
    e = Engine(daemon, seed=5)
    r, _ = e.add_request("long", tokens)
    first = r.block_ids[:20]  # vLLM allocates blocks as the prefill proceeds
    rest = r.block_ids[20:]
    r.block_ids = first
    e.step(new=[r], num_scheduled={"long": 320})  # chunk 0 complete, chunk 1 not yet
    assert stored_chunks(daemon, tokens) == 1
    r.block_ids = first + rest
    e.step(cached=[(r, (rest,))], num_scheduled={"long": 448})
    assert stored_chunks(daemon, tokens) == 3
    e.finish(r)
    e.close()

    other = Engine(daemon, seed=6)
    r2, ext = other.add_request("again", tokens)
    assert ext == 767
    other.step(new=[r2], num_scheduled={"again": 1})
    k, v = other.cached_kv(r2, 4, 0, 767)
    tk, tv = true_kv(tokens, 4)
    np.testing.assert_array_equal(k, tk[:767])
    np.testing.assert_array_equal(v, tv[:767])
    other.close()


def test_layout_mismatch_is_refused(daemon):
    w = KvdConnector(vllm_config(daemon), KVConnectorRole.WORKER)
    caches = {f"l{i}": np.zeros((2, 8, BLOCK, HEADS * 2, DIM), np.float32) for i in range(LAYERS)}
    with pytest.raises(ValueError, match=r"has layers/kv_heads/head_dim \(5, 4, 8\)"):
        w.register_kv_caches(caches)
    w.shutdown()
    with pytest.raises(ValueError, match="kvd_model"):
        cfg = vllm_config(daemon)
        del cfg.kv_transfer_config.kv_connector_extra_config["kvd_model"]
        KvdConnector(cfg, KVConnectorRole.WORKER)


def test_evicted_between_schedule_and_load_is_a_clear_error(daemon):
    tokens = prompt(4, 512)
    a = Engine(daemon, seed=7)
    r, _ = a.add_request("x", tokens)
    a.step(new=[r], num_scheduled={"x": 512})
    b = Engine(daemon, seed=8)
    r2, ext = b.add_request("y", tokens)
    assert ext == 511
    # Everything of the model is evicted between scheduling and loading.
    subprocess.run([os.environ.get("KVDCTL_BINARY", "kvdctl"), "--addr", daemon.address,
                    "evict", "--model", "stories260k"], check=True, capture_output=True)
    with pytest.raises(kvd.NotFoundError, match="evicted since"):
        b.step(new=[r2], num_scheduled={"y": 1})
    a.close()
    b.close()
