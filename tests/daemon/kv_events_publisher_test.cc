// KvEventsPublisher over real ZeroMQ sockets: the resync at start and after the hub's queue lost
// events. The router side decodes every batch from the replay endpoint and keeps an index; it
// must end equal to what the tiers hold. (The vLLM decoder and a real kvd: tests/kv_events.)
#include <gtest/gtest.h>
#include <unistd.h>
#include <zmq.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <msgpack.hpp>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "event_hub.h"
#include "kv_events_publisher.h"

namespace kvd::daemon {
namespace {

storage::ChunkMeta Copy(uint64_t n, storage::TierKind tier) {
  storage::ChunkMeta m;
  m.key.name_space = "default";
  m.key.model = "m";
  m.key.chain_hash = Hash128{n * 7, n};
  m.tokens = 16;
  m.size_bytes = 1024;
  m.tier = tier;
  return m;
}

storage::ChunkEvent Event(storage::ChunkEventKind kind, const storage::ChunkMeta& m) {
  return storage::MakeChunkEvent(kind, storage::RemoveReason::kNone, m.tier, m);
}

std::string BigEndian(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) out[i] = static_cast<char>(v & 0xff);
  return out;
}

std::string Frame(void* socket) {
  zmq_msg_t msg;
  zmq_msg_init(&msg);
  EXPECT_GE(zmq_msg_recv(&msg, socket, 0), 0);
  std::string out(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
  zmq_msg_close(&msg);
  return out;
}

// One decoded batch: its events as (type, block hash, medium).
struct Event3 {
  std::string type;
  uint64_t hash = 0;
  std::string medium;
};

std::vector<Event3> Decode(const std::string& payload) {
  msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = h.get();
  EXPECT_EQ(batch.type, msgpack::type::ARRAY);
  EXPECT_EQ(batch.via.array.size, 3u);
  std::vector<Event3> out;
  const msgpack::object& events = batch.via.array.ptr[1];
  for (uint32_t i = 0; i < events.via.array.size; ++i) {
    std::map<std::string, msgpack::object> fields;
    events.via.array.ptr[i].convert(fields);
    Event3 e;
    e.type = fields.at("type").as<std::string>();
    if (e.type != "AllBlocksCleared") {
      std::vector<uint64_t> hashes = fields.at("block_hashes").as<std::vector<uint64_t>>();
      EXPECT_EQ(hashes.size(), 1u);
      e.hash = hashes.at(0);
      e.medium = fields.at("medium").as<std::string>();
    }
    out.push_back(e);
  }
  return out;
}

class KvEventsPublisherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvd-kv-events-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    options_.endpoint = "ipc://" + dir_ + "/pub";
    options_.replay_endpoint = "ipc://" + dir_ + "/replay";
    options_.max_batch_events = 3;
    ctx_ = zmq_ctx_new();
  }
  void TearDown() override {
    zmq_ctx_term(ctx_);
    unlink((dir_ + "/pub").c_str());
    unlink((dir_ + "/replay").c_str());
    rmdir(dir_.c_str());
  }

