// The Client implementation (private to libkvd_client).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "bulk_path.h"
#include "connection.h"
#include "get_reply.h"
#include "kvd/client/client.h"
#include "kvd/client/device.h"
#include "kvd/transport/transport.h"
#include "nccl_path.h"
#include "path_context.h"
#include "reservation.h"
#include "segment_table.h"
#include "shm_path.h"
#include "testing/test_hooks.h"
#include "transfer_path.h"

namespace kvd::client::internal {

// Runs `fn(reader)` on a Response inside TryDecode (a hostile reply cannot throw out of here).
template <typename Fn>
Status ReadReply(proto::DecodedMessage& m, Fn&& fn) {
  return proto::TryDecode([&]() -> Status { return fn(m.Root<proto::Response>()); });
}

// INTERNAL: kvd answered with a message other than `expected` (its name in the Response union).
Status WrongReply(const char* expected);

// Shared by a ClientImpl and the ChunkViews and PutSlots it handed out: their way back to the
// client, cut by the client's destructor. Lock order: `mu` before ClientImpl::mu_.
struct InPlaceLink {
  std::mutex mu;                 // held while a view or slot calls into the client
  ClientImpl* client = nullptr;  // GUARDED_BY(mu); null once the client is gone
};

class ClientImpl final : public Client, public PathContext {
 public:
  ClientImpl(ClientOptions options, TestHooks hooks, std::unique_ptr<Channel> channel)
      : options_(std::move(options)),
        hooks_(std::move(hooks)),
        hasher_(ChainHasherOptions{options_.block_tokens, options_.chunk_tokens},
                options_.hash_seed),
        channel_(std::move(channel)) {
    link_->client = this;
  }
  ~ClientImpl() override;

  // Creates the transport (engine role) and runs Hello. Called once by Connect.
  Status Handshake();
  // Sends the Hello (`worker_address`: this client's transport, empty for an admin). A Hello
  // that cannot be sent returns the refusal kvd may have sent first (admission limits).
  StatusOr<uint64_t> SendHelloLocked(const std::string& worker_address);
  // What a HelloReply grants beyond SessionInfo.
  struct HelloGrant {
    std::string daemon_address;  // kvd's transport address
    bool reserve_ahead = false;  // HelloReply.reserveAhead
  };
  // Reads the HelloReply into session_ (and the protocol features it offers) and `*grant`.
  Status ReadHelloReply(proto::DecodedMessage& reply, HelloGrant* grant);

  // ---- PathContext (path_context.h): what the bulk paths drive ----
  const ClientOptions& options() const override { return options_; }
  const TestHooks& hooks() const override { return hooks_; }
  const SessionInfo& session() const override { return session_; }
  Channel& channel() override { return *channel_; }
  SegmentTable& segments() override { return segments_; }
  uint64_t NextTag() override { return next_tag_++; }
  Status CheckPutItem(const PutItem& it) const override;
  StatusOr<std::vector<uint64_t>> SendReservesLocked(std::span<const PutItem> items,
                                                     const ReserveExtras& extras) override;
  StatusOr<Reservation> AwaitReserveLocked(uint64_t request_id, const PutItem& item,
                                           PutResult* out) override;
  void AbortReservationsLocked(const std::vector<uint64_t>& reservation_ids) override;
  StatusOr<std::vector<uint64_t>> SendCommitsLocked(const std::vector<PutResult>& out,
                                                    const std::vector<uint64_t>& reservation,
                                                    const std::vector<uint64_t>& checksum,
                                                    const PutItem* named,
                                                    uint64_t reserve_next) override;
  void AwaitCommitsLocked(const std::vector<uint64_t>& commit_req, std::vector<PutResult>& out,
                          Status* first_error, OfferedSlot* offered) override;
  StatusOr<uint64_t> SendShmGetLocked(uint64_t lease_id, uint32_t chunk_index, uint64_t capacity,
                                      ChunkForm form) override;
  Status AwaitShmGetLocked(uint64_t request_id, uint64_t capacity, GetReply* got) override;
  StatusOr<std::byte*> SlotLocked(uint64_t request_id, const ArenaSlot& slot, uint64_t bytes,
                                  bool populate) override;

