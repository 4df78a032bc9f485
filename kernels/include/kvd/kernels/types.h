// Shared vocabulary of the compression kernels.
//
// Conventions (every op follows them):
// - Compute is float32; references in tests are float64. Inputs in float16/bfloat16 are converted
//   once at the entry of a plan (see convert.h), never inside an inner loop.
// - Per-head data is a row-major float32 matrix view: row i is token (or slot) i.
//   Shapes are written next to every pointer:  // [N, d]
// - Ops validate shapes, finiteness (NaN/Inf) and budgets at their public entry and return a
//   specific Status; kernels behind the entry assume valid input.
// - `ExecOptions` picks the backend. kCpu is always available; kCuda returns UNIMPLEMENTED in a
//   build without CUDA and UNAVAILABLE when no device is present at run time.
// - The kCuda twins of convert.h, rope.h, observation.h, keydiff.h and ApplyMerges take HOST
//   views like kCpu and stage them through device memory; they synchronise `cuda_stream` before
//   returning. CUDA errors become Status in one place (src/cuda/device.cu: INTERNAL, or
//   RESOURCE_EXHAUSTED for out-of-memory).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::kernels {

enum class Backend : uint8_t { kCpu = 0, kCuda = 1 };

struct ExecOptions {
  Backend backend = Backend::kCpu;  // where the op runs
  int num_threads = 0;              // CPU threads for parallel-over-heads ops; 0 = all cores
  void* cuda_stream = nullptr;      // cudaStream_t for kCuda; nullptr = default stream
};

// Read-only row-major float32 matrix.  // [rows, cols], row stride `ld` floats (>= cols)
struct ConstMatrixView {
  const float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  const float* Row(int64_t i) const { return data + i * ld; }
};

// Mutable row-major float32 matrix.  // [rows, cols], row stride `ld` floats (>= cols)
struct MatrixView {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  float* Row(int64_t i) const { return data + i * ld; }
  operator ConstMatrixView() const { return {data, rows, cols, ld}; }  // NOLINT
};

// Owning row-major float32 matrix (contiguous, ld == cols).
struct Matrix {
  std::vector<float> values;
  int64_t rows = 0;
  int64_t cols = 0;
  Matrix() = default;
  Matrix(int64_t r, int64_t c) : values(static_cast<size_t>(r * c)), rows(r), cols(c) {}
  MatrixView View() { return {values.data(), rows, cols, cols}; }
  ConstMatrixView View() const { return {values.data(), rows, cols, cols}; }
  float* Row(int64_t i) { return values.data() + i * cols; }
  const float* Row(int64_t i) const { return values.data() + i * cols; }
};

// True when this build has CUDA kernels AND a device is visible now.
bool CudaDeviceAvailable();

// Returns INVALID_ARGUMENT naming `what` and the first bad index if any element is NaN or Inf.
Status CheckFinite(ConstMatrixView m, const char* what);

// Runs fn(i) for every i in [0, n) on up to `num_threads` threads (0 = all cores; 1 = the
// calling thread only). Blocks until all calls returned. fn must be thread-safe for distinct i.
// Used to parallelise ops over heads / layers; cheap enough to call once per op.
void ParallelFor(int64_t n, int num_threads, const std::function<void(int64_t)>& fn);

// Number of threads ParallelFor would use for `num_threads` (resolves 0 to the core count).
int ResolveThreads(int num_threads);

// Returns INVALID_ARGUMENT naming `what` if any element of data[0, n) is NaN or Inf.
Status CheckFiniteSpan(const float* data, int64_t n, const char* what);

// Returns INVALID_ARGUMENT unless head_dim is even and in [2, kMaxHeadDim].
inline constexpr int kMaxHeadDim = 256;
Status CheckHeadDim(int64_t head_dim);

}  // namespace kvd::kernels
