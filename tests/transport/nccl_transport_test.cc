// The nccl backend: what runs without a GPU (bootstrap codec, option validation, registry and a
// clean UNAVAILABLE), and a device-to-device exchange between two transports of this process where
// a GPU is present (NcclCudaTest; tests/gpu/run_device_checks.sh runs it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#if KVD_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

#include "kvd/transport/transport.h"
#include "nccl/nccl_bootstrap.h"
#include "nccl/nccl_transport.h"
#include "test_util.h"

namespace kvd::transport {
namespace {

using ::testing::HasSubstr;
using namespace nccl;  // NOLINT: the codec under test

TEST(NcclBootstrapTest, AddressRoundTripsAndBadBytesAreNamed) {
  NcclAddress a{0x1234567890abcdefULL, 42, 3, "node-7"};
  const std::string bytes = EncodeAddress(a);
  auto back = DecodeAddress(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, a);
  EXPECT_THAT(DecodeAddress("KVDUCX1:whatever").status().message(),
              HasSubstr("not an NCCL transport address"));
  EXPECT_THAT(DecodeAddress(bytes.substr(0, 20)).status().message(), HasSubstr("truncated"));
  EXPECT_THAT(DecodeAddress(bytes + "x").status().message(), HasSubstr("its host name says"));
  std::string bad_version = bytes;
  bad_version[8] = 9;
  EXPECT_THAT(DecodeAddress(bad_version).status().message(), HasSubstr("version 9"));
  NcclAddress zero = a;
  zero.uuid = 0;
  EXPECT_THAT(DecodeAddress(EncodeAddress(zero)).status().message(), HasSubstr("uuid 0"));
  NcclAddress neg = a;
  neg.device = -1;
  EXPECT_THAT(DecodeAddress(EncodeAddress(neg)).status().message(), HasSubstr("device -1"));
  // A host name longer than the one-byte length field is cut, not corrupting the frame.
  NcclAddress long_host = a;
  long_host.host = std::string(300, 'h');
  auto cut = DecodeAddress(EncodeAddress(long_host));
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->host.size(), 255u);
}

TEST(NcclBootstrapTest, BootstrapRoundTripsBothUniqueIds) {
  NcclBootstrap b;
  b.from_uuid = 11;
  b.to_uuid = 22;
  for (size_t i = 0; i < kUniqueIdBytes; ++i) {
    b.forward[i] = static_cast<char>(i);
    b.backward[i] = static_cast<char>(255 - i);
  }
  const std::string bytes = EncodeBootstrap(b);
  EXPECT_EQ(bytes.size(), 8 + 16 + 2 * kUniqueIdBytes);
  auto back = DecodeBootstrap(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, b);
  EXPECT_THAT(DecodeBootstrap(bytes.substr(0, 100)).status().message(), HasSubstr("expected 280"));
  EXPECT_THAT(DecodeBootstrap("KVDNCCL1" + bytes.substr(8)).status().message(),
              HasSubstr("not NCCL bootstrap bytes"));
  b.to_uuid = 0;
  EXPECT_THAT(DecodeBootstrap(EncodeBootstrap(b)).status().message(), HasSubstr("zero"));
}

TEST(NcclOptionsTest, NcclFieldsAreValidated) {
  TransportOptions o;
  o.backend = "nccl";
  EXPECT_TRUE(o.Validate().ok());
  MutableBackendOptions<NcclOptions>(&o).nccl_device = -1;
  EXPECT_THAT(o.Validate().message(), HasSubstr("nccl_device is negative"));
  MutableBackendOptions<NcclOptions>(&o).nccl_device = 0;
  MutableBackendOptions<NcclOptions>(&o).nccl_init_timeout_ms = 0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("nccl_init_timeout_ms must be > 0"));
}

TEST(NcclTransportTest, RegisteredAndUnavailableWithTheReasonWithoutAGpu) {
  auto names = RegisteredTransportBackends();
  EXPECT_NE(std::find(names.begin(), names.end(), "nccl"), names.end());
  const std::string why = NcclUnavailableReason(0);
  if (why.empty()) GTEST_SKIP() << "a GPU is present: NcclCudaTest covers the backend";
  TransportOptions o;
  o.backend = "nccl";
  auto t = CreateTransport(o);
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(t.status().message(), HasSubstr(why));
}

