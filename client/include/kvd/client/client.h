// libkvd_client: the C++ API engines and tools use to talk to a kvd daemon.
//
//   kvd::client::ClientOptions o;
//   o.address = "127.0.0.1:7400";  o.model = "smollm2-135m";  o.layout = ...;
//   auto c = kvd::client::Client::Connect(o).value();           // Hello: layout and seed checked
//   auto chain = c->hasher().ChunkChain(tokens, /*include_partial_chunk=*/true);
//   c->Put(chain[0], 256, chunk_bytes.data(), chunk_bytes.size());  // reserve, send, commit
//   auto hit = c->Lookup(chain).value();                          // longest prefix + a lease
//   c->Get(hit.lease_id, 0, out.data(), out.size());             // byte-exact, checksum verified
//   c->ReleaseLease(hit.lease_id);
//
// Control messages travel as Cap'n Proto frames over one TCP or unix-socket connection; the
// bulk bytes travel over the transport (UCX tag messages) or, on the daemon's node, through its
// shared-memory arena. Puts of at most ClientOptions::inline_put_bytes (default 64 KiB; on the
// shared-memory path at most shm_inline_put_bytes, default 32 KiB) travel inside one frame
// instead: one exchange in place of reserve, send, commit.
//
// THREAD SAFETY: every method is thread-safe; calls on one Client are serialised on an internal
// mutex (one control connection, one transport). For parallelism use several Clients (one per
// thread), or the batched PutChunks/GetChunks which keep up to options.max_in_flight chunks in
// flight on one connection.
//
// ERRORS: every call returns Status/StatusOr and never throws. Every wait has a timeout.
//   UNAVAILABLE       the daemon cannot be reached, closed the connection, or died (a dead
//                     daemon never hangs a call: the socket reports it, or the timeout fires)
//   DEADLINE_EXCEEDED the daemon or a transfer did not answer within the configured timeout
//   DATA_LOSS         bytes received do not match the daemon's checksum
//   anything else     the daemon's own error, as it sent it (code and message)
// After UNAVAILABLE or DEADLINE_EXCEEDED on the control connection the Client is broken
// (connected() == false) and every later call fails with UNAVAILABLE: make a new one.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvd/client/hashing.h"
#include "kvd/common/hash.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/transport/options.h"

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
  // The bulk transport (engine role). Default: UCX with UCX's own transport choice.
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
  // shootdown), ~1.1 ms per 32 MiB put on an idle 2-core box and up to 3 ms under load
  // (docs/benchmarks.md), in exchange for no writable mapping of committed chunks existing in
  // this process at all (so even a wild pointer into the writable view cannot change one).
  // Device puts and puts with window queries always take the mprotect route. A read_only
  // session has no writable mapping either way.
  bool shm_writable_view = true;
  // A reading session (default false). When true the daemon refuses every put (Reserve and
  // InlinePut: PERMISSION_DENIED) and hands this client its shared-memory segments as read-only
  // descriptors: no writable mapping of them is possible in this process (mmap or mprotect
  // with PROT_WRITE fails with EACCES). Lookups, gets, leases and events work as usual.
  bool read_only = false;
  // Device puts and gets over NCCL, GPU to GPU (engine role). Default false. When true, Connect
  // creates an NCCL transport on CUDA device transport.nccl_device (its join bounded by
  // transport.nccl_init_timeout_ms) and joins kvd's NCCL link (NcclConnect, docs/wire-format.md);
  // Connect fails with UNAVAILABLE and the reason when this process or kvd cannot run NCCL (built
  // without NCCL, no CUDA device). NCCL refuses two ranks on one GPU ("Duplicate GPU"): kvd's
  // link device (its transport.nccl_device or tiers.gpu.device) must differ from this client's.
  // Then a put whose `data` is CUDA device memory with no separate `window_queries`, and a get
  // into a CUDA device buffer, move their bytes from / to that buffer over NCCL; every other
  // put and get keeps its path (shared memory or the transport). The commit and get checksums
  // are still xxh3 over host bytes: one device-to-host copy of each chunk into pinned staging.
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
  // Default 32 KiB: on a 2-core box the one exchange had the lower latency at 16 and 32 KiB and
  // the higher one (and twice the daemon CPU) at 64 KiB, where the frame's copies (into the
  // frame, through the socket, out into the arena) cost more than the second exchange
  // (docs/benchmarks.md, "Small operations"). At most kMaxInlinePutBytes; 0 = shared-memory
  // puts always take three steps.
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
  // the reply and neither pays it. On a 2-vCPU virtual machine the 64 KiB shared-memory get's
  // p50 went from 47-53 to 31-37 us with the two on different CPUs, and did not change with them
  // on one CPU, where sched_yield lets kvd run (docs/benchmarks.md, "Small
  // operations"). Costs this thread up to that much CPU per request that kvd answers later
  // than that (a put that kvd compresses, a busy kvd). While other threads compete for the
  // waiting thread's CPU (a sched_yield took longer than the whole spin: yielding to them would
  // hold the reply until their time slice ends), the next 64 waits sleep at once.
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

