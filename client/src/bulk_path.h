// The seam every chunk's bytes cross between this client and kvd. One BulkPath per way they can
// move: UcxPath (the client's transport, transfer_path.h), NcclPath (kvd's NCCL link, from and
// into CUDA device memory, nccl_path.h) and ShmPath (the shared-memory arena, shm_path.h).
// ClientImpl picks the path of each item (PutChunks, GetChunks) and hands each path whole
// windows of items; a path sends the window's messages and moves its bytes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/client/client.h"

namespace kvd::client::internal {

// Thread safety: none of its own; every call runs under the owning ClientImpl's mutex.
class BulkPath {
 public:
  virtual ~BulkPath() = default;

  // Puts one window (at most ClientOptions::max_in_flight items, already checked and staged by
  // PutChunks): reserves every chunk, moves its bytes, commits them with their checksums.
  // Returns the results in item order. Errors: the first failure (channel, daemon or
  // transfer); reservations not yet committed are aborted where the channel still works.
  virtual StatusOr<std::vector<PutResult>> PutWindow(std::span<const PutItem> items) = 0;

  // Gets one window of lease `lease_id`'s chunks into the items' buffers, each one's bytes
  // checked against the checksum kvd sent (VerifyGet). Returns the results in item order.
  // Errors: INVALID_ARGUMENT for a null buffer with a capacity; the first failure otherwise
  // (DATA_LOSS for bytes that do not match).
  virtual StatusOr<std::vector<GetResult>> GetWindow(uint64_t lease_id,
                                                     std::span<const GetItem> items) = 0;
};

}  // namespace kvd::client::internal
