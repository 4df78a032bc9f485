"""kvd.vllm.KvdConnector driven the way vLLM's v1 engine drives a KV connector, with a real kvd
underneath and paged KV caches as numpy arrays.

The stand-in below makes vLLM's calls with the same method names, arguments and order as the
v1 engine (written down from vLLM's KVConnectorBase_V1 interface,
vllm/distributed/kv_transfer/kv_connector/v1/base.py, as of vLLM 0.11, and its scheduler and
GPU model runner):
  scheduler, per new request: get_num_new_matched_tokens(request, num_local_computed_tokens)
      -> (num_external_tokens, load_async) -> allocate blocks (for the local and external
      tokens only when load_async) -> update_state_after_alloc(request, blocks,
      num_external_tokens). In-step load: request.num_computed_tokens is set after that call and
      the request is scheduled. Async load: the request waits (WAITING_FOR_REMOTE_KVS), is not
      scheduled, until a worker's get_finished reports it in finished_recving; then its computed
      tokens are its blocks' tokens (one less when that is the whole prompt; fewer when blocks
      failed to load), the rest of its blocks are allocated with a second
      update_state_after_alloc(request, blocks, 0), and it is scheduled as a new request.
  scheduler, per step: build_connector_meta(scheduler_output) with scheduled_new_reqs
      (req_id, prompt_token_ids, block_ids as a tuple of per-group lists, num_computed_tokens),
      scheduled_cached_reqs (req_ids, new_block_ids, num_computed_tokens) and
      num_scheduled_tokens
  worker, per step: bind_connector_metadata -> start_load_kv(forward_context) -> per layer:
      wait_for_layer_load(name), attention writes the step's K/V into the paged cache,
      save_kv_layer(name, kv_layer, attn_metadata) -> wait_for_save() -> get_finished(ids)
      -> get_block_ids_with_load_errors() -> clear_connector_metadata()
  scheduler, after the step: update_connector_output(output with finished_sending,
      finished_recving)
  scheduler, at the end: request_finished(request, block_ids) -> (delay freeing, params); a
      delayed request's blocks are freed when a worker reports it finished.
Caches are vLLM's logical per-layer view [num_blocks, num_kv_heads, block_size, 2 * head_dim]
with FlashAttention's split (K then V along the last axis): without vLLM installed the connector
takes that layout (kvd.vllm_layout.logical_layout); with vLLM it learns the layout from the
attention backend (tests/vllm). Every test runs with async loads (the default) and with in-step
loads.
"""

import os
import signal
import subprocess
import threading
import time
import types

import numpy as np
import pytest

import kvd
from kvd.vllm import KvdConnector, KVConnectorRole
from kvd_daemon import KvdDaemon

LAYERS, HEADS, DIM, BLOCK = 5, 4, 8, 16  # stories260k in the test daemon; vLLM block_size 16


