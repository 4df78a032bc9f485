// Compact chunk validation and the v2 to v5 byte format (docs/chunk-format.md is the spec; keep
// both in step; v3 is v2 with the quantize stage's fields in a 96-byte header, v4 is v3 with the
// rotation and the value format in its reserved bytes, v5 is v4 with the sink rows' count in a
// 104-byte header). Version 1 chunks are read by
// compact_chunk_v1.cc; the slot metadata of v2 is coded by slot_metadata.cc.
#include "kvd/kernels/compact_chunk.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "bit_io.h"
#include "byte_io.h"
#include "compact_chunk_internal.h"
#include "kvd/common/hash.h"
#include "kvd/kernels/stages.h"
#include "quantize_backend.h"
#include "slot_metadata.h"

namespace kvd::kernels {

using internal::HeadName;
using internal::kMaxHeadDimInFormat;
using internal::kMaxQuantGroup;
using internal::kMaxQuantRecent;
using internal::ValidateCodec;

namespace {

constexpr uint16_t kVersion = 2;  // unquantized chunks: byte for byte what v2 writers wrote
constexpr uint16_t kQuantizedVersion = 3;    // chunks with a quantize stage version 3 can record
constexpr uint16_t kQuantizedV4Version = 4;  // the rest (rotation, int3 / int2, int*s, ...)
constexpr uint16_t kSinksVersion = 5;        // version 4 with sink rows kept unquantized
constexpr size_t kHeaderBytes = 80;
constexpr size_t kQuantizedHeaderBytes = 96;
constexpr size_t kSinksHeaderBytes = 104;
constexpr size_t kDataAlign = 64;
constexpr size_t kTrailerBytes = internal::kCompactChunkTrailerBytes;

// Whether a quantized chunk needs version 4: what version 3's fields cannot say.
bool NeedsV4(const QuantDescription& q) {
  const auto v3_format = [](QuantFormat f) {
    return f == QuantFormat::kInt8 || f == QuantFormat::kInt4 || f == QuantFormat::kFp8E4M3;
  };
  return q.rotation != QuantRotation::kNone || q.value_format != QuantFormat::kNone ||
         !v3_format(q.format);
}

uint16_t VersionOf(const QuantDescription& q) {
  if (!q.quantized()) return kVersion;
  if (q.sinks > 0) return kSinksVersion;
  return NeedsV4(q) ? kQuantizedV4Version : kQuantizedVersion;
}

size_t HeaderBytesOf(uint16_t version) {
  return version == kVersion        ? kHeaderBytes
         : version == kSinksVersion ? kSinksHeaderBytes
                                    : kQuantizedHeaderBytes;
}

size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

bool ValidDType(uint8_t v) { return v <= static_cast<uint8_t>(DType::kBFloat16); }

// The first token the chunk's slots stand for: min over slots of (position - cardinality + 1);
// 0 without slots. Slot positions are coded relative to it.
int64_t PositionBase(const CompactChunk& chunk) {
  bool any = false;
  int64_t base = 0;
  for (const CompactHead& h : chunk.heads) {
    for (size_t j = 0; j < h.positions.size(); ++j) {
      const int64_t first = h.positions[j] - h.cardinality[j] + 1;
      base = any ? std::min(base, first) : first;
      any = true;
    }
  }
  return base;
}

// The smallest data a row of a head can take: its codes when quantized (recent rows and scales
// only add), else d elements of the dtype. Bounds the slot count the metadata may claim.
size_t MinRowBytes(const CompactChunk& c) {
  const QuantDescription& q = c.codec.quant;
  if (!q.quantized()) return static_cast<size_t>(c.head_dim) * DTypeSize(c.dtype);
  const QuantBlock k{.format = q.format, .d = c.head_dim};
  const QuantBlock v{.format = q.ValueFormat(), .d = c.head_dim};
  return std::max<size_t>(1, std::min(k.CodeRow(), v.CodeRow()));
}

// The fixed header of a version 2, 3 or 4 chunk as read; the codec and dimensions go straight
// into the chunk being decoded.
struct V2Header {
  size_t size = 0;  // the header size the version implies
  uint16_t header_bytes = 0;
  uint16_t reserved16 = 0;  // v3 / v4: the quant format, then the rotation (v4)
  uint32_t meta_bytes = 0;
  internal::ChunkHeaderFields fields;
  int64_t position_base = 0;
  // key_group, value_group, recent, v3 reserved / v4 value format; v5: sinks, reserved
  uint32_t quant_fields[6] = {};
};

// Reads the header of `bytes` into `h` and `c` (p_c, calibration version, original tokens,
// layout digest) and checks the chunk's size, checksum and header size.
Status ReadV2Header(std::span<const uint8_t> bytes, uint16_t version, V2Header* h,
                    CompactChunk* c) {
  const bool quantized = version != kVersion;
  h->size = HeaderBytesOf(version);
  if (bytes.size() < h->size + kTrailerBytes) {
    return Status::DataLoss("compact chunk truncated: " + std::to_string(bytes.size()) +
                            " bytes, a version " + std::to_string(version) +
                            " header and trailer alone need " +
                            std::to_string(h->size + kTrailerBytes));
  }
  internal::ByteReader r(bytes);
  uint8_t magic[4];
  internal::ChunkHeaderFields& f = h->fields;
  uint64_t total = 0;  // the size check is first: the 88 bytes checked by the caller hold it
  uint16_t version_read = 0;
  r.GetBytes(magic, 4), r.Get(&version_read), r.Get(&h->header_bytes);
  r.Get(&f.layers), r.Get(&f.kv_heads), r.Get(&f.head_dim), r.Get(&f.dtype);
  r.GetBytes(f.stages, 5);
  r.Get(&h->reserved16), r.Get(&h->meta_bytes);
  r.Get(&c->codec.p_c), r.Get(&c->codec.calibration_version), r.Get(&c->original_tokens);
  r.Get(&c->layout_digest), r.Get(&h->position_base), r.Get(&total);
  if (quantized) {
    for (size_t i = 0; i < (version == kSinksVersion ? 6u : 4u); ++i) r.Get(&h->quant_fields[i]);
  }
  KVD_RETURN_IF_ERROR(internal::CheckSizeAndChecksum(bytes, total));
  // From here the bytes are what an encoder wrote; inconsistencies mean a broken encoder.
  if (h->header_bytes != h->size) return Status::DataLoss("corrupt compact chunk: header size");
  return Status::Ok();
}

// Sets c->codec.quant from a version 3, 4 or 5 header; checks that a version 2 header leaves the
// quantize stage's bytes zero.
Status DecodeQuantFields(const V2Header& h, uint16_t version, CompactChunk* c) {
  if (version == kVersion) {
    if (h.reserved16 != 0)
      return Status::DataLoss("corrupt compact chunk: reserved bytes not zero");
    return Status::Ok();
  }
  // Offset 26: the quant format (1 byte), then the rotation (v4; reserved in v3).
  const uint8_t format = static_cast<uint8_t>(h.reserved16 & 0xff);
  const uint8_t rotation = static_cast<uint8_t>(h.reserved16 >> 8);
  const bool v5 = version == kSinksVersion;
  const bool v4 = version == kQuantizedV4Version;
  if ((!v4 && !v5 && (rotation != 0 || h.quant_fields[3] != 0)) || h.quant_fields[5] != 0) {
    return Status::DataLoss("corrupt compact chunk: reserved bytes not zero");
  }
  if (format == 0) {
    return Status::DataLoss("corrupt compact chunk: version " + std::to_string(version) +
                            " without a quant format");
  }
  if (h.quant_fields[3] > 0xff) return Status::DataLoss("corrupt compact chunk: value format");
  c->codec.quant = {.format = static_cast<QuantFormat>(format),
                    .key_group = h.quant_fields[0],
                    .value_group = h.quant_fields[1],
                    .recent = h.quant_fields[2],
                    .sinks = h.quant_fields[4],
                    .rotation = static_cast<QuantRotation>(rotation),
                    .value_format = static_cast<QuantFormat>(h.quant_fields[3])};
  if (Status s = ValidateCodec(c->codec); !s.ok()) {
    return Status::DataLoss("corrupt compact chunk: " + s.message());
  }
  if (v5 != (c->codec.quant.sinks > 0)) {
    return Status::DataLoss("corrupt compact chunk: version " + std::to_string(version) +
                            (v5 ? " without" : " with") + " sink rows");
  }
  if (!v5 && NeedsV4(c->codec.quant) != v4) {
    return Status::DataLoss("corrupt compact chunk: version " + std::to_string(version) +
                            " for a quantize stage that version " + (v4 ? "3" : "4") + " records");
  }
  return Status::Ok();
}

// The offset of the data section: the slot metadata rounded up to kDataAlign, checked to end
// before the trailer and to be followed by zero padding.
StatusOr<size_t> DataSectionStart(std::span<const uint8_t> bytes, const V2Header& h) {
  const size_t body_end = bytes.size() - kTrailerBytes;
  const size_t meta_end = h.size + static_cast<size_t>(h.meta_bytes);
  const size_t data_start = AlignUp(meta_end, kDataAlign);
  if (data_start > body_end) {
    return Status::DataLoss("corrupt compact chunk: " + std::to_string(h.meta_bytes) +
                            " bytes of slot metadata run past the end");
  }
  if (std::any_of(bytes.begin() + meta_end, bytes.begin() + data_start,
                  [](uint8_t b) { return b != 0; })) {
    return Status::DataLoss("corrupt compact chunk: nonzero padding before the data section");
  }
  return data_start;
}

// Decodes every head's slot metadata into c->heads (no rows yet), checking that the slots' rows
// fill the `data_bytes` of the data section exactly and that the metadata ends where the header
// says, padded with zero bits.
Status DecodeHeadSlots(std::span<const uint8_t> bytes, const V2Header& h, size_t data_bytes,
                       CompactChunk* c) {
  const size_t num_heads = static_cast<size_t>(h.fields.layers) * h.fields.kv_heads;
  if (num_heads > 4 * static_cast<size_t>(h.meta_bytes)) {  // every head takes >= 2 bits
    return Status::DataLoss("corrupt compact chunk: " + std::to_string(num_heads) +
                            " heads cannot fit in " + std::to_string(h.meta_bytes) +
                            " bytes of slot metadata");
  }
  const size_t min_row = MinRowBytes(*c);
  size_t data_left = data_bytes;
  internal::BitReader meta(bytes.subspan(h.size, h.meta_bytes));
  internal::SlotCodingState state;
  const bool has_route = c->codec.route != RouteStage::kNone;
  c->heads.resize(num_heads);
  for (size_t i = 0; i < num_heads; ++i) {
    CompactHead& head = c->heads[i];
    Status s = internal::DecodeSlotMetadata(&meta, has_route, h.position_base, data_left / min_row,
                                            &state, &head);
    if (!s.ok()) {
      return Status::DataLoss(
          "corrupt compact chunk: " + HeadName(static_cast<int64_t>(i), c->num_kv_heads) + ": " +
          s.message());
    }
    const size_t need =
        QuantizedRowsBytes(head.slots(), c->head_dim, c->dtype, c->codec.quant, true) +
        QuantizedRowsBytes(head.value_slots(), c->head_dim, c->dtype, c->codec.quant, false);
    if (need > data_left) {
      return Status::DataLoss(
          "corrupt compact chunk: " + HeadName(static_cast<int64_t>(i), c->num_kv_heads) +
          ": its keys and values need " + std::to_string(need) + " bytes, the data section has " +
          std::to_string(data_left) + " left");
    }
    data_left -= need;
  }
  const uint64_t used_bytes = (meta.bit_pos() + 7) / 8;
  if (used_bytes != h.meta_bytes) {
    return Status::DataLoss("corrupt compact chunk: slot metadata ends after " +
                            std::to_string(used_bytes) + " bytes, the header says " +
                            std::to_string(h.meta_bytes));
  }
  uint64_t pad_bits = 0;
  if (!meta.Get(static_cast<int>(meta.bits_left()), &pad_bits) || pad_bits != 0) {
    return Status::DataLoss("corrupt compact chunk: nonzero bits after the slot metadata");
  }
  if (data_left != 0) {
    return Status::DataLoss("corrupt compact chunk: " + std::to_string(data_left) +
                            " bytes of data beyond what the slots hold");
  }
  return Status::Ok();
}

// Copies each head's key rows, then its value rows, from the data section at `data`, in head
// order. REQUIRES the heads' slots checked to fill the section (DecodeHeadSlots).
void CopyHeadRows(const uint8_t* data, CompactChunk* c) {
  for (CompactHead& h : c->heads) {
    h.keys.assign(
        data, data + QuantizedRowsBytes(h.slots(), c->head_dim, c->dtype, c->codec.quant, true));
    data += h.keys.size();
    h.values.assign(data, data + QuantizedRowsBytes(h.value_slots(), c->head_dim, c->dtype,
                                                    c->codec.quant, false));
    data += h.values.size();
  }
}

// Versions 2 to 5 (`version`, already checked to be one of them).
StatusOr<CompactChunk> DecodeV2(std::span<const uint8_t> bytes, uint16_t version) {
  V2Header h;
  CompactChunk c;
  KVD_RETURN_IF_ERROR(ReadV2Header(bytes, version, &h, &c));
  KVD_RETURN_IF_ERROR(DecodeQuantFields(h, version, &c));
  KVD_RETURN_IF_ERROR(internal::SetChunkHeader(h.fields, &c));
  KVD_ASSIGN_OR_RETURN(const size_t data_start, DataSectionStart(bytes, h));
  KVD_RETURN_IF_ERROR(DecodeHeadSlots(bytes, h, bytes.size() - kTrailerBytes - data_start, &c));
  CopyHeadRows(bytes.data() + data_start, &c);
  if (Status s = c.Validate(); !s.ok()) {
    return Status::DataLoss("corrupt compact chunk: " + s.message());
  }
  return c;
}

// UNIMPLEMENTED naming the first of the codec's route, score and merge codes that no stage of this
// process registers: a chunk written where that stage is registered, well-formed but not served
// here.
Status CheckStagesRegistered(const CodecDescription& c) {
  const auto missing = [](const char* kind, auto code, const char* why) {
    return Status::Unimplemented("codec: unknown stage code: " + std::string(kind) + " " +
                                 std::to_string(static_cast<int>(code)) + " is not registered" +
                                 why);
  };
  if (c.route != RouteStage::kNone && FindStage(c.route) == nullptr) {
    return missing("route", c.route, " (no stage rebuilds its values)");
  }
  if (FindStage(c.score) == nullptr) return missing("score", c.score, "");
  if (c.merge != MergeStage::kNone && FindStage(c.merge) == nullptr) {
    return missing("merge", c.merge, "");
  }
  return Status::Ok();
}

}  // namespace

namespace internal {

std::string HeadName(int64_t idx, int heads) {
  return "layer " + std::to_string(idx / heads) + " head " + std::to_string(idx % heads);
}

Status ValidateCodec(const CodecDescription& c) {
  KVD_RETURN_IF_ERROR(CheckStagesRegistered(c));
  if (static_cast<uint8_t>(c.merge_norm) > static_cast<uint8_t>(MergeNorm::kL1Code) ||
      static_cast<uint8_t>(c.position) > static_cast<uint8_t>(RepresentativePosition::kWeighted)) {
    return Status::InvalidArgument("codec: unknown stage code");
  }
  if (!(c.p_c >= 0.0 && c.p_c < 1.0)) {
    return Status::InvalidArgument("codec: p_c " + std::to_string(c.p_c) + " not in [0, 1)");
  }
  const QuantDescription& q = c.quant;
  if (static_cast<uint8_t>(q.format) > static_cast<uint8_t>(QuantFormat::kInt2Zero) ||
      static_cast<uint8_t>(q.value_format) > static_cast<uint8_t>(QuantFormat::kInt2Zero)) {
    return Status::InvalidArgument("codec: unknown quant format");
  }
  if (static_cast<uint8_t>(q.rotation) > static_cast<uint8_t>(QuantRotation::kHadamard)) {
    return Status::InvalidArgument("codec: unknown quant rotation");
  }
  if (q.value_format != QuantFormat::kNone && q.value_format == q.format) {
    return Status::InvalidArgument(
        "codec: quant value format equal to the key format (leave it none)");
  }
  if (!q.quantized()) {
    if (q.key_group != 0 || q.value_group != 0 || q.recent != 0 || q.sinks != 0 ||
        q.rotation != QuantRotation::kNone || q.value_format != QuantFormat::kNone) {
      return Status::InvalidArgument(
          "codec: quant groups, recent window, sinks, rotation or value format without a format");
    }
  } else if (q.key_group < 1 || q.key_group > kMaxQuantGroup || q.value_group < 1 ||
             q.value_group > kMaxQuantGroup || q.recent > kMaxQuantRecent ||
             q.sinks > kMaxQuantRecent) {
    return Status::InvalidArgument("codec: quant key_group " + std::to_string(q.key_group) +
                                   ", value_group " + std::to_string(q.value_group) +
                                   " (each in [1, " + std::to_string(kMaxQuantGroup) +
                                   "]), recent " + std::to_string(q.recent) + " or sinks " +
                                   std::to_string(q.sinks) + " out of range");
  }
  return Status::Ok();
}

Status CheckSizeAndChecksum(std::span<const uint8_t> bytes, uint64_t total) {
  if (total != bytes.size()) {
    return Status::DataLoss("compact chunk size mismatch: header says " + std::to_string(total) +
                            " bytes, got " + std::to_string(bytes.size()) + " (truncated?)");
  }
  uint64_t stored_sum;
  std::memcpy(&stored_sum, bytes.data() + bytes.size() - kCompactChunkTrailerBytes, 8);
  if (Checksum64(bytes.data(), bytes.size() - kCompactChunkTrailerBytes) != stored_sum) {
    return Status::DataLoss("compact chunk checksum mismatch");
  }
  return Status::Ok();
}

Status SetChunkHeader(const ChunkHeaderFields& f, CompactChunk* c) {
  if (!ValidDType(f.dtype)) return Status::DataLoss("corrupt compact chunk: dtype");
  if (f.layers < 1 || f.kv_heads < 1 || f.head_dim < 1 || f.head_dim > kMaxHeadDimInFormat ||
      static_cast<uint64_t>(f.layers) * f.kv_heads > kMaxHeadsInFormat) {
    return Status::DataLoss("corrupt compact chunk: shape");
  }
  c->num_layers = static_cast<int>(f.layers);
  c->num_kv_heads = static_cast<int>(f.kv_heads);
  c->head_dim = static_cast<int>(f.head_dim);
  c->dtype = static_cast<DType>(f.dtype);
  c->codec.score = static_cast<ScoreStage>(f.stages[0]);
  c->codec.merge = static_cast<MergeStage>(f.stages[1]);
  c->codec.merge_norm = static_cast<MergeNorm>(f.stages[2]);
  c->codec.route = static_cast<RouteStage>(f.stages[3]);
  c->codec.position = static_cast<RepresentativePosition>(f.stages[4]);
  if (Status s = ValidateCodec(c->codec); !s.ok()) {
    // A stage this process does not register is no corruption: the bytes are an encoder's.
    if (s.code() == StatusCode::kUnimplemented) return s.WithContext("compact chunk");
    return Status::DataLoss("corrupt compact chunk: " + s.message());
  }
  return Status::Ok();
}

}  // namespace internal

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
  if (codec.quant.rotation == QuantRotation::kHadamard && (head_dim & (head_dim - 1)) != 0) {
    return Status::InvalidArgument(
        "compact chunk: the hadamard rotation needs a power-of-two head_dim, got " +
        std::to_string(head_dim));
  }
  if (heads.size() != static_cast<size_t>(num_layers) * num_kv_heads) {
    return Status::InvalidArgument("compact chunk: " + std::to_string(heads.size()) +
                                   " heads, expected num_layers * num_kv_heads");
  }
  for (size_t i = 0; i < heads.size(); ++i) {
    const CompactHead& h = heads[i];
    const std::string name = HeadName(static_cast<int64_t>(i), num_kv_heads);
    const size_t s = h.flags.size();
    if (h.cardinality.size() != s || h.positions.size() != s) {
      return Status::InvalidArgument("compact chunk: " + name +
                                     ": flags, cardinality and positions differ in size");
    }
    const size_t key_bytes =
        QuantizedRowsBytes(static_cast<int64_t>(s), head_dim, dtype, codec.quant, true);
    if (h.keys.size() != key_bytes) {
      return Status::InvalidArgument(
          "compact chunk: " + name + ": keys hold " + std::to_string(h.keys.size()) +
          " bytes, expected " + std::to_string(key_bytes) + " for " + std::to_string(s) + " slots");
    }
    if (h.values.size() !=
        QuantizedRowsBytes(h.value_slots(), head_dim, dtype, codec.quant, false)) {
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

CompactChunk CompactChunk::ForLayout(const ModelLayout& layout, int64_t tokens,
                                     const CodecDescription& codec) {
  CompactChunk chunk;
  chunk.num_layers = layout.num_layers;
  chunk.num_kv_heads = layout.num_kv_heads;
  chunk.head_dim = layout.head_dim;
  chunk.dtype = layout.dtype;
  chunk.original_tokens = tokens;
  chunk.layout_digest = layout.Digest();
  chunk.codec = codec;
  chunk.heads.resize(static_cast<size_t>(layout.num_layers) * layout.num_kv_heads);
  return chunk;
}

int64_t CompactChunk::HalfPairs() const {
  int64_t total = 0;
  for (const CompactHead& h : heads) total += h.slots() + h.value_slots();
  return total;
}

StatusOr<std::vector<uint8_t>> EncodeCompactChunk(const CompactChunk& chunk) {
  KVD_RETURN_IF_ERROR(chunk.Validate());
  const int64_t position_base = PositionBase(chunk);
  std::vector<uint8_t> meta;
  {
    internal::BitWriter bits(&meta);
    internal::SlotCodingState state;
    const bool has_route = chunk.codec.route != RouteStage::kNone;
    for (const CompactHead& h : chunk.heads) {
      internal::EncodeSlotMetadata(h, has_route, position_base, &state, &bits);
    }
    bits.Finish();
  }
  if (meta.size() > UINT32_MAX) {
    return Status::InvalidArgument("compact chunk: " + std::to_string(meta.size()) +
                                   " bytes of slot metadata exceed the format's 4 GiB");
  }
  size_t data_bytes = 0;
  for (const CompactHead& h : chunk.heads) data_bytes += h.keys.size() + h.values.size();
  const QuantDescription& quant = chunk.codec.quant;
  const uint16_t version = VersionOf(quant);
  const size_t header_size = HeaderBytesOf(version);
  const size_t data_start = AlignUp(header_size + meta.size(), kDataAlign);
  const uint64_t total = data_start + data_bytes + kTrailerBytes;

  std::vector<uint8_t> out;
  out.reserve(total);
  internal::ByteWriter w(&out);
  w.PutBytes(internal::kCompactChunkMagic, 4);
  w.Put(version);
  w.Put(static_cast<uint16_t>(header_size));
  w.Put(static_cast<uint32_t>(chunk.num_layers));
  w.Put(static_cast<uint32_t>(chunk.num_kv_heads));
  w.Put(static_cast<uint32_t>(chunk.head_dim));
  w.Put(static_cast<uint8_t>(chunk.dtype));
  w.Put(static_cast<uint8_t>(chunk.codec.score));
  w.Put(static_cast<uint8_t>(chunk.codec.merge));
  w.Put(static_cast<uint8_t>(chunk.codec.merge_norm));
  w.Put(static_cast<uint8_t>(chunk.codec.route));
  w.Put(static_cast<uint8_t>(chunk.codec.position));
  w.Put(static_cast<uint8_t>(quant.format));    // 0 in version 2 (reserved there)
  w.Put(static_cast<uint8_t>(quant.rotation));  // 0 in versions 2 and 3
  w.Put(static_cast<uint32_t>(meta.size()));
  w.Put(chunk.codec.p_c);
  w.Put(chunk.codec.calibration_version);
  w.Put(chunk.original_tokens);
  w.Put(chunk.layout_digest);
  w.Put(position_base);
  w.Put(total);
  if (quant.quantized()) {
    w.Put(quant.key_group);
    w.Put(quant.value_group);
    w.Put(quant.recent);
    w.Put(static_cast<uint32_t>(quant.value_format));  // 0 in version 3
  }
  if (version == kSinksVersion) {
    w.Put(quant.sinks);
    w.Put(uint32_t{0});  // reserved
  }
  w.PutBytes(meta.data(), meta.size());
  w.Align(kDataAlign);
  for (const CompactHead& h : chunk.heads) {
    w.PutBytes(h.keys.data(), h.keys.size());
    w.PutBytes(h.values.data(), h.values.size());
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
  if (std::memcmp(bytes.data(), internal::kCompactChunkMagic, 4) != 0) {
    return Status::InvalidArgument("not a kvd compact chunk: bad magic");
  }
  uint16_t version;
  std::memcpy(&version, bytes.data() + 4, 2);
  if (version == 1) return internal::DecodeCompactChunkV1(bytes);
  if (version < kVersion || version > kSinksVersion) {
    return Status::InvalidArgument("unsupported compact chunk version " + std::to_string(version) +
                                   " (this build reads 1 to 5)");
  }
  return DecodeV2(bytes, version);
}

std::string_view ScoreStageName(ScoreStage s) {
  if (s == ScoreStage::kNone) return "none";
  const StageRegistration* stage = FindStage(s);
  return stage == nullptr ? "unknown" : std::string_view(stage->name);
}
std::string_view MergeStageName(MergeStage s) {
  if (s == MergeStage::kNone) return "none";
  const StageRegistration* stage = FindStage(s);
  return stage == nullptr ? "unknown" : std::string_view(stage->name);
}
namespace {
// Every format and its name, in the order messages list them.
constexpr std::pair<QuantFormat, std::string_view> kQuantFormatNames[] = {
    {QuantFormat::kNone, "none"},        {QuantFormat::kInt8, "int8"},
    {QuantFormat::kInt4, "int4"},        {QuantFormat::kInt3, "int3"},
    {QuantFormat::kInt2, "int2"},        {QuantFormat::kInt8Zero, "int8z"},
    {QuantFormat::kInt4Zero, "int4z"},   {QuantFormat::kInt3Zero, "int3z"},
    {QuantFormat::kInt2Zero, "int2z"},   {QuantFormat::kInt4Sym, "int4s"},
    {QuantFormat::kInt3Sym, "int3s"},    {QuantFormat::kInt2Sym, "int2s"},
    {QuantFormat::kFp8E4M3, "fp8_e4m3"},
};
}  // namespace

std::string_view QuantFormatName(QuantFormat f) {
  for (const auto& [format, name] : kQuantFormatNames) {
    if (format == f) return name;
  }
  return "unknown";
}
std::optional<QuantFormat> QuantFormatFromName(std::string_view name) {
  for (const auto& [format, n] : kQuantFormatNames) {
    if (n == name) return format;
  }
  return std::nullopt;
}
std::string QuantFormatNameList() {
  std::string out;
  const size_t n = std::size(kQuantFormatNames);
  for (size_t i = 1; i < n; ++i) {
    out += std::string(i == 1       ? ""
                       : i + 1 == n ? " or "
                                    : ", ") +
           std::string(kQuantFormatNames[i].second);
  }
  return out;
}
std::vector<QuantFormat> QuantFormats() {
  std::vector<QuantFormat> out;
  for (size_t i = 1; i < std::size(kQuantFormatNames); ++i)
    out.push_back(kQuantFormatNames[i].first);
  return out;
}
std::vector<QuantRotation> QuantRotations() {
  return {QuantRotation::kNone, QuantRotation::kHadamard};
}
std::string_view QuantRotationName(QuantRotation r) {
  switch (r) {
    case QuantRotation::kNone:
      return "none";
    case QuantRotation::kHadamard:
      return "hadamard";
  }
  return "unknown";
}

size_t QuantizedRowsBytes(int64_t rows, int head_dim, DType dtype, const QuantDescription& quant,
                          bool keys) {
  const size_t d = static_cast<size_t>(head_dim);
  const size_t row = d * DTypeSize(dtype);
  if (rows <= 0) return 0;
  if (!quant.quantized()) return static_cast<size_t>(rows) * row;
  const QuantBlock b = BlockOf(quant, keys, rows, head_dim);
  return b.Bytes() + static_cast<size_t>(rows - b.rows) * row;
}

std::string_view RouteStageName(RouteStage s) {
  if (s == RouteStage::kNone) return "none";
  const StageRegistration* stage = FindStage(s);
  return stage == nullptr ? "unknown" : std::string_view(stage->name);
}

}  // namespace kvd::kernels
