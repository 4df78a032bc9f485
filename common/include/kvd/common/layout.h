// The model layout: what a KV cache looks like, shared by the wire protocol, the daemon, the
// client and the kernels. Two layouts with different digests never share a chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvd/common/dtype.h"
#include "kvd/common/status.h"

namespace kvd {

// Which coordinates RoPE rotates together.
enum class RopePairing : uint8_t {
  kInterleaved = 0,  // pairs (2i, 2i+1): llama2.c, GGUF / llama.cpp
  kHalves = 1,       // pairs (i, i + rotary_dim/2): HF transformers, GPT-NeoX
};

enum class RopeScaling : uint8_t { kNone = 0, kLinear = 1, kLlama3 = 2 };

struct RopeConfig {
  double theta = 10000.0;  // base
  int rotary_dim = 0;      // rotated dims per head; 0 means head_dim
  RopePairing pairing = RopePairing::kHalves;
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1.0;                // linear and llama3: position / frequency scaling factor
  double low_freq_factor = 1.0;       // llama3 only
  double high_freq_factor = 4.0;      // llama3 only
  int original_max_positions = 8192;  // llama3 only

  // Checks ranges (theta > 0, factor >= 1 for llama3, even rotary_dim <= head_dim, ...).
  Status Validate(int head_dim) const;
  bool operator==(const RopeConfig&) const = default;
};

// Layout of one engine rank's KV cache for one model.
//
// Raw chunk byte layout (the unit of put/get, and what kvd stores uncompressed):
//   for layer in [0, num_layers): K[tokens, num_kv_heads, head_dim], then V[same]
// elements of `dtype`, row-major, no padding. See ChunkBytes / LayerOffset.
struct ModelLayout {
  int num_layers = 0;
  int num_kv_heads = 0;  // KV heads held by THIS tp rank
  int num_q_heads = 0;   // query heads of this rank (GQA group = num_q_heads / num_kv_heads)
  int head_dim = 0;
  DType dtype = DType::kBFloat16;
  int tp_rank = 0;
  int tp_size = 1;
  RopeConfig rope;

  Status Validate() const;
  // Digest of every field above: the part of a chunk key that says "same layout".
  uint64_t Digest() const;
  // "layers=30 kv_heads=3 q_heads=9 head_dim=64 dtype=bfloat16 tp=0/1 rope=halves/100000/none"
  std::string ToString() const;
  // Human-readable description of the first field that differs from `other`, or "" if equal.
  std::string DescribeMismatch(const ModelLayout& other) const;

  // Bytes of one token's K (or V) in one layer.
  size_t TokenBytes() const {
    return static_cast<size_t>(num_kv_heads) * head_dim * DTypeSize(dtype);
  }
  // Bytes of a raw chunk of `tokens` tokens (all layers, K and V).
  size_t ChunkBytes(int tokens) const {
    return 2 * static_cast<size_t>(num_layers) * tokens * TokenBytes();
  }
  // Byte offset of layer `layer`'s K block inside a raw chunk; V follows at + tokens*TokenBytes().
  size_t LayerOffset(int layer, int tokens) const {
    return 2 * static_cast<size_t>(layer) * tokens * TokenBytes();
  }

  bool operator==(const ModelLayout&) const = default;
};

}  // namespace kvd
