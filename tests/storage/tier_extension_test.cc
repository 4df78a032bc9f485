// A new storage tier, end to end (docs/extending.md, "A storage tier"): MapTier below keeps chunks
// in a std::map, implements the Tier interface (tier.h) and answers two capability queries;
// registered in a TierManager's list under the host tier, it is demoted to, promoted from,
// listed, evicted and (when it says it is durable) written through, all by the manager's
// public API and without a line of the manager naming it.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <span>
#include <tuple>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier.h"
#include "kvd/storage/tier_manager.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::AlignedRegion;
using testing::ChainRequest;
using testing::MakeKey;
using testing::RandomBytes;

// Chunks in heap memory, keyed in a map; no capacity. `durable` is what durable() answers
// (a stand-in for a tier whose copies survive the process, e.g. a remote store);
// fail_inserts makes Insert fail UNAVAILABLE, as a medium that stops taking writes.
class MapTier final : public Tier {
 public:
  explicit MapTier(bool durable) : durable_(durable) {}

  TierKind kind() const override { return TierKind::kHost; }
  bool durable() const override { return durable_; }

  Status Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                std::span<const std::byte> bytes) override {
    if (bytes.empty()) return Status::InvalidArgument("map tier: empty chunk");
    if (Checksum64(bytes.data(), bytes.size()) != checksum) {
      return Status::DataLoss("map tier: checksum mismatch for " + key.ToString());
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_inserts_) return Status::Unavailable("map tier: writes fail");
    const Id id = IdOf(key);
    if (chunks_.count(id) > 0) return DedupStatus("map tier holds " + key.ToString());
    Entry& e = chunks_[id];
    e.meta = ChunkMeta{key, tokens, bytes.size(), checksum, 0, 0, kind()};
    e.bytes.assign(bytes.begin(), bytes.end());
    Notify(ChunkEventKind::kStored, RemoveReason::kNone, e.meta);
    return Status::Ok();
  }
  StatusOr<ChunkMeta> ReadInto(const ChunkKey& key, std::span<std::byte> out) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(IdOf(key));
    if (it == chunks_.end()) return Status::NotFound("map tier: no " + key.ToString());
    if (out.size() < it->second.bytes.size()) return Status::OutOfRange("map tier: out too small");
    std::memcpy(out.data(), it->second.bytes.data(), it->second.bytes.size());
    return it->second.meta;
  }
  StatusOr<ChunkMeta> Describe(const ChunkKey& key) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(IdOf(key));
    if (it == chunks_.end()) return Status::NotFound("map tier: no " + key.ToString());
    return it->second.meta;
  }
  Status Remove(const ChunkKey& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(IdOf(key));
    if (it == chunks_.end()) return Status::NotFound("map tier: no " + key.ToString());
    Notify(ChunkEventKind::kRemoved, RemoveReason::kMoved, it->second.meta);
    chunks_.erase(it);
    return Status::Ok();
  }
  std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<ChunkMeta> out;
    for (const auto& [id, e] : chunks_) {
      if (limit != 0 && out.size() >= limit) break;
      if (filter.Matches(e.meta.key)) out.push_back(e.meta);
    }
    return out;
  }
  EvictResult Evict(const ChunkFilter& filter) override {
    std::lock_guard<std::mutex> lock(mu_);
    EvictResult out;
    for (auto it = chunks_.begin(); it != chunks_.end();) {
      if (!filter.Matches(it->second.meta.key)) {
        ++it;
        continue;
      }
      out.evicted++;
      out.bytes += it->second.meta.size_bytes;
      Notify(ChunkEventKind::kRemoved, RemoveReason::kAdmin, it->second.meta);
      it = chunks_.erase(it);
    }
    return out;
  }
  TierStats GetStats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    TierStats s;
    s.kind = kind();
    for (const auto& [id, e] : chunks_) {
      s.chunk_count++;
      s.used_bytes += e.meta.size_bytes;
    }
    return s;
  }
  void SetEventListener(ChunkEventListener* listener) override { listener_ = listener; }

  void set_fail_inserts(bool fail) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_inserts_ = fail;
  }

 private:
  using Id = std::tuple<std::string, std::string, uint64_t, uint32_t, uint64_t, uint64_t>;
  struct Entry {
    ChunkMeta meta;
    std::vector<std::byte> bytes;
  };
  static Id IdOf(const ChunkKey& k) {
    return {k.name_space, k.model, k.layout_digest, k.codec_id, k.chain_hash.hi, k.chain_hash.lo};
  }
  void Notify(ChunkEventKind kind, RemoveReason reason, const ChunkMeta& meta) const {
    if (listener_ != nullptr)
      listener_->OnChunkEvent(MakeChunkEvent(kind, reason, this->kind(), meta));
  }

  const bool durable_;
  mutable std::mutex mu_;
  std::map<Id, Entry> chunks_;  // guarded by mu_
  bool fail_inserts_ = false;   // guarded by mu_
  ChunkEventListener* listener_ = nullptr;
};

