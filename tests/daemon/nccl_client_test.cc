// libkvd_client's NCCL option (ClientOptions::nccl) against the in-process daemon.
//
// The join and the device puts and gets run over the seams that stand in for NCCL and CUDA on a
// machine without a GPU: both ends of the link are loopback transports (the client's
// TestHooks::nccl_backend, ServerDeps::nccl_transport), kvd's device staging is FakeDeviceMemory
// and the client's "device" buffers are host buffers that a fake DeviceMemoryOps classifies as CUDA
// memory. What is checked is the client's routing and bookkeeping: device items over the link,
// host items on their usual path in the same call, results in order, the checksum over a host
// copy, and the refusals. The same calls over real NCCL between two GPUs are the device script's
// row (tests/gpu).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>

#include "../storage/fake_device_memory.h"
#include "daemon_test_util.h"
#include "kvd/client/client.h"
#include "kvd/client/device.h"
#include "kvd/storage/device_memory.h"
#include "loopback_client.h"
#include "test_hooks.h"

namespace kvd::daemon::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// "Device" buffers: host memory the client is told is CUDA memory (readable, so the loopback
// link can move it). Copies are memcpy and counted.
class FakeCudaOps final : public client::DeviceMemoryOps {
 public:
  void Add(const void* p, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.insert({reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + n});
  }
  StatusOr<client::BufferLocation> Locate(const void* p) const override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto a = reinterpret_cast<uintptr_t>(p);
    for (const auto& [begin, end] : ranges_) {
      if (a >= begin && a < end) return client::BufferLocation::kCuda;
    }
    return client::BufferLocation::kHost;
  }
  Status CanCopy() const override { return Status::Ok(); }
  Status CopyToHost(void* dst, const void* src, size_t n, void*) const override {
    to_host++;
    std::memcpy(dst, src, n);
    return Status::Ok();
  }
  Status CopyToDevice(void* dst, const void* src, size_t n, void*) const override {
    to_device++;
    std::memcpy(dst, src, n);
    return Status::Ok();
  }
  Status Pin(void*, size_t) const override { return Status::Ok(); }
  void Unpin(void*) const override {}

  mutable std::atomic<int> to_host{0}, to_device{0};

 private:
  mutable std::mutex mu_;
  std::set<std::pair<uintptr_t, uintptr_t>> ranges_;
};

class NcclClientTest : public DaemonTest {
 protected:
  NcclClientTest() {
    deps_.nccl_transport = transport::CreateTransport(LoopbackTransport(loopback_domain_)).value();
    auto memory = std::make_unique<storage::testing::FakeDeviceMemory>(64u << 20);
    memory_ = memory.get();
    deps_.nccl_device_memory = std::move(memory);
  }

  client::ClientOptions Options() const {
    client::ClientOptions o =
        LoopbackClientOptions(TcpAddress(), loopback_domain_, "stories260k", Layout());
    o.nccl = true;
    return o;
  }
  // The link's backend in these clients: loopback, as the daemon's (test_hooks.h).
  static client::TestHooks LoopbackLink() {
    client::TestHooks hooks;
    hooks.nccl_backend = "loopback";
    return hooks;
  }

  storage::testing::FakeDeviceMemory* memory_ = nullptr;  // owned by the daemon
  FakeCudaOps ops_;
};

TEST_F(NcclClientTest, DeviceItemsGoOverTheLinkAndHostItemsKeepTheirPathInOneCall) {
  client::ScopedDeviceMemoryOpsForTesting scoped(&ops_);
  StartDaemon();
  auto c = client::ConnectWithTestHooks(Options(), LoopbackLink());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->session().nccl);
  const size_t n = Layout().ChunkBytes(256);
  auto device_chunk = RandomBytes(n, 51);
  auto host_chunk = RandomBytes(n, 52);
  ops_.Add(device_chunk.data(), n);
  std::vector<int32_t> tokens(512);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + 3);
  auto chain = (*c)->hasher().ChunkChain(tokens, false);
  ASSERT_EQ(chain.size(), 2u);
  std::vector<client::PutItem> puts(2);
  puts[0] = {chain[0], 256, device_chunk.data(), n};
  puts[1] = {chain[1], 256, host_chunk.data(), n};
  auto put = (*c)->PutChunks(puts);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ((*put)[0].bytes, n);
  EXPECT_EQ((*put)[1].bytes, n);
  EXPECT_EQ(memory_->d2h.load(), 1) << "exactly the device chunk arrived in kvd's device staging";
  EXPECT_EQ(ops_.to_host.load(), 1) << "one host copy of the device chunk, for its checksum";

  auto hit = (*c)->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 2u);
  std::vector<uint8_t> device_out(n, 0), host_out(n, 0);
  ops_.Add(device_out.data(), n);
  std::vector<client::GetItem> gets(2);
  gets[0] = {1, host_out.data(), n};
  gets[1] = {0, device_out.data(), n};
  auto got = (*c)->GetChunks(hit->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(host_out, host_chunk);
  EXPECT_EQ(device_out, device_chunk);
  EXPECT_EQ((*got)[1].checksum, Checksum64(device_chunk.data(), n));
  EXPECT_EQ(memory_->h2d.load(), 1) << "only the device get was staged in kvd's device memory";
  EXPECT_EQ(ops_.to_host.load(), 2) << "one host copy of the received device chunk";
  EXPECT_EQ(ops_.to_device.load(), 0) << "nothing was staged through host memory";
  EXPECT_TRUE((*c)->ReleaseLease(hit->lease_id).ok());
  c->reset();
  EXPECT_TRUE(WaitReservedBytes(0));
}

TEST_F(NcclClientTest, TheOptionIsValidatedAndARealLinkIsRefusedWithTheReasonWithoutAGpu) {
  StartDaemon();
  client::ClientOptions admin = Options();
  admin.role = client::Role::kAdmin;
  Status v = admin.Validate();
  EXPECT_EQ(v.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(v.message(), HasSubstr("nccl needs the engine role"));

  if (storage::CudaDeviceUnavailableReason(0).empty()) {
    GTEST_SKIP() << "CUDA device 0 is present: NCCL can start here (the refusal needs a machine "
                    "without a device)";
  }
  client::ClientOptions real = Options();
  auto c = client::Client::Connect(real);  // the real backend in this client
  ASSERT_FALSE(c.ok()) << "an NCCL transport started without a CUDA device";
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status();
  EXPECT_THAT(c.status().message(),
              HasSubstr("ClientOptions::nccl: creating this client's NCCL transport"));
  EXPECT_THAT(c.status().message(),
              AnyOf(HasSubstr("built without NCCL"), HasSubstr("no CUDA device")));
  // Without the option the same client connects and puts.
  real.nccl = false;
  auto plain = client::Client::Connect(real);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE((*plain)->session().nccl);
}

}  // namespace
}  // namespace kvd::daemon::testing
