// CUDA device memory through the UCX backend: registration (ucp_mem_map of device memory), tagged
// send/recv between device buffers and RMA on a device region, all behind
// Capabilities::cuda_memory. Debian's UCX 1.13 has no CUDA support, and the libucx-cu1x wheel
// (KVD_UCX=wheel) reports it only where its CUDA module loads (the NVIDIA driver is present):
// elsewhere the refusal case runs and the device cases skip with the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if KVD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kvd/common/cuda_runtime.h"
#endif

#include "kvd/transport/transport.h"
#include "test_util.h"

namespace kvd::transport {
namespace {

using std::chrono::milliseconds;
using testing::FillPattern;
using testing::FirstMismatch;
using ::testing::HasSubstr;

// UCX with all its transports on loopback (naming cuda_copy/cuda_ipc in UCX_TLS would warn on a
// UCX without them); cma_threshold_bytes stays
// at its default, so host sends of >= 64 KiB take the descriptor path.
TransportOptions CudaOptions() {
  TransportOptions o = testing::OptionsFor("ucx-sm");
  UcxOptions& ucx = MutableBackendOptions<UcxOptions>(&o);
  ucx.ucx_tls = "";       // UCX's choice: every transport it has (cuda_copy, cuda_ipc where built)
  ucx.enable_rma = true;  // RmaReadsAndWritesADeviceRegion (off by default: see ucx_options.h)
  return o;
}

TransferRequest Request(TransferOp op, PeerHandle peer, uint64_t tag, void* buffer, size_t length,
                        MemoryType type, RemoteRegionHandle remote = {}) {
  TransferRequest r;
  r.op = op;
  r.peer = peer;
  r.tag = tag;
  r.buffer = buffer;
  r.length = length;
  r.memory_type = type;
  r.remote = remote;
  return r;
}

// Why the device cases cannot run here, or "" when they can.
std::string DeviceSkipReason(const Transport& t) {
#if KVD_HAVE_CUDA
  if (!t.capabilities().cuda_memory) {
    return t.capabilities().library +
           " reports no CUDA memory type (Debian's UCX has none; the libucx-cu1x wheel, "
           "KVD_UCX=wheel, needs the NVIDIA driver)";
  }
  return CudaDeviceUnavailable(0);
#else
  return "built without CUDA (KVD_WITH_CUDA=OFF or no nvcc)";
#endif
}

class UcxCudaMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = CreateTransport(CudaOptions());
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateTransport(CudaOptions());
    ASSERT_TRUE(b.ok()) << b.status();
    a_ = std::move(a).value();
    b_ = std::move(b).value();
    auto a_addr = a_->LocalAddress();
    auto b_addr = b_->LocalAddress();
    ASSERT_TRUE(a_addr.ok() && b_addr.ok());
    auto ab = a_->Connect(*b_addr);
    ASSERT_TRUE(ab.ok()) << ab.status();
    auto ba = b_->Connect(*a_addr);
    ASSERT_TRUE(ba.ok()) << ba.status();
    a_to_b_ = *ab;
    b_to_a_ = *ba;
  }

  // Progresses both transports until both transfers finished (UCX needs both workers driven).
  void Drive(TransferHandle x, Transport& tx, TransferHandle y, Transport& ty) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (tx.Check(x).state == TransferState::kInProgress ||
           ty.Check(y).state == TransferState::kInProgress) {
      a_->Progress();
      b_->Progress();
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "transfer hung";
    }
  }

  std::unique_ptr<Transport> a_, b_;
  PeerHandle a_to_b_, b_to_a_;
};

