// Client: zero-copy access to the shared-memory arena. ReadInPlace hands out a read-only view of
// a pinned chunk where it lies; ReservePut a writable slot the engine fills, CommitPut publishes.
#include <sys/mman.h>

#include <string>
#include <utility>

#include "client_impl.h"
#include "get_reply.h"
#include "kvd/common/hash.h"

namespace kvd::client {
namespace internal {
namespace {

Status NoSharedMemory(const char* call, const ClientOptions& options, const char* instead) {
  std::string why;
  auto parsed = ParseDaemonAddress(options.address);
  if (!parsed.ok() || !parsed->is_unix) {
    why = "the client is connected over TCP (" + options.address +
          "); the path needs a unix-socket address on the daemon's node";
  } else if (!options.shared_memory) {
    why = "ClientOptions::shared_memory is false";
  } else {
    why = "kvd did not grant it (no shared-memory arena: tiers.host.segment, see kvd's log)";
  }
  return Status::FailedPrecondition(
      std::string(call) + " needs the shared-memory path and this session has none: " + why +
      "; use " + instead + " instead");
}

}  // namespace

StatusOr<ChunkView> ClientImpl::ReadInPlace(uint64_t lease_id, uint32_t chunk_index,
                                            const ReadInPlaceOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  if (!session_.shared_memory) return NoSharedMemory("ReadInPlace", options_, "Get");
  const auto sent_at = std::chrono::steady_clock::now();
  KVD_ASSIGN_OR_RETURN(const uint64_t req,
                       SendShmGetLocked(lease_id, chunk_index, ~uint64_t{0}, options.form));
  GetReply got;
  Status s = AwaitShmGetLocked(req, ~uint64_t{0}, &got);
  StatusOr<std::byte*> slot = s;
  if (s.ok()) {
    slot = SlotLocked(req, got.slot, got.result.bytes, /*populate=*/true);
  }
  if (slot.ok() && options.verify_checksum) {
    if (Status v = VerifyGet("ReadInPlace", got.result, Checksum64(*slot, got.result.bytes),
                             lease_id, chunk_index);
        !v.ok()) {
      slot = v;
    }
  }
  if (!slot.ok()) {
    // The read (if one was opened) ends as a view's does.
    if (got.read_id != 0) EndReadLocked(got.read_id);
    return slot.status();
  }
  if (options.pin_for_device) segments_.Pin(got.slot.segment);
  const std::shared_ptr<SegmentMapping>& mapping = segments_.mapping(got.slot.segment);
  ChunkView view;
  view.hold_ = std::make_unique<ChunkView::Hold>();
  view.hold_->link = link_;
  view.hold_->mapping = mapping;
  view.hold_->read_id = got.read_id;
  view.data_ = *slot;
  view.result_ = got.result;
  view.verified_ = options.verify_checksum;
  view.device_pinned_ = mapping->pinned;
  if (got.read_ttl_ms != 0)
    view.pinned_until_ = sent_at + std::chrono::milliseconds(got.read_ttl_ms);
  return view;
}

void ClientImpl::EndViewRead(uint64_t read_id) {
  std::lock_guard<std::mutex> lock(mu_);
  EndReadLocked(read_id);
}

void ClientImpl::EndReadLocked(uint64_t read_id) {
  if (!channel_ || channel_->broken()) return;  // the connection's end ended the read
  if (session_.releases_on_requests) {
    channel_->DeferReleases({read_id});
    if (channel_->deferred_releases() < kFlushReadsAt) return;
    // Enough queued: end them now (one exchange; the rest ride on it), so an engine that reads
    // many chunks in place and then goes quiet does not keep them pinned to the read TTL.
    read_id = channel_->TakeDeferredRelease();
  }
  // Best effort: the read TTL or the connection's end ends it otherwise.
  ReleaseReadLocked(read_id).IgnoreError();
}

Status ClientImpl::ReleaseReadLocked(uint64_t read_id) {
  return CallLocked([&](proto::Request::Builder r) { r.initReleaseRead().setReadId(read_id); })
      .status();
}

StatusOr<PutSlot> ClientImpl::ReservePut(const Hash128& hash, int tokens, size_t bytes,
                                         const ReservePutOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  if (!session_.shared_memory) return NoSharedMemory("ReservePut", options_, "Put");
  if (session_.needs_queries) {
    return Status::FailedPrecondition(
        "ReservePut: model \"" + options_.model +
        "\" has a compression policy that needs the window queries of every put "
        "(SessionInfo::needs_queries); ReservePut writes the raw chunk alone: use PutChunks with "
        "window_queries");
  }
  PutItem item;
  item.hash = hash;
  item.tokens = tokens;
  item.data = &item;  // never read: the engine writes the slot itself (CheckPutItem wants one)
  item.bytes = bytes;
  KVD_ASSIGN_OR_RETURN(const std::vector<uint64_t> req, SendReservesLocked({&item, 1}, {}));
  PutResult reserved;
  KVD_ASSIGN_OR_RETURN(const Reservation rv, AwaitReserveLocked(req[0], item, &reserved));
  // The PutSlot is made last: one dropped on an error path here would abort through this
  // client's lock, which this call holds.
  auto hold = std::make_unique<PutSlot::Hold>();
  hold->link = link_;
  hold->bytes = bytes;
  std::byte* data = nullptr;
  bool pinned = false;
  if (!reserved.already_stored) {
    auto abort = [&](Status s) {
      AbortReservationsLocked({rv.id});
      return s;
    };
    if (!rv.has_slot) return abort(Status::Internal("kvd reserved without a memory slot"));
    const bool via_view = segments_.writable_view();
    auto slot = SlotLocked(req[0], rv.slot, bytes, /*populate=*/!via_view);
    if (!slot.ok()) return abort(slot.status());
    data = via_view ? segments_.WritableSlot(rv.slot.segment, rv.slot.offset, bytes) : nullptr;
    if (data == nullptr) {  // no writable view: open the slot's pages until the commit
      if (Status s = ProtectSlot(*slot, bytes, /*writable=*/true); !s.ok()) return abort(s);
      data = *slot;
      hold->opened = true;
    }
    if (options.pin_for_device) segments_.Pin(rv.slot.segment);
    hold->mapping = segments_.mapping(rv.slot.segment);
    hold->reservation_id = rv.id;
    hold->read_only_slot = *slot;
    pinned = hold->mapping->pinned;
  }
  PutSlot out;
  out.hold_ = std::move(hold);
  out.hash_ = hash;
  out.tokens_ = tokens;
  out.size_ = bytes;
  out.already_stored_ = reserved.already_stored;
  out.data_ = data;
  out.device_pinned_ = pinned;
  return out;
}

StatusOr<PutResult> ClientImpl::CommitPut(PutSlot&& slot) {
  std::unique_ptr<PutSlot::Hold> hold = std::move(slot.hold_);
  const size_t bytes = slot.size_;
  const std::byte* data = slot.data_;
  const bool already_stored = slot.already_stored_;
  slot = PutSlot();
  if (hold == nullptr) {
    return Status::InvalidArgument("CommitPut: the slot is empty (committed, aborted or moved)");
  }
  if (hold->link != link_) {
    PutSlot theirs;  // aborted through its own Client as it goes
    theirs.hold_ = std::move(hold);
    return Status::InvalidArgument("CommitPut: the slot was reserved by another Client");
  }
  PutResult out;
  out.bytes = bytes;
  if (already_stored) {
    out.already_stored = true;
    return out;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (hold->opened) {
    // Read-only again before the hash and the commit (as a put through the mprotect route).
    if (Status s = ProtectSlot(hold->read_only_slot, bytes, /*writable=*/false); !s.ok()) {
      if (!channel_->broken()) AbortReservationsLocked({hold->reservation_id});
      return s;
    }
  }
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  std::vector<PutResult> results{out};
  Status first_error;
  KVD_ASSIGN_OR_RETURN(
      const std::vector<uint64_t> commit_req,
      SendCommitsLocked(results, {hold->reservation_id}, {Checksum64(data, bytes)},
                        /*named=*/nullptr, /*reserve_next=*/0));
  AwaitCommitsLocked(commit_req, results, &first_error, /*offered=*/nullptr);
  if (!first_error.ok()) return first_error;
  return results[0];
}

Status ClientImpl::AbortSlot(PutSlot::Hold& hold) {
  std::lock_guard<std::mutex> lock(mu_);
  if (hold.opened) ProtectSlot(hold.read_only_slot, hold.bytes, /*writable=*/false).IgnoreError();
  if (hold.reservation_id == 0) return Status::Ok();
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  return CallLocked([&](proto::Request::Builder r) {
           r.initAbort().setReservationId(hold.reservation_id);
         })
      .status();
}

}  // namespace internal

// ---- ChunkView ----

ChunkView::ChunkView() = default;
ChunkView::ChunkView(ChunkView&& other) noexcept { *this = std::move(other); }
ChunkView& ChunkView::operator=(ChunkView&& other) noexcept {
  if (this != &other) {
    Release();
    hold_ = std::move(other.hold_);
    data_ = std::exchange(other.data_, nullptr);
    result_ = std::exchange(other.result_, GetResult{});
    verified_ = std::exchange(other.verified_, false);
    device_pinned_ = std::exchange(other.device_pinned_, false);
    pinned_until_ = std::exchange(other.pinned_until_, {});
  }
  return *this;
}
ChunkView::~ChunkView() { Release(); }

Status ChunkView::Verify() {
  if (data_ == nullptr) return Status::FailedPrecondition("ChunkView::Verify: the view is empty");
  if (Checksum64(data_, result_.bytes) != result_.checksum) {
    return Status::DataLoss("ChunkView::Verify: the chunk's bytes do not match its checksum");
  }
  verified_ = true;
  return Status::Ok();
}

void ChunkView::Release() {
  std::unique_ptr<Hold> hold = std::move(hold_);
  data_ = nullptr;
  result_ = GetResult{};
  verified_ = false;
  device_pinned_ = false;
  pinned_until_ = {};
  if (hold == nullptr || hold->read_id == 0) return;
  std::lock_guard<std::mutex> lock(hold->link->mu);
  if (hold->link->client != nullptr) hold->link->client->EndViewRead(hold->read_id);
}

// ---- PutSlot ----

PutSlot::PutSlot() = default;
PutSlot::PutSlot(PutSlot&& other) noexcept { *this = std::move(other); }
PutSlot& PutSlot::operator=(PutSlot&& other) noexcept {
  if (this != &other) {
    Abort().IgnoreError();
    hold_ = std::move(other.hold_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    hash_ = std::exchange(other.hash_, Hash128{});
    tokens_ = std::exchange(other.tokens_, 0);
    already_stored_ = std::exchange(other.already_stored_, false);
    device_pinned_ = std::exchange(other.device_pinned_, false);
  }
  return *this;
}
PutSlot::~PutSlot() { Abort().IgnoreError(); }

Status PutSlot::Abort() {
  std::unique_ptr<Hold> hold = std::move(hold_);
  data_ = nullptr;
  size_ = 0;
  already_stored_ = false;
  device_pinned_ = false;
  if (hold == nullptr) return Status::Ok();
  std::lock_guard<std::mutex> lock(hold->link->mu);
  // The client is gone: its closed connection had kvd reclaim the reservation.
  if (hold->link->client == nullptr) return Status::Ok();
  return hold->link->client->AbortSlot(*hold);
}

}  // namespace kvd::client
