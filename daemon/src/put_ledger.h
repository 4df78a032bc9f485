// The puts of one session between their reservation and their end. Private to daemon/.
//
// A put is filed once its host-tier reservation exists (Reserve, InlinePut, a slot held ahead
// by a Commit's reserveNext) and ends exactly once, by EndPut, whatever ends it: its commit, a
// failure, its client's Abort, expiry, a refused commit of a held slot, Reserve.abortFirst or
// the session's end. Ending a put forgets it (and its expected transfer), frees its device
// staging once no transfer writes there, gives its space back to the host tier when the tier
// still holds it, and retires its id with the reason a later Commit or Abort of it gets.
//
// Threading: io_context thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "bulk_link.h"
#include "kvd/common/status.h"
#include "kvd/storage/host_tier.h"
#include "kvd/transport/types.h"

namespace kvd::daemon {

// Who holds each open reservation id of the host tier, and why a retired one ended (bounded
// memory), so that a Commit from another connection, or a late one, gets a precise error.
// Implemented by Server::Impl for all sessions.
class ReservationBook {
 public:
  virtual ~ReservationBook() = default;
  virtual void RegisterReservation(uint64_t id, uint64_t session_id) = 0;
  // Forgets an open reservation and remembers why it ended.
  virtual void RetireReservation(uint64_t id, Status why) = 0;
  // The session holding `id` (0 if none) and, if retired, why.
  virtual uint64_t ReservationOwner(uint64_t id) const = 0;
  virtual std::optional<Status> RetiredReason(uint64_t id) const = 0;
};

struct PendingPut {
  transport::TransferHandle recv;  // invalid for a shared-memory put (the client copies)
  uint64_t tag = 0;
  uint64_t bytes = 0;
  int64_t deadline_ns = 0;
  bool busy = false;  // a Commit, Abort or expiry owns it
  // The client wrote the bytes into the slot itself (shared memory) and checksummed them in
  // the same pass: its Commit is verified only with tiers.host.verify_shm_commits.
  bool written_in_place = false;
  // Set for a model with a compression policy: the put is compressed on Commit.
  std::shared_ptr<void> ticket;  // ChunkCodec admission, held until the put ends
  std::byte* data = nullptr;     // the reservation's bytes
  storage::ChunkKey key;         // as reserved (codec id at Reserve time)
  uint32_t tokens = 0;
  uint64_t first_position = 0;
  uint32_t window = 0;
  // The link `recv` is on. kNccl (Reserve.overNccl): into `staging` (device memory of the link,
  // freed once the receive ended), copied into `data` before the commit.
  BulkLink link = BulkLink::kTransport;
  void* staging = nullptr;
  // Reserved ahead by a Commit's reserveNext (HelloReply.reserveAhead): no chunk yet; `key`
  // holds the session's namespace/model/codec with no hash, `tokens` 0, until the Commit that
  // fills it names the chunk.
  bool ahead = false;
};

// How a put ended.
enum class PutEnd {
  kCommitted,        // stored or deduplicated; a late Commit gets FAILED_PRECONDITION
  kTransferFailed,   // its bytes did not arrive whole (timeout, transport error, short)
  kCommitFailed,     // the commit (checksum, compression, store) failed; the tier ended it
  kAbortedByClient,  // Abort
  kExpired,          // not committed within limits.reservation_ttl_ms
  kCommitRefused,    // a held slot's Commit was refused: the slot goes
  kAbortFirst,       // a held slot aborted by Reserve.abortFirst
  kReclaimed,        // the session ended; its reservations go back at once (ReclaimOwner)
};

struct PutOutcome {
  PutEnd end;
  Status cause{};  // kTransferFailed, kCommitFailed, kCommitRefused: why
  // False when a transfer may still write the put's bytes (its cancel did not end it): the
  // space and the staging stay reserved, never reused while the transport may write there.
  bool transfer_ended = true;
};

class PutLedger {
 public:
  struct Deps {
    uint64_t owner = 0;  // the session id, as the host tier and the book know it
    ReservationBook* book = nullptr;
    storage::HostTier* host = nullptr;
    int64_t reservation_ttl_ms = 0;  // limits.reservation_ttl_ms, for the expiry reason
    // `delta` transfers more (or fewer) are due on `link` (ProgressLoop::ExpectTransfers).
    std::function<void(BulkLink link, int64_t delta)> expect_transfers;
    // Gives a staging buffer back to the NCCL link (nullptr: nothing).
    std::function<void(void* staging)> free_staging;
  };
  explicit PutLedger(Deps deps) : deps_(std::move(deps)) {}

  // Files `put` under reservation `id` and registers the id as the owner's. With `put.recv`
  // valid its bytes are due: one more expected transfer.
  void File(uint64_t id, PendingPut put);
  // The put of `id`, or null.
  PendingPut* Find(uint64_t id);
  // The put of `id` for a Commit or Abort, if no other request owns it. Errors: INVALID_ARGUMENT
  // (id 0), the retired reason of an id that ended, NOT_FOUND (another connection's, unknown),
  // FAILED_PRECONDITION (a Commit, Abort or expiry is working on it).
  StatusOr<PendingPut*> FindIdle(uint64_t id);
  // Error for a Commit/Abort of a reservation this session does not hold.
  Status Unknown(uint64_t id) const;
  // Marks busy the idle puts whose deadline (Clock ns) passed and returns their ids.
  std::vector<uint64_t> ClaimExpired(int64_t now_ns);
  // Ends the put of `id` as described at the top (a no-op for an id not filed).
  void EndPut(uint64_t id, const PutOutcome& outcome);

  bool empty() const { return puts_.empty(); }
  size_t size() const { return puts_.size(); }
  const std::map<uint64_t, PendingPut>& puts() const { return puts_; }

 private:
  // The reason a retired id answers for `outcome`.
  Status RetiredReason(uint64_t id, const PutOutcome& outcome) const;

  Deps deps_;
  std::map<uint64_t, PendingPut> puts_;  // by reservation id
};

}  // namespace kvd::daemon
