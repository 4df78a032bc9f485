// The client's device side (kvd/client/device.h, kvd/client/expand.h) on a real GPU:
//   - expansion into cudaMalloc'd buffers equals the CPU expansion of the same compact chunks
//     bit for bit (dense and compact forms, float32/float16/bfloat16, with VECTOR-routed slots);
//   - put from and get into device buffers through a real kvd, over shared memory and over the
//     transport, byte-exact;
//   - the same over kvd's NCCL link (ClientOptions::nccl) with two GPUs, and on one GPU (where
//     NCCL refuses the pair) a bounded failure after which kvd serves on.
// Without a device those cases skip with the reason (tests/gpu/run_device_checks.sh runs them);
// the host-only cases here check what the client says when it cannot run on a device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "e2e_common.h"
#include "fake_device_ops.h"
#include "kvd/client/device.h"
#include "kvd/client/expand.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/serving.h"
#include "kvd/kernels/types.h"
#include "serving_cases.h"

#if KVD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvd::e2e {
namespace {

namespace kk = kvd::kernels;
using ::testing::HasSubstr;

ModelLayout LayoutOf(const kk::testing::ServingCase& f) {
  ModelLayout l;
  l.num_layers = f.chunk.num_layers;
  l.num_kv_heads = f.chunk.num_kv_heads;
  l.num_q_heads = f.chunk.num_kv_heads;
  l.head_dim = f.chunk.head_dim;
  l.dtype = f.chunk.dtype;
  l.rope = f.rope_config;
  return l;
}

// A reader over the encoded bytes of `f.chunk` for its layout (weights set when routed).
std::unique_ptr<client::CompactChunkReader> Reader(kk::testing::ServingCase& f, bool routed) {
  ModelLayout layout = LayoutOf(f);
  f.chunk.layout_digest = layout.Digest();
  auto bytes = kk::EncodeCompactChunk(f.chunk);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok()) return nullptr;
  auto r = client::CompactChunkReader::Open(*bytes, layout);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  if (routed) {
    EXPECT_TRUE((*r)->SetWeights(f.weights.Serialize()).ok());
  }
  return std::move(r).value();
}

TEST(DeviceClient, ExpansionIntoDeviceBuffersWithoutADeviceIsUnavailable) {
  if (kk::CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: the CUDA cases run";
  FakeDeviceOps device;  // classifies its pages as device memory; no kernel may touch them
  client::ScopedDeviceMemoryOpsForTesting seam(&device);
  auto f = kk::testing::MakeCase(DType::kBFloat16, 2, 2, 64, 10, false, 5);
  auto reader = Reader(f, false);
  ASSERT_NE(reader, nullptr);
  const int64_t t = reader->DenseTokens().value();
  const size_t bytes = static_cast<size_t>(t) * 2 * 64 * 2;
  void* k = device.Allocate(bytes);
  void* v = device.Allocate(bytes);
  Status s = reader->DenseLayer(0, {k, v}, static_cast<int>(t));
#if KVD_HAVE_CUDA
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("no CUDA device"));
#else
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
#endif
  // Mixed host and device buffers in one call: refused before anything runs.
  std::vector<uint8_t> host(bytes);
  s = reader->DenseLayer(0, {host.data(), v}, static_cast<int>(t));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "DenseLayer: the buffers mix host and CUDA device memory");
  // The CPU path is unchanged.
  std::vector<uint8_t> hk(bytes), hv(bytes);
  EXPECT_TRUE(reader->DenseLayer(0, {hk.data(), hv.data()}, static_cast<int>(t)).ok());
  EXPECT_TRUE(device.copies().empty());
}