// ---- results ----
struct LookupResult {
  uint32_t matched_chunks = 0;
  uint64_t matched_tokens = 0;
  uint64_t lease_id = 0;  // 0 when nothing matched (nothing to release)
  uint32_t lease_ttl_ms = 0;
};

struct PutResult {
  uint64_t bytes = 0;           // bytes sent (raw chunk + window queries)
  bool already_stored = false;  // the daemon had the chunk: nothing was sent
  uint64_t stored_bytes = 0;    // bytes the daemon stored (the compact chunk under a policy)
  uint32_t codec_id = 0;        // codec id of the stored chunk's key (0 = raw)
};

// The form of a chunk (proto ChunkForm).
enum class ChunkForm : uint8_t {
  kAsStored = 0,  // Get only: whatever the chunk is stored as
  kRaw = 1,       // the raw chunk layout (common/layout.h)
  kCompact = 2,   // the compact chunk (docs/chunk-format.md); expand with kvd/client/expand.h
};

struct GetResult {
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // verified against the received bytes
  uint32_t tokens = 0;    // tokens of the original (raw) chunk
  uint32_t codec_id = 0;  // the stored chunk's codec id (0 = raw)
  ChunkForm form = ChunkForm::kRaw;
};

// Bytes of W window-query tokens for `layout`: W * num_layers * num_q_heads * head_dim float32.
size_t WindowQueryBytes(const ModelLayout& layout, int window);

// One chunk to put: `bytes` bytes at `data` in the raw chunk layout (common/layout.h), which
// must equal layout.ChunkBytes(tokens). The buffers are borrowed until the call returns.
//
// For a model with a compression policy (SessionInfo::codec_id != 0) a put may carry the
// post-RoPE queries of the chunk's LAST `window` tokens (window = SessionInfo::window_tokens):
// per layer, [window, num_q_heads, head_dim] float32 row-major, layer after layer
// (WindowQueryBytes floats in all). Either in `window_queries` (over the transport the library
// stages raw + queries in one buffer: one copy; over shared memory both are copied straight into
// the reserved slot), or already appended to `data` (then `bytes` covers both, no copy).
// `first_position` is the position of the chunk's first token in its sequence (RoPE
// de-rotation and merged-slot positions need it).
//
// `data` and `window_queries` may be host or CUDA device memory (kvd/client/device.h classifies
// them): device bytes are copied on `cuda_stream` (a cudaStream_t; nullptr = the default
// stream) straight into the daemon's shared-memory slot, or over the transport into a host
// staging buffer, and the put returns once they left the device. A build without CUDA refuses
// a device pointer with UNIMPLEMENTED "built without CUDA".
struct PutItem {
  Hash128 hash;
  int tokens = 0;
  const void* data = nullptr;
  size_t bytes = 0;
  uint64_t first_position = 0;
  int window = 0;
  std::span<const float> window_queries = {};
  void* cuda_stream = nullptr;
};

