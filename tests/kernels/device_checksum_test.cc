// The device checksum (kvd/kernels/device_checksum.h): its CPU twin equals kvd::Checksum64 for
// every length class of xxh3 (short forms, one partial block, block edges, many blocks) and
// unaligned starts, here; the CUDA kernels equal it too, on a GPU (DeviceChecksumCuda, run by
// tests/gpu/run_device_checks.sh). Integer arithmetic only: equality is exact.
#include "kvd/kernels/device_checksum.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/kernels/types.h"

#if KVD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvd::kernels {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n + 8);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Every length up to 2100 (the short forms, 241..1024 with no full block, the edges of the first
// two blocks), block multiples +-1, and a few larger inputs (many blocks, the last one partial).
std::vector<size_t> Lengths() {
  std::vector<size_t> out;
  for (size_t n = 0; n <= 2100; ++n) out.push_back(n);
  for (size_t k : {3, 4, 7, 16, 100, 1000}) {
    for (int d : {-65, -64, -1, 0, 1, 63, 64}) out.push_back(k * 1024 + d);
  }
  out.push_back((5u << 20) + 77);  // a 5 MiB chunk and a bit
  return out;
}

TEST(DeviceChecksum, TheBlockedTwinEqualsChecksum64ForEveryLengthAndAlignment) {
  const auto data = Bytes((5u << 20) + 77, 42);
  for (size_t n : Lengths()) {
    for (size_t offset : {0, 1, 3}) {
      if (n > 3000 && offset == 3) continue;
      const uint8_t* p = data.data() + offset;
      ASSERT_EQ(Checksum64Blocked(p, n), Checksum64(p, n)) << "bytes " << n << " offset " << offset;
    }
  }
}

TEST(DeviceChecksum, ReportsWhyItCannotRun) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: DeviceChecksumCuda runs";
  uint8_t host[4] = {1, 2, 3, 4};
  auto h = DeviceChecksum64(host, sizeof host);
#if KVD_HAVE_CUDA
  EXPECT_EQ(h.status().code(), StatusCode::kUnavailable) << h.status();
  EXPECT_EQ(h.status().message(), "DeviceChecksum64: no CUDA device is visible");
#else
  EXPECT_EQ(h.status().code(), StatusCode::kUnimplemented) << h.status();
  EXPECT_EQ(h.status().message(), "DeviceChecksum64: this build has no CUDA kernels");
#endif
  auto null = DeviceChecksum64(nullptr, 8);
  EXPECT_EQ(null.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(null.status().message(), "DeviceChecksum64: null data for 8 bytes");
}

#if KVD_HAVE_CUDA
TEST(DeviceChecksumCuda, EqualsChecksum64BitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DeviceChecksum64";
  const auto data = Bytes((5u << 20) + 77, 43);
  uint8_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, data.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d, data.data(), data.size(), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (size_t n : Lengths()) {
    for (size_t offset : {0, 1}) {  // 1: the unaligned (byte-read) path
      if (n > 3000 && n % 7 != 0 && offset == 1) continue;
      auto h = DeviceChecksum64(d + offset, n, n % 2 == 0 ? stream : nullptr);
      ASSERT_TRUE(h.ok()) << h.status();
      ASSERT_EQ(*h, Checksum64(data.data() + offset, n)) << "bytes " << n << " offset " << offset;
    }
  }
  cudaStreamDestroy(stream);
  cudaFree(d);
}
#endif

}  // namespace
}  // namespace kvd::kernels
