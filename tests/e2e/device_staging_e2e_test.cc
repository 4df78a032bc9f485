// Puts from and gets into device buffers through a real kvd, with the device behind the
// client's DeviceMemoryOps seam (fake_device_ops.h: "device" pages a host access crashes on).
// Checks the staging logic both paths share: every device byte moves through exactly one copy
// op on the caller's stream, checksums read host bytes only, shared-memory slots are pinned for
// device copies, and a build that cannot copy refuses device pointers before reserving.
// The same flow against a real GPU runs in tests/gpu (device_client_test).
#include <cstring>

#include "e2e_common.h"
#include "fake_device_ops.h"

namespace kvd::e2e {
namespace {

class DeviceStagingE2eTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    KvdConfig config;
    config.host_capacity = "64MiB";
    config.host_segment = "8MiB";
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
  }
  bool shared_memory() const { return GetParam(); }
  std::unique_ptr<client::Client> Engine(const std::string& id) {
    auto c = ConnectOrFail(shared_memory() ? kvd_->UnixEngineOptions(id) : kvd_->EngineOptions(id));
    if (c != nullptr) {
      EXPECT_EQ(c->session().shared_memory, shared_memory());
    }
    return c;
  }
  std::unique_ptr<KvdProcess> kvd_;
  FakeDeviceOps device_;
};

TEST_P(DeviceStagingE2eTest, PutFromAndGetIntoDeviceBuffersAreByteExactWithOneCopyEach) {
  client::ScopedDeviceMemoryOpsForTesting seam(&device_);
  auto c = Engine("dev");
  ASSERT_NE(c, nullptr);
  const size_t bytes = c->options().layout.ChunkBytes(256);
  constexpr int kChunks = 5;
  std::vector<std::vector<uint8_t>> host(kChunks);
  std::vector<void*> dev(kChunks);
  std::vector<Hash128> chain;
  std::vector<client::PutItem> puts;
  void* stream = reinterpret_cast<void*>(0x5eed);
  for (int i = 0; i < kChunks; ++i) {
    host[i] = RandomBytes(bytes, 300 + i);
    dev[i] = device_.Allocate(bytes);
    ASSERT_NE(dev[i], nullptr);
    device_.Write(dev[i], host[i].data(), bytes);
    chain.push_back(Hash128{0xde71, static_cast<uint64_t>(i) + (shared_memory() ? 100 : 0)});
    client::PutItem it{chain[i], 256, dev[i], bytes};
    it.cuda_stream = stream;
    puts.push_back(it);
  }
  auto put = c->PutChunks(puts);
  ASSERT_TRUE(put.ok()) << put.status();
  auto copies = device_.copies();
  ASSERT_EQ(copies.size(), static_cast<size_t>(kChunks));  // one device-to-host copy per chunk
  for (const auto& cp : copies) {
    EXPECT_FALSE(cp.to_device);
    EXPECT_EQ(cp.bytes, bytes);
    EXPECT_EQ(cp.stream, stream);
  }
  // The slots' segments (shared memory) or the staging buffers (transport) were page-locked.
  EXPECT_GE(device_.pins(), 1);

  // Read back through a host-only client: the daemon holds exactly the device bytes.
  auto plain = Engine("host");
  ASSERT_NE(plain, nullptr);
  auto hit = plain->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, static_cast<uint32_t>(kChunks));
  for (int i = 0; i < kChunks; ++i) {
    std::vector<uint8_t> out(bytes);
    ASSERT_TRUE(plain->Get(hit->lease_id, i, out.data(), out.size()).ok());
    EXPECT_EQ(out, host[i]) << "chunk " << i;
  }
  EXPECT_TRUE(plain->ReleaseLease(hit->lease_id).ok());

  // Get into device buffers.
  device_.ClearCopies();
  hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  std::vector<void*> back(kChunks);
  std::vector<client::GetItem> gets;
  for (int i = 0; i < kChunks; ++i) {
    back[i] = device_.Allocate(bytes);
    client::GetItem g{static_cast<uint32_t>(i), back[i], bytes};
    g.cuda_stream = stream;
    gets.push_back(g);
  }
  auto got = c->GetChunks(hit->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  copies = device_.copies();
  ASSERT_EQ(copies.size(), static_cast<size_t>(kChunks));  // one host-to-device copy per chunk
  for (int i = 0; i < kChunks; ++i) {
    EXPECT_TRUE(copies[i].to_device);
    EXPECT_EQ(copies[i].bytes, bytes);
    EXPECT_EQ(copies[i].stream, stream);
    std::vector<uint8_t> out(bytes);
    device_.Read(out.data(), back[i], bytes);
    EXPECT_EQ(out, host[i]) << "chunk " << i;
  }
  EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  c.reset();
  EXPECT_EQ(device_.pinned_now(), 0u);  // unpinned before they are unmapped or freed
}

