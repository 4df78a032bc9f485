// TierManager: demotion above the high watermark, promotion on a lookup hit, restart.
#include "kvd/storage/tier_manager.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "host_disk_fixture.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::ChainRequest;
using testing::Contains;
using testing::MakeKey;
using testing::PutChunk;
using testing::RandomBytes;
using testing::Recorder;

constexpr size_t kChunk = 1024;

class TierManagerTest : public testing::HostDiskFixture {
 protected:
  TierManagerTest() : HostDiskFixture(8 * kChunk) {}
  void SetUp() override {
    HostDiskFixture::SetUp();
    TierManagerOptions o;
    o.high_watermark = 0.75;  // 6 of 8 chunks
    o.low_watermark = 0.5;    // 4 of 8
    CreateManager(o);
  }
};

TEST_F(TierManagerTest, RejectsBadOptions) {
  TierManagerOptions o;
  o.low_watermark = 0.95;
  auto m = TierManager::Create(o, {host_.get()});
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(m.status(), "low_watermark")) << m.status();
  EXPECT_EQ(TierManager::Create({}, {nullptr}).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(TierManagerTest, DemotesLeastRecentlyUsedAboveHighWatermark) {
  std::vector<std::vector<std::byte>> payloads;
  for (uint64_t n = 0; n < 7; ++n) {
    payloads.push_back(RandomBytes(kChunk, static_cast<uint32_t>(n)));
    ASSERT_TRUE(PutChunk(*host_, MakeKey(n), payloads[n]).ok());
  }
  auto lease = host_->Lookup(ChainRequest(0, 1));  // pin chunk 0 (the oldest)
  ASSERT_EQ(lease->matched_chunks, 1u);
  auto d = manager_->MaybeDemote();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->demoted, 3u);  // 7 -> 4 chunks in host
  EXPECT_DOUBLE_EQ(d->occupancy_before, 7.0 / 8);
  EXPECT_DOUBLE_EQ(d->occupancy_after, 0.5);
  EXPECT_TRUE(host_->Describe(MakeKey(0)).ok());  // pinned: stays
  for (uint64_t n = 1; n <= 3; ++n) {
    EXPECT_FALSE(host_->Describe(MakeKey(n)).ok()) << n;
    EXPECT_TRUE(disk_->Contains(MakeKey(n))) << n;
  }
  EXPECT_EQ(manager_->demotions(), 3u);
  // Below the high watermark a pass does nothing.
  EXPECT_EQ(manager_->MaybeDemote()->demoted, 0u);
  ASSERT_TRUE(host_->ReleaseLease(lease->lease_id).ok());

  // A lookup of chunks 0..5 promotes 1..3 back from disk; the lease covers all six.
  auto r = manager_->Lookup(ChainRequest(0, 6));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->matched_chunks, 6u);
  EXPECT_EQ(manager_->promotions(), 3u);
  // Where each was found: 0, 4 and 5 in host, 1..3 on disk (copied up by this lookup).
  const std::vector<TierKind> found_in = {TierKind::kHost, TierKind::kDisk, TierKind::kDisk,
                                          TierKind::kDisk, TierKind::kHost, TierKind::kHost};
  EXPECT_EQ(r->found_in, found_in);
  for (size_t i = 0; i < 6; ++i) {
    auto view = host_->Get(r->lease_id, i);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(std::memcmp(view->data, payloads[i].data(), kChunk), 0) << i;
    ASSERT_TRUE(host_->ReleaseRead(view->read_id).ok());
  }
  // host (0..6) + disk (1..3): each chunk listed once
  EXPECT_EQ(manager_->List(ChunkFilter::All(), 0).size(), 7u);
  auto stats = manager_->GetStats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[1].kind, TierKind::kDisk);
  EXPECT_EQ(stats[1].chunk_count, 3u);
}

