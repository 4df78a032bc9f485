// The put ledger of a session.
#include "put_ledger.h"

#include <string>

namespace kvd::daemon {

void PutLedger::File(uint64_t id, PendingPut put) {
  if (put.recv.valid()) deps_.expect_transfers(put.link, 1);  // keep polling the transport
  puts_[id] = std::move(put);
  deps_.book->RegisterReservation(id, deps_.owner);
}

PendingPut* PutLedger::Find(uint64_t id) {
  auto it = puts_.find(id);
  return it == puts_.end() ? nullptr : &it->second;
}

StatusOr<PendingPut*> PutLedger::FindIdle(uint64_t id) {
  PendingPut* put = Find(id);
  if (put == nullptr) return Unknown(id);
  if (put->busy) {
    return Status::FailedPrecondition("reservation " + std::to_string(id) +
                                      " is already being committed or aborted");
  }
  return put;
}

Status PutLedger::Unknown(uint64_t id) const {
  if (id == 0) return Status::InvalidArgument("reservation id 0 (none)");
  if (auto reason = deps_.book->RetiredReason(id)) return *reason;
  if (uint64_t owner = deps_.book->ReservationOwner(id); owner != 0) {
    return Status::NotFound("reservation " + std::to_string(id) + " belongs to another connection");
  }
  return Status::NotFound("unknown reservation " + std::to_string(id));
}

std::vector<uint64_t> PutLedger::ClaimExpired(int64_t now_ns) {
  std::vector<uint64_t> expired;
  for (auto& [id, put] : puts_) {
    if (!put.busy && put.deadline_ns < now_ns) {
      put.busy = true;
      expired.push_back(id);
    }
  }
  return expired;
}

void PutLedger::EndPut(uint64_t id, const PutOutcome& outcome) {
  auto it = puts_.find(id);
  if (it == puts_.end()) return;
  if (outcome.transfer_ended) deps_.free_staging(it->second.staging);
  if (it->second.recv.valid()) deps_.expect_transfers(it->second.link, -1);
  puts_.erase(it);
  // The tier still holds the space of a put that neither committed nor failed in the tier, but
  // for the session's end (ReclaimOwner returns it) and a transfer that may still write there.
  const bool tier_holds = outcome.end != PutEnd::kCommitted &&
                          outcome.end != PutEnd::kCommitFailed &&
                          outcome.end != PutEnd::kReclaimed;
  if (tier_holds && outcome.transfer_ended) deps_.host->Abort(id).IgnoreError();
  deps_.book->RetireReservation(id, RetiredReason(id, outcome));
}

Status PutLedger::RetiredReason(uint64_t id, const PutOutcome& outcome) const {
  const std::string name = "reservation " + std::to_string(id);
  switch (outcome.end) {
    case PutEnd::kCommitted:
      return Status::FailedPrecondition(name + " is already committed");
    case PutEnd::kTransferFailed:
    case PutEnd::kCommitFailed:
      return Status::Aborted(name + " failed: " + outcome.cause.ToString());
    case PutEnd::kAbortedByClient:
      return Status::Aborted(name + " was aborted by its client");
    case PutEnd::kExpired:
      return Status::Aborted(name + " expired: not committed within " +
                             std::to_string(deps_.reservation_ttl_ms) + " ms");
    case PutEnd::kCommitRefused:
      return Status::Aborted(name + " was aborted: its commit was refused: " +
                             outcome.cause.ToString());
    case PutEnd::kAbortFirst:
      return Status::Aborted(name + " was aborted by its client (Reserve.abortFirst)");
    case PutEnd::kReclaimed:
      return Status::Aborted(name + " was reclaimed: its client disconnected");
  }
  return Status::Aborted(name + " ended");
}

}  // namespace kvd::daemon