// One chunk of a lease to read into [out, out + capacity).
// `out` may be host or CUDA device memory (kvd/client/device.h): device buffers get the bytes
// copied on `cuda_stream` (nullptr = the default stream) from the daemon's shared-memory slot,
// or over the transport from a host staging buffer, after the checksum was verified; the get
// returns once they are on the device.
struct GetItem {
  uint32_t chunk_index = 0;
  void* out = nullptr;
  size_t capacity = 0;
  // The form wanted; a form the stored chunk cannot give is FAILED_PRECONDITION (the daemon
  // stores one form and does not convert).
  ChunkForm form = ChunkForm::kAsStored;
  void* cuda_stream = nullptr;
};

// VECTOR calibration of a model (Client::GetCalibration, kvdctl calibration).
struct CalibrationInfo {
  std::string model;
  std::string state;  // "collecting", "calibrated", "not-routing"
  uint64_t tokens_seen = 0, tokens_needed = 0;
  uint64_t version = 0;
  uint32_t codec_id = 0;
  uint32_t num_layers = 0, num_kv_heads = 0;
  double r2_threshold = 0;
  std::vector<double> r2;    // [layers * kv heads] once calibrated
  std::vector<bool> routes;  // r2 >= r2_threshold
};

// One layer of a chunk as the engine holds it: K and V, each [tokens, num_kv_heads, head_dim]
// of layout.dtype, row-major, contiguous.
struct LayerKV {
  const void* k = nullptr;
  const void* v = nullptr;
};
struct MutableLayerKV {
  void* k = nullptr;
  void* v = nullptr;
};

// ---- admin views (mirror proto/kvd.capnp StatsReply etc.) ----
struct TierStats {
  std::string name;
  uint64_t capacity_bytes = 0, used_bytes = 0, reserved_bytes = 0, pinned_bytes = 0;
  uint64_t chunks = 0, evictions = 0, hits = 0, misses = 0;
};
struct GroupStats {
  std::string name;
  uint64_t chunks = 0, bytes = 0;
};
struct ModelInfo {
  std::string name;
  ModelLayout layout;
  uint64_t chunk_bytes = 0;
};
// Time of one compression stage of a model's ingest since the daemon started (StatsReply
// .compression): `nanos` summed over chunks, `chunks` the chunks in which the stage took time.
struct IngestStageTime {
  std::string stage;  // convert | derotate | score | select | merge | route | encode | serialize
  uint64_t nanos = 0;
  uint64_t chunks = 0;
};
struct ModelIngestStats {
  std::string model;
  std::vector<IngestStageTime> stages;  // pipeline order
  std::string device;                   // where it compresses: "cpu" or "cuda:N"
  std::string device_reason;            // why (compression.device, what kvd found at start)
};
struct Stats {
  std::string node_name;
  uint64_t uptime_ms = 0;
  uint32_t sessions = 0;
  std::vector<TierStats> tiers;
  std::vector<GroupStats> models, namespaces;
  std::vector<ModelInfo> registered_models;
  std::vector<std::pair<std::string, uint64_t>> counters;
  std::vector<ModelIngestStats> compression;  // models with a compression policy
};
struct ListFilter {
  std::string name_space;  // "" = any
  std::string model;       // "" = any
  uint32_t limit = 100;
};
struct ChunkInfo {
  std::string name_space, model;
  Hash128 hash;
  uint32_t tokens = 0;
  uint64_t bytes = 0;
  std::string tier;
  uint64_t age_ms = 0, idle_ms = 0;
  uint32_t leases = 0;
};
struct ListResult {
  std::vector<ChunkInfo> chunks;
  uint64_t total = 0;  // matching chunks; `chunks` may be cut at the limit
};
struct EvictFilter {
  enum class Kind { kAll, kNamespace, kModel, kChunk } kind = Kind::kAll;
  std::string name;  // namespace or model
  Hash128 chunk;
};
struct EvictResult {
  uint64_t chunks = 0, bytes = 0, skipped_pinned = 0;
};
struct Health {
  bool ok = false;
  // Serving (ok), but damaged stored data was found since start: corrupt chunks (dropped, never
  // served), quarantined metadata records, a damaged write-ahead log, failed promotions.
  // `status` then names each reason ("degraded: ...").
  bool degraded = false;
  std::string status;
  uint64_t uptime_ms = 0;
  std::string transport;
  struct Tier {
    std::string name;
    bool ok = false;
    std::string detail;
  };
  std::vector<Tier> tiers;
};

