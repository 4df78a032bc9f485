// KV cache events through real processes: a subscriber on a control connection learns every
// chunk stored in and removed from the node's tiers, in order, numbered; namespaces are
// isolated for engines; a subscriber that does not read gets a "dropped" marker while puts go
// on; kvdctl events prints them.
#include <gmock/gmock.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using client::KvEvent;
using client::KvEventKind;
using ::testing::HasSubstr;

// Polls `c` until `n` events arrived or `timeout` passed; returns what came.
std::vector<KvEvent> PollN(client::Client& c, size_t n,
                           std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  std::vector<KvEvent> out;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (out.size() < n && std::chrono::steady_clock::now() < deadline) {
    auto batch = c.PollEvents(200);
    EXPECT_TRUE(batch.ok()) << batch.status();
    if (!batch.ok()) break;
    out.insert(out.end(), batch->begin(), batch->end());
  }
  return out;
}

class EventsE2eTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (kvd_ && kvd_->Alive()) {
      EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    }
  }
  void Start(KvdConfig config = {}) {
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
  }
  client::ClientOptions Engine(const std::string& ns) {
    client::ClientOptions o = kvd_->EngineOptions("events-" + ns);
    o.name_space = ns;
    return o;
  }
  std::unique_ptr<KvdProcess> kvd_;
};

TEST_F(EventsE2eTest, PutsAreStoredEventsInOrderAndAnEvictIsARemovedEvent) {
  Start();
  auto admin = ConnectOrFail(kvd_->AdminOptions());
  auto engine = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_TRUE(admin && engine);
  auto sub = admin->SubscribeEvents();
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(sub->queue_limit, 4096u);
  EXPECT_EQ(sub->name_space, "");
  auto again = admin->SubscribeEvents();
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition) << again.status();

  const ModelLayout layout = Stories260kLayout();
  for (uint64_t i = 0; i < 4; ++i) PutChunk(*engine, {0xe0, i}, i);
  std::vector<KvEvent> ev = PollN(*admin, 4);
  ASSERT_EQ(ev.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(ev[i].sequence, i + 1);
    EXPECT_EQ(ev[i].kind, KvEventKind::kStored);
    EXPECT_EQ(ev[i].tier, "host");
    EXPECT_EQ(ev[i].name_space, "default");
    EXPECT_EQ(ev[i].model, "stories260k");
    EXPECT_EQ(ev[i].codec_id, 0u);
    EXPECT_EQ(ev[i].layout_digest, layout.Digest());
    EXPECT_EQ(ev[i].hash, (Hash128{0xe0, i}));
    EXPECT_EQ(ev[i].tokens, 256u);
    EXPECT_EQ(ev[i].bytes, layout.ChunkBytes(256));
  }
  // A dedup put stores nothing new: no event. The admin evict of one chunk is the next one.
  auto dup = engine->Put({0xe0, 0}, 256, RandomBytes(layout.ChunkBytes(256), 0).data(),
                         layout.ChunkBytes(256));
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_TRUE(dup->already_stored);
  client::EvictFilter one;
  one.kind = client::EvictFilter::Kind::kChunk;
  one.chunk = {0xe0, 1};
  auto evicted = admin->Evict(one);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  ASSERT_EQ(evicted->chunks, 1u);
  ev = PollN(*admin, 1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].sequence, 5u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kRemoved);
  EXPECT_EQ(ev[0].reason, "admin");
  EXPECT_EQ(ev[0].tier, "host");
  EXPECT_EQ(ev[0].hash, (Hash128{0xe0, 1}));
  // Nothing else happened.
  auto none = admin->PollEvents(300);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty()) << none->front().sequence;
  EXPECT_EQ(CounterValue(*admin, "events_queued"), 5u);
  EXPECT_EQ(CounterValue(*admin, "events_dropped"), 0u);
  auto early = engine->PollEvents(0);
  EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition) << early.status();
}

