// Client: one-exchange puts of small chunks (ClientOptions::inline_put_bytes, the InlinePut
// message): the chunk's bytes travel inside the control frame, and kvd reserves, copies,
// verifies and commits them before its one reply.
#include <algorithm>
#include <cstring>
#include <string>

#include "client_impl.h"
#include "kvd/client/device.h"
#include "kvd/common/hash.h"
#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"

namespace kvd::client::internal {
namespace {

// Frame header, Cap'n Proto segment table and the InlinePut's own fields, rounded up: a put
// whose bytes plus this exceed the daemon's frame limit takes the three steps.
constexpr size_t kInlineFrameOverhead = 1024;

}  // namespace

bool ClientImpl::InlineEligible(const PutItem& it) const {
  const size_t bytes = PutBytes(it);
  const size_t limit = session_.shared_memory
                           ? std::min(options_.inline_put_bytes, options_.shm_inline_put_bytes)
                           : options_.inline_put_bytes;
  return limit > 0 && session_.inline_put && bytes <= limit && !hooks_.before_commit &&
         bytes + kInlineFrameOverhead <= static_cast<size_t>(session_.max_frame_bytes);
}

StatusOr<uint64_t> ClientImpl::SendInlinePutLocked(const PutItem& it) {
  const size_t qbytes = it.window_queries.size() * sizeof(float);
  const void* data = it.data;
  const void* queries = it.window_queries.data();
  if (IsDevice(data) || IsDevice(queries)) {
    // The frame is built in host memory: device bytes come over once, on the caller's stream.
    inline_staging_.resize(it.bytes + qbytes);
    KVD_RETURN_IF_ERROR(
        CopyToHostFrom(inline_staging_.data(), it.data, it.bytes, it.cuda_stream, "put data"));
    KVD_RETURN_IF_ERROR(CopyToHostFrom(inline_staging_.data() + it.bytes, queries, qbytes,
                                       it.cuda_stream, "put window queries"));
    data = inline_staging_.data();
    queries = inline_staging_.data() + it.bytes;
  }
  return channel_->Send([&](proto::Request::Builder r) {
    auto put = r.initInlinePut();
    proto::ToProto(it.hash, put.initChunkHash());
    put.setTokens(static_cast<uint32_t>(it.tokens));
    put.setFirstPosition(it.first_position);
    put.setWindowTokens(static_cast<uint32_t>(it.window));
    auto bytes = put.initData(static_cast<unsigned>(it.bytes + qbytes));
    if (it.bytes > 0) std::memcpy(bytes.begin(), data, it.bytes);
    if (qbytes > 0) std::memcpy(bytes.begin() + it.bytes, queries, qbytes);
    put.setChecksum(Checksum64(bytes.begin(), bytes.size()) ^ hooks_.corrupt_checksum);
  });
}

Status ClientImpl::AwaitInlinePutLocked(uint64_t request_id, const PutItem& it, PutResult* out) {
  auto reply = channel_->Await(request_id);
  if (!reply.ok()) return reply.status().WithContext("inline put");
  return proto::TryDecode([&]() -> Status {
    auto r = (*reply)->Root<proto::Response>();
    if (!r.isCommit()) {
      return Status::Internal(
          "kvd answered an inline put with an unexpected message (expected commit)");
    }
    auto c = r.getCommit();
    out->bytes = PutBytes(it);
    out->already_stored = c.getAlreadyStored();
    out->stored_bytes = c.getStoredBytes();
    out->codec_id = c.getCodecId();
    return Status::Ok();
  });
}

}  // namespace kvd::client::internal
