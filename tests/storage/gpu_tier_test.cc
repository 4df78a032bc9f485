// GpuTier: its logic over a host-memory fake DeviceMemory (runs everywhere), and the same cases
// over CUDA device memory where a device is present (GpuTierCudaTest; skips with the reason).
#include "kvd/storage/gpu_tier.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "fake_device_memory.h"
#include "kvd/common/hash.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::FakeDeviceMemory;
using ::testing::HasSubstr;
using testing::MakeKey;
using testing::RandomBytes;

std::unique_ptr<GpuTier> MakeTier(uint64_t capacity, FakeDeviceMemory** fake_out = nullptr,
                                  Clock* clock = nullptr) {
  auto fake = std::make_unique<FakeDeviceMemory>();
  if (fake_out != nullptr) *fake_out = fake.get();
  GpuTierOptions o;
  o.capacity_bytes = capacity;
  auto t = GpuTier::Create(o, std::move(fake), clock);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

Status Put(GpuTier& t, const ChunkKey& key, const std::vector<std::byte>& b) {
  return t.Insert(key, 256, Checksum64(b.data(), b.size()), b);
}

TEST(GpuTierOptionsTest, EveryBadFieldIsNamed) {
  GpuTierOptions o;
  EXPECT_THAT(o.Validate().message(), HasSubstr("tiers.gpu.capacity must be > 0"));
  o.capacity_bytes = 1 << 20;
  EXPECT_TRUE(o.Validate().ok());
  o.alignment = 100;
  EXPECT_THAT(o.Validate().message(), HasSubstr("alignment must be a power of two"));
  o.alignment = 256;
  o.max_chunk_bytes = 2 << 20;
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_chunk_bytes"));
  o.max_chunk_bytes = 0;
  o.capacity_bytes = 100;
  EXPECT_THAT(o.Validate().message(), HasSubstr("below one alignment unit"));
}

TEST(GpuTierTest, CreateFailsWithTheDevicesReasonWhenItHasNoRoom) {
  GpuTierOptions o;
  o.capacity_bytes = 64 << 20;
  auto t = GpuTier::Create(o, std::make_unique<FakeDeviceMemory>(1 << 20));
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(t.status().message(), HasSubstr("1048576 free"));
  EXPECT_EQ(GpuTier::Create(o, nullptr).status().code(), StatusCode::kInvalidArgument);
}

TEST(GpuTierTest, InsertThenReadBackEveryByteThroughTheDevice) {
  FakeDeviceMemory* fake = nullptr;
  auto t = MakeTier(1 << 20, &fake);
  const auto bytes = RandomBytes(100000, 1);
  ASSERT_TRUE(Put(*t, MakeKey(1), bytes).ok());
  EXPECT_EQ(fake->h2d.load(), 1);
  std::vector<std::byte> out(bytes.size() + 10);
  auto meta = t->ReadInto(MakeKey(1), out);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(fake->d2h.load(), 1);
  EXPECT_EQ(meta->size_bytes, bytes.size());
  EXPECT_EQ(meta->tier, TierKind::kGpu);
  EXPECT_EQ(meta->tokens, 256u);
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), out.begin()));
  EXPECT_EQ(t->kind(), TierKind::kGpu);
  EXPECT_TRUE(t->Contains(MakeKey(1)));
  EXPECT_FALSE(t->Contains(MakeKey(2)));
}