// ---- KV cache events (SubscribeEvents / PollEvents; docs/wire-format.md "Events") ----

enum class KvEventKind : uint8_t {
  kStored = 0,   // the chunk became visible in `tier`
  kRemoved = 1,  // it left `tier`; `reason` says why
  kDropped = 2,  // the daemon's queue for this subscriber was full: `dropped` events were lost
                 // here (resync with List on an admin connection)
};

// One event of a subscription. Sequence numbers are per subscription, from 1, without gaps: a
// kDropped marker takes the numbers of the `dropped` events it stands for.
struct KvEvent {
  uint64_t sequence = 0;
  KvEventKind kind = KvEventKind::kStored;
  std::string reason;  // kRemoved: "evicted" (LRU, capacity or quota), "admin" (evict),
                       // "moved" (demoted to a lower tier / store rolled back), "corrupt"
  std::string tier;    // "gpu", "host", "disk"
  std::string name_space, model;
  uint32_t codec_id = 0;
  uint64_t layout_digest = 0;
  Hash128 hash;  // the chunk's key (chain hash of its last block, hashing.h)
  uint32_t tokens = 0;
  uint64_t bytes = 0;    // bytes of the chunk in that tier
  uint64_t dropped = 0;  // kDropped: events lost
};

struct SubscribeOptions {
  // Admin role: "" (default) = every namespace, else that one. Engine role: "" or the client's
  // own namespace (another one is PERMISSION_DENIED): an engine sees its namespace only.
  std::string name_space;
  // Events the daemon queues for this subscriber before it drops (0 = the daemon's default,
  // 4096; capped at 65536).
  uint32_t queue_limit = 0;
};

struct SubscriptionInfo {
  uint32_t queue_limit = 0;  // granted
  std::string name_space;    // the namespace seen ("" = all)
};

// What the daemon said at the handshake.
struct SessionInfo {
  uint64_t session_id = 0;
  std::string daemon_version;
  std::string node_name;
  uint32_t chunk_tokens = 0;
  uint32_t max_frame_bytes = 0;
  uint64_t max_chunk_bytes = 0;
  std::string transport;
  // The daemon granted the shared-memory path (see ClientOptions::shared_memory).
  bool shared_memory = false;
  // The daemon took this session as a reading one (ClientOptions::read_only).
  bool read_only = false;
  // The daemon ends shared-memory reads named on any request (Request.releaseReads), so a
  // shared-memory get is one exchange: its reads' ends go out with the next request. False for
  // an older daemon: each get then ends its reads with one more exchange before returning.
  bool releases_on_requests = false;
  // The daemon takes one-exchange puts of small chunks (HelloReply.inlinePut; see
  // ClientOptions::inline_put_bytes). False for an older daemon: every put takes three steps.
  bool inline_put = false;
  // Compression (engine role): the codec id lookups and gets use (0 = raw), the policy's digest
  // and canonical form ("" = none), the window W puts should carry, whether puts without window
  // queries are refused, and the VECTOR calibration version the codec id includes (0 = none).
  uint32_t codec_id = 0;
  uint64_t policy_digest = 0;
  std::string policy;
  uint32_t window_tokens = 0;
  bool needs_queries = false;
  uint64_t calibration_version = 0;
  // Every chunk's dense form (kvd/client/expand.h) has one K/V slot per token position: true for
  // a raw model and for a policy that merges or quantizes without evicting (false with an older
  // daemon). What an engine that addresses KV by position (vLLM's paged blocks) can take.
  bool keeps_positions = false;
  // ClientOptions::nccl: the link is joined; what carries its bytes (e.g. "NCCL 2.28.3") and
  // kvd's CUDA device on it.
  bool nccl = false;
  std::string nccl_library;
  int nccl_daemon_device = 0;
};

