// Byte encodings of ChunkKey and chunk headers for the disk tier (little-endian, versioned).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvd/common/status.h"
#include "kvd/storage/chunk.h"

namespace kvd::storage::codec {

// [u16 len][namespace][u16 len][model][u64 layout][u32 codec][u64 hash.hi][u64 hash.lo]
std::string EncodeKey(const ChunkKey& key);
// DATA_LOSS for bytes EncodeKey cannot have written: truncated, trailing bytes, or no model
// (DiskTier::Insert refuses an empty model).
StatusOr<ChunkKey> DecodeKey(std::string_view bytes);

// Value header in the data column family, before the payload.
inline constexpr size_t kValueHeaderBytes = 16;
struct ValueHeader {
  uint64_t checksum = 0;
  uint32_t tokens = 0;
};
void EncodeValueHeader(const ValueHeader& h, char* out /* kValueHeaderBytes */);
ValueHeader DecodeValueHeader(const char* in /* kValueHeaderBytes */);

// Entry of the metadata column family.
inline constexpr uint8_t kMetaVersion = 1;
struct MetaRecord {
  uint32_t tokens = 0;
  uint64_t size_bytes = 0;
  uint64_t checksum = 0;
};
std::string EncodeMeta(const MetaRecord& m);
// DATA_LOSS for bytes EncodeMeta cannot have written for a stored chunk: another version, wrong
// length, or size_bytes 0 (DiskTier::Insert refuses empty chunks).
StatusOr<MetaRecord> DecodeMeta(std::string_view bytes);

}  // namespace kvd::storage::codec
