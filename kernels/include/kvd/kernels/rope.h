// Rotary position embedding (RoPE) applied to, or removed from, keys at given positions.
//
// Math: for each rotated pair (a, b) with frequency f_i (i < rotary_dim/2) and position p,
//   angle = p * f_i;  (a, b) <- (a cos - b sin, a sin + b cos)     (rotate)
// De-rotation is rotation by -angle. Pairs are (2i, 2i+1) for kInterleaved and
// (i, i + rotary_dim/2) for kHalves; dims >= rotary_dim pass through unchanged.
// Frequencies: f_i = theta^(-2i/rotary_dim), then scaled:
//   kNone:   f_i
//   kLinear: f_i / factor
//   kLlama3: wavelen = 2 pi / f_i; low_wl = orig_max / low_freq_factor, high_wl = orig_max /
//            high_freq_factor; wavelen < high_wl: f_i; wavelen > low_wl: f_i / factor; otherwise
//            smooth = (orig_max / wavelen - low) / (high - low), f = (1-smooth) f/factor + smooth
//            f.
// (Same as HF transformers' `_compute_llama3_parameters` and Meta's reference.)
// Angles are formed in float64 and reduced modulo 2 pi before a float32 sin/cos, so positions up
// to 2^31 keep ~1e-6 relative accuracy.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

enum class RopeDirection : uint8_t { kRotate = 0, kDerotate = 1 };

// Inverse frequencies of one (RopeConfig, head_dim), computed once. Immutable after Create():
// safe to share between threads.
class RopeTable {
 public:
  // Validates `config` against head_dim (RopeConfig::Validate and CheckHeadDim).
  static StatusOr<RopeTable> Create(const RopeConfig& config, int head_dim);

  int head_dim() const { return head_dim_; }
  int rotary_dim() const { return rotary_dim_; }
  RopePairing pairing() const { return pairing_; }
  // f_i after scaling, i in [0, rotary_dim/2).  // [rotary_dim/2]
  const std::vector<double>& inv_freq() const { return inv_freq_; }

 private:
  int head_dim_ = 0;
  int rotary_dim_ = 0;
  RopePairing pairing_ = RopePairing::kHalves;
  std::vector<double> inv_freq_;
};

// Rotates (or de-rotates) every head in place: heads[h] row i is at positions[i].
// All heads share `positions` (the sin/cos of a row are computed once for all heads).
// REQUIRES: every view is [N, table.head_dim()] with N == positions.size().
// Errors: INVALID_ARGUMENT on shape mismatch or a negative position; INVALID_ARGUMENT naming the
// head and row when an input element is NaN/Inf (checked only if `check_finite`).
// kCuda: UNIMPLEMENTED without CUDA, UNAVAILABLE without a device.
Status ApplyRope(const RopeTable& table, RopeDirection direction,
                 std::span<const int64_t> positions, std::span<const MatrixView> heads,
                 const ExecOptions& exec = {}, bool check_finite = true);
Status ApplyRope(const RopeTable& table, RopeDirection direction,
                 std::span<const int32_t> positions, std::span<const MatrixView> heads,
                 const ExecOptions& exec = {}, bool check_finite = true);

// Out-of-place single-head form: out = R(+-angle) in. in and out may alias exactly.
Status ApplyRope(const RopeTable& table, RopeDirection direction,
                 std::span<const int64_t> positions, ConstMatrixView in, MatrixView out,
                 const ExecOptions& exec = {});

}  // namespace kvd::kernels
