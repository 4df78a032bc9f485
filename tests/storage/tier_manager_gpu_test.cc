// TierManager with a GPU tier above host (over the host-memory fake device): inserts land in the
// GPU, demote to host under pressure (copy first, never a drop), lookups copy GPU-only chunks
// into host for serving and promote host hits into the GPU, stats list the GPU first.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "fake_device_memory.h"
#include "kvd/common/hash.h"
#include "kvd/storage/tier_manager.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::AlignedRegion;
using testing::ChainRequest;
using testing::FakeDeviceMemory;
using testing::MakeKey;
using testing::RandomBytes;
using testing::Recorder;

constexpr size_t kChunk = 4096;

class TierManagerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto host = HostTier::Create(HostTierOptions{}, region_.span());
    ASSERT_TRUE(host.ok());
    host_ = std::move(host).value();
    auto fake = std::make_unique<FakeDeviceMemory>();
    fake_ = fake.get();
    GpuTierOptions g;
    g.capacity_bytes = 4 * kChunk;  // 4 chunks
    auto gpu = GpuTier::Create(g, std::move(fake));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(gpu).value();
    TierManagerOptions o;
    o.high_watermark = 0.75;  // 3 of 4 GPU chunks
    o.low_watermark = 0.5;    // 2 of 4
    auto m = TierManager::Create(o, {gpu_.get(), host_.get()});
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = std::move(m).value();
    for (int i = 0; i < 12; ++i) chunks_.push_back(RandomBytes(kChunk, 300 + i));
  }
  Status Insert(int i) {
    return manager_->Insert(MakeKey(i), 256, Checksum64(chunks_[i].data(), kChunk), chunks_[i]);
  }
  // The chunk's bytes as the host tier serves them.
  bool HostHolds(int i) {
    auto v = host_->GetByKey(MakeKey(i), 0);
    if (!v.ok()) return false;
    bool same = std::memcmp(v->data, chunks_[i].data(), kChunk) == 0;
    host_->ReleaseRead(v->read_id).IgnoreError();
    return same;
  }

  AlignedRegion region_{16 * kChunk};
  std::unique_ptr<HostTier> host_;
  FakeDeviceMemory* fake_ = nullptr;
  std::unique_ptr<GpuTier> gpu_;
  std::unique_ptr<TierManager> manager_;
  std::vector<std::vector<std::byte>> chunks_;
};

TEST_F(TierManagerGpuTest, InsertsLandInTheGpuAndStatsListItFirst) {
  ASSERT_TRUE(Insert(0).ok());
  EXPECT_TRUE(gpu_->Contains(MakeKey(0)));
  EXPECT_FALSE(host_->Describe(MakeKey(0)).ok());
  std::vector<TierStats> stats = manager_->GetStats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].kind, TierKind::kGpu);
  EXPECT_EQ(stats[0].chunk_count, 1u);
  EXPECT_EQ(stats[1].kind, TierKind::kHost);
  EXPECT_EQ(manager_->List(ChunkFilter::All(), 0).size(), 1u);
  EXPECT_EQ(manager_->List(ChunkFilter::All(), 0)[0].tier, TierKind::kGpu);
  // A bad checksum is the caller's error, not a reason to try host.
  Status bad = manager_->Insert(MakeKey(1), 256, 1, chunks_[1]);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss);
  EXPECT_FALSE(host_->Describe(MakeKey(1)).ok());
}

TEST_F(TierManagerGpuTest, GpuStoresAndDemotionsAreEventsOfTheirTiers) {
  Recorder rec;
  manager_->SetEventListener(&rec);
  const std::string k = std::to_string(kChunk);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Insert(i).ok());
  EXPECT_EQ(rec.Take(), (std::vector<std::string>{"stored gpu 0 " + k, "stored gpu 1 " + k,
                                                  "stored gpu 2 " + k, "stored gpu 3 " + k}));
  // Full GPU: its least recently used chunks are copied to host, then dropped from the GPU.
  auto demoted = manager_->MaybeDemote();
  ASSERT_TRUE(demoted.ok()) << demoted.status();
  ASSERT_EQ(demoted->demoted_to_host, 2u);
  EXPECT_EQ(rec.Take(),
            (std::vector<std::string>{"stored host 0 " + k, "removed(moved) gpu 0 " + k,
                                      "stored host 1 " + k, "removed(moved) gpu 1 " + k}));
  EvictResult ev = manager_->Evict(ChunkFilter::Key(MakeKey(2)));
  EXPECT_EQ(ev.evicted, 1u);
  EXPECT_EQ(rec.Take(), (std::vector<std::string>{"removed(admin) gpu 2 " + k}));
}