TEST_F(EventsE2eTest, TheCApiPollsEventsAsJson) {
  Start();
  kvd_config config;
  kvd_config_init(&config);
  const std::string address = kvd_->tcp_address();
  config.address = address.c_str();
  config.admin = 1;
  kvd_client* c = nullptr;
  ASSERT_EQ(kvd_client_connect(&config, &c), KVD_OK) << kvd_last_error();
  ASSERT_EQ(kvd_client_subscribe_events(c, nullptr, 0), KVD_OK) << kvd_last_error();
  EXPECT_EQ(kvd_client_subscribe_events(c, nullptr, 0), KVD_FAILED_PRECONDITION);
  char* json = nullptr;
  ASSERT_EQ(kvd_client_poll_events_json(c, 0, &json), KVD_OK) << kvd_last_error();
  EXPECT_STREQ(json, "[]");
  kvd_free_string(json);
  auto engine = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_NE(engine, nullptr);
  PutChunk(*engine, {0xc0, 1}, 1);
  nlohmann::json events = nlohmann::json::array();
  for (int i = 0; i < 50 && events.empty(); ++i) {
    ASSERT_EQ(kvd_client_poll_events_json(c, 200, &json), KVD_OK) << kvd_last_error();
    events = nlohmann::json::parse(json);
    kvd_free_string(json);
  }
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["seq"], 1);
  EXPECT_EQ(events[0]["event"], "stored");
  EXPECT_EQ(events[0]["hash"], (Hash128{0xc0, 1}).ToHex());
  EXPECT_EQ(kvd_client_poll_events_json(c, -1, &json), KVD_INVALID_ARGUMENT);
  kvd_client_close(c);
}

TEST_F(EventsE2eTest, CapacityEvictionsAreRemovedEventsOldestFirst) {
  KvdConfig config;
  config.host_capacity = "4MiB";  // about 12 chunks of stories260k (320 KiB)
  Start(config);
  auto admin = ConnectOrFail(kvd_->AdminOptions());
  auto engine = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_TRUE(admin && engine);
  ASSERT_TRUE(admin->SubscribeEvents().ok());
  constexpr uint64_t kPuts = 20;
  for (uint64_t i = 0; i < kPuts; ++i) PutChunk(*engine, {0xca, i}, i);
  auto listed = admin->List({"", "", 0});
  ASSERT_TRUE(listed.ok()) << listed.status();
  const uint64_t kept = listed->total;
  ASSERT_LT(kept, kPuts);
  std::vector<KvEvent> ev = PollN(*admin, kPuts + (kPuts - kept));
  ASSERT_EQ(ev.size(), kPuts + (kPuts - kept));
  std::vector<Hash128> stored, removed;
  for (size_t i = 0; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i].sequence, i + 1);
    if (ev[i].kind == KvEventKind::kStored) {
      stored.push_back(ev[i].hash);
    } else {
      ASSERT_EQ(ev[i].kind, KvEventKind::kRemoved);
      EXPECT_EQ(ev[i].reason, "evicted");
      // Evicted only after it was stored.
      EXPECT_NE(std::find(stored.begin(), stored.end(), ev[i].hash), stored.end());
      removed.push_back(ev[i].hash);
    }
  }
  ASSERT_EQ(stored.size(), kPuts);
  for (uint64_t i = 0; i < kPuts; ++i) EXPECT_EQ(stored[i], (Hash128{0xca, i}));
  // Least recently used first: the oldest puts, in put order.
  ASSERT_EQ(removed.size(), kPuts - kept);
  for (size_t i = 0; i < removed.size(); ++i) EXPECT_EQ(removed[i], (Hash128{0xca, i}));
}