// A segment of the daemon's shared-memory arena mapped into this process (diagnostics, tests).
struct SharedSegment {
  uint32_t index = 0;
  uint64_t generation = 0;
  const std::byte* data = nullptr;
  uint64_t size = 0;
};

namespace internal {
class ClientImpl;
}

// ---- zero-copy access to the shared-memory arena (Client::ReadInPlace / ReservePut) ----

struct ReadInPlaceOptions {
  // The form wanted, as GetItem::form (default: as stored).
  ChunkForm form = ChunkForm::kAsStored;
  // Verify the chunk's checksum before the view is returned (default true): one hashing pass
  // over the slot, no copy (~15-20 GB/s for a cache-resident chunk; about a memory read for a
  // cold one), DATA_LOSS on a mismatch. false hands out the view unverified: for an engine
  // that verifies elsewhere (its own checksum, or ChunkView::Verify() later, e.g. overlapped
  // with its DMA), or that accepts the risk. The daemon does not verify what it hands a
  // shared-memory reader, so without this nothing checks the bytes against the writer's
  // checksum on the way to the engine: a chunk damaged in memory (a wild write through another
  // process's writable view of the namespace) would reach the model undetected.
  bool verify_checksum = true;
  // Page-lock the chunk's segment for device DMA (cudaHostRegister through device.h's ops,
  // once per segment, best effort; default false): an engine that copies the view to its GPU
  // with cudaMemcpyAsync then gets a true asynchronous DMA instead of a staged copy. No effect
  // in a build without CUDA (ChunkView::device_pinned() says false).
  bool pin_for_device = false;
};

// A committed chunk where it lies in the daemon's shared-memory arena, read in place
// (Client::ReadInPlace). Move-only. While it lives the chunk is pinned: kvd neither evicts it
// nor reuses its slot (admin evict skips it, capacity pressure cannot take it), exactly like the
// read a copying Get holds while it copies. Destroying the view (or Release()) ends the read:
// the end goes to kvd with the client's next request (Request.releaseReads), or at once with
// its own exchange when 16 ended reads are queued or the daemon predates releaseReads; a
// destructor may therefore wait for a call in progress on the same Client.
//
// LIMITS: the pin lasts at most the daemon's read TTL (tiers.host.read_ttl_ms, default 60 s;
// pinned_until() says when) and the Client's connection: end views before either. After that
// the bytes stay mapped (reading them never faults) but kvd may reuse the slot for another chunk
// of the namespace. Destroy views before their Client (after it, they end nothing: the closed
// connection ended their reads). The bytes are read-only: a store through data() faults
// (SIGSEGV). Pinned chunks count against the host tier's capacity (stats: pinned_bytes):
// holding many views makes puts fail with RESOURCE_EXHAUSTED once nothing else can be evicted.
// NOT thread-safe itself (one owner); views of one Client may live on different threads.
class ChunkView {
 public:
  ChunkView();
  ChunkView(ChunkView&& other) noexcept;
  ChunkView& operator=(ChunkView&& other) noexcept;
  ~ChunkView();
  ChunkView(const ChunkView&) = delete;
  ChunkView& operator=(const ChunkView&) = delete;