constexpr size_t kChunk = 1024;

class TierExtensionTest : public ::testing::Test {
 protected:
  TierExtensionTest() : region_(8 * kChunk) {}
  void SetUp() override {
    auto host = HostTier::Create(HostTierOptions{}, region_.span());
    ASSERT_TRUE(host.ok()) << host.status();
    host_ = std::move(host).value();
  }
  // The one registration: the new tier's place in the list (here: below host).
  void CreateManager(Tier* below) {
    TierManagerOptions o;
    o.high_watermark = 0.75;  // 6 of 8 chunks
    o.low_watermark = 0.5;    // 4 of 8
    auto m = TierManager::Create(o, {host_.get(), below});
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = std::move(m).value();
  }
  // A put as the daemon makes it: reserve in host, write, commit through the manager.
  Status Put(uint64_t n) {
    const std::vector<std::byte> bytes = RandomBytes(kChunk, static_cast<uint32_t>(n));
    KVD_ASSIGN_OR_RETURN(Reservation r, host_->Reserve(MakeKey(n), kChunk, 256, 1));
    std::memcpy(r.data, bytes.data(), kChunk);
    return manager_->Commit(r.id, Checksum64(bytes.data(), kChunk));
  }

  AlignedRegion region_;
  std::unique_ptr<HostTier> host_;
  std::unique_ptr<TierManager> manager_;
};

TEST_F(TierExtensionTest, TierBelowHostIsDemotedToPromotedFromListedAndEvicted) {
  MapTier map(/*durable=*/false);
  CreateManager(&map);
  for (uint64_t n = 0; n < 7; ++n) ASSERT_TRUE(Put(n).ok()) << n;
  EXPECT_EQ(map.GetStats().chunk_count, 0u);  // not durable: no write-through

  auto d = manager_->MaybeDemote();  // 7 of 8 > high watermark: down to 4 in host
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->demoted, 3u);
  for (uint64_t n = 0; n < 3; ++n) {
    EXPECT_TRUE(map.Contains(MakeKey(n))) << n;
    EXPECT_FALSE(host_->Describe(MakeKey(n)).ok()) << n;
  }

  // A lookup copies them back into host, byte for byte; the lease covers all seven.
  auto r = manager_->Lookup(ChainRequest(0, 7));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->matched_chunks, 7u);
  EXPECT_EQ(manager_->promotions(), 3u);
  auto view = host_->Get(r->lease_id, 1);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(std::memcmp(view->data, RandomBytes(kChunk, 1).data(), kChunk), 0);
  ASSERT_TRUE(host_->ReleaseRead(view->read_id).ok());
  ASSERT_TRUE(host_->ReleaseLease(r->lease_id).ok());

  // Stats name both tiers; List and Evict count a chunk held in both once.
  ASSERT_EQ(manager_->GetStats().size(), 2u);
  EXPECT_EQ(manager_->GetStats()[1].chunk_count, 3u);
  EXPECT_EQ(manager_->List(ChunkFilter::All(), 0).size(), 7u);
  EvictResult e = manager_->Evict(ChunkFilter::All());
  EXPECT_EQ(e.evicted, 7u);
  EXPECT_EQ(e.bytes, 7 * kChunk);
  EXPECT_EQ(map.GetStats().chunk_count, 0u);
  EXPECT_TRUE(manager_->List(ChunkFilter::All(), 0).empty());
}

TEST_F(TierExtensionTest, DurableTierGetsEveryCommitBeforeItIsAcknowledged) {
  MapTier map(/*durable=*/true);
  CreateManager(&map);
  ASSERT_TRUE(Put(0).ok());
  EXPECT_TRUE(map.Contains(MakeKey(0)));  // written through before Commit returned
  EXPECT_EQ(IsDedup(Put(0)), true);       // a second put of it: the dedup, as durable

  // A failed write-through is not acknowledged and leaves nothing served.
  map.set_fail_inserts(true);
  Status s = Put(1);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_FALSE(host_->Describe(MakeKey(1)).ok());
  EXPECT_FALSE(map.Contains(MakeKey(1)));
}

TEST_F(TierExtensionTest, ListIsChecked) {
  MapTier durable(/*durable=*/true);
  // A durable tier above host, the same tier twice, no serving tier, a null entry: refused.
  for (std::vector<Tier*> tiers :
       {std::vector<Tier*>{&durable, host_.get()}, std::vector<Tier*>{host_.get(), host_.get()},
        std::vector<Tier*>{&durable}, std::vector<Tier*>{nullptr}}) {
    EXPECT_EQ(TierManager::Create({}, tiers).status().code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace kvd::storage
