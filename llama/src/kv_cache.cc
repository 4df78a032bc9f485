#include "kvd/llama/kv_cache.h"

#include <cmath>
#include <string>

namespace kvd::llama {

Status DenseKvCache::Validate(int num_layers, int num_kv_heads, int head_dim) const {
  if (num_tokens < 0) return Status::InvalidArgument("dense cache: negative num_tokens");
  if (static_cast<int>(layers.size()) != num_layers) {
    return Status::InvalidArgument("dense cache has " + std::to_string(layers.size()) +
                                   " layers, the model " + std::to_string(num_layers));
  }
  if (static_cast<int>(positions.size()) != num_tokens) {
    return Status::InvalidArgument("dense cache: " + std::to_string(positions.size()) +
                                   " positions for " + std::to_string(num_tokens) + " tokens");
  }
  for (int i = 0; i < num_tokens; ++i) {
    if (positions[i] < 0 || (i > 0 && positions[i] < positions[i - 1])) {
      return Status::InvalidArgument(
          "dense cache: positions must be >= 0 and non-decreasing (entry " + std::to_string(i) +
          ")");
    }
  }
  if (num_tokens > 0 && next_position <= positions.back()) {
    return Status::InvalidArgument("dense cache: next_position " + std::to_string(next_position) +
                                   " <= last cached position " + std::to_string(positions.back()));
  }
  if (next_position < 0) return Status::InvalidArgument("dense cache: negative next_position");
  const size_t want = static_cast<size_t>(num_tokens) * num_kv_heads * head_dim;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].k.size() != want || layers[l].v.size() != want) {
      return Status::InvalidArgument("dense cache layer " + std::to_string(l) + ": K/V hold " +
                                     std::to_string(layers[l].k.size()) + "/" +
                                     std::to_string(layers[l].v.size()) + " floats, expected " +
                                     std::to_string(want) + " = N*n_kv*d");
    }
  }
  return Status::Ok();
}

Status CompactKvCache::Validate(int num_layers, int num_kv_heads, int head_dim) const {
  if (static_cast<int>(layers.size()) != num_layers) {
    return Status::InvalidArgument("compact cache has " + std::to_string(layers.size()) +
                                   " layers, the model " + std::to_string(num_layers));
  }
  if (next_position < 0) return Status::InvalidArgument("compact cache: negative next_position");
  for (size_t l = 0; l < layers.size(); ++l) {
    if (static_cast<int>(layers[l].size()) != num_kv_heads) {
      return Status::InvalidArgument("compact cache layer " + std::to_string(l) + " has " +
                                     std::to_string(layers[l].size()) + " heads, the model " +
                                     std::to_string(num_kv_heads));
    }
    for (size_t h = 0; h < layers[l].size(); ++h) {
      const CompactHeadKv& c = layers[l][h];
      const std::string where =
          "compact cache layer " + std::to_string(l) + " head " + std::to_string(h);
      const size_t want = static_cast<size_t>(c.num_slots) * head_dim;
      if (c.num_slots < 0 || c.k.size() != want || c.v.size() != want ||
          c.bias.size() != static_cast<size_t>(c.num_slots)) {
        return Status::InvalidArgument(where + ": k/v/bias hold " + std::to_string(c.k.size()) +
                                       "/" + std::to_string(c.v.size()) + "/" +
                                       std::to_string(c.bias.size()) + " floats for " +
                                       std::to_string(c.num_slots) + " slots");
      }
      for (float b : c.bias) {
        if (!std::isfinite(b)) return Status::InvalidArgument(where + ": non-finite bias");
      }
    }
  }
  return Status::Ok();
}

}  // namespace kvd::llama