// Bytes of a committed host chunk changed behind the tier's back (a stray write through a
// client's shared-memory mapping): the demotion verifies before writing to disk and drops it.
TEST_F(TierManagerTest, AHostCopyChangedAfterItsCommitIsDroppedAtDemotionNotWritten) {
  Recorder rec;
  manager_->SetEventListener(&rec);
  std::vector<std::vector<std::byte>> payloads;
  for (uint64_t n = 0; n < 7; ++n) {
    payloads.push_back(RandomBytes(kChunk, static_cast<uint32_t>(n)));
    ASSERT_TRUE(PutChunk(*host_, MakeKey(n), payloads[n]).ok());  // host only: no disk copy
  }
  // Straight into the region (a read through the tier would make chunk 0 the most recent).
  auto* at = static_cast<std::byte*>(
      ::memmem(region_.data(), region_.span().size(), payloads[0].data(), kChunk));
  ASSERT_NE(at, nullptr);
  at[100] ^= std::byte{0x08};
  rec.Take();
  auto d = manager_->MaybeDemote();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->corrupt_dropped, 1u);
  EXPECT_EQ(d->demoted, 2u);  // 7 of 8 -> 6 (dropped) -> 4: chunks 1 and 2 went to disk
  EXPECT_EQ(manager_->host_corrupt_dropped(), 1u);
  EXPECT_FALSE(host_->Describe(MakeKey(0)).ok());
  EXPECT_FALSE(disk_->Contains(MakeKey(0))) << "changed bytes were written to disk";
  EXPECT_EQ(disk_->GetStats().checksum_failures, 0u);
  const std::string k = std::to_string(kChunk);
  std::vector<std::string> events = rec.Take();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0], "removed(corrupt) host 0 " + k);
  // The others are intact, in host or on disk.
  for (uint64_t n = 1; n < 7; ++n) {
    std::vector<std::byte> out(kChunk);
    auto read = n <= 2 ? disk_->ReadInto(MakeKey(n), out) : host_->ReadInto(MakeKey(n), out);
    ASSERT_TRUE(read.ok()) << n << ": " << read.status();
    EXPECT_EQ(out, payloads[n]) << n;
  }
  manager_->SetEventListener(nullptr);
}

// Many changed chunks in one pass (memory going bad): every one is dropped and counted, but
// the warning is logged once (then at most once a minute), not once per chunk.
TEST_F(TierManagerTest, ChangedChunksAreLoggedOnceNotPerChunk) {
  std::vector<std::vector<std::byte>> payloads;
  for (uint64_t n = 0; n < 7; ++n) {
    payloads.push_back(RandomBytes(kChunk, static_cast<uint32_t>(100 + n)));
    ASSERT_TRUE(PutChunk(*host_, MakeKey(n), payloads[n]).ok());
  }
  for (uint64_t n = 0; n < 3; ++n) {
    auto* at = static_cast<std::byte*>(
        ::memmem(region_.data(), region_.span().size(), payloads[n].data(), kChunk));
    ASSERT_NE(at, nullptr) << n;
    at[200] ^= std::byte{0x10};
  }
  ::testing::internal::CaptureStderr();
  auto d = manager_->MaybeDemote();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->corrupt_dropped, 3u);
  EXPECT_EQ(manager_->host_corrupt_dropped(), 3u);
  size_t records = 0;
  for (size_t at = log.find("chunk changed in host memory"); at != std::string::npos;
       at = log.find("chunk changed in host memory", at + 1)) {
    ++records;
  }
  EXPECT_EQ(records, 1u) << log;
  for (uint64_t n = 0; n < 3; ++n) EXPECT_FALSE(host_->Describe(MakeKey(n)).ok()) << n;
}

TEST_F(TierManagerTest, DiskChunksAreServedAfterARestart) {
  const auto bytes = RandomBytes(kChunk, 42);
  ASSERT_TRUE(disk_->Insert(MakeKey(0), 256, Checksum64(bytes.data(), kChunk), bytes).ok());
  manager_.reset();
  disk_.reset();
  OpenDisk();  // "restart": a fresh host tier would be empty; the disk index is rebuilt
  ASSERT_TRUE(host_->Evict(ChunkFilter::All()).evicted == 0);
  auto m = TierManager::Create({}, {host_.get(), disk_.get()});
  ASSERT_TRUE(m.ok());
  auto r = (*m)->Lookup(ChainRequest(0, 2));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->matched_chunks, 1u);
  EXPECT_EQ(r->matched_tokens, 256u);
  auto view = host_->Get(r->lease_id, 0);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(std::memcmp(view->data, bytes.data(), kChunk), 0);
}

