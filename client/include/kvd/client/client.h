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
//
// The API's parts, each its own header, all included here: options.h (ClientOptions),
// types.h (put and get items, results, SessionInfo), in_place.h (ChunkView, PutSlot),
// admin.h (Stats, List, Evict, Health, KV events).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvd/client/admin.h"
#include "kvd/client/hashing.h"
#include "kvd/client/in_place.h"
#include "kvd/client/options.h"
#include "kvd/client/types.h"
#include "kvd/common/hash.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/transport/options.h"

namespace kvd::client {

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
  // The same with options (LookupOptions: cluster scope).
  StatusOr<LookupResult> Lookup(std::span<const Hash128> chain, const LookupOptions& options);
  // Placement for prefill: the member of this daemon's cluster to put `chain`'s chunks to, so
  // that the node that decodes the chain finds them local (by the cluster's placement rule, or
  // the member named in options.node). Connect a client to it (PlacedOptions) and Put there:
  // the chunks travel over that client's transport (UCX) straight to the target kvd, and only
  // it stores them. Errors: FAILED_PRECONDITION when the daemon is in no cluster
  // (SessionInfo::cluster_placement) or the named member cannot hold this model's chunks (its
  // layout differs: the message says why), NOT_FOUND for a named node that is no member,
  // UNAVAILABLE when the daemon never saw a member list (etcd unreachable since its start),
  // INVALID_ARGUMENT for an empty chain.
  StatusOr<PlacementResult> Place(std::span<const Hash128> chain,
                                  const PlacementOptions& options = {});
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

// The options of a client that puts to `target` (Client::Place): `base` (the client of the
// daemon that answered) with address = target.control_address, unless target.local (then
// `base` as is: this daemon, over whatever address and path it already uses). The target is
// asked for the same model, layout, namespace and credentials (auth_token), so they must be
// valid there too.
ClientOptions PlacedOptions(const ClientOptions& base, const PlacementTarget& target);

// Parses "host:port" / "unix:/path" (what ClientOptions::address accepts).
struct DaemonAddress {
  bool is_unix = false;
  std::string host;  // TCP
  uint16_t port = 0;
  std::string path;  // unix
};
StatusOr<DaemonAddress> ParseDaemonAddress(std::string_view address);

}  // namespace kvd::client