TEST(GpuTierTest, BadInputsGetSpecificErrors) {
  auto t = MakeTier(1 << 20);
  const auto bytes = RandomBytes(1000, 2);
  Status bad_sum = t->Insert(MakeKey(1), 256, 12345, bytes);
  EXPECT_EQ(bad_sum.code(), StatusCode::kDataLoss);
  EXPECT_THAT(bad_sum.message(), HasSubstr("!= 12345 given"));
  EXPECT_FALSE(t->Contains(MakeKey(1)));
  EXPECT_EQ(t->Insert(MakeKey(1), 256, 0, {}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(Put(*t, MakeKey(1), bytes).ok());
  Status dup = Put(*t, MakeKey(1), bytes);
  EXPECT_TRUE(IsDedup(dup)) << dup;
  std::vector<std::byte> small(10);
  auto r = t->ReadInto(MakeKey(1), small);
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(r.status().message(), HasSubstr("10 bytes is smaller than the chunk (1000 bytes)"));
  EXPECT_EQ(t->ReadInto(MakeKey(9), small).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t->Remove(MakeKey(9)).code(), StatusCode::kNotFound);
  EXPECT_EQ(t->InsertFromDevice(MakeKey(3), 1, 0, nullptr, 10).code(),
            StatusCode::kInvalidArgument);
  TierStats s = t->GetStats();
  EXPECT_EQ(s.checksum_failures, 1u);
  EXPECT_EQ(s.dedup_puts, 1u);
  EXPECT_EQ(s.commits, 1u);
}

TEST(GpuTierTest, FullTierRefusesInsteadOfDroppingAndSaysDemoteFirst) {
  auto t = MakeTier(1 << 20);
  const auto bytes = RandomBytes(300 << 10, 3);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Put(*t, MakeKey(i), bytes).ok()) << i;
  EXPECT_FALSE(t->HasRoomFor(bytes.size()));
  Status full = Put(*t, MakeKey(10), bytes);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("demote to host first"));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(t->Contains(MakeKey(i))) << "dropped chunk " << i;
  // Least recently used first; a touch moves a chunk to the back of that order.
  EXPECT_TRUE(t->Touch(MakeKey(0)));
  EXPECT_FALSE(t->Touch(MakeKey(42)));
  auto lru = t->LeastRecentlyUsed(10);
  ASSERT_EQ(lru.size(), 3u);
  EXPECT_EQ(lru[0].key, MakeKey(1));
  EXPECT_EQ(lru[2].key, MakeKey(0));
  ASSERT_TRUE(t->Remove(MakeKey(1)).ok());
  EXPECT_TRUE(Put(*t, MakeKey(10), bytes).ok());
  TierStats s = t->GetStats();
  EXPECT_EQ(s.lookups, 2u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_NEAR(t->Occupancy(), 3.0 * (300 << 10) / (1 << 20), 1e-9);
}

TEST(GpuTierTest, ACopyFailureLeavesNothingHalfStored) {
  FakeDeviceMemory* fake = nullptr;
  auto t = MakeTier(1 << 20, &fake);
  const auto bytes = RandomBytes(4096, 4);
  fake->FailNextCopies(1);
  Status s = Put(*t, MakeKey(1), bytes);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("injected copy failure"));
  EXPECT_FALSE(t->Contains(MakeKey(1)));
  EXPECT_EQ(t->GetStats().arena_allocated_bytes, 0u);
  ASSERT_TRUE(Put(*t, MakeKey(1), bytes).ok());
  std::vector<std::byte> out(bytes.size());
  fake->FailNextCopies(1);
  EXPECT_EQ(t->ReadInto(MakeKey(1), out).status().code(), StatusCode::kInternal);
  EXPECT_TRUE(t->Contains(MakeKey(1)));  // a failed read is not corruption
  EXPECT_TRUE(t->ReadInto(MakeKey(1), out).ok());
}

TEST(GpuTierTest, CorruptDeviceBytesAreDetectedAndDropped) {
  FakeDeviceMemory* fake = nullptr;
  auto t = MakeTier(1 << 20, &fake);
  const auto bytes = RandomBytes(4096, 5);
  ASSERT_TRUE(Put(*t, MakeKey(1), bytes).ok());
  // Flip a byte "on the device" (the fake's memory is host memory): find it by reading back
  // through ReadIntoDevice into a buffer we own.
  std::vector<std::byte> dev_copy(bytes.size());
  ASSERT_TRUE(t->ReadIntoDevice(MakeKey(1), dev_copy.data(), dev_copy.size()).ok());
  EXPECT_EQ(fake->d2d.load(), 1);
  ASSERT_TRUE(t->Remove(MakeKey(1)).ok());
  dev_copy[7] ^= std::byte{1};
  // Stored with the checksum of the good bytes: the device path trusts it (documented) ...
  ASSERT_TRUE(t->InsertFromDevice(MakeKey(1), 256, Checksum64(bytes.data(), bytes.size()),
                                  dev_copy.data(), dev_copy.size())
                  .ok());
  // ... and the host read catches it.
  std::vector<std::byte> out(bytes.size());
  auto r = t->ReadInto(MakeKey(1), out);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("is corrupt"));
  EXPECT_FALSE(t->Contains(MakeKey(1)));
  EXPECT_EQ(t->GetStats().checksum_failures, 1u);
  EXPECT_EQ(t->GetStats().arena_allocated_bytes, 0u);
}

