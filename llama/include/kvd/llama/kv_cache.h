// KV caches an engine session can start from: plain structs, independent of the kernels library.
//
// Keys are always POST-RoPE (rotated at their original positions); values as the model produced
// them. A session that adopts a cache continues at `next_position`: the first new token gets that
// position whatever the number of cached entries (compression keeps original positions).
#pragma once

#include <cstdint>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::llama {

// The uncompressed form: every layer holds the same N entries.
struct DenseLayerKv {
  std::vector<float> k;  // [N, num_kv_heads, head_dim], post-RoPE
  std::vector<float> v;  // [N, num_kv_heads, head_dim]
};

struct DenseKvCache {
  int num_tokens = 0;  // N
  // [N] original position of each entry, non-decreasing: a dense expansion of merged slots
  // (docs/algorithms.md 1: slot j repeated l_j times) repeats the slot's representative position.
  // Informational for attention (keys are already rotated); checked against next_position.
  std::vector<int32_t> positions;
  int next_position = 0;             // position of the next token; >= positions.back() + 1
  std::vector<DenseLayerKv> layers;  // [num_layers]

  // Shapes against the model's (layers, kv heads, head dim) and the position rules.
  Status Validate(int num_layers, int num_kv_heads, int head_dim) const;
};

// The compact form of compressed caches: per layer AND per KV head a variable number of slots.
// Slot j of head h attends as softmax_j(q.k_j / sqrt(d) + bias_j) . v_j, where bias_j = ln(l_j)
// for a slot standing for l_j merged tokens and v_j is their MEAN value (docs/algorithms.md 1).
struct CompactHeadKv {
  int num_slots = 0;        // S (may differ between heads and layers; may be 0)
  std::vector<float> k;     // [S, head_dim], post-RoPE
  std::vector<float> v;     // [S, head_dim], mean values
  std::vector<float> bias;  // [S], additive attention bias ln(l_j) (0 for a raw token)
};

struct CompactKvCache {
  int next_position = 0;                           // position of the next token
  std::vector<std::vector<CompactHeadKv>> layers;  // [num_layers][num_kv_heads]

  Status Validate(int num_layers, int num_kv_heads, int head_dim) const;
};

}  // namespace kvd::llama