  const ChainHasher& hasher() const { return hasher_; }
  bool connected() const;

  StatusOr<LookupResult> Lookup(std::span<const Hash128> chain, const LookupOptions& options);
  StatusOr<PlacementResult> Place(std::span<const Hash128> chain, const PlacementOptions& options);
  Status ReleaseLease(uint64_t lease_id);
  StatusOr<std::vector<PutResult>> PutChunks(std::span<const PutItem> items);
  StatusOr<std::vector<GetResult>> GetChunks(uint64_t lease_id, std::span<const GetItem> items);
  StatusOr<Stats> GetStats();
  StatusOr<ListResult> List(const ListFilter& filter);
  StatusOr<EvictResult> Evict(const EvictFilter& filter);
  StatusOr<Health> GetHealth();
  StatusOr<SubscriptionInfo> SubscribeEvents(const SubscribeOptions& options);
  StatusOr<std::vector<KvEvent>> PollEvents(int64_t timeout_ms);
  std::vector<SharedSegment> SharedSegments() const;
  StatusOr<std::vector<CalibrationInfo>> GetCalibration(const std::string& model);

  // ---- zero-copy shared-memory access (in_place.cc) ----
  StatusOr<ChunkView> ReadInPlace(uint64_t lease_id, uint32_t chunk_index,
                                  const ReadInPlaceOptions& options);
  StatusOr<PutSlot> ReservePut(const Hash128& hash, int tokens, size_t bytes,
                               const ReservePutOptions& options);
  StatusOr<PutResult> CommitPut(PutSlot&& slot);
  // A view's read ends (ChunkView's destructor or Release): deferred onto the next request, or
  // sent at once (kFlushReadsAt queued, or a daemon without releasesOnRequests).
  void EndViewRead(uint64_t read_id);
  // An uncommitted slot is dropped (PutSlot's destructor or Abort): its reservation is aborted.
  Status AbortSlot(PutSlot::Hold& hold);
  static constexpr size_t kFlushReadsAt = 16;
  // Sends the deferred ends of reads and leases now (Client::FlushReleases).
  Status FlushReleases();
  StatusOr<std::shared_ptr<const std::vector<uint8_t>>> GetVectorWeights(uint64_t version);

 private:
  // Ends one read (caller holds mu_): deferred onto the next request where kvd takes them (all
  // queued ones sent at once when kFlushReadsAt are queued), else a ReleaseRead exchange; nothing
  // when the connection is gone (its end ended the read). Best effort.
  void EndReadLocked(uint64_t read_id);
  // One ReleaseRead exchange (caller holds mu_); the deferred ones ride on it.
  Status ReleaseReadLocked(uint64_t read_id);
  // REQUIRES: mu_ held.
  Status CheckUsable(bool needs_transport) const;
  // One request and its reply: sends what `fill(proto::Request::Builder)` builds and waits for
  // the reply (request_timeout_ms; an error reply is returned as its Status).
  template <typename Fill>
  StatusOr<std::unique_ptr<proto::DecodedMessage>> CallLocked(Fill&& fill) {
    KVD_ASSIGN_OR_RETURN(const uint64_t id, channel_->Send(std::forward<Fill>(fill)));
    return channel_->Await(id);
  }
  // PutChunks with mu_ held and the client usable.
  StatusOr<std::vector<PutResult>> PutChunksLocked(std::span<const PutItem> items);
  // One window of PutChunks: routes every item, sends the inline ones, hands the others to
  // their bulk paths.
  StatusOr<std::vector<PutResult>> PutWindowLocked(std::span<const PutItem> window);
  // INVALID_ARGUMENT for window queries of another size than the layout gives.
  Status CheckWindowQueries(std::span<const PutItem> window) const;
  // Where one item of a put window goes.
  enum class PutRoute : uint8_t {
    kInline,    // one InlinePut frame (inline_put.cc)
    kHostPath,  // HostPath(): shared memory or the transport
    kNccl,      // kvd's NCCL link, from CUDA device memory
  };
  // Routes every item of `window`, its device buffers located first (FAILED_PRECONDITION for
  // device memory in a build without CUDA).
  StatusOr<std::vector<PutRoute>> RoutePutsLocked(std::span<const PutItem> window) const;
  // The path of items that are not CUDA device memory sent over the NCCL link: shared memory
  // when the session has it, else the transport.
  BulkPath& HostPath() {
    if (shm_ != nullptr) return *shm_;
    return *ucx_;
  }