TEST_P(DeviceStagingE2eTest, PutLayersAndGetLayersMoveDeviceLayers) {
  client::ScopedDeviceMemoryOpsForTesting seam(&device_);
  auto c = Engine("layers");
  ASSERT_NE(c, nullptr);
  const ModelLayout& layout = c->options().layout;
  const int tokens = 64;
  const size_t half = static_cast<size_t>(tokens) * layout.TokenBytes();
  std::vector<std::vector<uint8_t>> k(layout.num_layers), v(layout.num_layers);
  std::vector<client::LayerKV> in;
  std::vector<client::MutableLayerKV> out;
  for (int l = 0; l < layout.num_layers; ++l) {
    k[l] = RandomBytes(half, 700 + l);
    v[l] = RandomBytes(half, 900 + l);
    void* dk = device_.Allocate(half);
    void* dv = device_.Allocate(half);
    device_.Write(dk, k[l].data(), half);
    device_.Write(dv, v[l].data(), half);
    in.push_back({dk, dv});
    out.push_back({device_.Allocate(half), device_.Allocate(half)});
  }
  Hash128 h{0x1a7e5, shared_memory() ? 1u : 2u};
  auto put = c->PutLayers(h, tokens, in);
  ASSERT_TRUE(put.ok()) << put.status();
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto got = c->GetLayers(hit->lease_id, 0, out, tokens);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tokens, static_cast<uint32_t>(tokens));
  for (int l = 0; l < layout.num_layers; ++l) {
    std::vector<uint8_t> kk(half), vv(half);
    device_.Read(kk.data(), out[l].k, half);
    device_.Read(vv.data(), out[l].v, half);
    EXPECT_EQ(kk, k[l]) << "layer " << l;
    EXPECT_EQ(vv, v[l]) << "layer " << l;
  }
  EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
}

TEST_P(DeviceStagingE2eTest, DevicePointersAreRefusedWhenTheBuildCannotCopyThem) {
  device_.can_copy = Status::Unimplemented("libkvd_client was built without CUDA");
  client::ScopedDeviceMemoryOpsForTesting seam(&device_);
  auto c = Engine("nocuda");
  ASSERT_NE(c, nullptr);
  const size_t bytes = c->options().layout.ChunkBytes(64);
  void* dev = device_.Allocate(bytes);
  Hash128 h{0x0dcda, shared_memory() ? 1u : 2u};
  auto put = c->Put(h, 64, dev, bytes);
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(put.status().message(),
            "put data is CUDA device memory: libkvd_client was built without CUDA");
  EXPECT_EQ(Present(*c, h), 0u);  // refused before anything was reserved
  EXPECT_TRUE(device_.copies().empty());

  // A host chunk, then a get into a device buffer: refused the same way; the client goes on.
  auto data = PutChunk(*c, h, 17, 64);
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto got = c->Get(hit->lease_id, 0, dev, bytes);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(got.status().message(),
            "get buffer is CUDA device memory: libkvd_client was built without CUDA");
  std::vector<uint8_t> out(bytes);
  ASSERT_TRUE(c->Get(hit->lease_id, 0, out.data(), out.size()).ok());
  EXPECT_EQ(out, data);
  EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  ExpectServes(*c, 5);
}

INSTANTIATE_TEST_SUITE_P(Paths, DeviceStagingE2eTest, ::testing::Values(true, false),
                         [](const auto& info) {
                           return info.param ? "SharedMemory" : "Transport";
                         });

}  // namespace
}  // namespace kvd::e2e