@pytest.fixture(params=[True, False], ids=["async-load", "in-step-load"])
def async_load(request):
    return request.param


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

    def __init__(self, daemon, num_blocks=128, seed=0, async_load=True):
        cfg = vllm_config(daemon, kvd_async_load=async_load)
        self.async_load = async_load
        self.sched = KvdConnector(cfg, KVConnectorRole.SCHEDULER)
        self.worker = KvdConnector(cfg, KVConnectorRole.WORKER)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.caches = {n: np.full((num_blocks, HEADS, BLOCK, 2 * DIM), np.nan, np.float32)
                       for n in self.names}
        self.worker.register_kv_caches(self.caches)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.waiting_remote = {}   # req_id -> request (WAITING_FOR_REMOTE_KVS)
        self.aborted = {}          # req_id -> request whose blocks wait for its load to finish
        self.load_errors = set()   # block ids the worker reported

    def _blocks(self, req):
        return types.SimpleNamespace(get_block_ids=lambda: (list(req.block_ids),))

    def add_request(self, req_id, tokens, num_local_computed=0, wait=True):
        req = types.SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens),
                                    num_computed_tokens=0, num_tokens=len(tokens))
        ext, is_async = self.sched.get_num_new_matched_tokens(req, num_local_computed)
        assert is_async == (self.async_load and ext > 0)
        covered = num_local_computed + ext if is_async else len(tokens)
        req.block_ids = [int(self.free.pop()) for _ in range(-(-covered // BLOCK))]
        self.sched.update_state_after_alloc(req, self._blocks(req), ext)
        if is_async:
            self.waiting_remote[req_id] = req
            if wait:
                self.wait_for_remote(req)
        else:
            req.num_computed_tokens = num_local_computed + ext
        return req, ext

    def wait_for_remote(self, req, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while req.request_id in self.waiting_remote:
            assert time.monotonic() < deadline, f"{req.request_id}: load not finished"
            self.step()
            time.sleep(0.005)

    def _remote_kvs_ready(self, req):
        """vLLM's scheduler once a request's async load is reported finished."""
        n = min(len(req.block_ids) * BLOCK, req.num_tokens)
        if n == req.num_tokens:
            n -= 1
        bad = [i for i, b in enumerate(req.block_ids) if b in self.load_errors]
        if bad:  # recompute from the first block that failed
            n = min(n, bad[0] * BLOCK)
        req.num_computed_tokens = n
        more = -(-req.num_tokens // BLOCK) - len(req.block_ids)
        req.block_ids += [int(self.free.pop()) for _ in range(more)]
        self.sched.update_state_after_alloc(req, self._blocks(req), 0)

    def step(self, new=(), cached=(), num_scheduled=None, finished=(), resumed=()):
        """One engine step. new: requests scheduled for the first time; cached: (request,
        new_block_ids or None) of requests continuing; resumed: ids of cached requests that were
        preempted, whose new_block_ids replace their blocks; num_scheduled: req_id -> tokens.
        Returns the worker's (finished_sending, finished_recving)."""
        num_scheduled = num_scheduled or {}
        out = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(
                req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                block_ids=(list(r.block_ids),), num_computed_tokens=r.num_computed_tokens)
                for r in new],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[r.request_id for r, _ in cached], resumed_req_ids=set(resumed),
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
                    self.caches[name][b, :, o, :DIM] = k[p]
                    self.caches[name][b, :, o, DIM:] = v[p]
            self.worker.save_kv_layer(name, self.caches[name], types.SimpleNamespace())
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set(finished))
        assert sending is None  # saves are synchronous
        self.load_errors |= self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(
            types.SimpleNamespace(finished_sending=sending, finished_recving=recving))
        for r in list(new) + [c[0] for c in cached]:
            r.num_computed_tokens += num_scheduled[r.request_id]
        for req_id in recving or ():
            if req_id in self.aborted:  # its blocks can be reused now
                self.free += self.aborted.pop(req_id).block_ids
            else:
                self._remote_kvs_ready(self.waiting_remote.pop(req_id))
        return sending, recving

    def finish(self, req):
        """Finishes (or aborts) a request; returns whether vLLM delays freeing its blocks."""
        delay, params = self.sched.request_finished(req, req.block_ids)
        assert params is None
        self.waiting_remote.pop(req.request_id, None)
        if delay:
            self.aborted[req.request_id] = req
        return delay

    def cached_kv(self, req, layer, lo, hi):
        name = self.names[layer]
        idx = [(req.block_ids[p // BLOCK], p % BLOCK) for p in range(lo, hi)]
        k = np.stack([self.caches[name][b, :, o, :DIM] for b, o in idx])
        v = np.stack([self.caches[name][b, :, o, DIM:] for b, o in idx])
        return k, v

    def close(self):
        self.sched.shutdown()
        self.worker.shutdown()


def prompt(seed, n, variant=0):
    """n token ids; each test variant gets its own prompts (the daemon is shared)."""
    return list(np.random.default_rng([seed, int(variant)]).integers(0, 32000, n))


def stored_chunks(daemon, tokens):
    with kvd.connect(daemon.address, model="stories260k", ucx_tls="sm,tcp",
                     net_devices="lo") as c:
        hit = c.lookup(c.hash(tokens, include_partial_chunk=False))
        if hit.lease_id:
            c.release(hit.lease_id)
        return hit.matched_chunks


def test_prefill_saves_and_another_engine_loads(daemon, async_load):
    tokens = prompt(1, 600, async_load)
    a = Engine(daemon, seed=1, async_load=async_load)
    r1, ext = a.add_request("r1", tokens)
    assert ext == 0  # nothing in kvd yet
    a.step(new=[r1], num_scheduled={"r1": 600})
    assert not a.finish(r1)
    assert stored_chunks(daemon, tokens) == 2  # the 88-token tail is not a full chunk

    b = Engine(daemon, seed=2, async_load=async_load)  # another engine: other block ids, empty cache
    r2, ext = b.add_request("r2", tokens)
    assert ext == 512
    b.step(new=[r2], num_scheduled={"r2": 600 - 512})
    for layer in range(LAYERS):
        k, v = b.cached_kv(r2, layer, 0, 600)
        tk, tv = true_kv(tokens, layer)
        np.testing.assert_array_equal(k, tk)  # loaded tokens are bit-exact copies
        np.testing.assert_array_equal(v, tv)
    assert not b.finish(r2)
    a.close()
    b.close()


def test_full_hit_leaves_one_token_to_compute_and_local_prefix_is_not_reloaded(daemon, async_load):
    tokens = prompt(2, 512, async_load)
    a = Engine(daemon, seed=3, async_load=async_load)
    r, _ = a.add_request("p", tokens)
    a.step(new=[r], num_scheduled={"p": 512})
    a.close()

    b = Engine(daemon, seed=4, async_load=async_load)
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


def test_chunked_prefill_saves_each_chunk_once_completed(daemon, async_load):
    tokens = prompt(3, 768, async_load)
    e = Engine(daemon, seed=5, async_load=async_load)
    r, _ = e.add_request("long", tokens)
    first = r.block_ids[:20]  # vLLM allocates blocks as the prefill proceeds
    rest = r.block_ids[20:]
    r.block_ids = first
    e.step(new=[r], num_scheduled={"long": 320})  # chunk 0 complete, chunk 1 not yet
    assert stored_chunks(daemon, tokens) == 1
    r.block_ids = first + rest
    e.step(cached=[(r, (rest,))], num_scheduled={"long": 448})
    assert stored_chunks(daemon, tokens) == 3
    assert not e.finish(r)
    e.close()

    other = Engine(daemon, seed=6, async_load=async_load)
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
    caches = {f"l{i}": np.zeros((8, HEADS * 2, BLOCK, 2 * DIM), np.float32) for i in range(LAYERS)}
    with pytest.raises(ValueError, match=r"has layers/kv_heads/head_dim \(5, 4, 8\)"):
        w.register_kv_caches(caches)
    caches = {f"l{i}": np.zeros((2, 8, BLOCK, HEADS, DIM), np.float32) for i in range(LAYERS)}
    with pytest.raises(ValueError, match=r"expected a \[num_blocks, num_kv_heads, block_size, "
                       r"2 \* 8\] cache, got \(2, 8, 16, 4, 8\)"):
        w.register_kv_caches(caches)
    w.shutdown()
    with pytest.raises(ValueError, match="kvd_model"):
        cfg = vllm_config(daemon)
        del cfg.kv_transfer_config.kv_connector_extra_config["kvd_model"]
        KvdConnector(cfg, KVConnectorRole.WORKER)


def evict_model(daemon):
    subprocess.run([os.environ.get("KVDCTL_BINARY", "kvdctl"), "--addr", daemon.address,
                    "evict", "--model", "stories260k"], check=True, capture_output=True)


def test_evicted_between_schedule_and_load_is_recomputed(daemon, async_load):
    tokens = prompt(4, 512, async_load)
    a = Engine(daemon, seed=7, async_load=async_load)
    r, _ = a.add_request("x", tokens)
    a.step(new=[r], num_scheduled={"x": 512})
    b = Engine(daemon, seed=8, async_load=async_load)
    r2, ext = b.add_request("y", tokens, wait=False)
    assert ext == 511
    # Everything of the model is evicted between scheduling and loading: no exception, the
    # blocks of the lost tokens (0..510) are reported and vLLM recomputes them.
    evict_model(daemon)
    if async_load:
        b.wait_for_remote(r2)
        assert r2.num_computed_tokens == 0  # recomputed from the first failed block
        b.step(new=[r2], num_scheduled={"y": 512})
    else:
        b.step(new=[r2], num_scheduled={"y": 1})
    assert b.load_errors == set(r2.block_ids[:32])
    if async_load:  # recomputed: the cache holds the true K/V
        k, v = b.cached_kv(r2, 2, 0, 512)
        np.testing.assert_array_equal(k, true_kv(tokens, 2)[0])
    a.close()
    b.close()


def gate_loads(engine):
    """Holds the worker's kvd gets until the returned event is set."""
    gate = threading.Event()
    stage = engine.worker._stage

    def held(c, plan):
        assert gate.wait(60)
        return stage(c, plan)

    engine.worker._stage = held
    return gate


def test_async_load_overlaps_other_requests_compute(daemon):
    cached_prompt, new_prompt = prompt(5, 520), prompt(6, 512)
    a = Engine(daemon, seed=9)
    r, _ = a.add_request("seed", cached_prompt)
    a.step(new=[r], num_scheduled={"seed": 520})
    a.close()

    e = Engine(daemon, seed=10)  # async loads (the default)
    gate = gate_loads(e)
    rb, ext = e.add_request("b", cached_prompt, wait=False)
    assert ext == 512
    ra, ext_a = e.add_request("a", new_prompt)
    assert ext_a == 0
    # Two steps of request a run while b's load is held: start_load_kv returned at once, and
    # b is not reported finished.
    _, recving = e.step(new=[ra], num_scheduled={"a": 256})
    assert recving is None and "b" in e.waiting_remote
    _, recving = e.step(cached=[(ra, None)], num_scheduled={"a": 256})
    assert recving is None and "b" in e.waiting_remote
    gate.set()
    e.wait_for_remote(rb)
    assert rb.num_computed_tokens == 512 and not e.load_errors
    e.step(new=[rb], num_scheduled={"b": 8})
    for layer in range(LAYERS):
        k, v = e.cached_kv(rb, layer, 0, 520)
        tk, tv = true_kv(cached_prompt, layer)
        np.testing.assert_array_equal(k, tk)
        np.testing.assert_array_equal(v, tv)
        k, _ = e.cached_kv(ra, layer, 0, 512)
        np.testing.assert_array_equal(k, true_kv(new_prompt, layer)[0])
    assert stored_chunks(daemon, new_prompt) == 2  # a's chunks saved meanwhile
    e.close()


def test_request_aborted_during_its_async_load_keeps_its_blocks_until_done(daemon):
    tokens = prompt(7, 512)
    a = Engine(daemon, seed=11)
    r, _ = a.add_request("seed", tokens)
    a.step(new=[r], num_scheduled={"seed": 512})
    a.close()

    e = Engine(daemon, seed=12)
    gate = gate_loads(e)
    rb, _ = e.add_request("gone", tokens, wait=False)
    e.step()  # the load reaches the worker and is held there
    free_before = len(e.free)
    assert e.finish(rb) is True  # vLLM must not free blocks the loader still writes
    assert len(e.free) == free_before
    gate.set()
    deadline = time.monotonic() + 60
    while "gone" in e.aborted:
        assert time.monotonic() < deadline
        e.step()
        time.sleep(0.005)
    assert len(e.free) == free_before + len(rb.block_ids)  # freed once reported finished
    # A request aborted before its load reached a worker is freed at once.
    rc, _ = e.add_request("early", tokens, wait=False)
    assert e.finish(rc) is False
    e.step()
    assert "early" not in e.worker._async_loads
    e.close()


def test_async_load_flag(daemon):
    with pytest.raises(ValueError, match="kvd_async_load: 'maybe' is not a boolean"):
        KvdConnector(vllm_config(daemon, kvd_async_load="maybe"), KVConnectorRole.SCHEDULER)
    c = KvdConnector(vllm_config(daemon, kvd_async_load="false"), KVConnectorRole.SCHEDULER)
    assert c._async_load is False
    c.shutdown()


def test_preempted_request_resumes_with_new_blocks_and_saves_from_them(daemon, async_load):
    tokens = prompt(8, 768, async_load)
    e = Engine(daemon, seed=13, async_load=async_load)
    r, _ = e.add_request("pre", tokens)
    old = r.block_ids[:20]
    r.block_ids = old
    e.step(new=[r], num_scheduled={"pre": 320})  # chunk 0 saved, chunk 1 not complete
    # Preempted: vLLM frees its blocks (another request overwrites them) and, when it is
    # scheduled again, gives it new blocks in resumed_req_ids: they replace the old ones.
    for name in e.names:
        e.caches[name][old] = -7.0
    r.block_ids = [int(e.free.pop()) for _ in range(48)]
    r.num_computed_tokens = 0
    e.step(cached=[(r, (list(r.block_ids),))], resumed={"pre"}, num_scheduled={"pre": 768})
    assert stored_chunks(daemon, tokens) == 3
    e.close()

    other = Engine(daemon, seed=14, async_load=async_load)
    r2, ext = other.add_request("after", tokens)
    assert ext == 767
    other.step(new=[r2], num_scheduled={"after": 1})
    for layer in range(LAYERS):
        k, v = other.cached_kv(r2, layer, 0, 767)
        tk, tv = true_kv(tokens, layer)
        np.testing.assert_array_equal(k, tk[:767])  # chunks 1 and 2 came from the new blocks
        np.testing.assert_array_equal(v, tv[:767])
    other.close()


def test_best_effort_cache_settings(daemon):
    c = KvdConnector(vllm_config(daemon), KVConnectorRole.SCHEDULER)
    assert c.requires_kv_delivery is False  # a lost save is a later miss, never awaited KV
    c.shutdown()


def test_reconnects_to_a_restarted_kvd_while_called_more_than_once_a_second():
    """kvd killed, then started again at the same address: a scheduler looking up every 50 ms
    (a busy engine calls the connector many times a second) finds the new kvd's chunks about a
    second after it is back. Calls refused by the once-a-second back-off must not push the next
    connection attempt back."""
    first = KvdDaemon(node="reconnect")
    second = None
    try:
        engine = Engine(first, seed=11)
        tokens = prompt(11, 512)
        request = types.SimpleNamespace(request_id="q", prompt_token_ids=tokens,
                                        num_computed_tokens=0, num_tokens=len(tokens))
        assert engine.sched.get_num_new_matched_tokens(request, 0) == (0, False)
        first.proc.kill()
        first.proc.wait()
        for _ in range(20):  # kvd gone: misses, never an exception
            assert engine.sched.get_num_new_matched_tokens(request, 0) == (0, False)
            time.sleep(0.05)
        second = KvdDaemon(node="reconnect", listen=first.address)
        writer = Engine(second, seed=12)
        r, _ = writer.add_request("w", tokens)
        writer.step(new=[r], num_scheduled={"w": 512})
        assert stored_chunks(second, tokens) == 2
        writer.close()
        deadline = time.monotonic() + 5
        while engine.sched.get_num_new_matched_tokens(request, 0)[0] == 0:
            assert time.monotonic() < deadline, "no hit 5 s after kvd came back"
            time.sleep(0.05)
        assert engine.sched.get_num_new_matched_tokens(request, 0) == (511, True)
        engine.close()
    finally:
        for d in (first, second):
            if d is not None:
                d.stop()


def test_a_kvd_that_stops_answering_costs_each_call_at_most_its_deadline():
    """kvd frozen (SIGSTOP: its sockets accept, nothing answers). Every connector call returns
    within kvd_timeout_ms (plus scheduling slack) as a miss, and only a few of 60 calls made
    over 3 s wait at all: the back-off doubles while kvd keeps failing."""
    d = KvdDaemon(node="frozen")
    try:
        sched = KvdConnector(vllm_config(d, kvd_timeout_ms=500), KVConnectorRole.SCHEDULER)
        tokens = prompt(12, 512)
        request = types.SimpleNamespace(request_id="f", prompt_token_ids=tokens,
                                        num_computed_tokens=0, num_tokens=len(tokens))
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # connected
        os.kill(d.proc.pid, signal.SIGSTOP)
        waits = []
        for _ in range(60):
            t = time.monotonic()
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
            waits.append(time.monotonic() - t)
            time.sleep(0.05)
        assert max(waits) < 1.5, f"a call waited {max(waits):.1f} s (deadline 0.5 s)"
        slow = sum(w > 0.25 for w in waits)
        assert slow <= 3, f"{slow} of 60 calls waited for kvd: {[round(w, 2) for w in waits]}"
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