  // Every batch kept for replay from `start`, in order: (sequence, events).
  std::vector<std::pair<uint64_t, std::vector<Event3>>> Replay(uint64_t start) {
    void* dealer = zmq_socket(ctx_, ZMQ_DEALER);
    const int linger = 0, timeout_ms = 10000;
    zmq_setsockopt(dealer, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    EXPECT_EQ(zmq_connect(dealer, options_.replay_endpoint.c_str()), 0);
    const std::string start_bytes = BigEndian(start);
    zmq_send(dealer, "", 0, ZMQ_SNDMORE);
    zmq_send(dealer, start_bytes.data(), start_bytes.size(), 0);
    std::vector<std::pair<uint64_t, std::vector<Event3>>> out;
    while (true) {
      Frame(dealer);  // ""
      Frame(dealer);  // topic
      const std::string seq = Frame(dealer);
      const std::string payload = Frame(dealer);
      uint64_t n = 0;
      for (unsigned char c : seq) n = (n << 8) | c;
      if (n == UINT64_MAX) break;
      out.emplace_back(n, Decode(payload));
    }
    zmq_close(dealer);
    return out;
  }

  std::string dir_;
  KvEventsOptions options_;
  void* ctx_ = nullptr;
};

TEST_F(KvEventsPublisherTest, ResyncsAtStartAndAfterTheQueueLostEvents) {
  // The hub queues at most 4 events for the publisher. The publisher's first listing (its
  // start) waits until the test has pushed 10 events, so 6 of them are lost.
  EventHub hub(EventHubOptions{4, 4});
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  int listings = 0;
  std::vector<storage::ChunkMeta> held = {Copy(1, storage::TierKind::kDisk)};  // restored at start
  auto list = [&] {
    std::unique_lock<std::mutex> lock(mu);
    if (++listings == 1) cv.wait(lock, [&] { return released; });
    return held;
  };
  auto publisher = KvEventsPublisher::Start(options_, &hub, list);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  {
    std::lock_guard<std::mutex> lock(mu);
    for (uint64_t n = 100; n < 110; ++n) {
      held.push_back(Copy(n, storage::TierKind::kHost));
      hub.OnChunkEvent(Event(storage::ChunkEventKind::kStored, held.back()));
    }
    released = true;
  }
  cv.notify_all();
  // After the resync, events flow again: chunk 105 leaves the host tier.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*publisher)->resyncs() < 2) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no resync after the loss";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    hub.OnChunkEvent(Event(storage::ChunkEventKind::kRemoved, Copy(105, storage::TierKind::kHost)));
    std::erase_if(held, [](const storage::ChunkMeta& m) { return m.key.chain_hash.lo == 105; });
  }
  std::vector<std::pair<uint64_t, std::vector<Event3>>> batches;
  while (true) {
    batches = Replay(0);
    if (!batches.empty() && batches.back().second.back().type == "BlockRemoved") break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the removal was not published";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ((*publisher)->dropped(), 6u);
  EXPECT_EQ(listings, 2);

  // A router's index, built from the batches in order.
  std::set<std::pair<uint64_t, std::string>> index;
  int cleared = 0;
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_EQ(batches[i].first, i);
    EXPECT_LE(batches[i].second.size(), 3u);  // max_batch_events
    for (const Event3& e : batches[i].second) {
      if (e.type == "AllBlocksCleared") {
        ++cleared;
        index.clear();
      } else if (e.type == "BlockStored") {
        index.emplace(e.hash, e.medium);
      } else {
        index.erase({e.hash, e.medium});
      }
    }
  }
  // The first batch is the start's resync: AllBlocksCleared, then the chunk held at start.
  ASSERT_FALSE(batches.empty());
  EXPECT_EQ(batches[0].second.front().type, "AllBlocksCleared");
  EXPECT_EQ(cleared, 2);
  std::set<std::pair<uint64_t, std::string>> expected;
  for (const storage::ChunkMeta& m : held) {
    expected.emplace(m.key.chain_hash.lo, m.tier == storage::TierKind::kDisk ? "STORAGE" : "CPU");
  }
  EXPECT_EQ(index, expected);  // 1 on disk, 100-109 in host but 105
  (*publisher)->Stop();
}

TEST(KvEventsEncodeTest, AllBlocksClearedIsATaggedMapFirstInTheBatch) {
  QueuedEvent q;
  q.event = Event(storage::ChunkEventKind::kStored, Copy(3, storage::TierKind::kHost));
  const std::vector<Event3> with = Decode(EncodeKvEventBatch(1.5, true, {q}));
  ASSERT_EQ(with.size(), 2u);
  EXPECT_EQ(with[0].type, "AllBlocksCleared");
  EXPECT_EQ(with[1].type, "BlockStored");
  EXPECT_EQ(with[1].hash, 3u);
  EXPECT_EQ(Decode(EncodeKvEventBatch(1.5, false, {q})).size(), 1u);
}

}  // namespace
}  // namespace kvd::daemon
