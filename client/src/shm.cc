// Client: the same-node shared-memory path (puts and gets copy straight into / out of the
// daemon's arena slots; see ClientOptions::shared_memory and the ShmSlot message).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "client_impl.h"
#include "get_reply.h"
#include "kvd/client/device.h"
#include "kvd/common/copy_checksum.h"
#include "kvd/common/hash.h"
#include "kvd/proto/convert.h"
#include "shm_path.h"

namespace kvd::client::internal {
bool IsDevice(const void* p) {
  if (p == nullptr) return false;
  auto at = ActiveDeviceMemoryOps().Locate(p);
  return at.ok() && *at == BufferLocation::kCuda;
}

std::vector<SharedSegment> ClientImpl::SharedSegments() const {
  std::lock_guard<std::mutex> lock(mu_);
  return segments_.List();
}

StatusOr<std::byte*> ClientImpl::SlotLocked(uint64_t request_id, const ArenaSlot& slot,
                                            uint64_t bytes, bool populate) {
  if (slot.fd_attached) {
    const int fd = channel_->TakeFd(request_id);
    if (fd < 0) return Status::Internal("kvd announced an arena memfd that did not arrive");
    KVD_RETURN_IF_ERROR(segments_.Map(fd, slot.segment, slot.generation));
  }
  return segments_.Slot(slot.segment, slot.generation, slot.offset, bytes, populate);
}

StatusOr<uint64_t> ClientImpl::SendShmGetLocked(uint64_t lease_id, uint32_t chunk_index,
                                                uint64_t capacity, ChunkForm form) {
  return channel_->Send([&](proto::Request::Builder r) {
    auto g = r.initGet();
    g.setLeaseId(lease_id);
    g.setChunkIndex(chunk_index);
    g.setBufferBytes(capacity);
    g.setForm(static_cast<proto::ChunkForm>(form));
  });
}

Status ClientImpl::AwaitShmGetLocked(uint64_t request_id, uint64_t capacity, GetReply* got) {
  auto reply = channel_->Await(request_id);
  if (!reply.ok()) return reply.status();
  Status s = ReadGetReply(**reply, got);
  if (s.ok() && !got->has_slot) s = Status::Internal("kvd answered a get without a memory slot");
  if (s.ok() && got->result.bytes > capacity) {
    s = Status::OutOfRange("get: chunk of " + std::to_string(got->result.bytes) +
                           " bytes, buffer of " + std::to_string(capacity));
  }
  if (!s.ok()) {
    if (int fd = got->slot.fd_attached ? channel_->TakeFd(request_id) : -1; fd >= 0) ::close(fd);
  }
  return s;
}

StatusOr<std::vector<PutResult>> ShmPath::PutWindow(std::span<const PutItem> items) {
  PathContext& c = client_;
  const size_t n = items.size();
  const HeldSlot held = std::exchange(held_, HeldSlot());
  const bool use_held = held.reservation != 0 && n > 0 &&
                        PutBytes(items[0]) == held.bytes && Clock::now() < held.use_by;
  if (use_held) KVD_RETURN_IF_ERROR(c.CheckPutItem(items[0]));
  // Phase 1: a Reserve for every chunk but the one going into the held slot.
  const uint64_t abort_first = held.reservation != 0 && !use_held ? held.reservation : 0;
  const size_t first_reserved = use_held ? 1 : 0;
  std::vector<uint64_t> req(n, 0);
  if (first_reserved < n) {
    auto sent = c.SendReservesLocked(items.subspan(first_reserved), {.abort_first = abort_first});
    if (!sent.ok()) {
      if (use_held) c.AbortReservationsLocked({held.reservation});
      return sent.status();
    }
    std::copy(sent->begin(), sent->end(), req.begin() + first_reserved);
  } else if (abort_first != 0) {
    c.AbortReservationsLocked({abort_first});
  }
  // Phase 2: as each reservation comes back, copy the chunk into its slot and checksum it.
  std::vector<PutResult> out(n);
  std::vector<uint64_t> reservation(n, 0), checksum(n, 0);
  std::vector<uint64_t> to_abort;
  Status first_error;
  for (size_t i = 0; i < n; ++i) {
    StatusOr<Reservation> rv = Status::Internal("unset");
    if (i == 0 && use_held) {
      rv = held.AsReservation();  // mapped when it came (no memfd with it now)
      out[0].bytes = PutBytes(items[0]);
    } else {
      rv = c.AwaitReserveLocked(req[i], items[i], &out[i]);
    }
    if (!rv.ok()) {
      if (first_error.ok()) first_error = rv.status();
      continue;
    }
    reservation[i] = rv->id;
    if (out[i].already_stored) continue;
    to_abort.push_back(reservation[i]);
    Status s = FillSlot(req[i], *rv, items[i], /*copy=*/first_error.ok(), &checksum[i]);
    if (!s.ok() && first_error.ok()) first_error = s;
  }
  if (!first_error.ok()) {
    c.AbortReservationsLocked(to_abort);
    return first_error;
  }
  if (c.hooks().before_commit) c.hooks().before_commit();
  // Phase 3: commit with checksums (pipelined), the last commit asking for the next slot.
  const uint64_t reserve_next = reserve_ahead_ && n > 0 ? PutBytes(items[n - 1]) : 0;
  KVD_ASSIGN_OR_RETURN(const std::vector<uint64_t> commit_req,
                       c.SendCommitsLocked(out, reservation, checksum,
                                           use_held ? &items[0] : nullptr, reserve_next));
  OfferedSlot offered;
  c.AwaitCommitsLocked(commit_req, out, &first_error, &offered);
  Keep(offered, reserve_next);
  if (!first_error.ok()) return first_error;
  return out;
}

void ShmPath::Keep(const OfferedSlot& offered, uint64_t bytes) {
  PathContext& c = client_;
  if (offered.slot.reservation == 0) return;
  HeldSlot next = offered.slot;
  next.bytes = bytes;  // what this client asked for: the last put's size
  // Mapped now (its memfd, when attached, is taken with the commit's reply).
  auto slot = c.SlotLocked(offered.request_id, next.slot, next.bytes, /*populate=*/false);
  if (!slot.ok()) {
    c.AbortReservationsLocked({next.reservation});
    return;
  }
  if (held_.reservation != 0) c.AbortReservationsLocked({held_.reservation});
  next.slot.fd_attached = false;  // its memfd is taken: mapped now
  held_ = next;
}

Status ShmPath::FillSlot(uint64_t request_id, const Reservation& rv, const PutItem& item, bool copy,
                         uint64_t* checksum) {
  PathContext& c = client_;
  if (!rv.has_slot) return Status::Internal("kvd reserved without a memory slot");
  const size_t put_bytes = PutBytes(item);
  // Device memory (device.h) is copied straight into the slot on the item's stream; the
  // checksum then reads the slot.
  const bool from_device =
      IsDevice(item.data) || IsDevice(item.window_queries.data());
  // Host bytes alone are copied and checksummed in one pass over them (copy_checksum.h),
  // through the writable view when there is one (no protection change of the slot, and no
  // page-table fill of the read-only mapping, which a later get of the slot does). The slot
  // is read later by other processes, not by this thread: non-temporal stores.
  const bool fused = !from_device && item.window_queries.empty();
  const bool via_view = fused && c.segments().writable_view();
  KVD_ASSIGN_OR_RETURN(auto slot,
                       c.SlotLocked(request_id, rv.slot, put_bytes, /*populate=*/!via_view));
  if (!copy) return Status::Ok();
  if (from_device) c.segments().Pin(rv.slot.segment);
  if (std::byte* view =
          fused ? c.segments().WritableSlot(rv.slot.segment, rv.slot.offset, put_bytes) : nullptr;
      view != nullptr) {
    KVD_RETURN_IF_ERROR(LocateForUse(item.data, "put data").status());
    *checksum = CopyWithChecksum64(view, item.data, item.bytes, CopyDestination::kNotReadSoon);
    return Status::Ok();
  }
  Status copied = ProtectSlot(slot, put_bytes, /*writable=*/true);
  if (copied.ok() && fused) {
    copied = LocateForUse(item.data, "put data").status();
    if (copied.ok()) {
      *checksum = CopyWithChecksum64(slot, item.data, item.bytes, CopyDestination::kNotReadSoon);
    }
  } else if (copied.ok()) {
    copied = CopyToHostFrom(slot, item.data, item.bytes, item.cuda_stream, "put data");
    if (copied.ok() && !item.window_queries.empty()) {
      // The window queries follow the raw chunk in the slot (no staging copy); the checksum
      // then reads the slot once instead of two source buffers.
      copied = CopyToHostFrom(slot + item.bytes, item.window_queries.data(), put_bytes - item.bytes,
                              item.cuda_stream, "put window queries");
    }
  }
  // Read-only again before the commit goes out (the copies above have completed).
  Status closed = ProtectSlot(slot, put_bytes, /*writable=*/false);
  if (copied.ok()) copied = closed;
  KVD_RETURN_IF_ERROR(copied);
  if (!fused) *checksum = Checksum64(slot, put_bytes);
  return Status::Ok();
}

StatusOr<std::vector<GetResult>> ShmPath::GetWindow(uint64_t lease_id,
                                                    std::span<const GetItem> items) {
  PathContext& c = client_;
  const size_t n = items.size();
  for (const GetItem& item : items) {
    if (item.out == nullptr && item.capacity > 0) {
      return Status::InvalidArgument("get: null output buffer");
    }
    KVD_RETURN_IF_ERROR(LocateForUse(item.out, "get buffer").status());
  }
  // Ask for every chunk (pipelined); each reply names the pinned slot.
  std::vector<uint64_t> req(n, 0);
  for (size_t i = 0; i < n; ++i) {
    KVD_ASSIGN_OR_RETURN(req[i], c.SendShmGetLocked(lease_id, items[i].chunk_index,
                                                    items[i].capacity, items[i].form));
  }
  std::vector<GetResult> out(n);
  std::vector<uint64_t> reads;
  Status first_error;
  for (size_t i = 0; i < n; ++i) {
    GetReply got;
    Status s = c.AwaitShmGetLocked(req[i], items[i].capacity, &got);
    if (got.read_id != 0) reads.push_back(got.read_id);
    if (s.ok()) {
      out[i] = got.result;
      s = CopyOut(req[i], lease_id, items[i], got);
    }
    if (!s.ok() && first_error.ok()) first_error = s;
  }
  Status ended = EndReads(reads);
  if (first_error.ok()) first_error = ended;
  if (!first_error.ok()) return first_error;
  return out;
}

Status ShmPath::CopyOut(uint64_t request_id, uint64_t lease_id, const GetItem& item,
                        const GetReply& got) {
  PathContext& c = client_;
  const uint64_t bytes = got.result.bytes;
  KVD_ASSIGN_OR_RETURN(auto slot, c.SlotLocked(request_id, got.slot, bytes, /*populate=*/true));
  // End to end: the bytes must match the checksum the writer committed. The slot is checked
  // (it stays pinned by the read until it ends): for a host buffer in the same pass as the copy
  // (each block hashed, then copied from the cache); for a device buffer (device.h) first,
  // then copied on the item's stream.
  const bool to_device = IsDevice(item.out);
  if (to_device) c.segments().Pin(got.slot.segment);
  const uint64_t sum =
      to_device ? Checksum64(slot, bytes) : CopyWithChecksum64(item.out, slot, bytes);
  KVD_RETURN_IF_ERROR(VerifyGet("get", got.result, sum, lease_id, item.chunk_index));
  if (!to_device) return Status::Ok();
  return CopyFromHostTo(item.out, slot, bytes, item.cuda_stream, "get buffer");
}

Status ShmPath::EndReads(const std::vector<uint64_t>& reads) {
  PathContext& c = client_;
  // The bytes are ours now: the reads end so the chunks may be evicted again. A daemon that
  // takes Request.releaseReads gets them with the next request, whatever it is (no exchange
  // here: the get was one round trip); an older one gets ReleaseReads (pipelined).
  if (c.session().releases_on_requests && !c.hooks().release_reads_apart) {
    c.channel().DeferReleases(reads);
    return Status::Ok();
  }
  std::vector<uint64_t> release_req;
  for (uint64_t read : reads) {
    auto id =
        c.channel().Send([&](proto::Request::Builder r) { r.initReleaseRead().setReadId(read); });
    if (!id.ok()) break;
    release_req.push_back(*id);
  }
  Status first_error;
  for (uint64_t id : release_req) {
    auto r = c.channel().Await(id);
    if (!r.ok() && first_error.ok()) first_error = r.status().WithContext("release of a read");
  }
  return first_error;
}

}  // namespace kvd::client::internal