TEST_F(TierManagerTest, EvictSpansBothTiers) {
  const auto bytes = RandomBytes(kChunk, 1);
  ASSERT_TRUE(PutChunk(*host_, MakeKey(0), bytes).ok());
  ASSERT_TRUE(disk_->Insert(MakeKey(1), 256, Checksum64(bytes.data(), kChunk), bytes).ok());
  const EvictResult ev = manager_->Evict(ChunkFilter::Model("llama"));
  EXPECT_EQ(ev.evicted, 2u);
  EXPECT_EQ(ev.bytes, 2 * kChunk);
  EXPECT_TRUE(manager_->List(ChunkFilter::All(), 0).empty());
}

TEST_F(TierManagerTest, ConcurrentPutsLookupsAndDemotionKeepEveryChunkReadable) {
  // Content is a function of the key, so readers verify what they get from either tier.
  auto content = [](uint64_t n) {
    std::vector<std::byte> b(kChunk);
    for (size_t j = 0; j < kChunk; ++j) b[j] = static_cast<std::byte>(n * 131 + j);
    return b;
  };
  std::atomic<uint64_t> bad{0}, unexpected{0}, served{0};
  std::atomic<bool> stop{false};
  auto writer = [&](int t) {
    for (uint64_t i = 0; i < 150; ++i) {
      const uint64_t n = static_cast<uint64_t>(t) * 1000 + i;
      Status s = PutChunk(*host_, MakeKey(n), content(n));
      if (!s.ok() && !IsDedup(s) && s.code() != StatusCode::kResourceExhausted) unexpected++;
      if (!manager_->MaybeDemote().ok()) unexpected++;  // as the daemon does after a commit
      auto r = manager_->Lookup(ChainRequest(static_cast<uint64_t>(t) * 1000 + i / 2, 2));
      if (!r.ok()) {
        unexpected++;
        continue;
      }
      for (size_t c = 0; c < r->matched_chunks; ++c) {
        auto view = host_->Get(r->lease_id, c);
        if (!view.ok()) {
          unexpected++;
          continue;
        }
        served++;
        if (std::memcmp(view->data, content(view->meta.key.chain_hash.hi).data(), kChunk) != 0) {
          bad++;
        }
        host_->ReleaseRead(view->read_id).IgnoreError();
      }
      if (r->lease_id != 0) host_->ReleaseLease(r->lease_id).IgnoreError();
    }
  };
  std::thread demoter([&] {
    while (!stop.load()) {
      auto d = manager_->MaybeDemote();
      if (!d.ok()) unexpected++;
      std::this_thread::yield();
    }
  });
  std::thread w0(writer, 0), w1(writer, 1);
  w0.join();
  w1.join();
  stop = true;
  demoter.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_EQ(unexpected.load(), 0u);
  EXPECT_GT(served.load(), 0u);
  EXPECT_GT(manager_->demotions(), 0u);
  const auto stats = manager_->GetStats();
  EXPECT_EQ(stats[0].leases_open, 0u);
  EXPECT_EQ(stats[0].reads_open, 0u);
  EXPECT_EQ(stats[0].reservations_open, 0u);
  EXPECT_EQ(stats[1].checksum_failures, 0u);
}

// Reserve + write + commit through the manager (the daemon's put path).
Status ManagerPut(TierManager& m, const ChunkKey& key, std::span<const std::byte> bytes) {
  KVD_ASSIGN_OR_RETURN(Reservation r, m.host()->Reserve(key, bytes.size(), 256, /*owner=*/1));
  std::memcpy(r.data, bytes.data(), bytes.size());
  return m.Commit(r.id, Checksum64(bytes.data(), bytes.size()));
}

