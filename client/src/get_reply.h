// A Get reply, read and checked the same way by every path that gets a chunk (the transport,
// shared memory, ReadInPlace).
#pragma once

#include <cstdint>

#include "arena_slot.h"
#include "kvd/client/client.h"
#include "kvd/proto/frame.h"

namespace kvd::client::internal {

// What kvd answered to one Get.
struct GetReply {
  GetResult result;
  // Shared memory: nonzero is a read to end, even when the reply is refused afterwards.
  uint64_t read_id = 0;
  uint32_t read_ttl_ms = 0;
  // Shared memory: the pinned slot holding the chunk (has_slot false: none named).
  bool has_slot = false;
  ArenaSlot slot;
};

// Decodes `reply` (an answer the channel did not turn into an error) into `out`. INTERNAL for
// another message than a Get reply or one that does not decode.
Status ReadGetReply(proto::DecodedMessage& reply, GetReply* out);

// DATA_LOSS, prefixed by `what` ("get", "ReadInPlace"), unless `checksum` (of the bytes this
// client holds) is the one kvd sent for chunk `chunk_index` of lease `lease_id`.
Status VerifyGet(const char* what, const GetResult& got, uint64_t checksum, uint64_t lease_id,
                 uint32_t chunk_index);

}  // namespace kvd::client::internal