TEST_F(EventsE2eTest, AnEngineSeesOnlyItsNamespaceAndAnAdminChooses) {
  Start();
  auto put_a = ConnectOrFail(Engine("team-a"));
  auto put_b = ConnectOrFail(Engine("team-b"));
  auto sub_a = ConnectOrFail(Engine("team-a"));
  auto admin_b = ConnectOrFail(kvd_->AdminOptions());
  auto admin_all = ConnectOrFail(kvd_->AdminOptions());
  ASSERT_TRUE(put_a && put_b && sub_a && admin_b && admin_all);

  auto other = ConnectOrFail(Engine("team-a"));
  ASSERT_NE(other, nullptr);
  auto denied = other->SubscribeEvents({"team-b", 0});
  EXPECT_EQ(denied.status().code(), StatusCode::kPermissionDenied) << denied.status();
  EXPECT_THAT(denied.status().message(),
              HasSubstr("events of its own namespace \"team-a\" only; namespace \"team-b\" "
                        "needs the admin role"));
  ExpectServes(*other, 3);  // the refusal left the connection usable

  auto a = sub_a->SubscribeEvents();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->name_space, "team-a");
  auto b = admin_b->SubscribeEvents({"team-b", 0});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->name_space, "team-b");
  ASSERT_TRUE(admin_all->SubscribeEvents().ok());

  PutChunk(*put_a, {0xa, 1}, 1);
  PutChunk(*put_b, {0xb, 1}, 2);
  PutChunk(*put_a, {0xa, 2}, 3);

  std::vector<KvEvent> all = PollN(*admin_all, 3);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].hash, (Hash128{0xa, 1}));
  EXPECT_EQ(all[1].hash, (Hash128{0xb, 1}));
  EXPECT_EQ(all[1].name_space, "team-b");
  EXPECT_EQ(all[2].hash, (Hash128{0xa, 2}));

  std::vector<KvEvent> only_b = PollN(*admin_b, 1);
  ASSERT_EQ(only_b.size(), 1u);
  EXPECT_EQ(only_b[0].sequence, 1u);
  EXPECT_EQ(only_b[0].hash, (Hash128{0xb, 1}));

  std::vector<KvEvent> only_a = PollN(*sub_a, 2);
  ASSERT_EQ(only_a.size(), 2u);
  EXPECT_EQ(only_a[0].sequence, 1u);
  EXPECT_EQ(only_a[0].hash, (Hash128{0xa, 1}));
  EXPECT_EQ(only_a[1].sequence, 2u);
  EXPECT_EQ(only_a[1].hash, (Hash128{0xa, 2}));
  for (auto* c : {sub_a.get(), admin_b.get()}) {
    auto more = c->PollEvents(300);
    ASSERT_TRUE(more.ok()) << more.status();
    EXPECT_TRUE(more->empty()) << more->front().name_space;
  }

  // A subscribed engine connection keeps serving puts and gets; it hears of its own puts.
  ExpectServes(*sub_a, 7);
  std::vector<KvEvent> own = PollN(*sub_a, 1);
  ASSERT_EQ(own.size(), 1u);
  EXPECT_EQ(own[0].sequence, 3u);
  EXPECT_EQ(own[0].name_space, "team-a");
  EXPECT_EQ(own[0].tokens, 64u);
}

