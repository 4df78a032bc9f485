// key_norm: a toy score stage (a token's score is the L2 norm of its post-RoPE key; with its
// policy key `key_norm_smallest: true`, minus that norm), the worked example of docs/extending.md
// "A compression method". A new score stage is its kernel pair and this one registration, policy
// key included; the plans, the chunk format and the daemon's policy read the registry.
#pragma once

#include <cmath>
#include <span>

#include "kvd/kernels/stages.h"

namespace kvd::kernels::testing {

// The on-disk score code of key_norm (any code no other score stage uses).
inline constexpr uint8_t kKeyNormCode = 200;
inline constexpr ScoreStage kKeyNorm = static_cast<ScoreStage>(kKeyNormCode);

// Its policy key: keep the smallest norms instead of the largest (a boolean, default false).
inline constexpr const char* kKeyNormSmallest = "key_norm_smallest";

// The kernel: scores[i] = |k_i| (higher = keep), or -|k_i| with key_norm_smallest.
inline Status KeyNormScores(const ScoreHeadInput& in, std::span<float> scores) {
  const float sign = StageKeyValue(*in.options, kKeyNormSmallest) != 0.0 ? -1.0f : 1.0f;
  for (int64_t i = 0; i < in.keys.rows; ++i) {
    const float* k = in.keys.Row(i);
    double sum = 0.0;
    for (int64_t c = 0; c < in.keys.cols; ++c) sum += double(k[c]) * k[c];
    scores[static_cast<size_t>(i)] = sign * static_cast<float>(std::sqrt(sum));
  }
  return Status::Ok();
}

// The registration (once per process; later calls return the first call's status).
inline Status RegisterKeyNormStage() {
  static const Status registered = StageRegistry::Global().Register({
      .name = "key_norm",
      .kind = StageKind::kScore,
      .code = kKeyNormCode,
      .score = KeyNormScores,  // no window queries, calibration or statistics; CPU plan only
      .policy_keys = {{.name = kKeyNormSmallest, .type = PolicyKeyType::kBool}},
  });
  return registered;
}

}  // namespace kvd::kernels::testing
