// Reading and checking a Get reply (get_reply.h).
#include "get_reply.h"

#include <string>

#include "client_impl.h"

namespace kvd::client::internal {

Status ReadGetReply(proto::DecodedMessage& reply, GetReply* out) {
  return ReadReply(reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isGet()) return WrongReply("get");
    auto g = r.getGet();
    out->result.bytes = g.getBytes();
    out->result.checksum = g.getChecksum();
    out->result.tokens = g.getTokens();
    out->result.codec_id = g.getCodecId();
    out->result.form =
        g.getForm() == proto::ChunkForm::COMPACT ? ChunkForm::kCompact : ChunkForm::kRaw;
    out->read_id = g.getReadId();
    out->read_ttl_ms = g.getReadTtlMs();
    out->has_slot = g.hasShm();
    if (out->has_slot) out->slot = ReadArenaSlot(g.getShm());
    return Status::Ok();
  });
}

Status VerifyGet(const char* what, const GetResult& got, uint64_t checksum, uint64_t lease_id,
                 uint32_t chunk_index) {
  if (checksum == got.checksum) return Status::Ok();
  return Status::DataLoss(std::string(what) + ": checksum mismatch on chunk " +
                          std::to_string(chunk_index) + " of lease " + std::to_string(lease_id));
}

}  // namespace kvd::client::internal
