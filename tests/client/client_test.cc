// The client against a scripted fake daemon (real frames over a unix socket, bulk bytes over
// the loopback transport): round trips, pipelining, and every failure path a caller must see.
#include "kvd/client/client.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>

#include "fake_daemon.h"
#include "test_hooks.h"

namespace kvd::client {
namespace {

using testing::FakeDaemon;
using testing::FakeDaemonBehavior;
using testing::TinyClientOptions;
using testing::TinyLayout;

std::string UniqueDomain() {
  static std::atomic<int> n{0};
  return "client-test-" + std::to_string(n++);
}

class ClientTest : public ::testing::Test {
 protected:
  void Start(FakeDaemonBehavior behavior = {}) {
    domain_ = UniqueDomain();
    daemon_ = std::make_unique<FakeDaemon>(domain_, behavior);
  }
  ClientOptions Options() { return TinyClientOptions(*daemon_, domain_); }
  std::unique_ptr<Client> Connect(ClientOptions o, const TestHooks& hooks = {}) {
    auto c = ConnectWithTestHooks(o, hooks);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  static std::vector<uint8_t> Random(size_t n, uint64_t seed) {
    std::vector<uint8_t> v(n);
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (auto& b : v) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      b = static_cast<uint8_t>(x);
    }
    return v;
  }

  // One Lookup finds every chunk of `chain`, and one GetChunks reads back exactly `data`.
  // n chunks of `bytes` random bytes (seeds seed, seed + 1, ...) and their chain {i, tag}.
  struct RandomChainData {
    std::vector<std::vector<uint8_t>> data;
    std::vector<Hash128> chain;
  };
  static RandomChainData RandomChain(uint64_t n, size_t bytes, uint64_t seed, uint64_t tag) {
    RandomChainData out;
    for (uint64_t i = 0; i < n; ++i) {
      out.data.push_back(Random(bytes, seed + i));
      out.chain.push_back({i, tag});
    }
    return out;
  }

  static void ExpectChainReadsBack(Client& c, const std::vector<Hash128>& chain,
                                   const std::vector<std::vector<uint8_t>>& data) {
    auto hit = c.Lookup(chain);
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, chain.size());
    std::vector<std::vector<uint8_t>> out;
    std::vector<GetItem> gets;
    for (const auto& d : data) out.emplace_back(d.size());
    for (uint32_t i = 0; i < out.size(); ++i) gets.push_back({i, out[i].data(), out[i].size()});
    auto got = c.GetChunks(hit->lease_id, gets);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(out, data);
  }

  std::string domain_;
  std::unique_ptr<FakeDaemon> daemon_;
};

TEST_F(ClientTest, PutLookupGetRoundTripIsByteExact) {
  Start();
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->session().node_name, "fake-node");
  const size_t bytes = TinyLayout().ChunkBytes(32);
  std::vector<int32_t> tokens(96);
  for (int i = 0; i < 96; ++i) tokens[i] = i * 3;
  auto chain = c->hasher().ChunkChain(tokens, true);
  ASSERT_EQ(chain.size(), 3u);
  std::vector<std::vector<uint8_t>> data;
  std::vector<PutItem> items;
  for (int i = 0; i < 3; ++i) data.push_back(Random(bytes, i));
  for (int i = 0; i < 3; ++i) items.push_back({chain[i], 32, data[i].data(), bytes});
  auto put = c->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_FALSE((*put)[0].already_stored);
  EXPECT_EQ(daemon_->stored_chunks(), 3u);

  auto hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched_chunks, 3u);
  std::vector<std::vector<uint8_t>> out(3, std::vector<uint8_t>(bytes));
  std::vector<GetItem> gets;
  for (uint32_t i = 0; i < 3; ++i) gets.push_back({i, out[i].data(), bytes});
  auto got = c->GetChunks(hit->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(out, data);
  EXPECT_EQ((*got)[1].bytes, bytes);
  EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());

  // A second put of the same chunk is deduplicated: nothing is sent.
  auto again = c->Put(chain[0], 32, data[0].data(), bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_stored);
}

// This daemon predates Request.releaseLeases (its HelloReply does not offer it): every release
// is a ReleaseLease exchange, and no request carries the field.
TEST_F(ClientTest, AnOlderDaemonGetsReleaseLeaseExchanges) {
  Start();
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  const size_t bytes = TinyLayout().ChunkBytes(32);
  const Hash128 h{0x1ea5, 1};
  const std::vector<uint8_t> data = Random(bytes, 5);
  ASSERT_TRUE(c->Put(h, 32, data.data(), bytes).ok());
  for (int i = 0; i < 3; ++i) {
    auto hit = c->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u) << hit.status();
    EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
    EXPECT_EQ(daemon_->seen("release"), i + 1);
  }
  EXPECT_EQ(daemon_->seen("releaseLeases"), 0);
}

