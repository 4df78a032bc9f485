// Shared helpers of the compression kernels: finiteness checks, head_dim check, ParallelFor and
// the CUDA availability probe (asked through the CUDA kernels module, cuda_module.h).
#include "kvd/kernels/types.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "backend_a.h"

#if KVD_HAVE_CUDA
#include "cuda_module.h"
#endif

namespace kvd::kernels {

bool CudaDeviceAvailable() {
#if KVD_HAVE_CUDA
  return CudaKernelsUnavailable(-1).empty();
#else
  return false;
#endif
}

Status CheckCudaBackend(const char* op) {
#if KVD_HAVE_CUDA
  if (std::string why = CudaKernelsUnavailable(-1); !why.empty()) {
    return Status::Unavailable(std::string(op) + ": backend cuda: " + why);
  }
  return Status::Ok();
#else
  return Status::Unimplemented(std::string(op) + ": backend cuda: this build has no CUDA kernels");
#endif
}

Status CheckFinite(ConstMatrixView m, const char* what) {
  for (int64_t i = 0; i < m.rows; ++i) {
    const float* row = m.Row(i);
    bool bad = false;
    for (int64_t j = 0; j < m.cols; ++j) bad |= !std::isfinite(row[j]);
    if (bad) {
      for (int64_t j = 0; j < m.cols; ++j) {
        if (!std::isfinite(row[j])) {
          return Status::InvalidArgument(std::string(what) + ": non-finite value (" +
                                         std::to_string(row[j]) + ") at row " + std::to_string(i) +
                                         " col " + std::to_string(j));
        }
      }
    }
  }
  return Status::Ok();
}

Status CheckFiniteSpan(const float* data, int64_t n, const char* what) {
  return CheckFinite(ConstMatrixView{data, n > 0 ? 1 : 0, n, n}, what);
}

Status CheckHeadDim(int64_t head_dim) {
  if (head_dim < 2 || head_dim > kMaxHeadDim || head_dim % 2 != 0) {
    return Status::InvalidArgument("unsupported head_dim " + std::to_string(head_dim) +
                                   ": must be even and in [2, " + std::to_string(kMaxHeadDim) +
                                   "]");
  }
  return Status::Ok();
}

int ResolveThreads(int num_threads) {
  if (num_threads > 0) return num_threads;
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void ParallelFor(int64_t n, int num_threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(ResolveThreads(num_threads), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace kvd::kernels