TEST_F(TierManagerGpuTest, ACommittedChunkOnTheDeviceIsCopiedUpWithoutTheHostWhenThereIsRoom) {
  // Chunk 0 committed to host, its bytes also in "device" memory (a put that came over NCCL).
  auto commit = [&](int i) {
    auto r = host_->Reserve(MakeKey(i), kChunk, 256, 1, std::chrono::seconds(60));
    ASSERT_TRUE(r.ok()) << r.status();
    std::memcpy(r->data, chunks_[i].data(), kChunk);
    ASSERT_TRUE(manager_->Commit(r->id, Checksum64(chunks_[i].data(), kChunk)).ok());
  };
  commit(0);
  void* device = fake_->Allocate(kChunk).value();
  ASSERT_TRUE(fake_->CopyToDevice(device, chunks_[0].data(), kChunk).ok());
  const int d2d = fake_->d2d.load(), h2d = fake_->h2d.load();
  const uint64_t sum = Checksum64(chunks_[0].data(), kChunk);
  ASSERT_TRUE(manager_->PromoteFromDevice(MakeKey(0), 256, sum, device, kChunk).ok());
  EXPECT_EQ(fake_->d2d.load(), d2d + 1) << "one copy on the device";
  EXPECT_EQ(fake_->h2d.load(), h2d) << "nothing from the host";
  EXPECT_TRUE(gpu_->Contains(MakeKey(0)));
  EXPECT_TRUE(HostHolds(0)) << "the host copy stays";
  auto back = gpu_->ReadInto(MakeKey(0), std::span<std::byte>(chunks_[11].data(), kChunk));
  ASSERT_TRUE(back.ok()) << back.status();  // ReadInto verifies the checksum: the bytes are right
  // Already there, no room, no GPU tier: the specific reasons, and nothing changes.
  EXPECT_EQ(manager_->PromoteFromDevice(MakeKey(0), 256, sum, device, kChunk).code(),
            StatusCode::kAlreadyExists);
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(Insert(i).ok());  // the GPU is full now
  commit(4);
  Status full = manager_->PromoteFromDevice(MakeKey(4), 256, sum, device, kChunk);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_FALSE(gpu_->Contains(MakeKey(4)));
  EXPECT_EQ(manager_->demotions(), 0u) << "no demotion for an eager copy";
  auto no_gpu = TierManager::Create(TierManagerOptions{}, {host_.get()});
  ASSERT_TRUE(no_gpu.ok());
  EXPECT_EQ((*no_gpu)->PromoteFromDevice(MakeKey(4), 256, sum, device, kChunk).code(),
            StatusCode::kFailedPrecondition);
  ASSERT_TRUE(fake_->Free(device).ok());
}

TEST_F(TierManagerGpuTest, AFullGpuDemotesItsLeastRecentlyUsedToHostNeverDropping) {
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(Insert(i).ok()) << i;
  // 4 fit in the GPU; the older 6 moved down to host, byte for byte.
  for (int i = 6; i < 10; ++i) EXPECT_TRUE(gpu_->Contains(MakeKey(i))) << i;
  for (int i = 0; i < 6; ++i) {
    EXPECT_FALSE(gpu_->Contains(MakeKey(i))) << i;
    EXPECT_TRUE(HostHolds(i)) << "chunk " << i << " lost on demotion";
  }
  EXPECT_EQ(manager_->demotions(), 6u);
  EXPECT_EQ(manager_->GetStats()[0].evictions, 6u);
  // Inserting what host already holds is a dedup.
  EXPECT_TRUE(IsDedup(Insert(0)));
}

