// The values the Client's data calls take and return: put and get items, their results, and
// what the daemon granted at the handshake (part of client.h; include that). Plain structs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/common/layout.h"

namespace kvd::client {

// ---- results ----
// How many of a lookup's matched chunks one tier held.
struct TierChunks {
  std::string tier;  // "gpu", "host", "disk"
  uint32_t chunks = 0;
};

// Cluster scope: how long a prefix of the chain one node holds, and in which tiers.
struct PrefixHolder {
  std::string node;             // the member's cluster.node
  uint32_t matched_chunks = 0;  // leading chunks of the chain it holds
  std::string error;            // "" = answered; else why it gave no answer
  std::vector<TierChunks> found_in;
};

struct LookupOptions {
  // Cluster scope (default false: this daemon only). The daemon also asks the other members of
  // its cluster that serve the same model and layout, lists every node's prefix in
  // LookupResult::holders and, by its cluster.peer_fetch policy, first copies the chunks a peer
  // holds beyond its own prefix into its host tier: the lease and Get then cover them like local
  // chunks. Needs SessionInfo::cluster_lookup (FAILED_PRECONDITION otherwise).
  bool cluster = false;
};

struct LookupResult {
  uint32_t matched_chunks = 0;
  uint64_t matched_tokens = 0;
  uint64_t lease_id = 0;  // 0 when nothing matched (nothing to release)
  uint32_t lease_ttl_ms = 0;
  // Cluster scope only: every node asked (this daemon first), and the chunks of this lease that
  // the daemon copied from a peer for it.
  std::vector<PrefixHolder> holders;
  uint32_t fetched_chunks = 0;
  // Cluster scope only: true while the daemon's etcd answers (the holders come from the current
  // member list); false: etcd is unreachable and they come from the last member list the daemon
  // saw, membership_age_ms old (the time since etcd last answered it; 0 while current). Local
  // scope, and a daemon that predates them: false and 0.
  bool membership_current = false;
  uint64_t membership_age_ms = 0;
  // Where the matched chunks were found, per tier (a chunk the lookup copied up from disk counts
  // as disk; chunks fetched from a peer as host). Empty from a daemon that predates it.
  std::vector<TierChunks> found_in;
};

// Placement for prefill (Client::Place): where to put a chain's chunks in the cluster.
struct PlacementOptions {
  // "" (default): the cluster's placement rule, rendezvous hashing of the chain's first chunk
  // hash over the members that serve this session's model with the same layout (the daemon
  // answering included; docs/deployment.md "Placement for prefill"). Else the member whose
  // cluster.node this is (the decode node a scheduler already chose).
  std::string node;
};

struct PlacementTarget {
  std::string node;             // the member's cluster.node
  std::string control_address;  // its TCP control address, "host:port"
  bool local = false;           // the member is the daemon that answered
};

struct PlacementResult {
  // Best first: put to targets[0]; by the rule, the rest are the next choices in order (a
  // named node: that one alone).
  std::vector<PlacementTarget> targets;
  // False: etcd is unreachable and the daemon answered from the last member list it saw,
  // membership_age_ms old (the time since etcd last answered it; 0 while current).
  bool membership_current = false;
  uint64_t membership_age_ms = 0;
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
  // The daemon is a cluster member and takes cluster-scope lookups (LookupOptions::cluster).
  bool cluster_lookup = false;
  // The daemon is a cluster member and answers Client::Place.
  bool cluster_placement = false;
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

}  // namespace kvd::client
