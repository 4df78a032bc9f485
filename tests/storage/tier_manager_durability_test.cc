// TierManager with a disk tier: a put is acknowledged only once its chunk is on disk, also when
// two writers put the same chunk and the first one's disk write is still in progress (or fails).
// A writer here acts as the daemon does for a client: a Reserve answered with the dedup
// ALREADY_EXISTS is an acknowledgement ("already stored"), else it writes the bytes and its
// Commit's OK or dedup is. At every acknowledgement the chunk must be on disk.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>

#include "disk_tier_faults.h"
#include "kvd/storage/tier_manager.h"
#include "host_disk_fixture.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::MakeKey;
using testing::RandomBytes;

constexpr size_t kChunk = 64 * 1024;

// Holds the first disk write of a key until Release(), then lets it succeed or fail.
class HeldWrite {
 public:
  Status OnWrite(const ChunkKey&) {
    std::unique_lock<std::mutex> lock(mu_);
    if (writes_++ > 0) return Status::Ok();  // later writes (the second writer's) go through
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    return outcome_;
  }
  void WaitEntered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void Release(Status outcome) {
    std::lock_guard<std::mutex> lock(mu_);
    outcome_ = std::move(outcome);
    released_ = true;
    cv_.notify_all();
  }
  int writes() {
    std::lock_guard<std::mutex> lock(mu_);
    return writes_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, released_ = false;
  int writes_ = 0;
  Status outcome_;
};

struct Acknowledged {
  Status status;          // OK: acknowledged (stored or already stored); else the put failed
  bool on_disk = false;   // the chunk was on disk when the writer was acknowledged
};

class TierManagerDurabilityTest : public testing::HostDiskFixture {
 protected:
  TierManagerDurabilityTest() : HostDiskFixture(16 * kChunk) {}
  void SetUp() override {
    HostDiskFixture::SetUp();
    DiskTierInternals::SetWriteHook(*disk_, [this](const ChunkKey& k) { return held_.OnWrite(k); });
    CreateManager(TierManagerOptions{});
  }

  // One put of `bytes` under `key`, as the daemon runs it for a client.
  Acknowledged Put(const ChunkKey& key, const std::vector<std::byte>& bytes) {
    const uint64_t checksum = Checksum64(bytes.data(), bytes.size());
    auto r = host_->Reserve(key, bytes.size(), 16, /*owner=*/0);
    if (!r.ok() && !IsDedup(r.status())) return {r.status(), false};
    if (r.ok()) {
      std::memcpy(r->data, bytes.data(), bytes.size());
      Status c = manager_->Commit(r->id, checksum);
      if (!c.ok() && !IsDedup(c)) return {c, false};
    }
    return {Status::Ok(), disk_->Contains(key)};
  }

  HeldWrite held_;
};

TEST_F(TierManagerDurabilityTest, SecondWriterIsAcknowledgedOnlyOnceTheChunkIsOnDisk) {
  const ChunkKey key = MakeKey(7);
  const std::vector<std::byte> bytes = RandomBytes(kChunk, 7);
  auto first = std::async(std::launch::async, [&] { return Put(key, bytes); });
  held_.WaitEntered();  // the first writer's chunk is published in host, its disk write held
  EXPECT_TRUE(host_->Describe(key).ok()) << "served while its disk write is in progress";
  auto second = std::async(std::launch::async, [&] { return Put(key, bytes); });
  // Whatever the second writer is doing now, it must not be acknowledged before the first
  // writer's disk write ends: release it only after giving the second a head start.
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the second writer was acknowledged while the chunk was not on disk";
  held_.Release(Status::Ok());
  const Acknowledged a = first.get(), b = second.get();
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_TRUE(a.on_disk);
  EXPECT_TRUE(b.on_disk);
  // Now durable: a third writer is told "already stored" at its Reserve, sending nothing.
  EXPECT_TRUE(IsDedup(host_->Reserve(key, kChunk, 16, 0).status()));
}

TEST_F(TierManagerDurabilityTest, FirstWriteFailingAfterASecondWriterCameIsWrittenByTheSecond) {
  const ChunkKey key = MakeKey(8);
  const std::vector<std::byte> bytes = RandomBytes(kChunk, 8);
  auto first = std::async(std::launch::async, [&] { return Put(key, bytes); });
  held_.WaitEntered();
  auto second = std::async(std::launch::async, [&] { return Put(key, bytes); });
  (void)second.wait_for(std::chrono::milliseconds(100));  // let it reach its commit
  held_.Release(Status::Unavailable("injected disk write failure"));
  const Acknowledged a = first.get(), b = second.get();
  EXPECT_EQ(a.status.code(), StatusCode::kUnavailable) << a.status;  // never acknowledged
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_TRUE(b.on_disk) << "the second writer was acknowledged but nothing reached the disk";
  EXPECT_EQ(held_.writes(), 2);  // the second writer wrote the chunk itself
  // On disk, byte-exact.
  std::vector<std::byte> out(kChunk);
  auto read = disk_->ReadInto(key, out);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(std::memcmp(out.data(), bytes.data(), kChunk), 0);
}

TEST_F(TierManagerDurabilityTest, FailedWriteWithNoOtherWriterLeavesNothingAcknowledged) {
  const ChunkKey key = MakeKey(9);
  const std::vector<std::byte> bytes = RandomBytes(kChunk, 9);
  auto first = std::async(std::launch::async, [&] { return Put(key, bytes); });
  held_.WaitEntered();
  held_.Release(Status::Unavailable("injected disk write failure"));
  EXPECT_EQ(first.get().status.code(), StatusCode::kUnavailable);
  EXPECT_FALSE(host_->Describe(key).ok());  // taken back out of host: not stored anywhere
  EXPECT_FALSE(disk_->Contains(key));
  // The next writer stores it normally.
  const Acknowledged again = Put(key, bytes);
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_TRUE(again.on_disk);
}

}  // namespace
}  // namespace kvd::storage
