// kvd with a GPU tier (tiers.gpu) through a real process (label `serving`). Without a device kvd
// refuses the topology naming the tier; with one (GpuTierCudaE2e, run by
// tests/gpu/run_device_checks.sh) compressed chunks land in the GPU tier, the node's stats show
// it, and gets serve the chunk the kernels produce, byte for byte.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvd/kernels/types.h"
#include "kvd_process.h"
#include "serving_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

class GpuTierE2eTest : public ServingFixture {
 protected:
  StatusOr<std::unique_ptr<KvdProcess>> StartWithGpuTier() {
    KvdConfig c;
    c.extra_models = PolicyModel("stories-snapkv", kSnapKv);
    c.gpu_capacity = "64MiB";
    return KvdProcess::Start(c);
  }
  static const client::TierStats* Tier(const client::Stats& s, const std::string& name) {
    for (const auto& t : s.tiers) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
};

TEST_F(GpuTierE2eTest, WithoutADeviceKvdRefusesTheGpuTierNamingIt) {
  if (kk::CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: GpuTierCudaE2e runs";
  auto kvd = StartWithGpuTier();
  ASSERT_FALSE(kvd.ok()) << "kvd started with tiers.gpu and no CUDA device";
  EXPECT_THAT(kvd.status().message(), HasSubstr("tiers.gpu"));
#ifdef KVD_HAVE_CUDA
  EXPECT_THAT(kvd.status().message(), HasSubstr("no CUDA device"));
#else  // kvd of the same build (e.g. the sanitizer builds, which are CUDA-off) names that instead
  EXPECT_THAT(kvd.status().message(), HasSubstr("built without CUDA"));
#endif
}

using GpuTierCudaE2eTest = GpuTierE2eTest;

TEST_F(GpuTierCudaE2eTest, CompressedChunksLandInTheGpuTierAndAreServed) {
  if (!kk::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: tiers.gpu needs one";
  auto kvd = StartWithGpuTier();
  ASSERT_TRUE(kvd.ok()) << kvd.status();
  kvd_ = std::move(*kvd);
  auto c = Connect("stories-snapkv");
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  Chunk chunk = MakeChunk(layout, kTokens, 21);
  const Hash128 hash{21, 22};
  auto put = c->PutChunks(std::vector<client::PutItem>{Item(hash, chunk, 0)});
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();

  auto admin = client::Client::Connect(kvd_->AdminOptions());
  ASSERT_TRUE(admin.ok()) << admin.status();
  auto stats = (*admin)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_FALSE(stats->tiers.empty());
  EXPECT_EQ(stats->tiers[0].name, "gpu");  // the GPU tier is listed first
  const client::TierStats* gpu = Tier(*stats, "gpu");
  ASSERT_NE(gpu, nullptr);
  EXPECT_EQ(gpu->capacity_bytes, 64u << 20);
  EXPECT_EQ(gpu->chunks, 1u);  // the compact chunk went to the GPU tier, not host
  const client::TierStats* host = Tier(*stats, "host");
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(host->chunks, 0u);

  // A hit copies the GPU-only chunk into host for the serve path; the bytes are the kernels'.
  auto hit = c->Lookup(std::vector<Hash128>{hash});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);
  std::vector<uint8_t> stored = GetCompact(*c, hit->lease_id, 0);
  auto expected = InProcess(layout, chunk, 0, SnapKvOptions());
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_TRUE(stored == *expected) << stored.size() << " vs " << expected->size();
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  auto after = (*admin)->GetStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(Tier(*after, "gpu")->chunks, 1u);  // the GPU keeps its copy
  EXPECT_EQ(Tier(*after, "host")->chunks, 1u);
}

}  // namespace
}  // namespace kvd::e2e
