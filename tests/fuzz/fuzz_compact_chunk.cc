// Fuzz target: the compact-chunk decoder (kernels/compact_chunk.h, docs/chunk-format.md).
//
// Each input is decoded twice: as given (size, magic, version and checksum checks), and with its
// framing repaired (the header's total size, at its place in format version 1 or 2, set to the
// input's size and the xxh3-64 trailer recomputed), so that mutations reach the structural checks
// behind the checksum, which only a buggy or hostile writer could reach.
//
// Invariants: a refusal is DATA_LOSS or INVALID_ARGUMENT; a decoded chunk passes Validate(),
// re-encodes, and decodes back to an equal chunk; encoding is deterministic.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fuzz_check.h"
#include "kvd/common/hash.h"
#include "kvd/kernels/compact_chunk.h"

namespace {

using kvd::StatusCode;
using kvd::kernels::CompactChunk;

// Where the header keeps the chunk's total size, and the smallest chunk, per format version (the
// decoder reads versions 1 and 2).
struct Framing {
  size_t size_offset;
  size_t min_bytes;  // header + trailer
};
constexpr Framing kV1{64, 136};
constexpr Framing kV2{72, 88};

void Check(std::span<const uint8_t> bytes) {
  auto chunk = kvd::kernels::DecodeCompactChunk(bytes);
  if (!chunk.ok()) {
    const StatusCode code = chunk.status().code();
    KVD_FUZZ_CHECK(code == StatusCode::kDataLoss || code == StatusCode::kInvalidArgument, "%s",
                   chunk.status().ToString().c_str());
    return;
  }
  kvd::Status valid = chunk->Validate();
  KVD_FUZZ_CHECK(valid.ok(), "decoded chunk fails Validate: %s", valid.ToString().c_str());
  auto encoded = kvd::kernels::EncodeCompactChunk(*chunk);
  KVD_FUZZ_CHECK(encoded.ok(), "decoded chunk does not encode: %s",
                 encoded.status().ToString().c_str());
  auto back = kvd::kernels::DecodeCompactChunk(*encoded);
  KVD_FUZZ_CHECK(back.ok(), "re-encoded chunk does not decode: %s",
                 back.status().ToString().c_str());
  KVD_FUZZ_CHECK(*back == *chunk, "decode(encode(chunk)) != chunk");
  KVD_FUZZ_CHECK(back->HalfPairs() == chunk->HalfPairs(), "half pairs differ");
  auto again = kvd::kernels::EncodeCompactChunk(*back);
  KVD_FUZZ_CHECK(again.ok() && *again == *encoded, "encoding is not deterministic");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Check(std::span(data, size));
  if (size < 6) return 0;
  uint16_t version;
  std::memcpy(&version, data + 4, sizeof version);
  const Framing f = version == 1 ? kV1 : kV2;
  if (size < f.min_bytes) return 0;
  std::vector<uint8_t> repaired(data, data + size);
  const uint64_t total = size;
  std::memcpy(repaired.data() + f.size_offset, &total, sizeof total);
  const uint64_t sum = kvd::Checksum64(repaired.data(), size - 8);
  std::memcpy(repaired.data() + size - 8, &sum, sizeof sum);
  Check(repaired);
  return 0;
}
