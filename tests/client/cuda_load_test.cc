// libkvd_client loads the CUDA runtime, NCCL and the CUDA kernels module on first device use, not
// at program start: a client process that only moves host buffers maps none of them, and device
// use on a machine without a GPU (or without the libraries) is a typed error, never a crash.
// Its own binary: nothing else may have used a device earlier in this process. ctest runs it
// twice: as it is, and with the libraries pointed at paths that do not exist
// (client_cuda_load_test_without_libraries).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "fake_daemon.h"
#include "kvd/client/client.h"
#include "kvd/kernels/device_checksum.h"
#include "kvd/kernels/types.h"

#if KVD_HAVE_CUDA
#include "kvd/common/cuda_runtime.h"
#endif

namespace kvd::client {
namespace {

// The files of /proc/self/maps whose name holds one of `names`.
std::vector<std::string> Mapped(const std::vector<std::string>& names) {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> out;
  for (std::string line; std::getline(maps, line);) {
    const size_t slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    const std::string file = line.substr(slash + 1);
    for (const std::string& n : names) {
      if (file.find(n) != std::string::npos && (out.empty() || out.back() != line)) {
        out.push_back(line.substr(line.find('/')));
      }
    }
  }
  return out;
}

const std::vector<std::string> kCudaLibraries = {"libcudart", "libnccl", "libcuda.so",
                                                 "libkvd_kernels_cuda"};

std::string Joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += "\n  " + l;
  return s;
}

// Asserts that no CUDA library is mapped yet when this is the first case of the process (ctest
// runs each case in its own process; a whole-binary run has the earlier cases' libraries).
void ExpectNothingMappedIfFirst() {
  static bool first = true;
  const bool was_first = std::exchange(first, false);
  if (was_first) {
    ASSERT_TRUE(Mapped(kCudaLibraries).empty())
        << "mapped at start:" << Joined(Mapped(kCudaLibraries));
  }
}

// True when this run points the libraries at missing paths (the second ctest entry).
bool LibrariesHidden() {
  const char* module = std::getenv("KVD_KERNELS_CUDA_MODULE");
  return module != nullptr && std::string(module).find("/nonexistent/") != std::string::npos;
}

TEST(ClientCudaLoadTest, AClientThatMovesHostBuffersMapsNoCudaLibrary) {
  ExpectNothingMappedIfFirst();
  if (!Mapped(kCudaLibraries).empty()) GTEST_SKIP() << "an earlier case loaded them";

  const std::string domain = "client-cuda-load-test";
  testing::FakeDaemon daemon(domain, {});
  testing::PutAndGetOneHostChunk(daemon, domain, {3, 4});
  EXPECT_TRUE(Mapped(kCudaLibraries).empty())
      << "a host-only client mapped:" << Joined(Mapped(kCudaLibraries));
}

TEST(ClientCudaLoadTest, DeviceUseWithoutAGpuIsATypedErrorAndLoadsTheLibrariesOnlyThen) {
  ExpectNothingMappedIfFirst();
  // The first device use: is there a device? (It loads the kernels module.)
  if (!LibrariesHidden() && kernels::CudaDeviceAvailable()) {
    GTEST_SKIP() << "a CUDA device is present (tests/gpu/run_device_checks.sh covers it)";
  }
  // The kernels: a device checksum, refused without a device.
  std::vector<uint8_t> host(4096, 1);
  auto sum = kernels::DeviceChecksum64(host.data(), host.size(), nullptr);
  ASSERT_FALSE(sum.ok());
#if KVD_HAVE_CUDA
  EXPECT_EQ(sum.status().code(), StatusCode::kUnavailable) << sum.status();
#else
  EXPECT_EQ(sum.status().code(), StatusCode::kUnimplemented) << sum.status();
#endif

  // The client: joining kvd's NCCL link needs an NCCL transport on a CUDA device.
  const std::string domain = "client-cuda-load-test-nccl";
  testing::FakeDaemon daemon(domain, {});
  ClientOptions options = testing::TinyClientOptions(daemon, domain);
  options.nccl = true;
  auto client = Client::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kUnavailable) << client.status();

#if KVD_HAVE_CUDA
  if (LibrariesHidden()) {
    // Each error names what it could not load.
    EXPECT_NE(client.status().message().find("/nonexistent/"), std::string::npos)
        << client.status();
    EXPECT_TRUE(Mapped(kCudaLibraries).empty()) << Joined(Mapped(kCudaLibraries));
  } else {
    // Now, and only now, the kernels module and the runtime are in the process.
    const std::vector<std::string> mapped = Mapped(kCudaLibraries);
    EXPECT_NE(Joined(mapped).find("libkvd_kernels_cuda.so"), std::string::npos) << Joined(mapped);
    EXPECT_NE(Joined(mapped).find("libcudart"), std::string::npos) << Joined(mapped);
  }
#endif
}

// On a GPU machine (tests/gpu/run_device_checks.sh): the first device use loads the runtime and
// the kernels module, and they work: the device checksum of device memory equals the host's.
TEST(ClientCudaLoadTest, WithAGpuTheFirstDeviceUseLoadsTheLibrariesAndTheyWork) {
#if !KVD_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (LibrariesHidden()) GTEST_SKIP() << "the libraries are hidden in this run";
  ExpectNothingMappedIfFirst();
  auto rt = CudaRuntimeForDevice(0);
  if (!rt.ok()) GTEST_SKIP() << rt.status();
  std::vector<uint8_t> host(1 << 20);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 31 + 7);
  void* device = nullptr;
  ASSERT_EQ((*rt)->Malloc(&device, host.size()), cudaSuccess);
  ASSERT_EQ((*rt)->MemcpyAsync(device, host.data(), host.size(), cudaMemcpyHostToDevice, nullptr),
            cudaSuccess);
  ASSERT_EQ((*rt)->StreamSynchronize(nullptr), cudaSuccess);
  auto sum = kernels::DeviceChecksum64(device, host.size(), nullptr);
  (*rt)->Free(device);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(*sum, kernels::Checksum64Blocked(host.data(), host.size()));
  const std::string mapped = Joined(Mapped(kCudaLibraries));
  EXPECT_NE(mapped.find("libkvd_kernels_cuda.so"), std::string::npos) << mapped;
  EXPECT_NE(mapped.find("libcudart"), std::string::npos) << mapped;
#endif
}

}  // namespace
}  // namespace kvd::client
