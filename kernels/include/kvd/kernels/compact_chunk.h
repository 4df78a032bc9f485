// The compact chunk: what a compression plan (plan.h) produces from one raw chunk, and its
// versioned, checksummed byte format (byte by byte in docs/chunk-format.md).
//
// Per (layer, KV head) a compact chunk holds S slots. Slot j has a post-RoPE key (as an engine
// serves it, at the slot's representative position), a cardinality l_j >= 1 (original tokens it
// stands for), a representative position, flags, and either a stored MEAN value Vsum_j / l_j or
// the flag kSlotRebuildValue ("rebuild me": the value is W RoPE^-1(k_j, pos_j), VECTOR). Values
// are stored as means, not sums, so they keep the model dtype's range (a float16 sum of l values
// could overflow); Vsum_j = l_j * mean_j. Keys and values are in the model dtype.
//
// Half-pair accounting: every slot stores a key (half a pair); slots without the rebuild flag
// also store a value (half a pair). HalfPairs() = S + (S - rebuild slots), summed over heads.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/dtype.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/kernels/kvslimmer.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// Stages of a compression plan, as recorded in a compact chunk (values are on-disk codes). The
// enumerators are the built-in stages; a code is valid when a stage is registered under it
// (stages.h), so a stage registered at run time records its own code.
enum class ScoreStage : uint8_t {
  kNone = 0,
  kSnapKv = 1,
  kKeyDiff = 2,
  kPyramidKv = 3,
  kExpectedAttention = 4,
};
enum class MergeStage : uint8_t { kNone = 0, kKvSlimmer = 1 };
enum class RouteStage : uint8_t { kNone = 0, kVector = 1 };
// Element format of quantized keys and values (quantize.h; docs/algorithms.md 6).
enum class QuantFormat : uint8_t {
  kNone = 0,
  kInt8 = 1,
  kInt4 = 2,
  kFp8E4M3 = 3,
  kInt3 = 4,  // 3-bit codes, bit-packed
  kInt2 = 5,  // 2-bit codes, four per byte
  // Symmetric integer formats: one float16 scale per group, no minimum (quantize.h).
  kInt4Sym = 6,
  kInt3Sym = 7,
  kInt2Sym = 8,
  // Zero-anchored integer formats: per group a float16 scale and a one-byte zero code (quantize.h).
  kInt8Zero = 9,
  kInt4Zero = 10,
  kInt3Zero = 11,
  kInt2Zero = 12,
};
// An orthogonal transform applied to every key row and value row before quantization and
// inverted after dequantization (quantize.h): it spreads a channel's outliers over all channels.
enum class QuantRotation : uint8_t { kNone = 0, kHadamard = 1 };

// The quantize stage as a chunk records it. With format kNone the other fields are 0 and the
// heads hold keys and values in the chunk dtype; otherwise each head's `keys` and `values` hold
// the quantized rows of quantize.h (QuantizedRowsBytes: the first `sinks` rows in the chunk
// dtype, codes, float16 scales, then the last `recent` rows in the chunk dtype).
struct QuantDescription {
  QuantFormat format = QuantFormat::kNone;  // the keys' format (and the values' by default)
  uint32_t key_group = 0;                   // keys: tokens (slots) per group of one channel, >= 1
  uint32_t value_group = 0;                 // values: channels per group of one token, >= 1
  uint32_t recent = 0;  // the last `recent` key rows and value rows stay in the chunk dtype
  // The rows of the sequence's first `sinks` tokens (its attention sinks) stay in the chunk dtype,
  // out of every group. In a plan (plan.h) at most the plan's sinks; a chunk records how many of
  // its first key rows and value rows that is: min(sinks - p0, rows) for a chunk whose first
  // token p0 is below `sinks`, 0 for the chunks after (the plan sets it).
  uint32_t sinks = 0;
  QuantRotation rotation = QuantRotation::kNone;  // applied to the quantized rows only
  QuantFormat value_format = QuantFormat::kNone;  // kNone: values in `format` too
  bool quantized() const { return format != QuantFormat::kNone; }
  QuantFormat ValueFormat() const {
    return value_format == QuantFormat::kNone ? format : value_format;
  }
  QuantFormat FormatOf(bool keys) const { return keys ? format : ValueFormat(); }
  bool operator==(const QuantDescription&) const = default;
};

// Slot flag bits.
inline constexpr uint8_t kSlotRebuildValue = 0x01;  // value not stored: the route stage rebuilds
inline constexpr uint8_t kSlotKnownFlags = kSlotRebuildValue;

// How a chunk was compressed (enough for a reader to serve it and for metrics to name it).
struct CodecDescription {
  ScoreStage score = ScoreStage::kNone;
  MergeStage merge = MergeStage::kNone;
  MergeNorm merge_norm = MergeNorm::kL2;  // meaningful when merge != kNone
  RouteStage route = RouteStage::kNone;
  RepresentativePosition position = RepresentativePosition::kLast;
  double p_c = 0.0;                  // target compression ratio in [0, 1)
  uint64_t calibration_version = 0;  // VectorWeights::version needed to rebuild values; 0 = none
  QuantDescription quant;            // the quantize stage (format kNone: keys and values as is)
  bool operator==(const CodecDescription&) const = default;
};

// One (layer, KV head).
struct CompactHead {
  std::vector<uint8_t> keys;         // [S, d] post-RoPE keys, elements of the chunk dtype
                                     //        (quantized chunks: QuantizedRowsBytes(S, ...))
  std::vector<uint8_t> values;       // [V, d] mean values of the slots WITHOUT the rebuild flag, in
                                     //        slot order, elements of the chunk dtype
                                     //        (quantized chunks: QuantizedRowsBytes(V, ...))
  std::vector<uint8_t> flags;        // [S] kSlot* bits
  std::vector<int32_t> cardinality;  // [S] l_j >= 1
  std::vector<int64_t> positions;    // [S] representative positions >= 0 (original numbering)

