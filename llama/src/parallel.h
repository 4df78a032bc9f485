// Private: a minimal parallel-for (spawns up to `threads - 1` helpers per call).
#pragma once

#include <algorithm>
#include <thread>
#include <vector>

namespace kvd::llama::internal {

// Calls fn(i) for i in [0, n), split into contiguous ranges over `threads` threads.
template <typename Fn>
void ParallelFor(int n, int threads, Fn&& fn) {
  threads = std::max(1, std::min(threads, n));
  if (threads == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  auto range = [&](int t) {
    const int lo = static_cast<int>(int64_t{n} * t / threads);
    const int hi = static_cast<int>(int64_t{n} * (t + 1) / threads);
    for (int i = lo; i < hi; ++i) fn(i);
  };
  for (int t = 1; t < threads; ++t) pool.emplace_back(range, t);
  range(0);
  for (auto& th : pool) th.join();
}

}  // namespace kvd::llama::internal