TEST_F(UcxCudaMemoryTest, CudaMemoryIsRefusedWithTheReasonWithoutSupport) {
  if (a_->capabilities().cuda_memory) {
    GTEST_SKIP() << a_->capabilities().library
                 << " supports CUDA memory: the device cases cover it";
  }
  EXPECT_FALSE(a_->capabilities().library.empty());
  auto alloc = a_->AllocateRegistered(4096, MemoryType::kCuda);
  EXPECT_EQ(alloc.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(alloc.status().message(), HasSubstr("without CUDA support"));
  uint64_t word = 0;  // never touched: registration is refused before UCX sees it
  auto reg = a_->RegisterMemory(&word, sizeof(word), MemoryType::kCuda);
  EXPECT_EQ(reg.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(reg.status().message(), HasSubstr("cuda"));
  TransferRequest send =
      Request(TransferOp::kSend, a_to_b_, 7, &word, sizeof(word), MemoryType::kCuda);
  auto post = a_->Post(send);
  EXPECT_EQ(post.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(post.status().message(), HasSubstr("stage CUDA buffers through host memory"));
  // Host memory still moves.
  uint64_t got = 0;
  word = 0x1234;
  auto recv = b_->PostRecv(b_to_a_, 8, &got, sizeof(got));
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto sent = a_->PostSend(a_to_b_, 8, &word, sizeof(word));
  ASSERT_TRUE(sent.ok()) << sent.status();
  Drive(*recv, *b_, *sent, *a_);
  EXPECT_EQ(got, 0x1234u);
  EXPECT_TRUE(a_->Release(*sent).ok());
  EXPECT_TRUE(b_->Release(*recv).ok());
}

#if KVD_HAVE_CUDA
// Host pattern -> device, and back for the check.
void ToDevice(void* dev, uint64_t seed, size_t n) {
  std::vector<uint8_t> host(n);
  FillPattern(seed, host.data(), n);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
}
size_t DeviceMismatch(const void* dev, uint64_t seed, size_t n) {
  std::vector<uint8_t> host(n);
  if (cudaMemcpy(host.data(), dev, n, cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
  return FirstMismatch(seed, host.data(), n);
}

TEST_F(UcxCudaMemoryTest, DeviceToDeviceSendRecvOfEverySize) {
  if (std::string why = DeviceSkipReason(*a_); !why.empty()) GTEST_SKIP() << why;
  constexpr size_t kMax = size_t{16} << 20;
  auto src = a_->AllocateRegistered(kMax, MemoryType::kCuda);  // ucp_mem_map(ALLOCATE) on device
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ(src->memory_type, MemoryType::kCuda);
  void* dst_mem = nullptr;
  ASSERT_EQ(cudaMalloc(&dst_mem, kMax), cudaSuccess);
  auto dst = b_->RegisterMemory(dst_mem, kMax, MemoryType::kCuda);
  ASSERT_TRUE(dst.ok()) << dst.status();
  uint64_t tag = 100;
  for (size_t n : {size_t{8}, size_t{4096}, size_t{1} << 20, kMax}) {
    SCOPED_TRACE(n);
    ++tag;
    ToDevice(src->data, tag, n);
    ASSERT_EQ(cudaMemset(dst_mem, 0, kMax), cudaSuccess);
    TransferRequest recv = Request(TransferOp::kRecv, b_to_a_, tag, dst_mem, n, MemoryType::kCuda);
    TransferRequest send =
        Request(TransferOp::kSend, a_to_b_, tag, src->data, n, MemoryType::kCuda);
    auto r = b_->Post(recv);
    ASSERT_TRUE(r.ok()) << r.status();
    auto s = a_->Post(send);
    ASSERT_TRUE(s.ok()) << s.status();
    Drive(*r, *b_, *s, *a_);
    TransferStatus rs = b_->Check(*r);
    ASSERT_EQ(rs.state, TransferState::kDone) << rs.status;
    EXPECT_EQ(rs.bytes, n);
    EXPECT_EQ(DeviceMismatch(dst_mem, tag, n), n);
    EXPECT_TRUE(a_->Release(*s).ok());
    EXPECT_TRUE(b_->Release(*r).ok());
  }
  EXPECT_TRUE(b_->DeregisterMemory(dst->handle).ok());
  EXPECT_TRUE(a_->DeregisterMemory(src->handle).ok());
  cudaFree(dst_mem);
}

TEST_F(UcxCudaMemoryTest, RmaReadsAndWritesADeviceRegion) {
  if (std::string why = DeviceSkipReason(*a_); !why.empty()) GTEST_SKIP() << why;
  constexpr size_t kBytes = size_t{4} << 20;
  auto region = b_->AllocateRegistered(kBytes, MemoryType::kCuda);
  ASSERT_TRUE(region.ok()) << region.status();
  ToDevice(region->data, 5, kBytes);
  auto exported = b_->ExportRegion(region->handle);
  ASSERT_TRUE(exported.ok()) << exported.status();
  auto remote = a_->ImportRegion(a_to_b_, *exported);
  ASSERT_TRUE(remote.ok()) << remote.status();
  // Read device -> host, then write host -> device, both one-sided.
  std::vector<uint8_t> host(kBytes, 0);
  TransferRequest read =
      Request(TransferOp::kRead, a_to_b_, 0, host.data(), kBytes, MemoryType::kHost, *remote);
  auto rd = a_->Post(read);
  ASSERT_TRUE(rd.ok()) << rd.status();
  Drive(*rd, *a_, *rd, *a_);
  ASSERT_EQ(a_->Check(*rd).state, TransferState::kDone) << a_->Check(*rd).status;
  EXPECT_EQ(FirstMismatch(5, host.data(), kBytes), kBytes);
  EXPECT_TRUE(a_->Release(*rd).ok());
  FillPattern(6, host.data(), kBytes);
  TransferRequest write =
      Request(TransferOp::kWrite, a_to_b_, 0, host.data(), kBytes, MemoryType::kHost, *remote);
  auto wr = a_->Post(write);
  ASSERT_TRUE(wr.ok()) << wr.status();
  Drive(*wr, *a_, *wr, *a_);
  ASSERT_EQ(a_->Check(*wr).state, TransferState::kDone) << a_->Check(*wr).status;
  EXPECT_EQ(DeviceMismatch(region->data, 6, kBytes), kBytes);
  EXPECT_TRUE(a_->Release(*wr).ok());
  EXPECT_TRUE(a_->ReleaseRemoteRegion(*remote).ok());
  EXPECT_TRUE(b_->DeregisterMemory(region->handle).ok());
}
#else
TEST_F(UcxCudaMemoryTest, DeviceToDeviceSendRecvOfEverySize) {
  GTEST_SKIP() << DeviceSkipReason(*a_);
}
#endif

}  // namespace
}  // namespace kvd::transport
