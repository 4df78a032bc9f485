#include "kvd/proto/frame.h"

#include <cstring>
#include <string>

namespace kvd::proto {
namespace {
uint32_t LoadU32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
uint16_t LoadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
void StoreU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
}  // namespace

void EncodeFrameHeader(uint32_t payload_bytes, uint8_t out[kFrameHeaderBytes]) {
  StoreU32(out, kFrameMagic);
  out[4] = kFrameVersion & 0xff;
  out[5] = kFrameVersion >> 8;
  out[6] = 0;
  out[7] = 0;
  StoreU32(out + 8, payload_bytes);
}

StatusOr<uint32_t> ParseFrameHeader(std::span<const uint8_t> h, uint32_t max_frame_bytes) {
  if (h.size() < kFrameHeaderBytes) {
    return Status::InvalidArgument("truncated frame header: " + std::to_string(h.size()) + " of " +
                                   std::to_string(kFrameHeaderBytes) + " bytes");
  }
  uint32_t magic = LoadU32(h.data());
  if (magic != kFrameMagic) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "bad frame magic 0x%08x (expected 0x%08x)", magic, kFrameMagic);
    return Status::InvalidArgument(buf);
  }
  uint16_t version = LoadU16(h.data() + 4);
  if (version != kFrameVersion) {
    return Status::InvalidArgument("unsupported frame version " + std::to_string(version) +
                                   " (this daemon speaks " + std::to_string(kFrameVersion) + ")");
  }
  if (LoadU16(h.data() + 6) != 0) return Status::InvalidArgument("non-zero reserved frame flags");
  uint32_t length = LoadU32(h.data() + 8);
  if (length > max_frame_bytes) {
    return Status::OutOfRange("frame of " + std::to_string(length) +
                              " bytes exceeds the limit of " + std::to_string(max_frame_bytes) +
                              " bytes");
  }
  if (length == 0 || length % sizeof(capnp::word) != 0) {
    return Status::InvalidArgument("frame length " + std::to_string(length) +
                                   " is not a positive multiple of 8");
  }
  return length;
}

std::vector<uint8_t> EncodeFrame(capnp::MessageBuilder& message) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  std::vector<uint8_t> out(kFrameHeaderBytes + bytes.size());
  EncodeFrameHeader(static_cast<uint32_t>(bytes.size()), out.data());
  std::memcpy(out.data() + kFrameHeaderBytes, bytes.begin(), bytes.size());
  return out;
}

StatusOr<std::unique_ptr<DecodedMessage>> DecodePayload(std::span<const uint8_t> payload) {
  if (payload.empty() || payload.size() % sizeof(capnp::word) != 0) {
    return Status::InvalidArgument("malformed frame: payload of " + std::to_string(payload.size()) +
                                   " bytes is not a positive multiple of 8");
  }
  auto msg = std::make_unique<DecodedMessage>();
  msg->words_ = kj::heapArray<capnp::word>(payload.size() / sizeof(capnp::word));
  std::memcpy(msg->words_.begin(), payload.data(), payload.size());
  capnp::ReaderOptions options;
  options.traversalLimitInWords = payload.size() / sizeof(capnp::word) * 4 + 1024;
  options.nestingLimit = 16;
  Status status;
  KJ_IF_MAYBE (e, kj::runCatchingExceptions([&]() {
                 msg->reader_ =
                     std::make_unique<capnp::FlatArrayMessageReader>(msg->words_.asPtr(), options);
               })) {
    return Status::InvalidArgument(std::string("malformed frame: ") + e->getDescription().cStr());
  }
  return msg;
}

}  // namespace kvd::proto
