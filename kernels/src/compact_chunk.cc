// Compact chunk validation and the v1 byte format (docs/chunk-format.md is the spec; keep both in
// step).
#include "kvd/kernels/compact_chunk.h"

#include <cmath>
#include <cstring>
#include <string>

#include "byte_io.h"
#include "kvd/common/hash.h"

namespace kvd::kernels {
namespace {

constexpr uint8_t kMagic[4] = {'K', 'V', 'C', 'C'};
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 128;
constexpr size_t kTableEntryBytes = 32;
constexpr size_t kAlign = 64;
constexpr size_t kTrailerBytes = 8;
constexpr int kMaxHeadDimInFormat = 1024;
constexpr uint32_t kMaxHeadsInFormat = 1u << 20;

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

std::string HeadName(int64_t idx, int heads) {
  return "layer " + std::to_string(idx / heads) + " head " + std::to_string(idx % heads);
}

bool ValidDType(uint8_t v) { return v <= static_cast<uint8_t>(DType::kBFloat16); }

Status ValidateCodec(const CodecDescription& c) {
  if (static_cast<uint8_t>(c.score) > static_cast<uint8_t>(ScoreStage::kPyramidKv) ||
      static_cast<uint8_t>(c.merge) > static_cast<uint8_t>(MergeStage::kKvSlimmer) ||
      static_cast<uint8_t>(c.merge_norm) > static_cast<uint8_t>(MergeNorm::kL1Code) ||
      static_cast<uint8_t>(c.route) > static_cast<uint8_t>(RouteStage::kVector) ||
      static_cast<uint8_t>(c.position) > static_cast<uint8_t>(RepresentativePosition::kWeighted)) {
    return Status::InvalidArgument("codec: unknown stage code");
  }
  if (!(c.p_c >= 0.0 && c.p_c < 1.0)) {
    return Status::InvalidArgument("codec: p_c " + std::to_string(c.p_c) + " not in [0, 1)");
  }
  return Status::Ok();
}

}  // namespace

int64_t CompactHead::value_slots() const {
  int64_t v = 0;
  for (uint8_t f : flags) v += (f & kSlotRebuildValue) ? 0 : 1;
  return v;
}

Status CompactChunk::Validate() const {
  if (num_layers < 1 || num_kv_heads < 1) {
    return Status::InvalidArgument("compact chunk: num_layers and num_kv_heads must be >= 1");
  }
  if (head_dim < 1 || head_dim > kMaxHeadDimInFormat) {
    return Status::InvalidArgument("compact chunk: head_dim " + std::to_string(head_dim) +
                                   " not in [1, 1024]");
  }
  if (!ValidDType(static_cast<uint8_t>(dtype))) {
    return Status::InvalidArgument("compact chunk: unknown dtype");
  }
  if (original_tokens < 0) return Status::InvalidArgument("compact chunk: original_tokens < 0");
  KVD_RETURN_IF_ERROR(ValidateCodec(codec));
  if (heads.size() != static_cast<size_t>(num_layers) * num_kv_heads) {
    return Status::InvalidArgument("compact chunk: " + std::to_string(heads.size()) +
                                   " heads, expected num_layers * num_kv_heads");
  }
  const size_t e = DTypeSize(dtype);
  for (size_t i = 0; i < heads.size(); ++i) {
    const CompactHead& h = heads[i];
    const std::string name = HeadName(static_cast<int64_t>(i), num_kv_heads);
    const size_t s = h.flags.size();
    if (h.cardinality.size() != s || h.positions.size() != s) {
      return Status::InvalidArgument("compact chunk: " + name +
                                     ": flags, cardinality and positions differ in size");
    }
    if (h.keys.size() != s * head_dim * e) {
      return Status::InvalidArgument("compact chunk: " + name + ": keys hold " +
                                     std::to_string(h.keys.size()) + " bytes, expected S*d*" +
                                     std::to_string(e));
    }
    if (h.values.size() != static_cast<size_t>(h.value_slots()) * head_dim * e) {
      return Status::InvalidArgument(
          "compact chunk: " + name +
          ": values must hold one row per slot without the rebuild flag");
    }
    for (size_t j = 0; j < s; ++j) {
      if (h.flags[j] & ~kSlotKnownFlags) {
        return Status::InvalidArgument("compact chunk: " + name + ": unknown flag bits at slot " +
                                       std::to_string(j));
      }
      if (h.cardinality[j] < 1) {
        return Status::InvalidArgument("compact chunk: " + name + ": cardinality < 1 at slot " +
                                       std::to_string(j));
      }
      if (h.positions[j] < 0) {
        return Status::InvalidArgument("compact chunk: " + name + ": negative position at slot " +
                                       std::to_string(j));
      }
      if ((h.flags[j] & kSlotRebuildValue) && codec.route == RouteStage::kNone) {
        return Status::InvalidArgument("compact chunk: " + name +
                                       ": rebuild flag set but the codec has no route stage");
      }
    }
  }
  return Status::Ok();
}

int64_t CompactChunk::HalfPairs() const {
  int64_t total = 0;
  for (const CompactHead& h : heads) total += h.slots() + h.value_slots();
  return total;
}

StatusOr<std::vector<uint8_t>> EncodeCompactChunk(const CompactChunk& chunk) {
  KVD_RETURN_IF_ERROR(chunk.Validate());
  const size_t num_heads = chunk.heads.size();
  const size_t table_end = AlignUp(kHeaderBytes + num_heads * kTableEntryBytes);
  std::vector<size_t> offsets(num_heads);
  size_t at = table_end;
  for (size_t i = 0; i < num_heads; ++i) {
    offsets[i] = at;
    const CompactHead& h = chunk.heads[i];
    at += Sizes(h.slots(), h.value_slots(), chunk.head_dim, chunk.dtype).Total();
  }
  const uint64_t total = at + kTrailerBytes;

  std::vector<uint8_t> out;
  out.reserve(total);
  internal::ByteWriter w(&out);
  w.PutBytes(kMagic, 4);
  w.Put(kVersion);
  w.Put(static_cast<uint16_t>(kHeaderBytes));
  w.Put(static_cast<uint32_t>(chunk.num_layers));
  w.Put(static_cast<uint32_t>(chunk.num_kv_heads));
  w.Put(static_cast<uint32_t>(chunk.head_dim));
  w.Put(static_cast<uint8_t>(chunk.dtype));
  w.Put(static_cast<uint8_t>(chunk.codec.score));
  w.Put(static_cast<uint8_t>(chunk.codec.merge));
  w.Put(static_cast<uint8_t>(chunk.codec.merge_norm));
  w.Put(static_cast<uint8_t>(chunk.codec.route));
  w.Put(static_cast<uint8_t>(chunk.codec.position));
  w.Put(uint16_t{0});
  w.Put(uint32_t{0});
  w.Put(chunk.codec.p_c);
  w.Put(chunk.codec.calibration_version);
  w.Put(chunk.original_tokens);
  w.Put(chunk.layout_digest);
  w.Put(total);
  w.Align(kHeaderBytes);  // bytes 72..127 reserved, zero
  for (size_t i = 0; i < num_heads; ++i) {
    const CompactHead& h = chunk.heads[i];
    w.Put(static_cast<uint64_t>(offsets[i]));
    w.Put(static_cast<uint32_t>(h.slots()));
    w.Put(static_cast<uint32_t>(h.value_slots()));
    w.Put(static_cast<uint64_t>(
        Sizes(h.slots(), h.value_slots(), chunk.head_dim, chunk.dtype).Total()));
    w.Put(uint64_t{0});
  }
  w.Align(kAlign);
  for (const CompactHead& h : chunk.heads) {
    w.PutBytes(h.flags.data(), h.flags.size());
    w.Align(kAlign);
    w.PutBytes(h.cardinality.data(), h.cardinality.size() * 4);
    w.Align(kAlign);
    w.PutBytes(h.positions.data(), h.positions.size() * 8);
    w.Align(kAlign);
    w.PutBytes(h.keys.data(), h.keys.size());
    w.Align(kAlign);
    w.PutBytes(h.values.data(), h.values.size());
    w.Align(kAlign);
  }
  if (out.size() + kTrailerBytes != total) {
    return Status::Internal("EncodeCompactChunk: size bookkeeping is off");
  }
  const uint64_t sum = Checksum64(out.data(), out.size());
  w.Put(sum);
  return out;
}

StatusOr<CompactChunk> DecodeCompactChunk(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes + kTrailerBytes) {
    return Status::DataLoss("compact chunk truncated: " + std::to_string(bytes.size()) +
                            " bytes, the header and trailer alone need " +
                            std::to_string(kHeaderBytes + kTrailerBytes));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) {
    return Status::InvalidArgument("not a kvd compact chunk: bad magic");
  }
  internal::ByteReader r(bytes);
  uint8_t magic[4];
  uint16_t version, header_bytes;
  r.GetBytes(magic, 4);
  r.Get(&version);
  if (version != kVersion) {
    return Status::InvalidArgument("unsupported compact chunk version " + std::to_string(version) +
                                   " (this build reads " + std::to_string(kVersion) + ")");
  }
  r.Get(&header_bytes);
  uint32_t layers, kv_heads, head_dim, reserved32;
  uint8_t dtype, score, merge, norm, route, position;
  uint16_t reserved16;
  CompactChunk c;
  uint64_t total;
  r.Get(&layers), r.Get(&kv_heads), r.Get(&head_dim);
  r.Get(&dtype), r.Get(&score), r.Get(&merge), r.Get(&norm), r.Get(&route), r.Get(&position);
  r.Get(&reserved16), r.Get(&reserved32);
  r.Get(&c.codec.p_c), r.Get(&c.codec.calibration_version), r.Get(&c.original_tokens);
  r.Get(&c.layout_digest), r.Get(&total);
  if (total != bytes.size()) {
    return Status::DataLoss("compact chunk size mismatch: header says " + std::to_string(total) +
                            " bytes, got " + std::to_string(bytes.size()) + " (truncated?)");
  }
  uint64_t stored_sum;
  std::memcpy(&stored_sum, bytes.data() + bytes.size() - kTrailerBytes, 8);
  if (Checksum64(bytes.data(), bytes.size() - kTrailerBytes) != stored_sum) {
    return Status::DataLoss("compact chunk checksum mismatch");
  }
  // From here the bytes are what an encoder wrote; inconsistencies mean a broken encoder.
  if (header_bytes != kHeaderBytes) return Status::DataLoss("corrupt compact chunk: header size");
  if (!ValidDType(dtype)) return Status::DataLoss("corrupt compact chunk: dtype");
  if (layers < 1 || kv_heads < 1 || head_dim < 1 || head_dim > kMaxHeadDimInFormat ||
      static_cast<uint64_t>(layers) * kv_heads > kMaxHeadsInFormat) {
    return Status::DataLoss("corrupt compact chunk: shape");
  }
  c.num_layers = static_cast<int>(layers);
  c.num_kv_heads = static_cast<int>(kv_heads);
  c.head_dim = static_cast<int>(head_dim);
  c.dtype = static_cast<DType>(dtype);
  c.codec.score = static_cast<ScoreStage>(score);
  c.codec.merge = static_cast<MergeStage>(merge);
  c.codec.merge_norm = static_cast<MergeNorm>(norm);
  c.codec.route = static_cast<RouteStage>(route);
  c.codec.position = static_cast<RepresentativePosition>(position);
  if (Status s = ValidateCodec(c.codec); !s.ok()) {
    return Status::DataLoss("corrupt compact chunk: " + s.message());
  }
  const size_t num_heads = static_cast<size_t>(layers) * kv_heads;
  const size_t body_end = bytes.size() - kTrailerBytes;
  if (kHeaderBytes + num_heads * kTableEntryBytes > body_end) {
    return Status::DataLoss("corrupt compact chunk: offset table beyond the end");
  }
  c.heads.resize(num_heads);
  const size_t e = DTypeSize(c.dtype);
  for (size_t i = 0; i < num_heads; ++i) {
    internal::ByteReader t(bytes.subspan(kHeaderBytes + i * kTableEntryBytes, kTableEntryBytes));
    uint64_t offset, section_bytes, reserved;
    uint32_t slots, value_slots;
    t.Get(&offset), t.Get(&slots), t.Get(&value_slots), t.Get(&section_bytes), t.Get(&reserved);
    const SectionSizes z = Sizes(slots, value_slots, head_dim, c.dtype);
    if (value_slots > slots || offset % kAlign != 0 || section_bytes != z.Total() ||
        offset > body_end || section_bytes > body_end - offset) {
      return Status::DataLoss("corrupt compact chunk: offset table entry of " +
                              HeadName(static_cast<int64_t>(i), c.num_kv_heads));
    }
    CompactHead& h = c.heads[i];
    const uint8_t* p = bytes.data() + offset;
    h.flags.assign(p, p + z.flags);
    p += AlignUp(z.flags);
    h.cardinality.resize(slots);
    std::memcpy(h.cardinality.data(), p, z.cardinality);
    p += AlignUp(z.cardinality);
    h.positions.resize(slots);
    std::memcpy(h.positions.data(), p, z.positions);
    p += AlignUp(z.positions);
    h.keys.assign(p, p + z.keys);
    p += AlignUp(z.keys);
    h.values.assign(p, p + z.values);
    if (h.value_slots() != value_slots) {
      return Status::DataLoss("corrupt compact chunk: value count of " +
                              HeadName(static_cast<int64_t>(i), c.num_kv_heads) +
                              " disagrees with its flags");
    }
    (void)e;
  }
  if (Status s = c.Validate(); !s.ok()) {
    return Status::DataLoss("corrupt compact chunk: " + s.message());
  }
  return c;
}

std::string_view ScoreStageName(ScoreStage s) {
  switch (s) {
    case ScoreStage::kNone:
      return "none";
    case ScoreStage::kSnapKv:
      return "snapkv";
    case ScoreStage::kKeyDiff:
      return "keydiff";
    case ScoreStage::kPyramidKv:
      return "pyramidkv";
  }
  return "unknown";
}
std::string_view MergeStageName(MergeStage s) {
  switch (s) {
    case MergeStage::kNone:
      return "none";
    case MergeStage::kKvSlimmer:
      return "kvslimmer";
  }
  return "unknown";
}
std::string_view RouteStageName(RouteStage s) {
  switch (s) {
    case RouteStage::kNone:
      return "none";
    case RouteStage::kVector:
      return "vector";
  }
  return "unknown";
}

}  // namespace kvd::kernels
