#include "get_request.h"

#include <string>

namespace kvd::daemon {

std::string ChunkName(const GetAsk& ask) {
  return "chunk " + std::to_string(ask.index) + " of lease " + std::to_string(ask.lease);
}

Status CheckGetOf(const GetAsk& ask, const storage::ChunkMeta& meta) {
  const bool compact = meta.key.codec_id != storage::kRawCodecId;
  if ((ask.form == proto::ChunkForm::RAW && compact) ||
      (ask.form == proto::ChunkForm::COMPACT && !compact)) {
    return Status::FailedPrecondition(
        ChunkName(ask) + " is stored " +
        (compact ? "compact (codec " + std::to_string(meta.key.codec_id) +
                       "); the daemon does not expand chunks: get it as stored and expand "
                       "it with the client library (kvd/client/expand.h)"
                 : std::string("raw (codec 0): it has no compact form")));
  }
  if (ask.form != proto::ChunkForm::AS_STORED && ask.form != proto::ChunkForm::RAW &&
      ask.form != proto::ChunkForm::COMPACT) {
    return Status::InvalidArgument("unknown chunk form " +
                                   std::to_string(static_cast<int>(ask.form)));
  }
  if (ask.buffer_bytes < meta.size_bytes) {
    return Status::OutOfRange(ChunkName(ask) + " is " + std::to_string(meta.size_bytes) +
                              " bytes; the client's buffer holds " +
                              std::to_string(ask.buffer_bytes));
  }
  return Status::Ok();
}

proto::ChunkForm StoredForm(uint32_t codec_id) {
  return codec_id == storage::kRawCodecId ? proto::ChunkForm::RAW : proto::ChunkForm::COMPACT;
}

void SetChunkOf(const storage::ChunkMeta& meta, proto::GetReply::Builder reply) {
  reply.setBytes(meta.size_bytes);
  reply.setChecksum(meta.checksum);
  reply.setTokens(meta.tokens);
  reply.setCodecId(meta.key.codec_id);
  reply.setForm(StoredForm(meta.key.codec_id));
}

}  // namespace kvd::daemon
