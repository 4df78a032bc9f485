// Session requests of the shared-memory path: slots in the arena's memfd segments, their
// descriptors, and the reads a client releases.
#include <string>

#include "kvd/common/logging.h"
#include "kvd/storage/host_tier.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

StatusOr<Session::ShmRef> Session::PrepareShm(uint64_t offset) {
  storage::HostTier* tier = server_->host_tier();
  ShmRef ref;
  ref.segment = tier->SegmentOf(offset);
  ref.offset = offset - tier->SegmentStart(ref.segment);
  // Defence in depth: the tier never puts another namespace's block in a segment it assigned to
  // ours (and the block held by the caller keeps the assignment), but a memfd is a capability.
  if (std::string owner = tier->SegmentOwner(ref.segment); owner != name_space_) {
    return Status::Internal("arena segment " + std::to_string(ref.segment) +
                            " belongs to namespace \"" + owner + "\", not \"" + name_space_ + "\"");
  }
  // The block the caller holds keeps the segment assigned, so its generation cannot change
  // under us. A client that maps it already gets no descriptor: no dup (or, for a reading
  // session, no re-open through /proc) and close on every get and reserve.
  KVD_ASSIGN_OR_RETURN(ref.generation, server_->shm()->Generation(ref.segment));
  auto sent = shm_sent_.find(ref.segment);
  if (sent != shm_sent_.end() && sent->second == ref.generation) return ref;
  KVD_ASSIGN_OR_RETURN(ShmArena::SegmentFd seg,
                       server_->shm()->DupSegment(ref.segment, read_only_));
  ref.generation = seg.generation;
  ref.fd = seg.fd;
  return ref;
}

void Session::SetShmSlot(const ShmRef& ref, proto::ShmSlot::Builder slot) {
  slot.setSegment(ref.segment);
  slot.setOffset(ref.offset);
  slot.setGeneration(ref.generation);
  slot.setFdAttached(ref.fd >= 0);
}

void Session::CompleteShm(uint64_t seq, Frame frame, const ShmRef& ref) {
  if (ref.fd < 0) return Complete(seq, std::move(frame));
  shm_sent_[ref.segment] = ref.generation;
  CompleteWithFd(seq, std::move(frame), ref.fd);
}

void Session::HandleReleaseRead(uint64_t seq, uint64_t rid, proto::ReleaseRead::Reader release) {
  const uint64_t read = release.getReadId();
  if (Status s = RequireEngine("ReleaseRead"); !s.ok()) return CompleteError(seq, rid, s);
  if (shm_reads_.erase(read) == 0) {
    return CompleteError(seq, rid,
                         Status::NotFound("read " + std::to_string(read) +
                                          " is not an open shared-memory read of this connection"));
  }
  Status s = server_->host_tier()->ReleaseRead(read);
  if (!s.ok()) return CompleteError(seq, rid, s);
  Complete(seq, MakeAck(rid));
}

void Session::ReleaseReadsOf(capnp::List<uint64_t>::Reader reads) {
  // Only this connection's open shared-memory reads; an id already ended (read TTL) or never
  // ours is skipped: this carries no reply to say so, and ending it again cannot matter.
  for (uint64_t read : reads) {
    if (shm_reads_.erase(read) == 0) continue;
    server_->host_tier()->ReleaseRead(read).IgnoreError();
  }
}

StatusOr<Session::ShmRef> Session::HoldShmSlot(uint64_t id, uint64_t offset, PendingPut put) {
  auto ref = PrepareShm(offset);
  if (!ref.ok()) {
    server_->host_tier()->Abort(id).IgnoreError();
    return ref.status();
  }
  put.written_in_place = true;
  puts_.File(id, std::move(put));
  return ref;
}

}  // namespace kvd::daemon
