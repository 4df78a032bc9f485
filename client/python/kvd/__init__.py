"""kvd: Python client of the kvd KV-cache daemon.

    import numpy as np, kvd
    c = kvd.connect("127.0.0.1:7400", model="stories260k")   # layout asked from the daemon
    chain = c.hash(np.arange(512, dtype=np.int32))            # one key per 256-token chunk
    c.put(chain[0], 256, chunk)                               # chunk: c.chunk_bytes bytes
    hit = c.lookup(chain)                                     # longest stored prefix + a lease
    out = np.empty(c.chunk_bytes, np.uint8)
    c.get(hit.lease_id, 0, out)                               # byte-exact, checksum verified
    c.release(hit.lease_id)

Buffers are borrowed without copies: anything with the buffer protocol (numpy arrays, bytes,
bytearray, memoryview) or DLPack (torch CPU tensors, ...) that is C-contiguous host memory.
Every blocking call releases the GIL. A failure raises kvd.Error (or its subclass per status
code, e.g. kvd.NotFoundError) with .code, .code_name and .message.

Zero-copy on kvd's node (a "unix:/path" address; c.shared_memory is then True):
c.read_in_place(lease_id, index, verify_checksum=True) -> kvd.ChunkView, a read-only buffer
(memoryview / numpy.frombuffer without a copy) of the chunk where it lies in kvd's arena, pinned
until released; c.reserve_put(hash, tokens) -> kvd.PutSlot, a writable buffer of the reserved
slot, published by slot.commit() (or c.commit_put(slot)) and aborted when released or collected
uncommitted; c.flush_releases(). Both are context managers; a buffer exported from one keeps it
alive (see docs/python.md, "Zero-copy reads and writes in Python").

In a cluster (docs/python.md, "Clusters"): c.lookup(chain, cluster=True) also asks the other
members, lists each node's prefix in hit.holders (kvd.PrefixHolder: node, matched_chunks, error,
found_in), counts the chunks copied from a peer in hit.fetched_chunks and says in
hit.membership_current whether its member list is current (False while etcd is unreachable;
hit.membership_age_ms: how long ago etcd last answered, 0 while current); c.place(chain, node="")
-> kvd.PlacementResult (targets: kvd.PlacementTarget(node, control_address, local), best first;
membership_current, membership_age_ms as for a lookup)
says where a prefill engine puts a chain, and c.connect_placed(target) connects there. On a kvd
in no cluster both raise kvd.FailedPreconditionError.

KV cache events (for routers): c.subscribe_events(namespace="", queue_limit=0), then
c.poll_events(timeout_ms) returns a list of dicts shaped like `kvdctl events --json` lines
({"seq", "event": "stored"|"removed"|"dropped", "tier", "namespace", "model", "hash", ...}).

The raw chunk layout (what put/get move): for each layer, K then V, each
[tokens, num_kv_heads, head_dim] of the layout's dtype, row-major (put_layers/get_layers
gather/scatter per-layer K/V arrays for you).
"""

from ._errors import *  # noqa: F401,F403
from ._errors import Error, error_for_code  # noqa: F401
from ._kvd import (  # noqa: F401
    ChunkView, Client, GetResult, Hash128, LookupResult, PlacementResult, PlacementTarget,
    PrefixHolder, PutResult, PutSlot)
from ._kvd import __version__  # noqa: F401  (kvd's version, set by the build)


def connect(address="127.0.0.1:7400", model="", **options):
    """Connects to a kvd daemon (see Client.connect for every option).

    address      "host:port" or "unix:/path" (default "127.0.0.1:7400")
    model        a model registered in the daemon's topology (engine role)
    layout       dict (num_layers, num_kv_heads, num_q_heads, head_dim, dtype, tp_rank, tp_size,
                 rope_theta, rope_rotary_dim, rope_pairing); default: the registered layout
    namespace, client_id, hash_seed, chunk_tokens, block_tokens, ucx_tls, net_devices,
    admin (stats/health only), timeout_ms, max_in_flight
    nccl         True: CUDA tensors move GPU to GPU over kvd's NCCL link (this process's NCCL
                 rank on CUDA device `nccl_device`, default 0; kvd's must be another GPU);
                 kvd.UnavailableError with the reason where this process or kvd cannot run NCCL
    inline_put_bytes  puts of at most this many bytes go in one exchange (default 65536, 0 = off;
                 on the shared-memory path at most 32768 whatever this says)
    read_only    True: a reading session; its puts raise kvd.PermissionDeniedError and its
                 shared-memory mappings of kvd's arena cannot be made writable
    shared_memory  False: never the shared-memory path, even over a unix socket (default True:
                 asked for on a "unix:/path" address; needed by read_in_place and reserve_put)
    reserve_ahead  True: on the shared-memory path each put's commit also reserves the next
                 put's slot (one exchange per put; holds that slot between puts). Default False
    """
    return Client.connect(address=address, model=model, **options)


def _enter(self):
    return self


def _exit(self, *exc):
    self.close()
    return False


Client.__enter__ = _enter
Client.__exit__ = _exit