// A chunk larger than the whole GPU tier: demoting could never make room, so nothing is demoted
// and the chunk is stored in host at once (and served); smaller chunks still go to the GPU.
TEST_F(TierManagerGpuTest, AChunkTheGpuCanNeverHoldGoesToHostWithoutDemotingAnything) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Insert(i).ok()) << i;
  EXPECT_TRUE(gpu_->CanEverHold(4 * kChunk));
  EXPECT_FALSE(gpu_->CanEverHold(4 * kChunk + 1));
  const std::vector<std::byte> big = RandomBytes(4 * kChunk + 1, 400);
  ASSERT_TRUE(manager_->Insert(MakeKey(50), 256, Checksum64(big.data(), big.size()), big).ok());
  EXPECT_FALSE(gpu_->Contains(MakeKey(50)));
  auto v = host_->GetByKey(MakeKey(50), 0);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(std::memcmp(v->data, big.data(), big.size()), 0);
  host_->ReleaseRead(v->read_id).IgnoreError();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(gpu_->Contains(MakeKey(i))) << "chunk " << i;
  EXPECT_EQ(manager_->demotions(), 0u);
  EXPECT_EQ(manager_->gpu_skipped(), 1u);
  // A chunk that fits still lands in the GPU tier.
  ASSERT_TRUE(Insert(3).ok());
  EXPECT_TRUE(gpu_->Contains(MakeKey(3)));
  EXPECT_EQ(manager_->gpu_skipped(), 1u);
}

TEST_F(TierManagerGpuTest, LookupServesGpuChunksThroughHostAndPromotesHostHits) {
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(Insert(i).ok());  // 0,1 in host; 2..5 in the GPU
  ASSERT_TRUE(HostHolds(0));
  ASSERT_FALSE(host_->Describe(MakeKey(4)).ok());
  auto r = manager_->Lookup(ChainRequest(0, 6));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->matched_chunks, 6u);
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(HostHolds(i)) << i;  // the serve path reads host
  EXPECT_TRUE(gpu_->Contains(MakeKey(4)));                     // and the GPU keeps its copy
  ASSERT_TRUE(host_->ReleaseLease(r->lease_id).ok());
  // A GPU with room takes a host hit up.
  ASSERT_TRUE(gpu_->Remove(MakeKey(5)).ok());
  ASSERT_FALSE(gpu_->Contains(MakeKey(0)));
  auto again = manager_->Lookup(ChainRequest(0, 1));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(gpu_->Contains(MakeKey(0)));
  ASSERT_TRUE(host_->ReleaseLease(again->lease_id).ok());
  // A prefix stops at the first chunk no tier has.
  auto partial = manager_->Lookup(ChainRequest(0, 9));
  ASSERT_TRUE(partial.ok());
  EXPECT_EQ(partial->matched_chunks, 6u);
  ASSERT_TRUE(host_->ReleaseLease(partial->lease_id).ok());
}

TEST_F(TierManagerGpuTest, MaybeDemoteBringsTheGpuToTheLowWatermark) {
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Insert(i).ok());
  EXPECT_DOUBLE_EQ(gpu_->Occupancy(), 1.0);
  auto d = manager_->MaybeDemote();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->demoted_to_host, 2u);
  EXPECT_DOUBLE_EQ(gpu_->Occupancy(), 0.5);
  EXPECT_TRUE(HostHolds(0));
  EXPECT_TRUE(HostHolds(1));
  EXPECT_TRUE(gpu_->Contains(MakeKey(3)));
}

TEST_F(TierManagerGpuTest, ADeviceFailureFallsBackToHostAndEvictCoversTheGpu) {
  fake_->FailNextCopies(1);
  ASSERT_TRUE(Insert(0).ok());  // the GPU copy failed: stored in host instead
  EXPECT_FALSE(gpu_->Contains(MakeKey(0)));
  EXPECT_TRUE(HostHolds(0));
  ASSERT_TRUE(Insert(1).ok());
  EvictResult e = manager_->Evict(ChunkFilter::All());
  EXPECT_EQ(e.evicted, 2u);
  EXPECT_EQ(gpu_->GetStats().chunk_count, 0u);
}

}  // namespace
}  // namespace kvd::storage
