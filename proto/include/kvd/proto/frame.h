// Length-prefixed frames that carry Cap'n Proto control messages (see docs/wire-format.md).
//
//   offset 0  u32 LE magic   0x4644564B ("KVDF")
//   offset 4  u16 LE version 1
//   offset 6  u16 LE flags   0 (reserved; non-zero is rejected)
//   offset 8  u32 LE length  payload bytes, a multiple of 8 (Cap'n Proto words), <= the limit
//   offset 12 payload        a Cap'n Proto flat message (kvd::proto::Request or Response)
//
// Pure byte functions: no I/O here, so the daemon (Boost.Asio) and the client (blocking sockets)
// share them and tests can feed them arbitrary bytes. Thread-safe (no shared state).
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::proto {

inline constexpr uint32_t kFrameMagic = 0x4644564B;  // "KVDF" little-endian
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 12;
// Default limit on a frame's payload. Control messages are small; bulk bytes never travel here.
inline constexpr uint32_t kDefaultMaxFrameBytes = 4u << 20;

// Writes the 12-byte header for a payload of `payload_bytes`.
void EncodeFrameHeader(uint32_t payload_bytes, uint8_t out[kFrameHeaderBytes]);

// Validates a header and returns the payload length.
// Errors: INVALID_ARGUMENT (bad magic, version or flags, length not a multiple of 8 or zero),
// OUT_OF_RANGE (length over `max_frame_bytes`; the message names both numbers).
StatusOr<uint32_t> ParseFrameHeader(std::span<const uint8_t> header, uint32_t max_frame_bytes);

// Serialises a message into header + payload, ready to write.
std::vector<uint8_t> EncodeFrame(capnp::MessageBuilder& message);

// A decoded payload; owns its (word-aligned) bytes.
class DecodedMessage {
 public:
  template <typename T>
  typename T::Reader Root() {
    return reader_->getRoot<T>();
  }

 private:
  friend StatusOr<std::unique_ptr<DecodedMessage>> DecodePayload(std::span<const uint8_t>);
  kj::Array<capnp::word> words_;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
};

// Parses a payload (the bytes after the header). Errors: INVALID_ARGUMENT "malformed frame: ..."
// for anything Cap'n Proto rejects (truncated segment table, out-of-bounds pointer, ...).
// Reading fields of the result may still throw kj::Exception on a hostile message: callers
// decode inside TryDecode() below.
StatusOr<std::unique_ptr<DecodedMessage>> DecodePayload(std::span<const uint8_t> payload);

// Runs `fn` and converts any kj::Exception (a malformed message discovered while reading
// fields) into INVALID_ARGUMENT "malformed frame: ...". `fn` returns Status.
template <typename Fn>
Status TryDecode(Fn&& fn) {
  Status result;
  KJ_IF_MAYBE (e, kj::runCatchingExceptions([&]() { result = fn(); })) {
    return Status::InvalidArgument(std::string("malformed frame: ") + e->getDescription().cStr());
  }
  return result;
}

}  // namespace kvd::proto
