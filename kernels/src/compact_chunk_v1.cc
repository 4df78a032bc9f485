// Reader of compact chunk format v1 (docs/chunk-format.md "Version 1"), kept so that chunks
// written by earlier builds (e.g. on a disk tier) still decode. Nothing writes v1 any more.
#include <cstring>
#include <string>

#include "byte_io.h"
#include "compact_chunk_internal.h"

namespace kvd::kernels::internal {
namespace {

constexpr size_t kHeaderBytes = 128;
constexpr size_t kTableEntryBytes = 32;
constexpr size_t kAlign = 64;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Byte sizes of the five sections of a head with S slots, V stored values.
struct SectionSizes {
  size_t flags, cardinality, positions, keys, values;
  size_t Total() const {
    return AlignUp(flags) + AlignUp(cardinality) + AlignUp(positions) + AlignUp(keys) +
           AlignUp(values);
  }
};
SectionSizes Sizes(uint64_t s, uint64_t v, uint64_t d, DType dtype) {
  const size_t e = DTypeSize(dtype);
  return {s, 4 * s, 8 * s, s * d * e, v * d * e};
}

}  // namespace

StatusOr<CompactChunk> DecodeCompactChunkV1(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes + kCompactChunkTrailerBytes) {
    return Status::DataLoss("compact chunk truncated: " + std::to_string(bytes.size()) +
                            " bytes, the v1 header and trailer alone need " +
                            std::to_string(kHeaderBytes + kCompactChunkTrailerBytes));
  }
  ByteReader r(bytes);
  uint8_t magic[4];
  uint16_t version, header_bytes;
  r.GetBytes(magic, 4);
  r.Get(&version);
  r.Get(&header_bytes);
  ChunkHeaderFields f;
  uint32_t reserved32;
  uint16_t reserved16;
  CompactChunk c;
  uint64_t total;
  r.Get(&f.layers), r.Get(&f.kv_heads), r.Get(&f.head_dim), r.Get(&f.dtype);
  r.GetBytes(f.stages, 5);
  r.Get(&reserved16), r.Get(&reserved32);
  r.Get(&c.codec.p_c), r.Get(&c.codec.calibration_version), r.Get(&c.original_tokens);
  r.Get(&c.layout_digest), r.Get(&total);
  KVD_RETURN_IF_ERROR(CheckSizeAndChecksum(bytes, total));
  // From here the bytes are what an encoder wrote; inconsistencies mean a broken encoder.
  if (header_bytes != kHeaderBytes) return Status::DataLoss("corrupt compact chunk: header size");
  KVD_RETURN_IF_ERROR(SetChunkHeader(f, &c));
  const size_t num_heads = static_cast<size_t>(f.layers) * f.kv_heads;
  const size_t body_end = bytes.size() - kCompactChunkTrailerBytes;
  if (kHeaderBytes + num_heads * kTableEntryBytes > body_end) {
    return Status::DataLoss("corrupt compact chunk: offset table beyond the end");
  }
  c.heads.resize(num_heads);
  for (size_t i = 0; i < num_heads; ++i) {
    ByteReader t(bytes.subspan(kHeaderBytes + i * kTableEntryBytes, kTableEntryBytes));
    uint64_t offset, section_bytes, reserved;
    uint32_t slots, value_slots;
    t.Get(&offset), t.Get(&slots), t.Get(&value_slots), t.Get(&section_bytes), t.Get(&reserved);
    const SectionSizes z = Sizes(slots, value_slots, f.head_dim, c.dtype);
    if (value_slots > slots || offset % kAlign != 0 || section_bytes != z.Total() ||
        offset > body_end || section_bytes > body_end - offset) {
      return Status::DataLoss("corrupt compact chunk: offset table entry of " +
                              HeadName(static_cast<int64_t>(i), c.num_kv_heads));
    }
    CompactHead& h = c.heads[i];
    const uint8_t* p = bytes.data() + offset;
    h.flags.assign(p, p + z.flags);
    p += AlignUp(z.flags);
    // A head may have no slots: memcpy must not see the empty vectors' null data().
    h.cardinality.resize(slots);
    if (slots != 0) std::memcpy(h.cardinality.data(), p, z.cardinality);
    p += AlignUp(z.cardinality);
    h.positions.resize(slots);
    if (slots != 0) std::memcpy(h.positions.data(), p, z.positions);
    p += AlignUp(z.positions);
    h.keys.assign(p, p + z.keys);
    p += AlignUp(z.keys);
    h.values.assign(p, p + z.values);
    if (h.value_slots() != value_slots) {
      return Status::DataLoss("corrupt compact chunk: value count of " +
                              HeadName(static_cast<int64_t>(i), c.num_kv_heads) +
                              " disagrees with its flags");
    }
  }
  if (Status s = c.Validate(); !s.ok()) {
    return Status::DataLoss("corrupt compact chunk: " + s.message());
  }
  return c;
}

}  // namespace kvd::kernels::internal