TEST_F(ClientTest, PipelinesMoreChunksThanTheWindow) {
  Start();
  ClientOptions o = Options();
  o.max_in_flight = 3;
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  const size_t bytes = TinyLayout().ChunkBytes(32);
  auto [data, chain] = RandomChain(8, bytes, 100, 42);
  std::vector<PutItem> items;
  for (int i = 0; i < 8; ++i) items.push_back({chain[i], 32, data[i].data(), bytes});
  ASSERT_TRUE(c->PutChunks(items).ok());
  EXPECT_EQ(daemon_->seen("reserve"), 8);
  EXPECT_EQ(daemon_->seen("commit"), 8);
  ExpectChainReadsBack(*c, chain, data);
}

// A kvd that does not announce HelloReply.inlinePut (older, or protocol.inline_put off) never
// gets an InlinePut, although every put here is small enough and its frame limit allows one.
TEST_F(ClientTest, KvdWithoutInlinePutGetsThreeStepPuts) {
  FakeDaemonBehavior b;
  b.predates_inline_put = true;
  Start(b);
  ClientOptions o = Options();
  o.max_in_flight = 3;
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  const size_t bytes = TinyLayout().ChunkBytes(32);
  ASSERT_LE(bytes, o.inline_put_bytes);  // every put here is small enough to go inline
  auto [data, chain] = RandomChain(8, bytes, 300, 77);
  std::vector<PutItem> items;
  for (int i = 0; i < 5; ++i) items.push_back({chain[i], 32, data[i].data(), bytes});
  auto put = c->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_EQ(put->size(), 5u);
  for (const PutResult& r : *put) {
    EXPECT_EQ(r.bytes, bytes);
    EXPECT_FALSE(r.already_stored);
  }
  EXPECT_FALSE(c->session().inline_put);
  EXPECT_EQ(daemon_->seen("inline_put"), 0);
  EXPECT_EQ(daemon_->seen("reserve"), 5);
  EXPECT_EQ(daemon_->seen("commit"), 5);
  EXPECT_EQ(daemon_->stored_chunks(), 5u);
  auto one = c->Put(chain[5], 32, data[5].data(), bytes);
  ASSERT_TRUE(one.ok()) << one.status();
  std::vector<PutItem> more = {{chain[6], 32, data[6].data(), bytes},
                               {chain[7], 32, data[7].data(), bytes}};
  ASSERT_TRUE(c->PutChunks(more).ok());
  EXPECT_EQ(daemon_->seen("inline_put"), 0);
  EXPECT_EQ(daemon_->seen("commit"), 8);
  ExpectChainReadsBack(*c, chain, data);
}

TEST_F(ClientTest, KvdWithoutInlinePutTakesASinglePutInThreeSteps) {
  FakeDaemonBehavior b;
  b.predates_inline_put = true;
  Start(b);
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  const size_t bytes = TinyLayout().ChunkBytes(32);
  auto data = Random(bytes, 400);
  auto put = c->Put(Hash128{9, 9}, 32, data.data(), bytes);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->bytes, bytes);
  EXPECT_EQ(daemon_->seen("inline_put"), 0);
  EXPECT_EQ(daemon_->seen("commit"), 1);
  // A duplicate goes to Reserve, which reports it stored.
  auto again = c->Put(Hash128{9, 9}, 32, data.data(), bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_stored);
  EXPECT_EQ(daemon_->seen("inline_put"), 0);
}

TEST_F(ClientTest, PerLayerPutAndGet) {
  Start();
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  ModelLayout l = TinyLayout();
  const size_t half = 32 * l.TokenBytes();
  std::vector<std::vector<uint8_t>> k, v;
  for (int i = 0; i < 2; ++i) {
    k.push_back(Random(half, 10 + i));
    v.push_back(Random(half, 20 + i));
  }
  std::vector<LayerKV> in = {{k[0].data(), v[0].data()}, {k[1].data(), v[1].data()}};
  Hash128 h{5, 5};
  ASSERT_TRUE(c->PutLayers(h, 32, in).ok());
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok());
  std::vector<std::vector<uint8_t>> k2(2, std::vector<uint8_t>(half)), v2 = k2;
  std::vector<MutableLayerKV> out = {{k2[0].data(), v2[0].data()}, {k2[1].data(), v2[1].data()}};
  auto r = c->GetLayers(hit->lease_id, 0, out, 32);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(k, k2);
  EXPECT_EQ(v, v2);
  std::vector<LayerKV> one_layer = {in[0]};
  EXPECT_EQ(c->PutLayers(h, 32, one_layer).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, WrongByteCountIsRefusedLocally) {
  Start();
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  std::vector<uint8_t> data(100);
  auto r = c->Put({1, 1}, 32, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("the layout needs 8192"), std::string::npos);
  EXPECT_EQ(daemon_->seen("reserve"), 0);
}