  int64_t slots() const { return static_cast<int64_t>(flags.size()); }
  int64_t value_slots() const;  // S minus the slots with kSlotRebuildValue
  bool operator==(const CompactHead&) const = default;
};

struct CompactChunk {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBFloat16;
  int64_t original_tokens = 0;  // N of the raw chunk
  uint64_t layout_digest = 0;   // ModelLayout::Digest() of the model it came from
  CodecDescription codec;
  std::vector<CompactHead> heads;  // [num_layers * num_kv_heads], index layer * H + head

  // The header of a chunk compressed from `tokens` raw tokens of `layout` (its dimensions,
  // dtype and Digest(), original_tokens = tokens, `codec`) and layout.num_layers *
  // num_kv_heads heads with no slots yet, for a plan (or a caller storing tokens as they are) to
  // fill. Validate() holds once every head is filled consistently.
  static CompactChunk ForLayout(const ModelLayout& layout, int64_t tokens,
                                const CodecDescription& codec = {});

  // REQUIRES valid indices.
  const CompactHead& Head(int layer, int head) const { return heads[layer * num_kv_heads + head]; }
  CompactHead& Head(int layer, int head) { return heads[layer * num_kv_heads + head]; }

  // Checks every invariant above (sizes vs S, V and d, cardinalities, positions, known flags,
  // codec ranges). INVALID_ARGUMENT naming the first broken one; UNIMPLEMENTED "codec: unknown
  // stage code: <kind> N is not registered" for a score, merge or route code no stage of this
  // process registers.
  Status Validate() const;
  // Sum over heads of keys + stored values, each half a pair.
  int64_t HalfPairs() const;
  bool operator==(const CompactChunk&) const = default;
};

// Bytes of the quantized rows of one head (docs/chunk-format.md): `rows` rows of `head_dim`
// elements quantized per `quant` (`keys`: per channel over key_group rows; else per row over
// value_group channels), the first `sinks` and the last `recent` rows in `dtype`.
// rows * head_dim * DTypeSize(dtype) when quant is kNone.
size_t QuantizedRowsBytes(int64_t rows, int head_dim, DType dtype, const QuantDescription& quant,
                          bool keys);

// Bytes of format version 2 (docs/chunk-format.md), version 3 when the chunk is quantized
// (version 2 plus the quantize stage's fields; its heads' rows are QuantizedRowsBytes), or version
// 4 when the quantize stage uses what version 3 cannot record (a rotation, int3 / int2, the
// symmetric formats, values in another format than keys; version 3 plus those fields in its
// reserved bytes), or version 5 when rows of sink tokens stay unquantized (version 4 plus their
// count): an 80-byte header (96 in versions 3 and 4, 104 in version 5), the bit-packed slot
// metadata of every head (slot counts, cardinalities, positions relative to the chunk's first
// token, rebuild flags), the keys and values of every head back to back from a 64-byte aligned
// offset, an xxh3-64 trailer. Metadata takes a few bits per slot, so the size is the keys and
// values plus well under 1% (at 256 tokens per chunk, head_dim 64, bf16). Deterministic: equal
// chunks give equal bytes. Validate()'s error when it fails.
StatusOr<std::vector<uint8_t>> EncodeCompactChunk(const CompactChunk& chunk);

// Decodes and fully validates format versions 5, 4, 3 and 2, and version 1 (written by earlier
// builds). Errors, in the order checked:
//   DATA_LOSS "truncated" when shorter than the fixed header + trailer;
//   INVALID_ARGUMENT "bad magic" / "unsupported compact chunk version N";
//   DATA_LOSS "size mismatch" when the header's total size differs from the bytes given;
//   DATA_LOSS "checksum mismatch";
//   UNIMPLEMENTED "compact chunk: codec: unknown stage code: ..." for a score, merge or route
//   code no stage of this process registers (well-formed bytes: not corrupt);
//   DATA_LOSS "corrupt compact chunk: ..." naming the inconsistent field, and the head for slot
//   metadata (only reachable with a valid checksum, i.e. bytes written by a buggy or hostile
//   encoder): metadata that ends early or late, counts that the data section cannot hold, values
//   no encoder writes, nonzero padding, data left over.
// Never reads out of bounds, whatever the input; allocates at most a small multiple of its size.
StatusOr<CompactChunk> DecodeCompactChunk(std::span<const uint8_t> bytes);

// Name of a stage, e.g. "snapkv", "kvslimmer", "vector" (for logs and metrics).
std::string_view ScoreStageName(ScoreStage s);
std::string_view MergeStageName(MergeStage s);
std::string_view RouteStageName(RouteStage s);
// "none", "int8", "int4", "fp8_e4m3", "int3", "int2", "int4s", "int3s", "int2s"; "none",
// "hadamard". The one table of format names: policies name formats by it.
std::string_view QuantFormatName(QuantFormat f);
std::string_view QuantRotationName(QuantRotation r);
// The format QuantFormatName calls `name` ("none" included); nullopt for any other name.
std::optional<QuantFormat> QuantFormatFromName(std::string_view name);
// The names of the formats other than none, for messages: "int8, int4, ..., int2s or fp8_e4m3".
std::string QuantFormatNameList();
// The formats other than none and every rotation, in the order of the names above (policies list
// their choices in this order).
std::vector<QuantFormat> QuantFormats();
std::vector<QuantRotation> QuantRotations();

}  // namespace kvd::kernels
