// The checks of a Get against the chunk its lease pins, and the chunk's part of a GetReply.
// Private to daemon/; pure, testable without a daemon (daemon_session_test).
#pragma once

#include <cstdint>
#include <string>

#include "kvd/common/status.h"
#include "kvd/proto/kvd.capnp.h"
#include "kvd/storage/chunk.h"

namespace kvd::daemon {

// What a Get asks of the chunk it names.
struct GetAsk {
  uint64_t lease = 0;
  uint32_t index = 0;  // the chunk's index in the lease
  proto::ChunkForm form = proto::ChunkForm::AS_STORED;
  uint64_t buffer_bytes = 0;  // what the client's buffer holds
};

// "chunk <index> of lease <lease>", as errors about it name it.
std::string ChunkName(const GetAsk& ask);

// OK when the chunk `meta` can go out as `ask` asks. FAILED_PRECONDITION: RAW asked of a compact
// chunk (the daemon does not expand chunks) or COMPACT of a raw one; INVALID_ARGUMENT: a form this
// daemon does not know; OUT_OF_RANGE: the chunk is larger than the client's buffer. Checked in
// that order.
Status CheckGetOf(const GetAsk& ask, const storage::ChunkMeta& meta);

// The form a chunk stored with `codec_id` goes out in: RAW for the raw codec, else COMPACT.
proto::ChunkForm StoredForm(uint32_t codec_id);

// Sets the chunk's fields of a GetReply: bytes, checksum, tokens, codec id and form.
void SetChunkOf(const storage::ChunkMeta& meta, proto::GetReply::Builder reply);

}  // namespace kvd::daemon
