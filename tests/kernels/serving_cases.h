// Compact chunks with known content for serving tests (CPU vs device expansion): several layers
// and heads, every head with the same cardinalities (so the dense form exists), optionally with
// VECTOR-routed slots and their weights.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvd/common/dtype.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/vector.h"
#include "reference.h"

namespace kvd::kernels::testing {

struct ServingCase {
  RopeConfig rope_config{.theta = 10000.0, .pairing = RopePairing::kHalves};
  CompactChunk chunk;
  VectorWeights weights;
};

// A chunk of `layers` x `heads` heads, `slots` slots each, every head with the same
// cardinalities (so it has a dense form); with `routed`, every third slot is rebuilt by VECTOR.
// Values are scaled so that float16 sees subnormals and values that round.
inline ServingCase MakeCase(DType dtype, int layers, int heads, int d, int64_t slots, bool routed,
                            uint64_t seed) {
  ServingCase f;
  CompactChunk& c = f.chunk;
  c.num_layers = layers;
  c.num_kv_heads = heads;
  c.head_dim = d;
  c.dtype = dtype;
  c.codec.p_c = 0.5;
  if (routed) {
    c.codec.route = RouteStage::kVector;
    f.weights.num_layers = layers;
    f.weights.num_kv_heads = heads;
    f.weights.head_dim = d;
    for (int i = 0; i < layers * heads; ++i) {
      f.weights.heads.emplace_back();
      f.weights.heads.back().w = RandomMatrix(d, d, seed + 100 + i, 1.0f / std::sqrt(float(d)));
    }
    f.weights.version = f.weights.ComputeVersion();
    c.codec.calibration_version = f.weights.version;
  }
  std::mt19937_64 rng(seed);
  std::vector<int32_t> card(static_cast<size_t>(slots));
  std::vector<int64_t> pos(static_cast<size_t>(slots));
  int64_t t = 0;
  for (int64_t j = 0; j < slots; ++j) {
    card[j] = 1 + static_cast<int32_t>(rng() % 5);
    t += card[j];
    pos[j] = t - 1;
  }
  c.original_tokens = t;
  const size_t e = DTypeSize(dtype);
  for (int i = 0; i < layers * heads; ++i) {
    CompactHead h;
    Matrix k = RandomMatrix(slots, d, seed + 7 * i + 1, 3.0f);
    Matrix v = RandomMatrix(slots, d, seed + 7 * i + 2, i % 2 == 0 ? 1e-5f : 40.0f);
    h.keys.resize(static_cast<size_t>(slots) * d * e);
    ConvertFromFloat(dtype, k.values.data(), h.keys.data(), k.values.size());
    for (int64_t j = 0; j < slots; ++j) {
      const bool rebuild = routed && j % 3 == 1;
      h.flags.push_back(rebuild ? kSlotRebuildValue : 0);
      h.cardinality.push_back(card[j]);
      h.positions.push_back(pos[j]);
      if (!rebuild) {
        const size_t at = h.values.size();
        h.values.resize(at + d * e);
        ConvertFromFloat(dtype, v.Row(j), h.values.data() + at, d);
      }
    }
    c.heads.push_back(std::move(h));
  }
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  return f;
}

}  // namespace kvd::kernels::testing