  // ---- one-exchange puts of small chunks (inline_put.cc) ----
  // True when `it` goes as an InlinePut (ClientOptions::inline_put_bytes).
  bool InlineEligible(const PutItem& it) const;
  // Sends `it` as one InlinePut frame (its bytes and window queries copied into the frame,
  // device bytes through host staging first) without waiting. Returns the request id.
  StatusOr<uint64_t> SendInlinePutLocked(const PutItem& it);
  // Waits for the reply of an InlinePut and fills `out` (error: the daemon's, as sent). Sent
  // only to a daemon that announced HelloReply.inlinePut.
  Status AwaitInlinePutLocked(uint64_t request_id, const PutItem& it, PutResult* out);

  // At most this many entries in live_leases_ (a client that never releases its leases).
  static constexpr size_t kMaxLiveLeases = 4096;

  ClientOptions options_;
  const TestHooks hooks_;
  ChainHasher hasher_;
  mutable std::mutex mu_;
  std::unique_ptr<Channel> channel_;  // GUARDED_BY(mu_)
  // The arena segments mapped (shared memory). GUARDED_BY(mu_)
  SegmentTable segments_{options_.shm_writable_view && !options_.read_only};
  // The bulk paths (bulk_path.h). GUARDED_BY(mu_)
  std::unique_ptr<UcxPath> ucx_;    // the engine role's transport; null for an admin
  std::unique_ptr<ShmPath> shm_;    // when the session has shared memory
  std::unique_ptr<NcclPath> nccl_;  // ClientOptions::nccl
  uint64_t next_tag_ = 1;           // of the transfers on both transports; GUARDED_BY(mu_)
  // HelloReply.leaseReleasesOnRequests: ReleaseLease of a lease this client holds goes out with
  // the next request instead of an exchange of its own.
  bool lease_releases_on_requests_ = false;  // GUARDED_BY(mu_)
  // Leases this connection's Lookups took and that were not released, with the time until
  // which they are live (the reply's arrival plus the granted TTL). Only these are released on
  // the next request; any other id gets the ReleaseLease exchange and the daemon's answer.
  std::map<uint64_t, Deadline> live_leases_;  // GUARDED_BY(mu_)
  SessionInfo session_;
  std::vector<uint8_t> inline_staging_;  // device bytes of an InlinePut; GUARDED_BY(mu_)
  // VECTOR weights by version (GetVectorWeights); GUARDED_BY(mu_)
  std::map<uint64_t, std::shared_ptr<const std::vector<uint8_t>>> weights_;
  bool subscribed_ = false;  // GUARDED_BY(mu_)
  std::shared_ptr<InPlaceLink> link_ = std::make_shared<InPlaceLink>();

  friend class ::kvd::client::Client;
  friend StatusOr<std::unique_ptr<Client>> kvd::client::ConnectWithTestHooks(const ClientOptions&,
                                                                             const TestHooks&);
};

}  // namespace kvd::client::internal

namespace kvd::client {

struct ChunkView::Hold {
  std::shared_ptr<internal::InPlaceLink> link;
  std::shared_ptr<internal::SegmentMapping> mapping;
  uint64_t read_id = 0;  // 0: nothing to end
};

struct PutSlot::Hold {
  std::shared_ptr<internal::InPlaceLink> link;
  std::shared_ptr<internal::SegmentMapping> mapping;
  uint64_t reservation_id = 0;  // 0: already stored, nothing to commit or abort
  uint64_t bytes = 0;
  // The slot in the read-only mapping; `opened`: its pages were made writable (no writable
  // view), to close again before the commit or the abort.
  std::byte* read_only_slot = nullptr;
  bool opened = false;
};

}  // namespace kvd::client
