"""kvd as a vLLM KV connector (vLLM v1 engine, ``KVConnectorBase_V1``).

Enable it with (the module path and class name are what vLLM's connector factory loads):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvd_address": "127.0.0.1:7400",
                                      "kvd_model": "llama-3.1-8b"}}'

``kvd_model`` must be registered in the daemon's topology with the layout vLLM holds on this
rank (layers, KV heads per rank, head dim, dtype); register_kv_caches checks it. Optional
extra keys: ``kvd_namespace``, ``kvd_hash_seed``, ``kvd_ucx_tls``, ``kvd_net_devices``, and
``kvd_async_load`` (default true, see below).

Loads are asynchronous by default (vLLM's async KV load, as LMCache's and Mooncake's connectors
do): a request with tokens in kvd waits in vLLM's WAITING_FOR_REMOTE_KVS state while a loader
thread of the worker (with its own kvd connection) gets its chunks and writes them into the
request's blocks; the engine keeps computing the other requests meanwhile, and schedules the
request once get_finished() reports it. ``"kvd_async_load": false`` loads inside the step that
first computes the request instead (start_load_kv gets, wait_for_layer_load scatters per layer).
Either way, chunks evicted from kvd between scheduling and loading are not an exception: their
blocks are reported by get_block_ids_with_load_errors() and vLLM recomputes those tokens.

What it does, in vLLM's call order:
  scheduler  get_num_new_matched_tokens  kvd Lookup of the prompt's full chunks (lease released
                                         at once); tokens beyond the local hit, async or not
             update_state_after_alloc    remembers which blocks receive the external tokens
             build_connector_meta        per request: tokens to load (async loads of requests
                                         waiting for them, or loads in this step), full chunks
                                         to save, the request's block ids
             update_connector_output     async loads the workers finished
             request_finished            True while the request's async load is in flight (vLLM
                                         frees its blocks once the load is reported finished);
                                         saves are synchronous, so otherwise False
  worker     register_kv_caches          the paged caches, [2, num_blocks, block_size, heads, dim]
                                         per layer (vLLM's FlashAttention layout)
             start_load_kv               async loads: handed to the loader thread, returns at
                                         once; in-step loads: Lookup + Get into host staging
             wait_for_layer_load         in-step loads: scatters that layer's K/V into the blocks
             save_kv_layer               gathers that layer's K/V of every chunk to save
             wait_for_save               puts the gathered chunks (kvd deduplicates)
             get_finished                (None, ids of the requests whose async load completed)
             get_block_ids_with_load_errors  blocks whose tokens kvd no longer had

Chunks are kvd chunks (chunk_tokens, default 256; a multiple of vLLM's block_size), keyed by
kvd's chain hash of the token ids, so every engine using the same daemon and hash seed shares
them. Only full chunks are saved. Tensors may be numpy arrays or torch tensors (on any device:
staging is in host memory).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
from typing import Any

import numpy as np

import kvd

try:  # the real base class when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
except ImportError:  # without vLLM: the same names, so the connector can be driven by tests
    import enum

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata


@dataclasses.dataclass
class RequestPlan:
    """What the worker does for one request in one step."""
    req_id: str
    token_ids: list          # the prompt tokens known so far
    block_ids: list          # the request's vLLM blocks, in token order
    load_start: int = 0      # load tokens [load_start, load_end) from kvd
    load_end: int = 0
    load_async: bool = False  # loaded by the worker's loader thread, reported by get_finished
    save_chunks: list = dataclasses.field(default_factory=list)  # chunk indexes to save


@dataclasses.dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    requests: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _SchedulerRequest:
    token_ids: list
    block_ids: list
    saved_chunks: int  # chunks [0, saved_chunks) are in kvd or planned to be saved


_log = logging.getLogger("kvd.vllm")


def _flag(value) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"kvd_async_load: {value!r} is not a boolean")
    return bool(value)


def _extra(vllm_config) -> dict:
    cfg = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    if "kvd_model" not in cfg:
        raise ValueError("kv_connector_extra_config needs \"kvd_model\": a model registered in "
                         "the kvd topology")
    return cfg


class KvdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM before the kv_cache_config argument
            super().__init__(vllm_config, role)
        self._cfg = _extra(vllm_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._async_load = _flag(self._cfg.get("kvd_async_load", True))
        self._client = None
        # scheduler side
        self._requests: dict[str, _SchedulerRequest] = {}
        self._pending_loads: dict[str, int] = {}  # req_id -> external tokens to load in-step
        self._local_tokens: dict[str, int] = {}   # req_id -> local hit at the last match
        self._async_plans: dict[str, RequestPlan] = {}  # allocated, not yet sent to workers
        self._loading: set = set()  # req_ids whose async load the workers have not finished
        # worker side
        self._kv_caches: dict[str, Any] = {}
        self._layer_index: dict[str, int] = {}
        self._loads: list = []   # (plan, {chunk index: staging uint8 array})
        self._saves: dict = {}   # (req_id, chunk index) -> (hash, staging uint8 array)
        self._load_client = None  # the loader thread's own connection
        self._loader = None       # ThreadPoolExecutor of one thread, started on first use
        self._async_loads: dict = {}  # req_id -> Future of its load
        self._load_errors: set = set()  # block ids kvd could not fill
        self._errors_lock = threading.Lock()
        self._load_stream = None  # CUDA stream of the loader thread (torch device caches)

    # ---- shared ----
    def _new_client(self, suffix=""):
        cfg = self._cfg
        client = kvd.connect(
            cfg.get("kvd_address", "127.0.0.1:7400"), model=cfg["kvd_model"],
            namespace=cfg.get("kvd_namespace", ""),
            hash_seed=cfg.get("kvd_hash_seed", "kvd-default-seed"),
            ucx_tls=cfg.get("kvd_ucx_tls", ""), net_devices=cfg.get("kvd_net_devices", ""),
            client_id=f"vllm-{self.role.name.lower()}{suffix}")
        if client.chunk_tokens % self._block_size:
            client.close()
            raise ValueError(f"kvd chunk_tokens {client.chunk_tokens} is not a multiple "
                             f"of vLLM's block_size {self._block_size}")
        return client

    def _connect(self):
        if self._client is None:
            self._client = self._new_client()
        return self._client

    # ==== scheduler side ====
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        c = self._connect()
        chain = c.hash(request.prompt_token_ids, include_partial_chunk=False)
        if not chain:
            return 0, False
        hit = c.lookup(chain)
        if hit.lease_id:
            c.release(hit.lease_id)
        matched = int(hit.matched_tokens)
        # vLLM must compute at least one token of the prompt itself.
        matched = min(matched, len(request.prompt_token_ids) - 1)
        external = max(0, matched - num_computed_tokens)
        if external == 0:
            return 0, False
        # The load starts after the local hit (update_state_after_alloc needs it for async loads).
        self._local_tokens[request.request_id] = num_computed_tokens
        return external, self._async_load

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens <= 0:
            return  # nothing to load (or the second call after an async load)
        if not self._async_load:
            # vLLM sets request.num_computed_tokens only after this call: the load range is
            # known in build_connector_meta (the last num_external_tokens of the computed ones).
            self._pending_loads[request.request_id] = num_external_tokens
            return
        # Async: the request is not scheduled until its load is done; the load goes to the
        # workers in the next build_connector_meta.
        start = self._local_tokens.pop(request.request_id, 0)
        self._async_plans[request.request_id] = RequestPlan(
            request.request_id, list(request.prompt_token_ids), list(blocks.get_block_ids()[0]),
            load_start=start, load_end=start + num_external_tokens, load_async=True)

    def build_connector_meta(self, scheduler_output):
        meta = KvdConnectorMetadata()
        chunk = self._connect().chunk_tokens
        for req_id, plan in self._async_plans.items():
            meta.requests.append(plan)
            self._loading.add(req_id)
        self._async_plans = {}
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            state = _SchedulerRequest(list(new.prompt_token_ids), block_ids, 0)
            self._requests[new.req_id] = state
            external = self._pending_loads.pop(new.req_id, 0)
            plan = RequestPlan(new.req_id, state.token_ids, block_ids)
            if external:
                plan.load_start = new.num_computed_tokens - external
                plan.load_end = new.num_computed_tokens
            # Chunks already loaded (or held locally) are in kvd: never saved again.
            done = max(new.num_computed_tokens, plan.load_end)
            state.saved_chunks = done // chunk
            end = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._plan_saves(state, plan, end, chunk)
            meta.requests.append(plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            if cached.new_block_ids[i] is not None:
                state.block_ids.extend(cached.new_block_ids[i][0])
            end = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            plan = RequestPlan(req_id, state.token_ids, list(state.block_ids))
            self._plan_saves(state, plan, end, chunk)
            if plan.save_chunks:
                meta.requests.append(plan)
        return meta

    @staticmethod
    def _plan_saves(state, plan, end, chunk):
        # Full prompt chunks whose tokens are all computed by the end of this step.
        full = min(end, len(state.token_ids)) // chunk
        plan.save_chunks = list(range(state.saved_chunks, full))
        state.saved_chunks = max(state.saved_chunks, full)

    def update_connector_output(self, connector_output):
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(req_id)

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._local_tokens.pop(req_id, None)
        if self._async_plans.pop(req_id, None) is not None:
            return False, None  # its load never reached a worker
        # An async load still writing into the blocks: vLLM frees them once a worker reports
        # the request in get_finished's finished_recving.
        return req_id in self._loading, None

    # ==== worker side ====
    def register_kv_caches(self, kv_caches):
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self._kv_caches)}
        first = next(iter(self._kv_caches.values()))
        if len(first.shape) != 5 or first.shape[0] != 2 or first.shape[2] != self._block_size:
            raise ValueError(f"expected paged KV caches [2, num_blocks, {self._block_size}, "
                             f"num_kv_heads, head_dim], got {tuple(first.shape)}")
        c = self._connect()
        layout = c.layout
        want = (layout["num_layers"], layout["num_kv_heads"], layout["head_dim"])
        have = (len(self._kv_caches), int(first.shape[3]), int(first.shape[4]))
        itemsize = _itemsize(first)
        dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[layout["dtype"]]
        if want != have or itemsize != dtype_bytes:
            raise ValueError(
                f"kvd model {self._cfg['kvd_model']!r} has layers/kv_heads/head_dim {want} of "
                f"{layout['dtype']}; vLLM's caches have {have} with {itemsize}-byte elements")

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        c = self._connect()
        self._loads = []
        for plan in meta.requests:
            if plan.load_end <= plan.load_start:
                continue
            if plan.load_async:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="kvd-load")
                self._async_loads[plan.req_id] = self._loader.submit(self._load_async, plan)
                continue
            self._loads.append((plan, self._stage(c, plan)))

    def _stage(self, c, plan):
        """Gets the chunks of plan's load range into host staging arrays ({chunk index: uint8
        array}). Tokens of chunks kvd no longer holds go to the load errors (not staged)."""
        chunk = c.chunk_tokens
        last_chunk = math.ceil(plan.load_end / chunk)
        chain = c.hash(plan.token_ids[:last_chunk * chunk], include_partial_chunk=False)
        hit = c.lookup(chain)
        staged = {}
        try:
            held = min(int(hit.matched_chunks), last_chunk)
            for ci in range(plan.load_start // chunk, held):
                buf = np.empty(c.chunk_bytes, np.uint8)
                c.get(hit.lease_id, ci, buf)
                staged[ci] = buf
        finally:
            if hit.lease_id:
                c.release(hit.lease_id)
        if held < last_chunk:
            lost = max(plan.load_start, held * chunk)
            _log.warning("request %s: kvd holds %d of the %d chunks it matched at scheduling "
                         "(evicted since): tokens %d..%d are recomputed", plan.req_id, held,
                         last_chunk, lost, plan.load_end)
            self._fail_blocks(plan, lost, plan.load_end)
        return staged

    def _fail_blocks(self, plan, lo, hi):
        blocks = {plan.block_ids[p // self._block_size] for p in range(lo, hi)}
        with self._errors_lock:
            self._load_errors |= blocks

    def _load_async(self, plan):
        """The loader thread: one request's chunks from kvd into its blocks, every layer."""
        try:
            if self._load_client is None:
                self._load_client = self._new_client("-loader")
            staged = self._stage(self._load_client, plan)
            first = next(iter(self._kv_caches.values()))
            if hasattr(first, "is_cuda") and first.is_cuda:
                import torch
                if self._load_stream is None:
                    self._load_stream = torch.cuda.Stream(device=first.device)
                with torch.cuda.stream(self._load_stream):
                    self._scatter_all(plan, staged)
                self._load_stream.synchronize()
            else:
                self._scatter_all(plan, staged)
        except Exception:  # noqa: BLE001 - reported as failed blocks, vLLM recomputes them
            _log.exception("request %s: async load from kvd failed", plan.req_id)
            self._fail_blocks(plan, plan.load_start, plan.load_end)

    def _scatter_all(self, plan, staged):
        for name, kv_layer in self._kv_caches.items():
            self._scatter_staged(plan, staged, self._layer_index[name], kv_layer)

    def _scatter_staged(self, plan, staged, layer, kv_layer):
        chunk = self._client.chunk_tokens if self._client else self._load_client.chunk_tokens
        for ci, buf in staged.items():
            lo = max(plan.load_start, ci * chunk)
            hi = min(plan.load_end, (ci + 1) * chunk)
            k, v = self._chunk_layer(buf, layer, chunk)
            _scatter(kv_layer, plan.block_ids, self._block_size, lo, hi,
                     k[lo - ci * chunk:hi - ci * chunk], v[lo - ci * chunk:hi - ci * chunk])

    def wait_for_layer_load(self, layer_name):
        if not self._loads:
            return
        layer = self._layer_index[layer_name]
        kv_layer = self._kv_caches[layer_name]
        for plan, staged in self._loads:
            self._scatter_staged(plan, staged, layer, kv_layer)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        meta = self._get_connector_metadata()
        c = self._connect()
        chunk = c.chunk_tokens
        layer = self._layer_index[layer_name]
        for plan in meta.requests:
            if not plan.save_chunks:
                continue
            chain = None
            for ci in plan.save_chunks:
                key = (plan.req_id, ci)
                if key not in self._saves:
                    if chain is None:
                        chain = c.hash(plan.token_ids[:(plan.save_chunks[-1] + 1) * chunk],
                                       include_partial_chunk=False)
                    self._saves[key] = (chain[ci], np.empty(c.chunk_bytes, np.uint8))
                buf = self._saves[key][1]
                k, v = _gather(kv_layer, plan.block_ids, self._block_size, ci * chunk,
                               (ci + 1) * chunk)
                dk, dv = self._chunk_layer(buf, layer, chunk)
                dk[...] = k.reshape(dk.shape)
                dv[...] = v.reshape(dv.shape)

    def wait_for_save(self):
        c = self._connect()
        try:
            for (req_id, ci), (h, buf) in sorted(self._saves.items()):
                c.put(h, c.chunk_tokens, buf)
        finally:
            self._saves = {}

    def get_finished(self, finished_req_ids):
        done = {req_id for req_id, f in self._async_loads.items() if f.done()}
        for req_id in done:
            self._async_loads.pop(req_id).result()  # _load_async reports its own failures
        return None, (done or None)

    def get_block_ids_with_load_errors(self):
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self._loads = []

    def shutdown(self):
        if self._loader is not None:
            self._loader.shutdown(wait=True)  # loads in flight finish (their blocks are held)
            self._loader = None
        for attr in ("_load_client", "_client"):
            if getattr(self, attr) is not None:
                getattr(self, attr).close()
                setattr(self, attr, None)

    # ---- helpers ----
    def _chunk_layer(self, buf, layer, tokens):
        """K and V of `layer` inside a staged raw chunk of `tokens` tokens, as [tokens, row]
        uint8 views (row = one token's heads x dim elements)."""
        lay = (self._client or self._load_client).layout
        row = lay["num_kv_heads"] * lay["head_dim"] * {"float32": 4, "float16": 2,
                                                        "bfloat16": 2}[lay["dtype"]]
        base = 2 * layer * tokens * row
        k = buf[base:base + tokens * row].reshape(tokens, row)
        v = buf[base + tokens * row:base + 2 * tokens * row].reshape(tokens, row)
        return k, v


