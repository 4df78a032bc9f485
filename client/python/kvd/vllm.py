"""kvd as a vLLM KV connector (vLLM v1 engine, ``KVConnectorBase_V1``).

Enable it with (the module path and class name are what vLLM's connector factory loads):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvd_address": "127.0.0.1:7400",
                                      "kvd_model": "llama-3.1-8b"}}'

``kvd_model`` must be registered in the daemon's topology with the layout vLLM holds on this
rank (layers, KV heads per rank, head dim, dtype); register_kv_caches checks it. Optional
extra keys: ``kvd_namespace``, ``kvd_hash_seed``, ``kvd_ucx_tls``, ``kvd_net_devices``, and
``kvd_async_load`` (default true, see below), ``kvd_timeout_ms`` (default 2000: the deadline of
every kvd call, connecting included; after a failure the connector tries kvd again 1 s later,
doubling up to 30 s while it keeps failing, so a kvd that hangs costs vLLM little time).

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
  worker     register_kv_caches          the paged caches, vLLM's [B, H, N, C] view per layer;
                                         where each token's K/V lie is learned from the
                                         attention backend's own op (vllm_layout)
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
import importlib.util
import logging
import math
import threading
import time
from typing import Any

import numpy as np

import kvd
from kvd.vllm_layout import (TokenLayout, UnsupportedLayoutError, logical_layout,  # noqa: F401
                             probe_layout)

# With vLLM installed the real base classes (an import error there is raised as it is: a vLLM
# that does not fit must not be papered over); without vLLM, the same names, so the connector
# can be driven by kvd's own tests.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if HAVE_VLLM:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore
    except ImportError:  # vLLM before per-source cache-hit metrics
        CacheHitSource = None
else:
    import enum

    CacheHitSource = None

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

        def has_connector_metadata(self):
            return self._connector_metadata is not None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata


class UnsupportedPolicyError(ValueError):
    """The kvd model's compression policy serves chunks vLLM cannot take (raised at
    register_kv_caches, so the engine does not start)."""


def unservable_policy(client):
    """Why vLLM cannot take what kvd serves for the client's model, or None. vLLM addresses KV
    by token position in its blocks, so it takes a raw model or a policy whose dense form keeps
    one slot per position (kvd's keeps_positions: quantize alone, KVSlimmer alone); and a
    connector sees no queries, so a policy that needs window queries with each put is out."""
    if client.codec_id == 0:
        return None
    if not client.keeps_positions:
        return ("its compression policy removes token positions (" + client.policy + "), and "
                "vLLM keeps one KV slot per position")
    if client.needs_queries:
        return ("its compression policy needs the window queries of each put (" +
                client.policy + "), which vLLM does not hand a KV connector")
    return None


class _BackedOff(ConnectionError):
    """kvd failed moments ago: no new connection is tried before the back-off ends."""


class _Reconnect:
    """When the connector may try kvd again after failures: 1 s after a failure, doubling with
    each failure in a row up to 30 s; a connection that succeeds resets it. A kvd that hangs
    instead of refusing then costs vLLM one deadline (kvd_timeout_ms) per period, not one per
    call; a kvd that is back is found within the period."""

    FIRST_S, MAX_S = 1.0, 30.0

    def __init__(self):
        self._at = 0.0    # no new connection before this (time.monotonic)
        self._wait = 0.0  # the current period, seconds (0: no failure since the last success)

    def check(self):
        if time.monotonic() < self._at:
            raise _BackedOff(f"kvd failed less than {self._wait:g} s ago")

    def failed(self):
        self._wait = min(self.MAX_S, 2 * self._wait if self._wait else self.FIRST_S)
        self._at = time.monotonic() + self._wait

    def succeeded(self):
        self._wait = 0.0


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


# Inside vLLM, a child of vLLM's own logger (its handlers and level); else kvd's.
_log = logging.getLogger("vllm.kvd_connector" if HAVE_VLLM else "kvd.vllm")


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
    # kvd's chunks live in its host tier (and below it, on disk): vLLM's per-source hit metrics
    # count them as host hits.
    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role, kv_cache_config=None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM before the kv_cache_config argument
            super().__init__(vllm_config, role)
        self._cfg = _extra(vllm_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._async_load = _flag(self._cfg.get("kvd_async_load", True))
        # kv_consumer (a decode instance) loads and never saves; kv_producer (a prefill
        # instance) and kv_both save, and load the prefixes kvd already holds.
        kv_role = getattr(vllm_config.kv_transfer_config, "kv_role", "kv_both") or "kv_both"
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role {kv_role!r}: kvd's connector takes kv_both, kv_producer "
                             "or kv_consumer")
        self._saves_enabled = kv_role != "kv_consumer"
        self._client = None
        self._dense = False         # kvd serves compact chunks: loads expand them (get_dense)
        self._chunk_tokens = 0      # kvd's, known from the first connection
        self._layout = None         # kvd's model layout (dict), from the first connection
        self._timeout_ms = int(self._cfg.get("kvd_timeout_ms", DEFAULT_TIMEOUT_MS))
        if self._timeout_ms <= 0:
            raise ValueError(f"kvd_timeout_ms must be > 0, got {self._timeout_ms}")
        self._reconnect = _Reconnect()  # when the main connection may be tried again
        # scheduler side
        self._requests: dict[str, _SchedulerRequest] = {}
        self._pending_loads: dict[str, int] = {}  # req_id -> external tokens to load in-step
        self._local_tokens: dict[str, int] = {}   # req_id -> local hit at the last match
        self._async_plans: dict[str, RequestPlan] = {}  # allocated, not yet sent to workers
        self._loading: set = set()  # req_ids whose async load the workers have not finished
        # worker side
        self._kv_caches: dict[str, Any] = {}      # layer name -> vLLM's [B, H, N, C] view
        self._layer_index: dict[str, int] = {}    # layer name -> kvd layer (model order)
        self._token_layouts: dict[str, TokenLayout] = {}
        self._kernel_blocks = 1   # kernel blocks per vLLM block (block_size / N of the view)
        self._loads: list = []   # (plan, {chunk index: staging uint8 array})
        self._saves: dict = {}   # (req_id, chunk index) -> (hash, staging uint8 array)
        self._load_client = None  # the loader thread's own connection
        self._loader = None       # ThreadPoolExecutor of one thread, started on first use
        self._async_loads: dict = {}  # req_id -> Future of its load
        self._load_errors: set = set()  # block ids kvd could not fill
        self._errors_lock = threading.Lock()
        self._load_stream = None  # CUDA stream of the loader thread (torch device caches)

    @property
    def requires_kv_delivery(self) -> bool:
        # kvd is a best-effort cache: a save lost to a preemption is a later cache miss, never
        # KV another engine waits for. So vLLM may let such a request finish normally.
        return False

    # ---- shared ----
    def _new_client(self, suffix=""):
        cfg = self._cfg
        client = kvd.connect(
            cfg.get("kvd_address", "127.0.0.1:7400"), model=cfg["kvd_model"],
            namespace=cfg.get("kvd_namespace", ""),
            hash_seed=cfg.get("kvd_hash_seed", "kvd-default-seed"),
            ucx_tls=cfg.get("kvd_ucx_tls", ""), net_devices=cfg.get("kvd_net_devices", ""),
            client_id=f"vllm-{self.role.name.lower()}{suffix}", timeout_ms=self._timeout_ms)
        if client.chunk_tokens % self._block_size:
            client.close()
            raise ValueError(f"kvd chunk_tokens {client.chunk_tokens} is not a multiple "
                             f"of vLLM's block_size {self._block_size}")
        why = unservable_policy(client)
        if why is not None:
            client.close()
            raise UnsupportedPolicyError(
                f"kvd model {cfg['kvd_model']!r}: {why}. Serve it raw (compression: off) or "
                "with a policy that keeps positions, e.g. compression: {stages: [quantize]} "
                "(docs/vllm.md, Compression)")
        self._chunk_tokens = client.chunk_tokens
        self._layout = client.layout
        self._dense = client.codec_id != 0
        return client

    def _connect(self, strict=False):
        """The main connection. Raises _BackedOff where connecting fails (logged) and until the
        back-off (_Reconnect) lets the next attempt go: each call would otherwise wait for a
        refused or unanswered connect."""
        if self._client is None:
            self._reconnect.check()
            try:
                self._client = self._new_client()
            except UnsupportedPolicyError as e:
                if strict:
                    raise  # at register_kv_caches: the engine does not start
                self._drop_client("connect", e)  # a kvd restarted under another policy
                raise _BackedOff(str(e)) from e
            except kvd.Error as e:
                self._drop_client("connect", e)
                raise _BackedOff(str(e)) from e
            self._reconnect.succeeded()
        return self._client

    def _drop_client(self, what, error):
        """After a failed kvd call: logs it and reconnects at the next use. vLLM goes on
        without kvd meanwhile (misses and dropped saves, never wrong KV). A call refused by
        the back-off neither logs nor pushes the next attempt back: an engine calling many
        times a second must still reconnect when the back-off ends."""
        if isinstance(error, _BackedOff):
            return
        _log.warning("kvd %s failed, vLLM goes on without it: %s", what, error)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - the connection is already broken
                pass
            self._client = None
        self._reconnect.failed()

    # ==== scheduler side ====
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        try:
            c = self._connect()
            chain = c.hash(request.prompt_token_ids, include_partial_chunk=False)
            if not chain:
                return 0, False
            hit = c.lookup(chain)
            if hit.lease_id:
                c.release(hit.lease_id)
        except (kvd.Error, ConnectionError) as e:
            self._drop_client("lookup", e)
            return 0, False
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
        chunk = self._chunk_tokens
        if not chunk:  # kvd never reached: nothing to load, nothing planned to save
            try:
                chunk = self._connect().chunk_tokens
            except (kvd.Error, ConnectionError):
                chunk = 0
        for req_id, plan in self._async_plans.items():
            meta.requests.append(plan)
            self._loading.add(req_id)
        self._async_plans = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = _SchedulerRequest(list(new.prompt_token_ids), list(new.block_ids[0]), 0)
            self._requests[new.req_id] = state
            plan = self._scheduled(state, new.req_id, new.num_computed_tokens,
                                   scheduler_output.num_scheduled_tokens[new.req_id], chunk,
                                   first=True)
            meta.requests.append(plan)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                # A preempted request scheduled again: its blocks are these, all new (vLLM
                # freed the old ones; reading them would store another request's KV).
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            if req_id in resumed and chunk:
                _log.info("request %s resumed after a preemption in %d new blocks; %d of its "
                          "%d full prompt chunks are still to save", req_id,
                          len(state.block_ids), len(state.token_ids) // chunk -
                          state.saved_chunks, len(state.token_ids) // chunk)
            plan = self._scheduled(state, req_id, cached.num_computed_tokens[i],
                                   scheduler_output.num_scheduled_tokens[req_id], chunk,
                                   first=req_id in resumed)
            if plan.save_chunks or plan.load_end > plan.load_start:
                meta.requests.append(plan)
        return meta

    def _scheduled(self, state, req_id, num_computed, num_scheduled, chunk, first):
        """The plan of a request scheduled in this step: its in-step load (first step after
        it was (re)allocated) and the full prompt chunks this step completes."""
        plan = RequestPlan(req_id, state.token_ids, list(state.block_ids))
        external = self._pending_loads.pop(req_id, 0) if first else 0
        if external:
            plan.load_start = num_computed - external
            plan.load_end = num_computed
        if chunk:
            # Chunks already loaded (or held locally) are in kvd: never saved again.
            done = max(num_computed, plan.load_end)
            state.saved_chunks = max(state.saved_chunks, done // chunk)
            full = min(num_computed + num_scheduled, len(state.token_ids)) // chunk
            if self._saves_enabled:
                plan.save_chunks = list(range(state.saved_chunks, full))
            state.saved_chunks = max(state.saved_chunks, full)
        return plan

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
        """Checks vLLM's caches against the kvd model's layout and learns, per layer, where
        each token's K and V lie (vllm_layout). Refuses, with the backend's name, a cache kvd
        cannot address token by token."""
        self._kv_caches = dict(kv_caches)
        names = list(self._kv_caches)
        self._layer_index = {name: i for i, name in enumerate(sorted(names, key=_layer_order))}
        c = self._connect(strict=True)
        layout = c.layout
        heads, head_dim = int(layout["num_kv_heads"]), int(layout["head_dim"])
        dtype_bytes = _DTYPE_BYTES[layout["dtype"]]
        first = self._kv_caches[names[0]]
        if len(names) != int(layout["num_layers"]):
            raise ValueError(f"kvd model {self._cfg['kvd_model']!r} has {layout['num_layers']} "
                             f"layers; vLLM registered {len(names)} KV caches")
        probed: dict = {}
        for name in names:
            cache = self._kv_caches[name]
            tl = self._token_layout(name, cache, head_dim, probed)
            shape = tuple(int(x) for x in cache.shape)
            dtype = _dtype_name(cache)
            if shape[1] != heads or _itemsize(cache) != dtype_bytes or (
                    dtype in _DTYPE_BYTES and dtype != layout["dtype"]):
                raise ValueError(
                    f"kvd model {self._cfg['kvd_model']!r} has layers/kv_heads/head_dim "
                    f"{(layout['num_layers'], heads, head_dim)} of {layout['dtype']}; vLLM's "
                    f"cache {name} is {shape} of {dtype} ({_itemsize(cache)}-byte elements)")
            if self._block_size % tl.block_tokens:
                raise UnsupportedLayoutError(
                    f"attention backend {tl.backend}: kernel blocks of {tl.block_tokens} "
                    f"tokens do not divide vLLM's block_size {self._block_size}")
            self._token_layouts[name] = tl
        self._kernel_blocks = self._block_size // self._token_layouts[names[0]].block_tokens
        _log.info("kvd: %d layers of %s caches %s, %d kernel block(s) of %d tokens per block",
                  len(names), self._token_layouts[names[0]].backend, tuple(first.shape),
                  self._kernel_blocks, self._token_layouts[names[0]].block_tokens)

    def _token_layout(self, name, cache, head_dim, probed):
        if not HAVE_VLLM:  # kvd's stand-in engine: vLLM's logical view, FlashAttention's split
            return logical_layout(cache, head_dim)
        layer = _attention_layer(self._vllm_config, name)
        if layer is None:
            raise UnsupportedLayoutError(f"KV cache {name}: no attention layer of that name in "
                                         "vLLM's forward context to learn its layout from")
        # vLLM names it as a string ("bfloat16", "fp8"); compared in kvd's spelling of the
        # cache's own type, so naming the unquantized type the cache has is as good as "auto".
        dtype = getattr(layer, "kv_cache_dtype", "auto")
        if dtype not in ("auto", None) and str(dtype) != _dtype_name(cache):
            raise UnsupportedLayoutError(
                f"attention backend {_backend_of(layer)}: kv_cache_dtype {dtype!r}; kvd stores "
                "the model's own dtype (run vLLM with kv_cache_dtype auto)")
        key = (_backend_of(layer), tuple(cache.shape), tuple(cache.stride()), str(cache.dtype),
               str(cache.device))
        if key not in probed:
            probed[key] = probe_layout(layer, cache, head_dim)
        return probed[key]

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
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
            try:
                staged = self._stage(self._connect(), plan)
            except (kvd.Error, ConnectionError) as e:
                self._drop_client("load", e)
                _log.warning("request %s: no load from kvd: tokens %d..%d are recomputed",
                             plan.req_id, plan.load_start, plan.load_end)
                self._fail_blocks(plan, plan.load_start, plan.load_end)
                continue
            self._loads.append((plan, staged))

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
                if self._dense:  # compact chunks, expanded to one slot per position
                    _, tokens = c.get_dense(hit.lease_id, ci, buf)
                    if tokens != chunk:
                        raise kvd.FailedPreconditionError(
                            5, "FAILED_PRECONDITION", f"chunk {ci} expands to {tokens} tokens, "
                            f"not {chunk}: kvd's policy no longer keeps positions")
                else:
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
        except Exception as e:  # noqa: BLE001 - reported as failed blocks, vLLM recomputes them
            _log.warning("request %s: async load from kvd failed (%s): tokens %d..%d are "
                         "recomputed", plan.req_id, e, plan.load_start, plan.load_end)
            if self._load_client is not None:
                try:
                    self._load_client.close()
                except Exception:  # noqa: BLE001 - already broken
                    pass
                self._load_client = None
            self._fail_blocks(plan, plan.load_start, plan.load_end)

    def _scatter_all(self, plan, staged):
        for name in self._kv_caches:
            self._scatter_staged(plan, staged, name)

    def _scatter_staged(self, plan, staged, name):
        chunk = self._chunk_tokens
        layer = self._layer_index[name]
        for ci, buf in staged.items():
            lo = max(plan.load_start, ci * chunk)
            hi = min(plan.load_end, (ci + 1) * chunk)
            k, v = self._chunk_layer(buf, layer, chunk)
            self._access(name, plan.block_ids, lo, hi).write(
                k[lo - ci * chunk:hi - ci * chunk], v[lo - ci * chunk:hi - ci * chunk])

    def wait_for_layer_load(self, layer_name):
        for plan, staged in self._loads:
            self._scatter_staged(plan, staged, layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        meta = self._get_connector_metadata()
        chunk = self._chunk_tokens
        layer = self._layer_index[layer_name]
        for plan in meta.requests:
            if not plan.save_chunks:
                continue
            chain = None
            for ci in plan.save_chunks:
                key = (plan.req_id, ci)
                if key not in self._saves:
                    if chain is None:
                        chain = self._hash(plan.token_ids[:(plan.save_chunks[-1] + 1) * chunk])
                        if chain is None:
                            return  # kvd unreachable: this step saves nothing
                    self._saves[key] = (chain[ci], np.empty(self._chunk_bytes(), np.uint8))
                buf = self._saves[key][1]
                dk, dv = self._chunk_layer(buf, layer, chunk)
                self._access(layer_name, plan.block_ids, ci * chunk, (ci + 1) * chunk).read(
                    dk, dv)

    def wait_for_save(self):
        try:
            if not self._saves:
                return
            c = self._connect()
            for (req_id, ci), (h, buf) in sorted(self._saves.items()):
                c.put(h, c.chunk_tokens, buf)
        except (kvd.Error, ConnectionError) as e:
            self._drop_client("save", e)
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
    def _hash(self, tokens):
        """kvd's chain of full-chunk hashes of `tokens`, or None while kvd is unreachable."""
        try:
            return self._connect().hash(tokens, include_partial_chunk=False)
        except (kvd.Error, ConnectionError) as e:
            self._drop_client("hash", e)
            return None

    def _row_bytes(self):
        lay = self._layout
        return int(lay["num_kv_heads"]) * int(lay["head_dim"]) * _DTYPE_BYTES[lay["dtype"]]

    def _chunk_bytes(self):
        return 2 * int(self._layout["num_layers"]) * self._chunk_tokens * self._row_bytes()

    def _chunk_layer(self, buf, layer, tokens):
        """K and V of `layer` inside a staged raw chunk of `tokens` tokens, as [tokens, row]
        uint8 views (row = one token's heads x dim elements)."""
        row = self._row_bytes()
        base = 2 * layer * tokens * row
        k = buf[base:base + tokens * row].reshape(tokens, row)
        v = buf[base + tokens * row:base + 2 * tokens * row].reshape(tokens, row)
        return k, v

    def _access(self, name, block_ids, lo, hi):
        """The elements of tokens [lo, hi) of a request (its vLLM blocks block_ids) in layer
        `name`'s cache."""
        tl = self._token_layouts[name]
        pos = np.arange(lo, hi)
        inner = pos % self._block_size
        kernel = np.asarray(block_ids, np.int64)[pos // self._block_size] * self._kernel_blocks \
            + inner // tl.block_tokens
        return _TokenAccess(self._kv_caches[name], tl, tl.element_offsets(kernel,
                                                                          inner % tl.block_tokens))


class _TokenAccess:
    """Reads or writes the K/V of some tokens of one layer's cache, element by element (a load
    that ends inside a block leaves the block's other slots as they are)."""

    def __init__(self, cache, layout, offsets):
        self.cache = cache
        self.layout = layout
        self.offsets = offsets  # int64 [tokens, 2, heads, head_dim]

    def _flat(self):
        cache = self.cache
        if hasattr(cache, "detach"):  # torch
            import torch
            return torch.as_strided(cache, (self.layout.span,), (1,), cache.storage_offset())
        return np.lib.stride_tricks.as_strided(cache, (self.layout.span,), (cache.itemsize,))

    def read(self, k_rows, v_rows):
        """Copies the tokens' K into k_rows and V into v_rows ([tokens, row] uint8)."""
        flat = self._flat()
        if hasattr(flat, "detach"):
            import torch
            idx = torch.from_numpy(self.offsets.reshape(-1)).to(flat.device)
            values = flat[idx].reshape(self.offsets.shape).cpu()
            for i, rows in ((0, k_rows), (1, v_rows)):
                dst = torch.from_numpy(rows).view(values.dtype).reshape(values[:, i].shape)
                dst.copy_(values[:, i])
            return
        values = flat[self.offsets]
        for i, rows in ((0, k_rows), (1, v_rows)):
            rows.view(values.dtype).reshape(values[:, i].shape)[...] = values[:, i]

    def write(self, k_rows, v_rows):
        flat = self._flat()
        if hasattr(flat, "detach"):
            import torch
            idx = torch.from_numpy(self.offsets.reshape(-1)).to(flat.device)
            src = torch.stack([torch.from_numpy(np.ascontiguousarray(r)).view(flat.dtype)
                               for r in (k_rows, v_rows)], dim=1)
            flat[idx] = src.reshape(-1).to(flat.device)
            return
        src = np.stack([np.ascontiguousarray(r).view(flat.dtype) for r in (k_rows, v_rows)],
                       axis=1)
        flat[self.offsets.reshape(-1)] = src.reshape(-1)


DEFAULT_TIMEOUT_MS = 2000

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _itemsize(t):
    return t.element_size() if hasattr(t, "element_size") else t.itemsize


def _dtype_name(t):
    """The element type's name as kvd's layouts spell it (float16, bfloat16, ...)."""
    return str(t.dtype).removeprefix("torch.")


def _layer_order(name):
    """Model order of a layer name (vLLM's extract_layer_index where it parses it)."""
    if HAVE_VLLM:
        try:
            from vllm.model_executor.models.utils import extract_layer_index  # type: ignore
            return (extract_layer_index(name), name)
        except Exception:  # noqa: BLE001 - a name without one index: registration order
            pass
    digits = [int(p) for p in name.split(".") if p.isdigit()]
    return (digits[0] if len(digits) == 1 else -1, name)


def _attention_layer(vllm_config, name):
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context",
                  None) or {}
    return ctx.get(name)


def _backend_of(layer):
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None and hasattr(backend, "get_name") else \
        type(layer).__name__
