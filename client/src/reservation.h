// What kvd answers to the Reserve and Commit of a put window, as the bulk paths use it.
#pragma once

#include <cstdint>

#include "arena_slot.h"
#include "connection.h"  // Deadline

namespace kvd::client::internal {

// What kvd answered to one Reserve.
struct Reservation {
  uint64_t id = 0;
  uint64_t tag = 0;  // over a transport: the tag of the bulk transfer
  // Shared-memory path: the arena slot the bytes go to (has_slot false: none offered).
  bool has_slot = false;
  ArenaSlot slot;
};

// A slot kvd reserved ahead for this client's next put (ClientOptions::reserve_ahead; kvd.capnp,
// Commit). Reservation 0: none.
struct HeldSlot {
  uint64_t reservation = 0;
  uint64_t bytes = 0;
  ArenaSlot slot;     // held: mapped already (fd_attached false)
  Deadline use_by{};  // used only before this: half of the reservation TTL
  // The slot as a Reserve's answer.
  Reservation AsReservation() const {
    return Reservation{.id = reservation, .has_slot = true, .slot = slot};
  }
};

// A slot kvd reserved ahead with a commit (CommitReply.next), not mapped yet.
struct OfferedSlot {
  uint64_t request_id = 0;  // the commit whose reply named it (and carried its memfd)
  HeldSlot slot;            // reservation 0: none offered; bytes: not filled
};

// The extra fields of a window's Reserve messages.
struct ReserveExtras {
  bool over_nccl = false;    // Reserve.overNccl: the bytes come over kvd's NCCL link
  uint64_t abort_first = 0;  // Reserve.abortFirst of the first one: a held slot to abort
};

}  // namespace kvd::client::internal