  bool valid() const { return data_ != nullptr; }
  // [data(), data() + size()): the chunk's bytes, read-only. Null / 0 once released.
  const std::byte* data() const { return data_; }
  size_t size() const { return static_cast<size_t>(result_.bytes); }
  // Bytes, checksum (the writer's), tokens, codec id and form, as a Get reports them.
  const GetResult& result() const { return result_; }
  // The checksum was verified against the bytes (ReadInPlaceOptions::verify_checksum, Verify).
  bool verified() const { return verified_; }
  // The segment is page-locked for device DMA (ReadInPlaceOptions::pin_for_device).
  bool device_pinned() const { return device_pinned_; }
  // When kvd's read TTL ends the pin (measured from when the Get was sent); the epoch for a
  // daemon that does not say (older than GetReply.readTtlMs).
  std::chrono::steady_clock::time_point pinned_until() const { return pinned_until_; }
  // Hashes the bytes now: OK, DATA_LOSS on a mismatch, FAILED_PRECONDITION for a released view.
  Status Verify();
  // Ends the read now (as the destructor does). The view is then empty.
  void Release();

 private:
  friend class internal::ClientImpl;
  struct Hold;  // the mapping kept alive, and the way back to the Client
  std::unique_ptr<Hold> hold_;
  const std::byte* data_ = nullptr;
  GetResult result_;
  bool verified_ = false;
  bool device_pinned_ = false;
  std::chrono::steady_clock::time_point pinned_until_{};
};

struct ReservePutOptions {
  // Page-lock the slot's segment for device DMA into data() (as ReadInPlaceOptions; default
  // false).
  bool pin_for_device = false;
};

// A reserved slot of the shared-memory arena that the engine writes a raw chunk into itself
// (Client::ReservePut), then publishes with Client::CommitPut. Move-only. Until the commit the
// chunk is invisible to everyone. Destroying an uncommitted slot (or Abort()) aborts the
// reservation (one exchange with kvd; it may wait for a call in progress on the same Client);
// a client that dies first has it reclaimed by kvd with its connection, and one that holds it
// past limits.reservation_ttl_ms gets ABORTED at CommitPut.
// data() is this process's writable view of the slot only (ClientOptions::shm_writable_view; or,
// with that off, the slot's pages of the read-only mapping opened until the commit). Write
// exactly size() bytes in the raw chunk layout (common/layout.h); never write after CommitPut.
class PutSlot {
 public:
  PutSlot();
  PutSlot(PutSlot&& other) noexcept;
  PutSlot& operator=(PutSlot&& other) noexcept;
  ~PutSlot();
  PutSlot(const PutSlot&) = delete;
  PutSlot& operator=(const PutSlot&) = delete;

  // kvd already holds this chunk: nothing to write (data() is null); CommitPut returns at once
  // with PutResult::already_stored.
  bool already_stored() const { return already_stored_; }
  // False once committed, aborted or moved from.
  bool valid() const { return hold_ != nullptr; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const Hash128& hash() const { return hash_; }
  int tokens() const { return tokens_; }
  bool device_pinned() const { return device_pinned_; }
  // Aborts the reservation now: OK, or the daemon's / connection's error. The slot is then empty.
  Status Abort();

 private:
  friend class internal::ClientImpl;
  struct Hold;
  std::unique_ptr<Hold> hold_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  Hash128 hash_;
  int tokens_ = 0;
  bool already_stored_ = false;
  bool device_pinned_ = false;
};

class Client {
 public:
  // Validates options, connects (within connect_timeout_ms), creates the transport (engine
  // role), and runs the Hello handshake. Errors: INVALID_ARGUMENT (options), UNAVAILABLE
  // (cannot connect: the message names the address), DEADLINE_EXCEEDED, or the daemon's refusal
  // (FAILED_PRECONDITION for a layout / seed / chunk size mismatch, NOT_FOUND for an unknown
  // model) with the daemon's message.
  static StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  virtual ~Client();  // sends Bye (best effort) and closes; never blocks past the timeouts
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const;
  const SessionInfo& session() const;
  const ChainHasher& hasher() const;
  // false once the control connection broke (see ERRORS above).
  bool connected() const;