TEST(GpuTierTest, EvictFiltersAndStatsSliceByModelAndNamespace) {
  auto t = MakeTier(4 << 20);
  const auto bytes = RandomBytes(1000, 6);
  ASSERT_TRUE(Put(*t, MakeKey(1, "llama", "a"), bytes).ok());
  ASSERT_TRUE(Put(*t, MakeKey(2, "llama", "b"), bytes).ok());
  ASSERT_TRUE(Put(*t, MakeKey(3, "qwen", "a"), bytes).ok());
  TierStats s = t->GetStats();
  EXPECT_EQ(s.kind, TierKind::kGpu);
  EXPECT_EQ(s.chunk_count, 3u);
  EXPECT_EQ(s.used_bytes, 3000u);
  EXPECT_EQ(s.per_model["llama"].chunks, 2u);
  EXPECT_EQ(s.per_namespace["a"].bytes, 2000u);
  EXPECT_EQ(s.capacity_bytes, 4u << 20);
  EXPECT_EQ(t->List(ChunkFilter::Namespace("a"), 0).size(), 2u);
  EXPECT_EQ(t->List(ChunkFilter::All(), 1).size(), 1u);
  EvictResult e = t->Evict(ChunkFilter::Model("llama"));
  EXPECT_EQ(e.evicted, 2u);
  EXPECT_EQ(e.bytes, 2000u);
  s = t->GetStats();
  EXPECT_EQ(s.chunk_count, 1u);
  EXPECT_EQ(s.admin_evictions, 2u);
  EXPECT_EQ(s.per_model.count("llama"), 0u);
}

TEST(GpuTierTest, ConcurrentReadersAndEvictionNeverFreeABlockInUse) {
  auto t = MakeTier(8 << 20);
  std::vector<std::vector<std::byte>> chunks;
  for (int i = 0; i < 16; ++i) {
    chunks.push_back(RandomBytes(64 << 10, 100 + i));
    ASSERT_TRUE(Put(*t, MakeKey(i), chunks.back()).ok());
  }
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&, r] {
      std::vector<std::byte> out(64 << 10);
      for (int n = 0; !stop; ++n) {
        const int i = (n + r) % 16;
        auto m = t->ReadInto(MakeKey(i), out);
        if (m.ok() && !std::equal(out.begin(), out.end(), chunks[i].begin())) bad++;
        if (!m.ok() && m.status().code() != StatusCode::kNotFound) bad++;
      }
    });
  }
  for (int round = 0; round < 50; ++round) {
    t->Evict(ChunkFilter::All());
    for (int i = 0; i < 16; ++i) {
      Status s = Put(*t, MakeKey(i), chunks[i]);
      if (!s.ok() && !IsDedup(s) && s.code() != StatusCode::kResourceExhausted) bad++;
    }
  }
  stop = true;
  for (auto& th : readers) th.join();
  EXPECT_EQ(bad.load(), 0);
  t->Evict(ChunkFilter::All());
  EXPECT_EQ(t->GetStats().arena_allocated_bytes, 0u);  // deferred frees all happened
}

// The same tier over real CUDA memory (the device script runs it on a GPU machine).
TEST(GpuTierCudaTest, RoundTripsThroughCudaDeviceMemory) {
  if (std::string why = CudaDeviceUnavailableReason(0); !why.empty()) GTEST_SKIP() << why;
  auto device = CreateCudaDeviceMemory(0);
  ASSERT_TRUE(device.ok()) << device.status();
  GpuTierOptions o;
  o.capacity_bytes = 64 << 20;
  auto t = GpuTier::Create(o, std::move(device).value());
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<std::vector<std::byte>> chunks;
  for (int i = 0; i < 8; ++i) {
    chunks.push_back(RandomBytes((1 << 20) + 17 * i, 200 + i));
    ASSERT_TRUE(Put(**t, MakeKey(i), chunks.back()).ok());
  }
  // Device -> device: copy chunk 0 to a staging chunk 100 of the same tier, read both back.
  auto scratch = CreateCudaDeviceMemory(0);
  ASSERT_TRUE(scratch.ok());
  auto buf = (*scratch)->Allocate(chunks[0].size());
  ASSERT_TRUE(buf.ok());
  ASSERT_TRUE((*t)->ReadIntoDevice(MakeKey(0), *buf, chunks[0].size()).ok());
  ASSERT_TRUE((*t)->InsertFromDevice(MakeKey(100), 256,
                                     Checksum64(chunks[0].data(), chunks[0].size()), *buf,
                                     chunks[0].size())
                  .ok());
  for (int i : {0, 3, 7, 100}) {
    const auto& want = chunks[i == 100 ? 0 : i];
    std::vector<std::byte> out(want.size());
    auto m = (*t)->ReadInto(MakeKey(i), out);
    ASSERT_TRUE(m.ok()) << i << ": " << m.status();
    EXPECT_TRUE(out == want) << "chunk " << i;
  }
  EXPECT_THAT((*t)->device_name(), HasSubstr("cuda:0"));
  EXPECT_TRUE((*scratch)->Free(*buf).ok());
}

TEST(GpuTierCudaTest, NoDeviceIsUnavailableWithTheReason) {
  if (CudaDeviceUnavailableReason(0).empty()) GTEST_SKIP() << "a CUDA device is present";
  auto d = CreateCudaDeviceMemory(0);
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(d.status().message(),
              ::testing::AnyOf(HasSubstr("no CUDA device"), HasSubstr("built without CUDA")));
}

}  // namespace
}  // namespace kvd::storage