TEST_F(TierManagerTest, ListAndEvictCountAChunkWithCopiesInTwoTiersOnce) {
  // Chunks 0-2 committed through the manager: a host copy and a disk copy each. Chunk 3 only on
  // disk, chunk 4 only in host.
  for (uint64_t n = 0; n < 3; ++n) {
    ASSERT_TRUE(
        ManagerPut(*manager_, MakeKey(n), RandomBytes(kChunk, static_cast<uint32_t>(30 + n))).ok());
  }
  const auto bytes = RandomBytes(kChunk, 33);
  ASSERT_TRUE(disk_->Insert(MakeKey(3), 256, Checksum64(bytes.data(), kChunk), bytes).ok());
  ASSERT_TRUE(PutChunk(*host_, MakeKey(4), bytes).ok());
  ASSERT_EQ(host_->GetStats().chunk_count + disk_->GetStats().chunk_count, 8u);  // 5 chunks

  const std::vector<ChunkMeta> all = manager_->List(ChunkFilter::All(), 0);
  ASSERT_EQ(all.size(), 5u);
  std::set<uint64_t> listed;
  for (const ChunkMeta& m : all) {
    listed.insert(m.key.chain_hash.hi);
    // A chunk with a host copy is listed as the host's.
    EXPECT_EQ(m.tier, m.key == MakeKey(3) ? TierKind::kDisk : TierKind::kHost) << m.key.ToString();
  }
  EXPECT_EQ(listed.size(), 5u);
  EXPECT_EQ(manager_->List(ChunkFilter::All(), 4).size(), 4u);  // the limit counts chunks
  // ListCopies: every copy with its tier (chunks 0-2 twice, 3 on disk, 4 in host).
  std::multiset<std::pair<uint64_t, TierKind>> copies;
  for (const ChunkMeta& m : manager_->ListCopies(ChunkFilter::All())) {
    copies.emplace(m.key.chain_hash.hi, m.tier);
  }
  std::multiset<std::pair<uint64_t, TierKind>> expected;
  for (uint64_t n : {0, 1, 2, 4}) expected.emplace(MakeKey(n).chain_hash.hi, TierKind::kHost);
  for (uint64_t n : {0, 1, 2, 3}) expected.emplace(MakeKey(n).chain_hash.hi, TierKind::kDisk);
  EXPECT_EQ(copies, expected);

  auto lease = host_->Lookup(ChainRequest(1, 1));  // pin chunk 1's host copy
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->matched_chunks, 1u);
  const EvictResult ev = manager_->Evict(ChunkFilter::All());
  EXPECT_EQ(ev.evicted, 4u);
  EXPECT_EQ(ev.deferred, 1u);  // chunk 1: hidden now, freed when the lease goes
  EXPECT_EQ(ev.bytes, 4 * kChunk);
  EXPECT_TRUE(manager_->List(ChunkFilter::All(), 0).empty());
  EXPECT_EQ(disk_->GetStats().chunk_count, 0u);  // no disk copy left to come back from
  auto again = manager_->Lookup(ChainRequest(0, 5));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->matched_chunks, 0u);
  ASSERT_TRUE(host_->ReleaseLease(lease->lease_id).ok());
  EXPECT_EQ(host_->GetStats().used_bytes, 0u);
}

TEST_F(TierManagerTest, CommitIsOnDiskBeforeItReturns) {
  const auto bytes = RandomBytes(kChunk, 7);
  ASSERT_TRUE(ManagerPut(*manager_, MakeKey(0), bytes).ok());
  EXPECT_TRUE(disk_->Contains(MakeKey(0)));
  EXPECT_TRUE(host_->Describe(MakeKey(0)).ok());
  EXPECT_EQ(host_->GetStats().reads_open, 0u);  // the write-through pin was released
  // A re-put of the same key is the dedup answer, and stays durable.
  EXPECT_TRUE(IsDedup(ManagerPut(*manager_, MakeKey(0), bytes)));
  // Closing without a flush (the WAL is what keeps it) and reopening finds it.
  manager_.reset();
  disk_.reset();
  OpenDisk();
  std::vector<std::byte> out(kChunk);
  auto meta = disk_->ReadInto(MakeKey(0), out);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(out, bytes);
}