  // ---- engine role ----
  // Longest stored prefix of `chain` (chunk keys, see hashing.h) and a lease pinning the
  // matched chunks. Release the lease (ReleaseLease) when done; it expires otherwise.
  StatusOr<LookupResult> Lookup(std::span<const Hash128> chain);
  // Ends a lease. A live lease that this client's Lookup took, with a daemon that takes
  // releases on requests (every kvd since Request.releaseLeases), costs no exchange: it returns
  // OK at once and the lease ends when the daemon reads this client's next request of any kind
  // (its chunks stay pinned until then, at most the lease TTL; a client that ends or dies has
  // its leases ended with its connection). Any other id (another client's, already released,
  // expired, unknown) and every id with an older daemon is one ReleaseLease exchange, and its
  // errors are the daemon's: NOT_FOUND for an id this connection does not hold, ABORTED naming
  // why for one that ended already.
  Status ReleaseLease(uint64_t lease_id);
  // Ends now what this client has released but kvd has not heard of yet: the leases
  // ReleaseLease deferred and the reads of ended ChunkViews and copying gets, all in one
  // exchange (nothing to end: no exchange, OK). For an engine that is about to go quiet, so that
  // what it released does not stay pinned until its next request (at most the lease / read
  // TTL). Errors: UNAVAILABLE for a broken connection; the daemon's error for the exchange
  // (the connection's end ends those reads and leases anyway).
  Status FlushReleases();

  // Puts one chunk from a contiguous raw chunk (reserve -> send -> commit with checksum).
  StatusOr<PutResult> Put(const Hash128& hash, int tokens, const void* data, size_t bytes);
  // Puts one chunk from per-layer K/V pointers (layers.size() == layout.num_layers), gathered
  // into the raw chunk layout by the library (one staging copy; from CUDA device memory on the
  // default stream, see device.h).
  StatusOr<PutResult> PutLayers(const Hash128& hash, int tokens, std::span<const LayerKV> layers);
  // Puts several chunks with up to max_in_flight in flight. Stops at the first error and
  // returns it (chunks before it are committed; in-flight ones are aborted).
  StatusOr<std::vector<PutResult>> PutChunks(std::span<const PutItem> items);

  // Reads chunk `chunk_index` of a lease into [out, out + capacity) and verifies its checksum.
  // NOT_FOUND if the chunk is gone (evicted, lease expired); OUT_OF_RANGE if capacity is too
  // small; DATA_LOSS on checksum mismatch.
  StatusOr<GetResult> Get(uint64_t lease_id, uint32_t chunk_index, void* out, size_t capacity);
  // Reads a chunk and scatters it into per-layer K/V buffers (each [tokens, kv_heads, head_dim];
  // sized for at least the chunk's tokens, which the result reports; host or CUDA device memory,
  // copied on the default stream).
  StatusOr<GetResult> GetLayers(uint64_t lease_id, uint32_t chunk_index,
                                std::span<const MutableLayerKV> layers, int capacity_tokens);
  // Reads several chunks of one lease with up to max_in_flight in flight; stops at the first
  // error.
  StatusOr<std::vector<GetResult>> GetChunks(uint64_t lease_id, std::span<const GetItem> items);

