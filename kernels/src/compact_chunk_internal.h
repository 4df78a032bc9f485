// Pieces shared by the compact chunk formats (compact_chunk.cc writes and reads v2,
// compact_chunk_v1.cc reads v1). Internal to kvd_kernels; docs/chunk-format.md is the spec.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"

namespace kvd::kernels::internal {

inline constexpr uint8_t kCompactChunkMagic[4] = {'K', 'V', 'C', 'C'};
inline constexpr size_t kCompactChunkTrailerBytes = 8;  // xxh3-64 of every byte before it
inline constexpr int kMaxHeadDimInFormat = 1024;
inline constexpr uint32_t kMaxHeadsInFormat = 1u << 20;
inline constexpr uint32_t kMaxQuantGroup = 1u << 16;   // key_group and value_group
inline constexpr uint32_t kMaxQuantRecent = 1u << 30;  // recent rows, and sink rows

// "layer L head H" of head index `idx` (layer-major) in a chunk with `heads` KV heads.
std::string HeadName(int64_t idx, int heads);

// UNIMPLEMENTED "codec: unknown stage code: <kind> N is not registered" for a score, merge or
// route code no stage of this process registers; INVALID_ARGUMENT "codec: ..." on another unknown
// code or a p_c outside [0, 1).
Status ValidateCodec(const CodecDescription& codec);

// The header fields every version shares, as stored (stages in the order score, merge,
// merge_norm, route, position).
struct ChunkHeaderFields {
  uint32_t layers = 0, kv_heads = 0, head_dim = 0;
  uint8_t dtype = 0;
  uint8_t stages[5] = {};
};

// Checks the fields (dtype known, shape within the format's limits, stage codes, p_c already in
// `c->codec.p_c`) and sets the shape, dtype and stages of `c`. DATA_LOSS "corrupt compact
// chunk: ..." naming the field; UNIMPLEMENTED (ValidateCodec's) for a stage code no stage of this
// process registers.
Status SetChunkHeader(const ChunkHeaderFields& fields, CompactChunk* c);

// The checks every version makes first, in this order: the header's total size equals
// bytes.size() (DATA_LOSS "compact chunk size mismatch ... (truncated?)"), then the xxh3-64
// trailer matches (DATA_LOSS "compact chunk checksum mismatch").
Status CheckSizeAndChecksum(std::span<const uint8_t> bytes, uint64_t total);

// Decodes a version 1 chunk (magic and version already checked). Errors as DecodeCompactChunk's.
StatusOr<CompactChunk> DecodeCompactChunkV1(std::span<const uint8_t> bytes);

}  // namespace kvd::kernels::internal
