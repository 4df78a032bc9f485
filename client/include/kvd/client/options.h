// ClientOptions: what a Client is told at Connect (part of client.h; include that).
// Every field says its default; options are read at Connect and never change afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/transport/nccl_options.h"
#include "kvd/transport/options.h"
#include "kvd/transport/ucx_options.h"

namespace kvd::client {

enum class Role { kEngine, kAdmin };

struct ClientOptions {
  // Daemon control address: "host:port" (TCP) or "unix:/path/to.sock". Default the embedded
  // default of `kvd`: "127.0.0.1:7400".
  std::string address = "127.0.0.1:7400";
  // Shown in the daemon's logs and stats. "" (default) = "<hostname>-<pid>".
  std::string client_id;
  // Cache namespace (tenant). "" (default) = the daemon's "default".
  std::string name_space;
  // Sent in the handshake: the namespace's token (engine role) or the admin token (admin role)
  // when the daemon is configured with auth.tokens_file. "" (default) = none. A wrong or missing
  // token fails Connect with PERMISSION_DENIED.
  std::string auth_token;
  // A kvd of a cluster talking to another member (peer fetch): the cluster's cluster.token. The
  // daemon checks it against its own (PERMISSION_DENIED naming why when it differs or the daemon
  // is in no cluster); it stands in for auth_token and the session is read-only. "" (default):
  // an ordinary client.
  std::string cluster_token;
  // kEngine (default): puts and gets; needs model, layout and a transport.
  // kAdmin: stats, list, evict, health only; no model, no transport is created.
  Role role = Role::kEngine;
  // Engine role: a model registered in the daemon's topology, and this rank's layout of it
  // (must equal the registered one; the daemon names the first field that differs).
  std::string model;
  ModelLayout layout;
  // The deployment's hash seed text (the daemon checks its digest at the handshake). Default
  // the daemon's default "kvd-default-seed".
  std::string hash_seed = "kvd-default-seed";
  // Tokens per chunk (must equal the daemon's; default 256) and per hashed block (default 16;
  // chunk_tokens must be a multiple of it).
  int chunk_tokens = 256;
  int block_tokens = 16;
  // 0 (default) = follow the daemon: raw chunks for a model without a compression policy, the
  // policy's compact chunks otherwise (SessionInfo says which). Nonzero = this exact codec id
  // (the handshake is refused when the model's policy is another one, or there is none).
  uint32_t codec_id = 0;
  // The bulk transport (engine role). Default: UCX with UCX's own transport choice. Its UCX and
  // NCCL knobs are UcxOptions / NcclOptions, e.g.
  // `transport::MutableBackendOptions<transport::UcxOptions>(&o.transport).ucx_tls = "tcp"`.
  transport::TransportOptions transport;
  // Timeouts, milliseconds (> 0): connecting and the handshake (default 5000), one control
  // request (default 10000), one bulk transfer (default 30000).
  int64_t connect_timeout_ms = 5000;
  int64_t request_timeout_ms = 10000;
  int64_t transfer_timeout_ms = 30000;
  // Lease TTL asked on Lookup; 0 (default) = the daemon's default.
  uint32_t lease_ttl_ms = 0;
  // Largest control frame accepted from the daemon (default 4 MiB).
  uint32_t max_frame_bytes = 4u << 20;
  // Chunks kept in flight by PutChunks/GetChunks (default 8; >= 1).
  int max_in_flight = 8;
  // Same-node shared-memory path (default true): connected over a unix socket ("unix:/path"),
  // the client asks kvd for it at the handshake; if granted (SessionInfo::shared_memory), puts
  // copy the bytes straight into the daemon's arena slot and gets copy them out of it (the
  // arena's segments of this client's namespace are mapped into this process); the transport
  // carries no bytes. false forces the transport (UCX) path.
  // Committed chunks are read-only in this process: the segments are mapped PROT_READ (the
  // mappings SharedSegments() shows and gets read from), and a stray write through them to a
  // committed chunk faults (SIGSEGV). How a put writes its slot: see shm_writable_view.
  bool shared_memory = true;
  // How a shared-memory put of host bytes writes its reserved slot (default true): through a
  // second, writable mapping of the segment that only the library uses and never hands out,
  // filled a granule at a time on first use like the read-only one. false: the put makes its
  // slot's pages of the read-only mapping writable (mprotect) while it copies and read-only
  // again before the commit: two page-table walks of the whole slot per put (and a TLB
  // shootdown), in exchange for no writable mapping of committed chunks existing in this
  // process at all (so even a wild pointer into the writable view cannot change one).
  // Device puts and puts with window queries always take the mprotect route. A read_only
  // session has no writable mapping either way.
  bool shm_writable_view = true;
  // A reading session (default false). When true the daemon refuses every put (Reserve and
  // InlinePut: PERMISSION_DENIED) and hands this client its shared-memory segments as read-only
  // descriptors: no writable mapping of them is possible in this process (mmap or mprotect
  // with PROT_WRITE fails with EACCES). Lookups, gets, leases and events work as usual.
  bool read_only = false;
  // Device puts and gets over NCCL, GPU to GPU (engine role). Default false. When true, Connect
  // creates an NCCL transport on CUDA device NcclOptions::nccl_device (its join bounded by
  // NcclOptions::nccl_init_timeout_ms) and joins kvd's NCCL link (NcclConnect,
  // docs/wire-format.md); Connect fails with UNAVAILABLE and the reason when this process or kvd
  // cannot run NCCL (built without NCCL, no CUDA device). NCCL refuses two ranks on one GPU
  // ("Duplicate GPU"): kvd's link device (its transport.nccl_device or tiers.gpu.device) must
  // differ from this client's. Then a put whose `data` is CUDA device memory with no separate
  // `window_queries`, and a get into a CUDA device buffer, move their bytes from / to that buffer
  // over NCCL; every other put and get keeps its path (shared memory or the transport). The commit
  // and get checksums are still xxh3 over host bytes: one device-to-host copy of each chunk into
  // pinned staging.
  bool nccl = false;
  // One-exchange puts for small chunks: a put of at most this many bytes (raw chunk + window
  // queries) travels inside one control frame (InlinePut), and kvd reserves, copies, verifies
  // the checksum and commits it before its one reply, instead of Reserve, a transfer (or a
  // shared-memory copy) and Commit. Same results and errors as the three steps; durability and
  // compression are the same. Default 64 KiB; 0 = every put takes the three steps. At most
  // kMaxInlinePutBytes (1 MiB). A put that would not fit in the daemon's frame limit
  // (SessionInfo::max_frame_bytes) takes the three steps whatever this says.
  size_t inline_put_bytes = size_t{64} << 10;
  static constexpr size_t kMaxInlinePutBytes = size_t{1} << 20;
  // The same threshold for sessions on the shared-memory path (SessionInfo::shared_memory),
  // where the three steps copy the bytes once, straight into the arena, and the daemon never
  // copies them: a put goes inline when it is at most both this and inline_put_bytes.
  // Default 32 KiB: for larger chunks the frame's copies (into the frame, through the socket,
  // out into the arena) cost more than the second exchange. At most kMaxInlinePutBytes;
  // 0 = shared-memory puts always take three steps.
  size_t shm_inline_put_bytes = size_t{32} << 10;
  // Reserve-ahead on the shared-memory path (default false): the commit of a put (of PutChunks'
  // last chunk) also asks kvd for the space of this client's next put of the same size, and
  // the next put writes there and commits: one exchange per put instead of two (reserve,
  // commit), for a client that puts chunk after chunk. Used when kvd offers it
  // (HelloReply.reserveAhead; with a kvd that does not, every put reserves) and the model has no
  // compression policy. Off by default because of what it holds: between puts this client keeps one
  // reserved slot of its last put's size (counted against the arena and the namespace quota like
  // any reservation, and keeping its arena segment with the namespace) until its next put, its
  // disconnect, or limits.reservation_ttl_ms; a put of another size aborts it in the exchange of
  // its own Reserve; a chunk kvd already holds is found at the commit instead of the reserve, after
  // its bytes were copied (kvd counts puts_copied_for_nothing). kvd declines to reserve ahead
  // when the held space could make another put fail (docs/wire-format.md). A held slot is used
  // only while half of its TTL is left. The zero-copy ReservePut / CommitPut are unaffected.
  bool reserve_ahead = false;
  // How long a thread waiting for kvd's reply on a unix socket keeps looking for it (a
  // non-blocking read, then sched_yield, in a loop) before it sleeps in poll(2), microseconds.
  // Read at Connect. Default 50; 0 = sleep at once; at most kMaxReplySpinUs. Connections over
  // TCP never spin.
  // Why: when the client's thread and kvd's io thread run on two CPUs, a reply to a thread that
  // sleeps costs a cross-CPU wake-up of it (on virtual machines an inter-processor interrupt
  // and the wake of an idle virtual CPU), in kvd's send and in this thread's latency; kvd
  // answers a lookup, a get or a reserve in a few microseconds, so a short look usually finds
  // the reply and neither pays it. Costs this thread up to that much CPU per request that kvd
  // answers later than that (a put that kvd compresses, a busy kvd). While other threads compete
  // for the waiting thread's CPU (a sched_yield took longer than the whole spin: yielding to them
  // would hold the reply until their time slice ends), the next 64 waits sleep at once.
  uint32_t reply_spin_us = 50;
  static constexpr uint32_t kMaxReplySpinUs = 1000;

  // ---- test seams (leave at the defaults) ----
  // Check a raw put's byte count against the layout before asking the daemon (default true).
  // Tests of the daemon's own checks turn it off.
  bool verify_locally = true;

  // INVALID_ARGUMENT naming the field and value (bad address form, chunk_tokens not a multiple
  // of block_tokens, non-positive timeouts, inline_put_bytes over kMaxInlinePutBytes, engine
  // role without model or with an invalid layout).
  Status Validate() const;
};

}  // namespace kvd::client