TEST_F(EventsE2eTest, ASubscriberThatDoesNotReadGetsADroppedMarkerWhilePutsGoOn) {
  Start();
  // Over the unix socket: small socket buffers, so the daemon's queue for it fills soon.
  client::ClientOptions slow_options = kvd_->AdminOptions();
  slow_options.address = kvd_->unix_address();
  auto slow = ConnectOrFail(slow_options);
  auto admin = ConnectOrFail(kvd_->AdminOptions());
  auto engine = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_TRUE(slow && admin && engine);
  auto sub = slow->SubscribeEvents({"", 16});
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(sub->queue_limit, 16u);

  // One-token chunks (1.25 KiB): many events cheaply. Puts go on until the daemon dropped some.
  const size_t bytes = Stories260kLayout().ChunkBytes(1);
  const std::vector<uint8_t> data = RandomBytes(bytes, 9);
  uint64_t puts = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (CounterValue(*admin, "events_dropped") == 0) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no drop after " << puts << " puts";
    std::vector<client::PutItem> items(64);
    for (auto& it : items) it = {{0xd0, puts++}, 1, data.data(), bytes};
    auto r = engine->PutChunks(items);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // The daemon kept serving while the subscriber did not read.
  ExpectServes(*engine, 11);
  const uint64_t dropped_by_daemon = CounterValue(*admin, "events_dropped");

  // Now read everything: numbers run without a gap, markers standing for what was lost.
  uint64_t next = 1, events = 0, dropped = 0, markers = 0;
  for (;;) {
    auto batch = slow->PollEvents(1000);
    ASSERT_TRUE(batch.ok()) << batch.status();
    if (batch->empty()) break;
    for (const KvEvent& e : *batch) {
      ASSERT_EQ(e.sequence, next) << "after " << events << " events, " << dropped << " dropped";
      if (e.kind == KvEventKind::kDropped) {
        ASSERT_GT(e.dropped, 0u);
        next += e.dropped;
        dropped += e.dropped;
        ++markers;
      } else {
        next += 1;
        ++events;
      }
    }
  }
  EXPECT_GE(markers, 1u);
  EXPECT_EQ(dropped, CounterValue(*admin, "events_dropped"));
  EXPECT_GE(dropped, dropped_by_daemon);
  // Every put (and the ExpectServes one) is accounted for: received or counted as dropped
  // (removals would add more, but 64 MiB holds every chunk here).
  EXPECT_EQ(events + dropped, puts + 1);
}

TEST_F(EventsE2eTest, KvdctlEventsPrintsOneLinePerEvent) {
  Start();
  auto engine = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_NE(engine, nullptr);
  // Puts go on until kvdctl (subscribing at some point) has printed its three events.
  std::atomic<bool> stop{false};
  std::thread putter([&] {
    for (uint64_t i = 0; !stop; ++i) {
      PutChunk(*engine, {0xc7, i}, i, 16);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  std::string out;
  const int rc =
      RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "--json", "events", "--count", "3"},
                 &out, std::chrono::seconds(30));
  stop = true;
  putter.join();
  ASSERT_EQ(rc, 0) << out;
  std::istringstream lines(out);
  std::string line;
  std::vector<nlohmann::json> ev;
  while (std::getline(lines, line)) ev.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(ev.size(), 3u) << out;
  Hash128 first;
  ASSERT_TRUE(Hash128::FromHex(ev[0]["hash"].get<std::string>(), &first)) << out;
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ev[i]["seq"], i + 1) << out;
    EXPECT_EQ(ev[i]["event"], "stored") << out;
    EXPECT_EQ(ev[i]["tier"], "host") << out;
    EXPECT_EQ(ev[i]["namespace"], "default") << out;
    EXPECT_EQ(ev[i]["model"], "stories260k") << out;
    EXPECT_EQ(ev[i]["tokens"], 16) << out;
    EXPECT_EQ(ev[i]["hash"], (Hash128{0xc7, first.lo + i}).ToHex()) << out;  // consecutive puts
  }

  // Human form; an engine-only option is refused with the daemon's reason.
  out.clear();
  stop = false;
  std::thread putter2([&] {
    for (uint64_t i = 0; !stop; ++i) {
      PutChunk(*engine, {0xc8, i}, i, 16);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  const int rc2 = RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "events", "--namespace",
                              "default", "--count", "1"},
                             &out, std::chrono::seconds(30));
  stop = true;
  putter2.join();
  ASSERT_EQ(rc2, 0) << out;
  EXPECT_THAT(out, HasSubstr("1 stored host default/stories260k codec=0 "));
  EXPECT_THAT(out, HasSubstr(" tokens=16 "));
  out.clear();
  EXPECT_EQ(
      RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "events", "--count", "-1"}, &out),
      2);
}

}  // namespace
}  // namespace kvd::e2e
