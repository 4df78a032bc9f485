// A slot of kvd's shared-memory arena as its replies name it (ShmSlot, kvd.capnp): in a Reserve
// reply (where a put writes), a Get reply (where a chunk lies) and a Commit reply's slot held
// ahead.
#pragma once

#include <cstdint>

#include "kvd/proto/kvd.capnp.h"

namespace kvd::client::internal {

struct ArenaSlot {
  uint32_t segment = 0;
  uint64_t offset = 0, generation = 0;
  bool fd_attached = false;  // the segment's memfd came with the reply (to map first)
};

inline ArenaSlot ReadArenaSlot(proto::ShmSlot::Reader shm) {
  return ArenaSlot{.segment = shm.getSegment(),
                   .offset = shm.getOffset(),
                   .generation = shm.getGeneration(),
                   .fd_attached = shm.getFdAttached()};
}

}  // namespace kvd::client::internal
