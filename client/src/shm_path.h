// The bulk path through kvd's shared-memory arena (ClientOptions::shared_memory, a session on
// kvd's node): a put copies its chunk straight into the arena slot its Reserve names, a get
// copies (and checksums) the chunk out of the pinned slot its Get reply names. No transport.
#pragma once

#include "bulk_path.h"
#include "get_reply.h"
#include "reservation.h"

namespace kvd::client::internal {

class PathContext;

class ShmPath final : public BulkPath {
 public:
  // `reserve_ahead`: ClientOptions::reserve_ahead, offered by kvd (HelloReply.reserveAhead),
  // on a session that may put.
  ShmPath(PathContext& client, bool reserve_ahead)
      : client_(client), reserve_ahead_(reserve_ahead) {}

  // Reserve-ahead: the window's last commit asks kvd to hold a slot of the last chunk's size
  // for the next put; the next window's first chunk goes into it when it fits (same size, half
  // its TTL left), with no Reserve. A held slot it does not fit is aborted with the first
  // Reserve.
  StatusOr<std::vector<PutResult>> PutWindow(std::span<const PutItem> items) override;
  // The reads the replies opened end with the next request (or ReleaseRead exchanges for a
  // daemon that does not take them) once the bytes are copied.
  StatusOr<std::vector<GetResult>> GetWindow(uint64_t lease_id,
                                             std::span<const GetItem> items) override;

 private:
  // Maps the slot of reservation `rv` (answer to `request_id`) and, when `copy`, copies `item`
  // into it and takes its checksum into `*checksum`. Errors: INTERNAL for a reservation without
  // a slot or one outside what is mapped; the copy's.
  Status FillSlot(uint64_t request_id, const Reservation& rv, const PutItem& item, bool copy,
                  uint64_t* checksum);
  // Maps a slot kvd held ahead (its memfd came with the commit's reply) and keeps it in held_,
  // aborting the one held before; aborts it instead when it cannot be mapped.
  void Keep(const OfferedSlot& offered, uint64_t bytes);
  // Copies the chunk of the reply to Get `request_id` (`got`) into `item`'s buffer, checking
  // its bytes (VerifyGet).
  Status CopyOut(uint64_t request_id, uint64_t lease_id, const GetItem& item, const GetReply& got);
  // Ends the reads a get window opened (see GetWindow).
  Status EndReads(const std::vector<uint64_t>& reads);

  PathContext& client_;
  const bool reserve_ahead_;
  HeldSlot held_;  // a slot kvd holds for the next put (reservation 0: none)
};

}  // namespace kvd::client::internal