def _itemsize(t):
    return t.element_size() if hasattr(t, "element_size") else t.itemsize


def _host_bytes(x):
    """A host numpy uint8 view (or copy, for device tensors) of a contiguous tensor's rows."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().contiguous().cpu()
        return x.view(-1).view(__import__("torch").uint8).numpy().reshape(x.shape[0], -1)
    x = np.ascontiguousarray(x)
    return x.reshape(x.shape[0], -1).view(np.uint8)


def _slots(block_ids, block_size, lo, hi):
    pos = np.arange(lo, hi)
    return np.asarray(block_ids)[pos // block_size], pos % block_size


def _gather(kv_layer, block_ids, block_size, lo, hi):
    blocks, offs = _slots(block_ids, block_size, lo, hi)
    if hasattr(kv_layer, "detach"):
        import torch
        b = torch.as_tensor(blocks, device=kv_layer.device)
        o = torch.as_tensor(offs, device=kv_layer.device)
        return _host_bytes(kv_layer[0][b, o]), _host_bytes(kv_layer[1][b, o])
    return _host_bytes(kv_layer[0][blocks, offs]), _host_bytes(kv_layer[1][blocks, offs])


def _scatter(kv_layer, block_ids, block_size, lo, hi, k_rows, v_rows):
    blocks, offs = _slots(block_ids, block_size, lo, hi)
    shape = (hi - lo,) + tuple(kv_layer.shape[3:])
    if hasattr(kv_layer, "detach"):
        import torch
        b = torch.as_tensor(blocks, device=kv_layer.device)
        o = torch.as_tensor(offs, device=kv_layer.device)
        for i, rows in ((0, k_rows), (1, v_rows)):
            src = torch.from_numpy(np.ascontiguousarray(rows)).view(kv_layer.dtype)
            kv_layer[i][b, o] = src.reshape(shape).to(kv_layer.device)
        return
    for i, rows in ((0, k_rows), (1, v_rows)):
        kv_layer[i][blocks, offs] = np.ascontiguousarray(rows).view(kv_layer.dtype).reshape(shape)