TEST_F(ClientTest, GetErrorReplyCancelsTheReceiveAtOnce) {
  FakeDaemonBehavior b;
  b.get_not_found = true;
  Start(b);
  auto c = Connect(Options());  // transfer timeout 20 s
  ASSERT_NE(c, nullptr);
  std::vector<uint8_t> data = Random(TinyLayout().ChunkBytes(32), 1);
  Hash128 h{9, 9};
  ASSERT_TRUE(c->Put(h, 32, data.data(), data.size()).ok());
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto r = c->Get(hit->lease_id, 0, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_TRUE(c->connected());  // a daemon error leaves the connection usable
  EXPECT_TRUE(c->GetHealth().ok());
}

TEST_F(ClientTest, CorruptBytesGiveDataLoss) {
  FakeDaemonBehavior b;
  b.corrupt_get = true;
  Start(b);
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  std::vector<uint8_t> data = Random(TinyLayout().ChunkBytes(32), 2);
  Hash128 h{3, 3};
  ASSERT_TRUE(c->Put(h, 32, data.data(), data.size()).ok());
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok());
  std::vector<uint8_t> out(data.size());
  auto r = c->Get(hit->lease_id, 0, out.data(), out.size());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("checksum mismatch"), std::string::npos);
}

TEST_F(ClientTest, CommitChecksumMismatchIsTheDaemonsDataLoss) {
  Start();
  TestHooks hooks;
  hooks.corrupt_checksum = 1;
  auto c = Connect(Options(), hooks);
  ASSERT_NE(c, nullptr);
  std::vector<uint8_t> data = Random(TinyLayout().ChunkBytes(32), 3);
  auto r = c->Put({4, 4}, 32, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("checksum mismatch at commit"), std::string::npos);
  EXPECT_EQ(daemon_->stored_chunks(), 0u);
}

TEST_F(ClientTest, HungDaemonTimesOutAndBreaksTheClient) {
  FakeDaemonBehavior b;
  b.hang_on = "lookup";
  Start(b);
  ClientOptions o = Options();
  o.request_timeout_ms = 300;
  o.reply_spin_us = ClientOptions::kMaxReplySpinUs;  // the spin ends by the deadline too
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  Hash128 h{1, 2};
  auto t0 = std::chrono::steady_clock::now();
  auto r = c->Lookup({&h, 1});
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_FALSE(c->connected());
  auto again = c->GetStats();
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(again.status().message().find("broken"), std::string::npos);
}

TEST_F(ClientTest, DaemonClosingGivesUnavailable) {
  FakeDaemonBehavior b;
  b.close_on = "get";
  Start(b);
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  std::vector<uint8_t> data = Random(TinyLayout().ChunkBytes(32), 4);
  Hash128 h{7, 7};
  ASSERT_TRUE(c->Put(h, 32, data.data(), data.size()).ok());
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto r = c->Get(hit->lease_id, 0, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST_F(ClientTest, HandshakeRefusalCarriesTheDaemonsMessage) {
  FakeDaemonBehavior b;
  b.refuse_hello = "hash seed mismatch: client digest 1, daemon digest 2";
  Start(b);
  auto c = Client::Connect(Options());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("kvd refused the handshake: hash seed mismatch"),
            std::string::npos);
}

TEST_F(ClientTest, NoDaemonIsUnavailable) {
  ClientOptions o;
  o.role = Role::kAdmin;
  o.address = "unix:/tmp/kvd-client-test-no-such.sock";
  auto c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("cannot connect to kvd at unix:/tmp/kvd-client-test-no-such"),
            std::string::npos);
}

TEST_F(ClientTest, AdminRoleServesStatsButNotPuts) {
  Start();
  ClientOptions o = Options();
  o.role = Role::kAdmin;
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  auto s = c->GetStats();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->tiers.size(), 1u);
  EXPECT_EQ(s->tiers[0].name, "host");
  EXPECT_EQ(s->tiers[0].capacity_bytes, 1u << 20);
  Hash128 h{1, 1};
  EXPECT_EQ(c->Lookup({&h, 1}).status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvd::client
