// pair_mean: a toy merge stage, the worked example of docs/extending.md "A merge or route
// stage". After a score stage has picked the pool, every pool token that is not a sink or window
// token absorbs the token right after it when that token was evicted (in no slot, not a sink or
// window token): the merged slot's key is the mean of the two post-RoPE keys, its value sum the
// sum of their values, its position the later token's. A new merge stage is its kernel and this
// one registration; the CPU plan runs it through the registry.
#pragma once

#include <cstring>
#include <vector>

#include "kvd/kernels/stages.h"

namespace kvd::kernels::testing {

// The on-disk merge code of pair_mean (any code no other merge stage uses).
inline constexpr uint8_t kPairMeanCode = 200;
inline constexpr MergeStage kPairMean = static_cast<MergeStage>(kPairMeanCode);

// The kernel: the pool's slots, each pool token paired with its evicted right neighbour.
inline Status PairMeanMerge(const MergeHeadInput& in, HeadSlots* out) {
  if (!in.selected) return Status::FailedPrecondition("pair_mean: needs a score stage");
  KVD_ASSIGN_OR_RETURN(const ConstMatrixView kpre, in.cache->KeysPre());  // for route stages
  const int64_t n = in.keys.rows, d = in.keys.cols;
  const auto forced = [&](int64_t i) { return i < in.options->sinks || i >= n - in.window; };
  std::vector<uint8_t> in_pool(static_cast<size_t>(n), 0);
  for (int32_t i : in.pool) in_pool[i] = 1;
  out->Resize(in.slots, d);
  for (int64_t j = 0; j < in.slots; ++j) {
    const int64_t a = in.pool[j], b = a + 1;
    out->forced[j] = forced(a);
    out->positions[j] = in.positions[a];
    float* key = out->keys_post.Row(j);
    float* value = out->value_sums.Row(j);
    std::memcpy(key, in.keys.Row(a), d * sizeof(float));
    std::memcpy(value, in.values.Row(a), d * sizeof(float));
    if (forced(a) || b >= n || in_pool[b] || forced(b)) {
      std::memcpy(out->keys_pre.Row(j), kpre.Row(a), d * sizeof(float));
      out->token[j] = a;
      continue;
    }
    for (int64_t c = 0; c < d; ++c) {
      key[c] = 0.5f * (key[c] + in.keys.Row(b)[c]);
      value[c] += in.values.Row(b)[c];
    }
    out->cardinality[j] = 2;
    out->positions[j] = in.positions[b];
  }
  return Status::Ok();
}

// The registration (once per process; later calls return the first call's status).
inline Status RegisterPairMeanStage() {
  static const Status registered = StageRegistry::Global().Register({
      .name = "pair_mean",
      .kind = StageKind::kMerge,
      .code = kPairMeanCode,
      .merge = PairMeanMerge,  // no queries, calibration or statistics; CPU plan only
  });
  return registered;
}

}  // namespace kvd::kernels::testing