TEST(DeviceClient, ExpansionIntoDeviceBuffersIsRefusedWhenTheBuildCannotCopy) {
  FakeDeviceOps device;
  device.can_copy = Status::Unimplemented("libkvd_client was built without CUDA");
  client::ScopedDeviceMemoryOpsForTesting seam(&device);
  auto f = kk::testing::MakeCase(DType::kFloat16, 1, 2, 64, 6, false, 6);
  auto reader = Reader(f, false);
  ASSERT_NE(reader, nullptr);
  std::vector<client::CompactHeadOut> heads(2);
  for (auto& h : heads) {
    h.keys = static_cast<float*>(device.Allocate(6 * 64 * 4));
    h.values = static_cast<float*>(device.Allocate(6 * 64 * 4));
    h.bias = static_cast<float*>(device.Allocate(6 * 4));
    h.capacity_slots = 6;
  }
  Status s = reader->CompactLayer(0, heads);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_EQ(s.message(),
            "CompactLayer is CUDA device memory: libkvd_client was built without CUDA");
}

#if KVD_HAVE_CUDA

struct DeviceBytes {
  explicit DeviceBytes(size_t n) : n(n) { EXPECT_EQ(cudaMalloc(&p, n + 1), cudaSuccess); }
  ~DeviceBytes() { cudaFree(p); }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  void Write(const std::vector<uint8_t>& in) {
    EXPECT_EQ(cudaMemcpy(p, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void* p = nullptr;
  size_t n;
};

TEST(DeviceClientCuda, ExpansionOnTheDeviceEqualsTheCpuBitForBit) {
  if (!kk::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: expansion on the device";
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool routed : {false, true}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + (routed ? " routed" : ""));
      auto f = kk::testing::MakeCase(dtype, 4, 3, 64, 131, routed, 77);
      auto reader = Reader(f, routed);
      ASSERT_NE(reader, nullptr);
      const int64_t t = reader->DenseTokens().value();
      const size_t half = static_cast<size_t>(t) * 3 * 64 * DTypeSize(dtype);
      const int H = 3;
      for (int l = 0; l < 4; ++l) {
        std::vector<uint8_t> k(half), v(half);
        ASSERT_TRUE(reader->DenseLayer(l, {k.data(), v.data()}, static_cast<int>(t)).ok());
        DeviceBytes dk(half), dv(half);
        Status s = reader->DenseLayer(l, {dk.p, dv.p}, static_cast<int>(t), stream);
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        EXPECT_TRUE(dk.Read() == k) << "dense K, layer " << l;
        EXPECT_TRUE(dv.Read() == v) << "dense V, layer " << l;

        std::vector<std::vector<float>> hk(H), hv(H), hb(H);
        std::vector<std::vector<int64_t>> hp(H);
        std::vector<client::CompactHeadOut> host(H), dev(H);
        std::vector<std::unique_ptr<DeviceBytes>> keep;
        for (int h = 0; h < H; ++h) {
          const int64_t s_slots = reader->Slots(l, h);
          hk[h].resize(s_slots * 64);
          hv[h].resize(s_slots * 64);
          hb[h].resize(s_slots);
          hp[h].resize(s_slots);
          host[h] = {hk[h].data(), hv[h].data(), hb[h].data(), hp[h].data(), s_slots};
          for (size_t n : {s_slots * 64 * 4, s_slots * 64 * 4, s_slots * 4, s_slots * 8}) {
            keep.push_back(std::make_unique<DeviceBytes>(static_cast<size_t>(n)));
          }
          auto* base = &keep[keep.size() - 4];
          dev[h] = {static_cast<float*>(base[0]->p), static_cast<float*>(base[1]->p),
                    static_cast<float*>(base[2]->p), static_cast<int64_t*>(base[3]->p), s_slots};
        }
        ASSERT_TRUE(reader->CompactLayer(l, host).ok());
        ASSERT_TRUE(reader->CompactLayer(l, dev, stream).ok());
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        for (int h = 0; h < H; ++h) {
          auto bytes_of = [](const auto& vec) {
            const auto* p = reinterpret_cast<const uint8_t*>(vec.data());
            return std::vector<uint8_t>(p, p + vec.size() * sizeof(vec[0]));
          };
          EXPECT_TRUE(keep[4 * h + 0]->Read() == bytes_of(hk[h])) << "keys " << l << "/" << h;
          EXPECT_TRUE(keep[4 * h + 1]->Read() == bytes_of(hv[h])) << "values " << l << "/" << h;
          EXPECT_TRUE(keep[4 * h + 2]->Read() == bytes_of(hb[h])) << "bias " << l << "/" << h;
          EXPECT_TRUE(keep[4 * h + 3]->Read() == bytes_of(hp[h])) << "positions " << l << "/" << h;
        }
      }
    }
  }
  cudaStreamDestroy(stream);
}

// Puts 4 chunks from cudaMalloc'd buffers (keys {tag, i}), gets them back into other device
// buffers on a stream of their own, and checks the bytes, and a host get of one of them.
void PutFromAndGetIntoDeviceBuffers(client::Client& c, uint64_t tag, uint64_t seed) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const size_t bytes = c.options().layout.ChunkBytes(256);
  std::vector<std::vector<uint8_t>> host;
  std::vector<std::unique_ptr<DeviceBytes>> dev, back;
  std::vector<client::PutItem> puts;
  std::vector<Hash128> chain;
  for (int i = 0; i < 4; ++i) {
    host.push_back(RandomBytes(bytes, seed + i));
    dev.push_back(std::make_unique<DeviceBytes>(bytes));
    dev.back()->Write(host.back());
    chain.push_back(Hash128{tag, static_cast<uint64_t>(i)});
    client::PutItem it{chain.back(), 256, dev.back()->p, bytes};
    it.cuda_stream = stream;
    puts.push_back(it);
  }
  auto put = c.PutChunks(puts);
  ASSERT_TRUE(put.ok()) << put.status();
  auto hit = c.Lookup(chain);
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 4u);
  std::vector<client::GetItem> gets;
  for (uint32_t i = 0; i < 4; ++i) {
    back.push_back(std::make_unique<DeviceBytes>(bytes));
    client::GetItem g{i, back.back()->p, bytes};
    g.cuda_stream = stream;
    gets.push_back(g);
  }
  auto got = c.GetChunks(hit->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(back[i]->Read() == host[i]) << "chunk " << i;
  // And a host reader sees the device bytes.
  std::vector<uint8_t> out(bytes);
  ASSERT_TRUE(c.Get(hit->lease_id, 2, out.data(), out.size()).ok());
  EXPECT_EQ(out, host[2]);
  EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
  cudaStreamDestroy(stream);
}

