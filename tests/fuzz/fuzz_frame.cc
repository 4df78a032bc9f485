// Fuzz target: the frame codec (proto/frame.h) over a byte stream, as the daemon's read loop and
// the client consume it: a 12-byte header, a payload of the announced length, the Cap'n Proto
// reader over that payload, then the next frame. A bad header ends the stream (it cannot be
// resynchronised); a stream that ends inside a frame is a truncated frame.
//
// Invariants: an accepted header re-encodes to the same 12 bytes and announces a positive
// multiple of 8 within the limit; a refused one says why with INVALID_ARGUMENT or OUT_OF_RANGE.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_check.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"

namespace {

// The daemon's default limit (limits.max_frame_bytes) and the smallest one it accepts.
constexpr uint32_t kLimits[2] = {kvd::proto::kDefaultMaxFrameBytes, 4096};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint32_t max_frame = kLimits[data[0] & 1];
  std::span<const uint8_t> stream(data + 1, size - 1);
  while (!stream.empty()) {
    auto length = kvd::proto::ParseFrameHeader(stream, max_frame);
    if (!length.ok()) {
      const auto code = length.status().code();
      KVD_FUZZ_CHECK(
          code == kvd::StatusCode::kInvalidArgument || code == kvd::StatusCode::kOutOfRange, "%s",
          length.status().ToString().c_str());
      KVD_FUZZ_CHECK(!length.status().message().empty(), "refusal without a message");
      return 0;
    }
    KVD_FUZZ_CHECK(*length > 0 && *length % 8 == 0 && *length <= max_frame, "length %u", *length);
    uint8_t again[kvd::proto::kFrameHeaderBytes];
    kvd::proto::EncodeFrameHeader(*length, again);
    for (size_t i = 0; i < kvd::proto::kFrameHeaderBytes; ++i) {
      KVD_FUZZ_CHECK(again[i] == stream[i], "header byte %zu re-encodes differently", i);
    }
    stream = stream.subspan(kvd::proto::kFrameHeaderBytes);
    if (stream.size() < *length) return 0;  // the connection ended inside the frame
    auto message = kvd::proto::DecodePayload(stream.first(*length));
    stream = stream.subspan(*length);
    if (!message.ok()) {
      KVD_FUZZ_CHECK(message.status().code() == kvd::StatusCode::kInvalidArgument, "%s",
                     message.status().ToString().c_str());
      continue;  // the daemon answers with an error and reads the next frame
    }
    kvd::Status status = kvd::proto::TryDecode([&]() -> kvd::Status {
      auto request = (*message)->Root<kvd::proto::Request>();
      (void)request.getRequestId();
      (void)request.which();
      return kvd::Status::Ok();
    });
    if (!status.ok()) {
      KVD_FUZZ_CHECK(status.code() == kvd::StatusCode::kInvalidArgument, "%s",
                     status.ToString().c_str());
    }
  }
  return 0;
}
