// Public entry of rope.h: RopeTable, validation and the one backend switch.
#include "kvd/kernels/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "backend_a.h"

namespace kvd::kernels {

StatusOr<RopeTable> RopeTable::Create(const RopeConfig& config, int head_dim) {
  KVD_RETURN_IF_ERROR(CheckHeadDim(head_dim).WithContext("rope"));
  KVD_RETURN_IF_ERROR(config.Validate(head_dim));
  RopeTable t;
  t.head_dim_ = head_dim;
  t.rotary_dim_ = config.rotary_dim == 0 ? head_dim : config.rotary_dim;
  t.pairing_ = config.pairing;
  const int half = t.rotary_dim_ / 2;
  t.inv_freq_.resize(static_cast<size_t>(half));
  const double low_wavelen = config.original_max_positions / config.low_freq_factor;
  const double high_wavelen = config.original_max_positions / config.high_freq_factor;
  for (int i = 0; i < half; ++i) {
    double f = std::pow(config.theta, -2.0 * i / t.rotary_dim_);
    switch (config.scaling) {
      case RopeScaling::kNone:
        break;
      case RopeScaling::kLinear:
        f /= config.factor;
        break;
      case RopeScaling::kLlama3: {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f /= config.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (config.original_max_positions / wavelen - config.low_freq_factor) /
                                (config.high_freq_factor - config.low_freq_factor);
          f = (1.0 - smooth) * f / config.factor + smooth * f;
        }
        break;
      }
    }
    t.inv_freq_[static_cast<size_t>(i)] = f;
  }
  return t;
}

namespace {

Status ValidateRope(const RopeTable& table, size_t n, std::span<const MatrixView> heads,
                    bool check_finite) {
  if (table.head_dim() == 0) return Status::InvalidArgument("rope: table was not created");
  for (size_t h = 0; h < heads.size(); ++h) {
    const MatrixView& v = heads[h];
    if (v.rows != static_cast<int64_t>(n) || v.cols != table.head_dim() || v.ld < v.cols ||
        (v.data == nullptr && n > 0)) {
      return Status::InvalidArgument("rope: head " + std::to_string(h) + " is [" +
                                     std::to_string(v.rows) + ", " + std::to_string(v.cols) +
                                     "], expected [" + std::to_string(n) + ", " +
                                     std::to_string(table.head_dim()) + "] (one row per position)");
    }
    if (check_finite) {
      Status s = CheckFinite(v, "rope: keys");
      if (!s.ok()) return s.WithContext("head " + std::to_string(h));
    }
  }
  return Status::Ok();
}

template <typename Int>
Status CheckPositions(std::span<const Int> positions) {
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0) {
      return Status::InvalidArgument("rope: negative position " + std::to_string(positions[i]) +
                                     " at row " + std::to_string(i));
    }
  }
  return Status::Ok();
}

Status Dispatch(const RopeTable& table, RopeDirection direction, const int64_t* positions,
                std::span<const MatrixView> heads, const ExecOptions& exec) {
  switch (exec.backend) {
    case Backend::kCpu:
      cpu::ApplyRope(table, direction, positions, heads, exec.num_threads);
      return Status::Ok();
    case Backend::kCuda: {
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("ApplyRope"));
      return cuda::ApplyRope(table, direction, positions, heads, exec.cuda_stream);
#else
      return CheckCudaBackend("ApplyRope");
#endif
    }
    default:
      return Status::InvalidArgument("ApplyRope: unknown backend");
  }
}

}  // namespace

Status ApplyRope(const RopeTable& table, RopeDirection direction,
                 std::span<const int64_t> positions, std::span<const MatrixView> heads,
                 const ExecOptions& exec, bool check_finite) {
  KVD_RETURN_IF_ERROR(ValidateRope(table, positions.size(), heads, check_finite));
  KVD_RETURN_IF_ERROR(CheckPositions(positions));
  return Dispatch(table, direction, positions.data(), heads, exec);
}

Status ApplyRope(const RopeTable& table, RopeDirection direction,
                 std::span<const int32_t> positions, std::span<const MatrixView> heads,
                 const ExecOptions& exec, bool check_finite) {
  KVD_RETURN_IF_ERROR(ValidateRope(table, positions.size(), heads, check_finite));
  KVD_RETURN_IF_ERROR(CheckPositions(positions));
  std::vector<int64_t> wide(positions.begin(), positions.end());
  return Dispatch(table, direction, wide.data(), heads, exec);
}

Status ApplyRope(const RopeTable& table, RopeDirection direction,
                 std::span<const int64_t> positions, ConstMatrixView in, MatrixView out,
                 const ExecOptions& exec) {
  if (in.rows != out.rows || in.cols != out.cols) {
    return Status::InvalidArgument("rope: input and output shapes differ");
  }
  KVD_RETURN_IF_ERROR(
      ValidateRope(table, positions.size(), std::span<const MatrixView>(&out, 1), false));
  KVD_RETURN_IF_ERROR(CheckFinite(in, "rope: keys"));
  KVD_RETURN_IF_ERROR(CheckPositions(positions));
  if (in.data != out.data) {
    for (int64_t i = 0; i < in.rows; ++i) {
      std::copy(in.Row(i), in.Row(i) + in.cols, out.Row(i));
    }
  } else if (in.ld != out.ld) {
    return Status::InvalidArgument("rope: aliased input and output with different strides");
  }
  return Dispatch(table, direction, positions.data(), std::span<const MatrixView>(&out, 1), exec);
}

}  // namespace kvd::kernels