#if KVD_HAVE_NCCL
// Two transports of this process on devices 0 and 1 (or both on 0 with one GPU, which NCCL may
// refuse as a duplicate GPU: then the test skips with NCCL's message).
TEST(NcclCudaTest, DeviceToDeviceSendRecvThroughTheBootstrap) {
  if (std::string why = NcclUnavailableReason(0); !why.empty()) GTEST_SKIP() << why;
  int count = 0;
  cudaGetDeviceCount(&count);
  TransportOptions oa, ob;
  oa.backend = ob.backend = "nccl";
  MutableBackendOptions<NcclOptions>(&ob).nccl_device = count > 1 ? 1 : 0;
  MutableBackendOptions<NcclOptions>(&oa).nccl_init_timeout_ms = 20000;
  MutableBackendOptions<NcclOptions>(&ob).nccl_init_timeout_ms = 20000;
  auto a = CreateTransport(oa);
  auto b = CreateTransport(ob);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " / " << b.status();
  EXPECT_TRUE((*a)->capabilities().cuda_memory);
  EXPECT_FALSE((*a)->capabilities().host_memory);
  // Host memory is refused with the advice to use ucx.
  uint64_t word = 0;
  EXPECT_EQ((*a)->RegisterMemory(&word, 8, MemoryType::kHost).status().code(),
            StatusCode::kUnimplemented);
  // B's address -> A connects (rank 0), A's bootstrap bytes -> B connects (rank 1).
  auto a_to_b = (*a)->Connect(*(*b)->LocalAddress());
  ASSERT_TRUE(a_to_b.ok()) << a_to_b.status();
  auto boot = (*a)->PeerBootstrap(*a_to_b);
  ASSERT_TRUE(boot.ok() && !boot->empty());
  auto b_to_a = (*b)->Connect(*boot);
  ASSERT_TRUE(b_to_a.ok()) << b_to_a.status();
  constexpr size_t kMax = size_t{8} << 20;
  auto src = (*a)->AllocateRegistered(kMax, MemoryType::kCuda);
  auto dst = (*b)->AllocateRegistered(kMax, MemoryType::kCuda);
  ASSERT_TRUE(src.ok() && dst.ok());
  uint64_t tag = 1;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, kMax}) {
    SCOPED_TRACE(n);
    ++tag;
    std::vector<uint8_t> host(n), back(n);
    testing::FillPattern(tag, host.data(), n);
    cudaSetDevice(BackendOptionsOf<NcclOptions>(oa).nccl_device);
    if (n > 0) {
      ASSERT_EQ(cudaMemcpy(src->data, host.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    }
    TransferRequest send, recv;
    send.op = TransferOp::kSend;
    send.peer = *a_to_b;
    send.tag = tag;
    send.buffer = src->data;
    send.length = n;
    send.memory_type = MemoryType::kCuda;
    recv = send;
    recv.op = TransferOp::kRecv;
    recv.peer = *b_to_a;
    recv.buffer = dst->data;
    recv.length = kMax;
    auto r = (*b)->Post(recv);
    auto s = (*a)->Post(send);
    ASSERT_TRUE(r.ok() && s.ok()) << r.status() << " / " << s.status();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((*b)->Check(*r).state == TransferState::kInProgress ||
           (*a)->Check(*s).state == TransferState::kInProgress) {
      (*a)->Progress();
      (*b)->Progress();
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "nccl transfer hung";
    }
    TransferStatus rs = (*b)->Check(*r);
    if (!rs.status.ok() && rs.status.message().find("Duplicate GPU") != std::string::npos) {
      GTEST_SKIP() << "NCCL refuses two ranks on one GPU: " << rs.status;
    }
    ASSERT_EQ(rs.state, TransferState::kDone) << rs.status;
    EXPECT_EQ(rs.bytes, n);
    cudaSetDevice(BackendOptionsOf<NcclOptions>(ob).nccl_device);
    if (n > 0) {
      ASSERT_EQ(cudaMemcpy(back.data(), dst->data, n, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    EXPECT_EQ(testing::FirstMismatch(tag, back.data(), n), n);
    EXPECT_TRUE((*a)->Release(*s).ok());
    EXPECT_TRUE((*b)->Release(*r).ok());
  }
  // The peer going away fails what is waiting for it.
  TransferRequest late;
  late.op = TransferOp::kRecv;
  late.peer = *b_to_a;
  late.tag = 999;
  late.buffer = dst->data;
  late.length = 16;
  late.memory_type = MemoryType::kCuda;
  auto waiting = (*b)->Post(late);
  ASSERT_TRUE(waiting.ok());
  EXPECT_TRUE((*b)->Disconnect(*b_to_a).ok());
  EXPECT_EQ((*b)->Check(*waiting).status.code(), StatusCode::kCancelled);
  EXPECT_TRUE((*b)->Release(*waiting).ok());
}
#endif

}  // namespace
}  // namespace kvd::transport