  // ---- engine role, zero-copy (shared-memory sessions; see ChunkView and PutSlot) ----
  // Chunk `chunk_index` of a lease where it lies in the arena: a read-only view, pinned while it
  // lives, its checksum verified first unless options say not to. One exchange (the Get); the
  // read's end rides on a later request. Errors: those of Get (NOT_FOUND, DATA_LOSS,
  // FAILED_PRECONDITION for a form the chunk cannot give), and FAILED_PRECONDITION naming the
  // reason when this session has no shared-memory path (TCP address, ClientOptions::
  // shared_memory false, or a daemon that did not grant it): use Get there.
  StatusOr<ChunkView> ReadInPlace(uint64_t lease_id, uint32_t chunk_index,
                                  const ReadInPlaceOptions& options = {});
  // Reserves the slot of a raw chunk of `tokens` tokens (`bytes` must be layout.ChunkBytes(
  // tokens), INVALID_ARGUMENT otherwise) for the engine to write itself. Errors: those of Put's
  // reserve (RESOURCE_EXHAUSTED when nothing can be evicted, PERMISSION_DENIED for a reading
  // session), and FAILED_PRECONDITION naming the reason where a put is not a plain
  // shared-memory reserve and commit of the raw chunk: no shared-memory path (use Put), or a
  // compression policy that needs window queries with every put (SessionInfo::needs_queries:
  // use PutChunks with window_queries).
  StatusOr<PutSlot> ReservePut(const Hash128& hash, int tokens, size_t bytes,
                               const ReservePutOptions& options = {});
  // Hashes the slot once and commits it: the chunk becomes visible. The slot is consumed
  // whatever the outcome (a failed commit leaves nothing stored). Errors: those of Put's commit
  // (ABORTED past the reservation TTL; DATA_LOSS where kvd re-reads commits, with a disk
  // tier or tiers.host.verify_shm_commits, and the bytes changed after the hash), INVALID_ARGUMENT
  // for an empty slot or one of another Client.
  StatusOr<PutResult> CommitPut(PutSlot&& slot);

  // VECTOR weights of `version` (VectorWeights::Serialize bytes), fetched once per version and
  // cached by the client. NOT_FOUND when the daemon does not hold that version.
  StatusOr<std::shared_ptr<const std::vector<uint8_t>>> GetVectorWeights(uint64_t version);

  // ---- any role ----
  // VECTOR calibration of `model` ("" = every model whose policy routes values).
  StatusOr<std::vector<CalibrationInfo>> GetCalibration(const std::string& model);
  StatusOr<Stats> GetStats();
  // The arena segments this client has mapped (shared-memory sessions; empty otherwise). Each
  // holds chunks of this client's namespace only.
  std::vector<SharedSegment> SharedSegments() const;
  StatusOr<ListResult> List(const ListFilter& filter);
  StatusOr<EvictResult> Evict(const EvictFilter& filter);
  StatusOr<Health> GetHealth();

  // Subscribes this client's control connection to the node's KV cache events (one
  // subscription per Client). FAILED_PRECONDITION if already subscribed; PERMISSION_DENIED for
  // an engine asking for another namespace.
  StatusOr<SubscriptionInfo> SubscribeEvents(const SubscribeOptions& options = {});
  // The events received since the last call, in order, waiting up to `timeout_ms` (>= 0) for
  // the first one; empty when none came in time. Holds this Client's lock while it waits: use a
  // Client of its own for events. Until polled, received events are kept in this process (the
  // daemon stops sending once its queue for us is full, then drops). FAILED_PRECONDITION before
  // SubscribeEvents.
  StatusOr<std::vector<KvEvent>> PollEvents(int64_t timeout_ms);

 protected:
  Client() = default;
};

// Bytes of a raw chunk of `tokens` tokens for `layout` (layout.ChunkBytes).
size_t RawChunkBytes(const ModelLayout& layout, int tokens);
// Gathers per-layer K/V into a raw chunk at `out` (REQUIRES: out has RawChunkBytes bytes; host
// memory). The layers may be host or CUDA device memory (copied on `cuda_stream`); errors of
// device.h's CopyToHostFrom.
Status GatherLayers(const ModelLayout& layout, int tokens, std::span<const LayerKV> layers,
                    void* out, void* cuda_stream = nullptr);
// Scatters a raw chunk (host memory) into per-layer K/V buffers (host or device memory).
Status ScatterLayers(const ModelLayout& layout, int tokens, const void* raw,
                     std::span<const MutableLayerKV> layers, void* cuda_stream = nullptr);

// Parses "host:port" / "unix:/path" (what ClientOptions::address accepts).
struct DaemonAddress {
  bool is_unix = false;
  std::string host;  // TCP
  uint16_t port = 0;
  std::string path;  // unix
};
StatusOr<DaemonAddress> ParseDaemonAddress(std::string_view address);

}  // namespace kvd::client