TEST_F(TierManagerTest, HostPressureNeverLosesACommittedChunk) {
  // 40 chunks through an 8-chunk host tier, no demotion pass at all: the host tier's own LRU
  // eviction makes room, and every chunk is still served (from disk, promoted) afterwards.
  constexpr uint64_t kChunks = 40;
  for (uint64_t n = 0; n < kChunks; ++n) {
    Status s = ManagerPut(*manager_, MakeKey(n), RandomBytes(kChunk, static_cast<uint32_t>(n)));
    ASSERT_TRUE(s.ok()) << n << ": " << s;
  }
  EXPECT_GT(host_->GetStats().evictions, 0u);
  for (uint64_t n = 0; n < kChunks; ++n) {
    auto r = manager_->Lookup(ChainRequest(n, 1));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->matched_chunks, 1u) << "chunk " << n << " lost";
    auto view = host_->Get(r->lease_id, 0);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(std::memcmp(view->data, RandomBytes(kChunk, static_cast<uint32_t>(n)).data(), kChunk),
              0)
        << n;
    ASSERT_TRUE(host_->ReleaseRead(view->read_id).ok());
    ASSERT_TRUE(host_->ReleaseLease(r->lease_id).ok());
  }
  EXPECT_EQ(manager_->promote_failures(), 0u);
}