class DeviceClientKvdTest : public ::testing::TestWithParam<bool> {};

TEST_P(DeviceClientKvdTest, PutFromAndGetIntoCudaMemoryAreByteExact) {
  if (!kk::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: device put/get";
  KvdConfig config;
  config.host_capacity = "64MiB";
  config.host_segment = "8MiB";
  auto kvd = StartKvd(config);
  ASSERT_NE(kvd, nullptr);
  const bool shm = GetParam();
  auto c = ConnectOrFail(shm ? kvd->UnixEngineOptions("cuda") : kvd->EngineOptions("cuda"));
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(c->session().shared_memory, shm);
  PutFromAndGetIntoDeviceBuffers(*c, 0xc0da, 50);
}

INSTANTIATE_TEST_SUITE_P(Paths, DeviceClientKvdTest, ::testing::Values(true, false),
                         [](const auto& info) {
                           return info.param ? "SharedMemory" : "Transport";
                         });

int CudaDevices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Put from and get into device memory over kvd's NCCL link (ClientOptions::nccl), GPU to GPU.
// NCCL refuses two ranks on one GPU, so kvd's link runs on device 1 and this client on device 0.
TEST(DeviceClientNcclTest, PutFromAndGetIntoCudaMemoryOverNcclAreByteExact) {
  if (!kk::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: NCCL put/get";
  if (CudaDevices() < 2) {
    GTEST_SKIP() << "NCCL put/get needs two GPUs (kvd's GPU tier and link on device 0, this "
                    "client on device 1): NCCL refuses two ranks on one GPU (\"Duplicate GPU\"); "
                    "this machine has "
                 << CudaDevices();
  }
  for (bool gpu_tier : {false, true}) {
    SCOPED_TRACE(gpu_tier ? "with a GPU tier" : "host tier only");
    KvdConfig config;
    config.nccl_device = 0;  // with a GPU tier its device (0 too) is the link's
    if (gpu_tier) config.gpu_capacity = "256MiB";
    auto kvd = StartKvd(config);
    ASSERT_NE(kvd, nullptr);
    client::ClientOptions o = kvd->EngineOptions("nccl");
    o.nccl = true;
    transport::MutableBackendOptions<transport::NcclOptions>(&o.transport).nccl_device = 1;
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->session().nccl);
    EXPECT_EQ(c->session().nccl_daemon_device, 0);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    PutFromAndGetIntoDeviceBuffers(*c, 0x2cc1, 70);
    auto stats = c->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (gpu_tier) {
      // The puts were copied up into the GPU tier device to device (the host copy stays).
      ASSERT_EQ(stats->tiers.front().name, "gpu");
      EXPECT_EQ(stats->tiers.front().chunks, 4u);
    }
  }
}

// On one GPU the link cannot form (NCCL: "Duplicate GPU"): a device put over it must fail with
// an error within the timeouts, not hang, and kvd must go on serving. (Should an NCCL form the
// pair on one GPU after all, the put/get round trip is checked instead.)
TEST(DeviceClientNcclTest, OnOneGpuTheLinkFailsInBoundedTimeAndKvdServesOn) {
  if (!kk::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: NCCL link on one GPU";
  KvdConfig config;
  config.nccl_device = 0;
  config.nccl_init_timeout_ms = 5000;
  config.transfer_timeout_ms = 8000;
  auto kvd = StartKvd(config);
  ASSERT_NE(kvd, nullptr);
  client::ClientOptions o = kvd->EngineOptions("nccl-one-gpu");
  o.nccl = true;
  auto& nccl = transport::MutableBackendOptions<transport::NcclOptions>(&o.transport);
  nccl.nccl_device = 0;
  nccl.nccl_init_timeout_ms = 5000;
  o.transfer_timeout_ms = 10000;
  auto c = client::Client::Connect(o);
  if (c.ok()) {
    const size_t bytes = (*c)->options().layout.ChunkBytes(256);
    DeviceBytes d(bytes);
    d.Write(RandomBytes(bytes, 90));
    const auto start = std::chrono::steady_clock::now();
    Status s = (*c)->Put(Hash128{0x1660, 1}, 256, d.p, bytes).status();
    const auto took = std::chrono::steady_clock::now() - start;
    if (s.ok()) {
      // This NCCL formed a pair of ranks on one GPU: then the whole round trip must hold.
      PutFromAndGetIntoDeviceBuffers(**c, 0x1661, 95);
      return;
    }
    EXPECT_THAT(s.code(), ::testing::AnyOf(StatusCode::kUnavailable, StatusCode::kDeadlineExceeded))
        << s;
    EXPECT_LT(took, std::chrono::seconds(30)) << s;
  } else {
    EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status();
  }
  // kvd serves another client over its transport.
  auto plain = ConnectOrFail(kvd->EngineOptions("after-nccl"));
  ASSERT_NE(plain, nullptr);
  const size_t bytes = plain->options().layout.ChunkBytes(256);
  auto data = RandomBytes(bytes, 91);
  auto put = plain->Put(Hash128{0x1660, 2}, 256, data.data(), bytes);
  ASSERT_TRUE(put.ok()) << put.status();
}

#endif  // KVD_HAVE_CUDA

}  // namespace
}  // namespace kvd::e2e