TEST_F(TierManagerTest, FailedDiskWriteFailsTheCommitAndLeavesNothingInHost) {
  manager_.reset();
  disk_.reset();
  DiskTierOptions o;
  o.path = (dir_ / "small").string();
  o.capacity_bytes = kChunk / 2;  // every chunk is too large for it
  auto d = DiskTier::Open(o);
  ASSERT_TRUE(d.ok()) << d.status();
  disk_ = std::move(d).value();
  auto m = TierManager::Create({}, {host_.get(), disk_.get()});
  ASSERT_TRUE(m.ok());
  Status s = ManagerPut(**m, MakeKey(3), RandomBytes(kChunk, 3));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "write-through of")) << s;
  EXPECT_TRUE(Contains(s, "exceeds the capacity")) << s;
  EXPECT_EQ(host_->Describe(MakeKey(3)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(host_->GetStats().reads_open, 0u);
}

TEST_F(TierManagerTest, InsertIsDurableAndServedFromHost) {
  const auto bytes = RandomBytes(kChunk, 9);
  const uint64_t sum = Checksum64(bytes.data(), kChunk);
  ASSERT_TRUE(manager_->Insert(MakeKey(5), 128, sum, bytes).ok());
  EXPECT_TRUE(disk_->Contains(MakeKey(5)));
  auto meta = host_->Describe(MakeKey(5));
  ASSERT_TRUE(meta.ok());
  EXPECT_EQ(meta->tokens, 128u);
  EXPECT_TRUE(IsDedup(manager_->Insert(MakeKey(5), 128, sum, bytes)));
  Status bad = manager_->Insert(MakeKey(6), 128, sum ^ 1, bytes);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad;
  EXPECT_FALSE(disk_->Contains(MakeKey(6)));
  EXPECT_EQ(host_->Describe(MakeKey(6)).status().code(), StatusCode::kNotFound);
}

TEST_F(TierManagerTest, WithADiskTierATrustedCommitIsStillVerifiedBeforeTheWriteThrough) {
  auto bytes = RandomBytes(kChunk, 8);
  auto r = host_->Reserve(MakeKey(8), bytes.size(), 256, /*owner=*/1);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t sum = Checksum64(bytes.data(), bytes.size());
  std::memcpy(r->data, bytes.data(), bytes.size());
  r->data[5] ^= std::byte{1};
  // The write-through copies the bytes out of host memory: they are checked there.
  Status s = manager_->Commit(r->id, sum, CommitCheck::kTrustWriter);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_FALSE(disk_->Contains(MakeKey(8)));
  EXPECT_EQ(host_->Describe(MakeKey(8)).status().code(), StatusCode::kNotFound);
  // Without a disk tier the host tier records it unread.
  auto m = TierManager::Create({}, {host_.get()});
  ASSERT_TRUE(m.ok());
  auto r2 = host_->Reserve(MakeKey(9), bytes.size(), 256, /*owner=*/1);
  ASSERT_TRUE(r2.ok()) << r2.status();
  std::memcpy(r2->data, bytes.data(), bytes.size());
  r2->data[5] ^= std::byte{1};
  EXPECT_TRUE((*m)->Commit(r2->id, sum, CommitCheck::kTrustWriter).ok());
  EXPECT_TRUE(host_->Describe(MakeKey(9)).ok());
}

TEST_F(TierManagerTest, WithoutADiskTierCommitAndInsertAreTheHostTiers) {
  auto m = TierManager::Create({}, {host_.get()});
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(ManagerPut(**m, MakeKey(1), RandomBytes(kChunk, 1)).ok());
  EXPECT_TRUE(host_->Describe(MakeKey(1)).ok());
  EXPECT_FALSE(disk_->Contains(MakeKey(1)));
}

TEST_F(TierManagerTest, EveryTierTellsItsListenerWhatItStoresAndRemovesAndWhy) {
  Recorder rec;
  manager_->SetEventListener(&rec);
  const std::string k = std::to_string(kChunk);
  // A commit: published in host, then written through to disk. A dedup says nothing.
  ASSERT_TRUE(ManagerPut(*manager_, MakeKey(0), RandomBytes(kChunk, 0)).ok());
  EXPECT_TRUE(IsDedup(ManagerPut(*manager_, MakeKey(0), RandomBytes(kChunk, 0))));
  EXPECT_EQ(rec.Take(), (std::vector<std::string>{"stored host 0 " + k, "stored disk 0 " + k}));
  // An insert (a chunk made in the daemon): disk first, then host.
  const auto bytes = RandomBytes(kChunk, 1);
  ASSERT_TRUE(manager_->Insert(MakeKey(1), 128, Checksum64(bytes.data(), kChunk), bytes).ok());
  EXPECT_EQ(rec.Take(), (std::vector<std::string>{"stored disk 1 " + k, "stored host 1 " + k}));
  // Demotion above the high watermark: the oldest leave host ("moved"), their disk copies stay.
  for (uint64_t n = 2; n < 7; ++n) {
    ASSERT_TRUE(ManagerPut(*manager_, MakeKey(n), RandomBytes(kChunk, n)).ok());
  }
  rec.Take();
  auto demoted = manager_->MaybeDemote();
  ASSERT_TRUE(demoted.ok()) << demoted.status();
  ASSERT_EQ(demoted->demoted, 3u);  // 7 of 8 -> 4 of 8
  EXPECT_EQ(rec.Take(),
            (std::vector<std::string>{"removed(moved) host 0 " + k, "removed(moved) host 1 " + k,
                                      "removed(moved) host 2 " + k}));
  // A lookup promotes a disk-only chunk back into host: stored in host again.
  auto hit = manager_->Lookup(ChainRequest(0, 1));
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);
  ASSERT_TRUE(host_->ReleaseLease(hit->lease_id).ok());
  EXPECT_EQ(rec.Take(), (std::vector<std::string>{"stored host 0 " + k}));
  // Admin eviction of one chunk: from disk (the lower tier first), then from host; counted once.
  EvictResult ev = manager_->Evict(ChunkFilter::Key(MakeKey(3)));
  EXPECT_EQ(ev.evicted, 1u);
  EXPECT_EQ(rec.Take(),
            (std::vector<std::string>{"removed(admin) disk 3 " + k, "removed(admin) host 3 " + k}));
  manager_->SetEventListener(nullptr);
  ASSERT_TRUE(ManagerPut(*manager_, MakeKey(9), RandomBytes(kChunk, 9)).ok());
  EXPECT_TRUE(rec.Take().empty());
}

TEST_F(TierManagerTest, HostEvictionForRoomIsAnEvictedEvent) {
  auto m = TierManager::Create({}, {host_.get()});  // no disk: LRU eviction drops
  ASSERT_TRUE(m.ok());
  Recorder rec;
  (*m)->SetEventListener(&rec);
  for (uint64_t n = 0; n < 9; ++n) {
    ASSERT_TRUE(ManagerPut(**m, MakeKey(n), RandomBytes(kChunk, n)).ok());
  }
  std::vector<std::string> ev = rec.Take();
  ASSERT_EQ(ev.size(), 10u);
  const std::string k = std::to_string(kChunk);
  EXPECT_EQ(ev[7], "stored host 7 " + k);
  EXPECT_EQ(ev[8], "removed(evicted) host 0 " + k);  // the 9th needed room: the oldest went
  EXPECT_EQ(ev[9], "stored host 8 " + k);
}

}  // namespace
}  // namespace kvd::storage
