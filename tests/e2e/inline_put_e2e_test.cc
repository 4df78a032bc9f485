// One-exchange puts of small chunks (ClientOptions::inline_put_bytes, the InlinePut message)
// against a real kvd: byte-exact around the threshold over TCP and the shared-memory unix socket,
// the three-step path above it, every refusal with the three-step put's code and message, and no
// space held or chunk visible after a refused one. stories260k: 1280 bytes per token.
#include <gmock/gmock.h>
#include <sys/stat.h>

#include <cstdio>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

class InlinePutE2eTest : public ::testing::Test {
 protected:
  void Start(KvdConfig config = {}, const std::string& admin_token = "") {
    if (config.host_segment.empty()) config.host_segment = "8MiB";  // shm on the unix socket
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    auto admin = kvd_->AdminOptions();
    admin.auth_token = admin_token;
    admin_ = ConnectOrFail(admin);
    ASSERT_NE(admin_, nullptr);
  }
  uint64_t Inline() { return CounterValue(*admin_, "puts_inline"); }
  uint64_t Committed() { return CounterValue(*admin_, "puts_committed"); }

  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> admin_;
};

// Reads `hash` back through `c` and compares it with `data`.
void ExpectStored(client::Client& c, const Hash128& hash, const std::vector<uint8_t>& data) {
  auto hit = c.Lookup({&hash, 1});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);
  std::vector<uint8_t> out(data.size() + 64, 0xee);
  auto g = c.Get(hit->lease_id, 0, out.data(), out.size());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->bytes, data.size());
  out.resize(g->bytes);
  EXPECT_TRUE(out == data);
  EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
}

TEST_F(InlinePutE2eTest, ByteExactAroundTheThresholdOverTcpAndSharedMemory) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const ModelLayout layout = kvd_->EngineOptions().layout;
  for (bool unix_socket : {false, true}) {
    SCOPED_TRACE(unix_socket ? "unix socket (shared memory)" : "tcp");
    auto o = unix_socket ? kvd_->UnixEngineOptions("inline") : kvd_->EngineOptions("inline");
    o.inline_put_bytes = layout.ChunkBytes(51);   // 65280 bytes: 51 tokens inline, 52 not
    o.shm_inline_put_bytes = o.inline_put_bytes;  // the same threshold on shared memory
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->session().shared_memory, unix_socket);
    const uint64_t salt = unix_socket ? 1000 : 0;
    // One at a time: each size's path is counted.
    for (int tokens : {1, 50, 51, 52, 53, 256}) {
      SCOPED_TRACE(tokens);
      const Hash128 h{0x1e, salt + static_cast<uint64_t>(tokens)};
      const uint64_t inline_before = Inline(), committed_before = Committed();
      auto data = RandomBytes(layout.ChunkBytes(tokens), salt + tokens);
      auto r = c->Put(h, tokens, data.data(), data.size());
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(r->already_stored);
      EXPECT_EQ(r->bytes, data.size());
      EXPECT_EQ(r->stored_bytes, data.size());
      EXPECT_EQ(Inline() - inline_before, tokens <= 51 ? 1u : 0u);
      EXPECT_EQ(Committed() - committed_before, 1u);
      ExpectStored(*c, h, data);
      // A second put of the same key is a dedup on either path, and stores nothing.
      auto again = c->Put(h, tokens, data.data(), data.size());
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_TRUE(again->already_stored);
      EXPECT_EQ(Committed() - committed_before, 1u);
    }
    // A window of mixed sizes: inline and three-step puts interleaved, results in item order.
    std::vector<std::vector<uint8_t>> data;
    std::vector<client::PutItem> items;
    const int sizes[] = {16, 128, 8, 51, 200, 52, 1, 33, 256, 2};
    for (int i = 0; i < 10; ++i) data.push_back(RandomBytes(layout.ChunkBytes(sizes[i]), 77 + i));
    for (int i = 0; i < 10; ++i) {
      items.push_back({Hash128{0x1f, salt + i}, sizes[i], data[i].data(), data[i].size()});
    }
    const uint64_t inline_before = Inline();
    auto put = c->PutChunks(items);
    ASSERT_TRUE(put.ok()) << put.status();
    ASSERT_EQ(put->size(), items.size());
    for (int i = 0; i < 10; ++i) EXPECT_EQ((*put)[i].bytes, data[i].size()) << i;
    EXPECT_EQ(Inline() - inline_before, 6u);  // 16, 8, 51, 1, 33, 2 tokens
    for (int i = 0; i < 10; ++i) ExpectStored(*c, items[i].hash, data[i]);
  }
  // 0 turns it off: every put takes the three steps, on shared memory too (whatever
  // shm_inline_put_bytes says).
  for (bool unix_socket : {false, true}) {
    auto o =
        unix_socket ? kvd_->UnixEngineOptions("three-steps") : kvd_->EngineOptions("three-steps");
    o.inline_put_bytes = 0;
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    const uint64_t inline_before = Inline();
    const Hash128 h{0x20, unix_socket ? 5u : 4u};
    auto data = RandomBytes(layout.ChunkBytes(4), h.lo);
    ASSERT_TRUE(c->Put(h, 4, data.data(), data.size()).ok());
    EXPECT_EQ(Inline(), inline_before);
    ExpectStored(*c, h, data);
  }
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
}

// Shared-memory sessions put inline only up to the lower of the two thresholds (default
// 32 KiB); transport sessions up to inline_put_bytes (default 64 KiB).
// A kvd that predates InlinePut, as a real daemon: protocol.inline_put off makes a current kvd
// answer it as that kvd did ("unknown request kind"). The client puts in three steps instead,
// on both paths, and every byte arrives.
TEST_F(InlinePutE2eTest, AgainstAKvdWithoutInlinePutTheClientPutsInThreeSteps) {
  KvdConfig config;
  config.extra_yaml = "protocol:\n  inline_put: false\n";
  ASSERT_NO_FATAL_FAILURE(Start(config));
  const ModelLayout layout = kvd_->EngineOptions().layout;
  for (bool unix_socket : {false, true}) {
    SCOPED_TRACE(unix_socket ? "unix socket (shared memory)" : "tcp");
    auto o = unix_socket ? kvd_->UnixEngineOptions("older") : kvd_->EngineOptions("older");
    o.inline_put_bytes = layout.ChunkBytes(16);
    o.shm_inline_put_bytes = o.inline_put_bytes;
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->session().shared_memory, unix_socket);
    const uint64_t committed_before = Committed();
    std::vector<std::vector<uint8_t>> data;
    std::vector<client::PutItem> items;
    for (uint64_t i = 0; i < 4; ++i) {
      data.push_back(RandomBytes(layout.ChunkBytes(16), 700 + i + (unix_socket ? 10 : 0)));
    }
    for (uint64_t i = 0; i < 4; ++i) {
      items.push_back(
          {Hash128{0x01de + (unix_socket ? 1u : 0u), i}, 16, data[i].data(), data[i].size()});
    }
    auto put = c->PutChunks(items);  // the first window tries inline and is refused
    ASSERT_TRUE(put.ok()) << put.status();
    const Hash128 later{0x01de + (unix_socket ? 1u : 0u), 99};
    const std::vector<uint8_t> later_data = RandomBytes(layout.ChunkBytes(16), 799);
    ASSERT_TRUE(c->Put(later, 16, later_data.data(), later_data.size()).ok());  // three steps
    EXPECT_EQ(Inline(), 0u) << "kvd stored an inline put with protocol.inline_put off";
    EXPECT_EQ(Committed() - committed_before, 5u) << "each chunk once, in three steps";
    for (uint64_t i = 0; i < 4; ++i) ExpectStored(*c, items[i].hash, data[i]);
    ExpectStored(*c, later, later_data);
  }
}

TEST_F(InlinePutE2eTest, SharedMemorySessionsHaveTheirOwnThreshold) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const ModelLayout layout = kvd_->EngineOptions().layout;
  const client::ClientOptions defaults;
  ASSERT_EQ(defaults.shm_inline_put_bytes, size_t{32} << 10);
  ASSERT_EQ(layout.ChunkBytes(25), 32000u);  // 1280 bytes a token: 25 tokens under 32 KiB
  for (bool unix_socket : {false, true}) {
    SCOPED_TRACE(unix_socket ? "unix socket (shared memory)" : "tcp");
    auto o =
        unix_socket ? kvd_->UnixEngineOptions("thresholds") : kvd_->EngineOptions("thresholds");
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->session().shared_memory, unix_socket);
    for (int tokens : {25, 26, 51, 52}) {
      SCOPED_TRACE(tokens);
      const Hash128 h{0x21, (unix_socket ? 1000u : 0u) + static_cast<uint64_t>(tokens)};
      const uint64_t inline_before = Inline();
      auto data = RandomBytes(layout.ChunkBytes(tokens), 500 + tokens);
      auto r = c->Put(h, tokens, data.data(), data.size());
      ASSERT_TRUE(r.ok()) << r.status();
      const bool expect_inline = tokens <= (unix_socket ? 25 : 51);
      EXPECT_EQ(Inline() - inline_before, expect_inline ? 1u : 0u);
      ExpectStored(*c, h, data);
    }
  }
}

TEST_F(InlinePutE2eTest, OptionIsValidated) {
  client::ClientOptions o;
  o.model = "stories260k";
  o.layout = Stories260kLayout();
  o.inline_put_bytes = client::ClientOptions::kMaxInlinePutBytes;
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o.inline_put_bytes = client::ClientOptions::kMaxInlinePutBytes + 1;
  Status s = o.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("inline_put_bytes must be <= 1048576 (0 = off), got 1048577"));
  o.inline_put_bytes = 0;
  o.shm_inline_put_bytes = client::ClientOptions::kMaxInlinePutBytes + 1;
  s = o.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("shm_inline_put_bytes must be <= 1048576 (0 = off), got 1048577"));
}

TEST_F(InlinePutE2eTest, RefusedPutsGetTheThreeStepErrorsAndHoldNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const ModelLayout layout = kvd_->EngineOptions().layout;
  for (bool unix_socket : {false, true}) {
    SCOPED_TRACE(unix_socket ? "unix socket (shared memory)" : "tcp");
    auto o = unix_socket ? kvd_->UnixEngineOptions("refused") : kvd_->EngineOptions("refused");
    o.verify_locally = false;  // the daemon's own checks
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    const uint64_t inline_before = Inline(), committed_before = Committed();
    auto data = RandomBytes(layout.ChunkBytes(8), 8);

    // Byte count the layout does not give.
    auto r = c->Put(Hash128{0x30, 1}, 8, data.data(), data.size() - 4);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(),
                HasSubstr("bytes 10236 != 10240 = layout.ChunkBytes(tokens=8) of model "
                          "stories260k (raw codec)"));
    // Tokens outside [1, chunk_tokens].
    r = c->Put(Hash128{0x30, 2}, 0, data.data(), 0);
    EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("tokens 0 is outside [1, chunk_tokens=256]"));
    // Window queries for a model without a compression policy.
    client::PutItem with_queries{Hash128{0x30, 3}, 8, data.data(), data.size()};
    std::vector<float> queries(client::WindowQueryBytes(layout, 4) / sizeof(float), 0.5f);
    with_queries.window = 4;
    with_queries.window_queries = queries;
    auto q = c->PutChunks({&with_queries, 1});
    EXPECT_EQ(q.status().code(), StatusCode::kFailedPrecondition) << q.status();
    EXPECT_THAT(q.status().message(),
                HasSubstr("windowTokens 4: model stories260k has no compression policy"));
    // Checksum mismatch: DATA_LOSS, and the chunk is not visible.
    {
      client::TestHooks hooks;
      hooks.corrupt_checksum = 0x1;
      auto bad = ConnectOrFail(o, hooks);
      ASSERT_NE(bad, nullptr);
      auto b = bad->Put(Hash128{0x30, 4}, 8, data.data(), data.size());
      EXPECT_EQ(b.status().code(), StatusCode::kDataLoss) << b.status();
      EXPECT_THAT(b.status().message(), HasSubstr("checksum mismatch"));
      EXPECT_EQ(Present(*c, Hash128{0x30, 4}), 0u);
    }
    EXPECT_EQ(Inline() - inline_before, 1u);  // only the corrupt one got as far as a reservation
    EXPECT_EQ(Committed(), committed_before);
    EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
    for (uint64_t n = 1; n <= 4; ++n) EXPECT_EQ(Present(*c, Hash128{0x30, n}), 0u);
    ExpectServes(*c, unix_socket ? 31 : 30);  // the connection keeps working
  }
}

// Capacity: with every chunk leased, an inline put cannot make room (RESOURCE_EXHAUSTED, as a
// Reserve), and succeeds once the leases are gone.
TEST_F(InlinePutE2eTest, FullHostTierRefusesAnInlinePutUntilRoomIsMade) {
  KvdConfig config;
  config.host_capacity = "1MiB";
  // Start's 8 MiB segment is not below this capacity: no shared memory, chunks pack densely.
  ASSERT_NO_FATAL_FAILURE(Start(config));
  const ModelLayout layout = kvd_->EngineOptions().layout;
  auto c = ConnectOrFail(kvd_->EngineOptions("capacity"));
  ASSERT_NE(c, nullptr);
  std::vector<Hash128> pinned;
  for (uint64_t n = 0; n < 64; ++n) {  // 1 MiB of 16-token chunks (20 KiB each)
    auto d = RandomBytes(layout.ChunkBytes(16), 500 + n);
    auto p = c->Put(Hash128{0x31, n}, 16, d.data(), d.size());
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted) << p.status();
      break;
    }
    pinned.push_back(Hash128{0x31, n});
  }
  ASSERT_GE(pinned.size(), 40u);
  // Leases of single-chunk chains: every stored chunk pinned.
  std::vector<uint64_t> leases;
  for (const Hash128& h : pinned) {
    auto l = c->Lookup({&h, 1});
    ASSERT_TRUE(l.ok()) << l.status();
    if (l->matched_chunks == 1) leases.push_back(l->lease_id);
  }
  const uint64_t inline_before = Inline();
  auto d = RandomBytes(layout.ChunkBytes(48), 48);
  auto full = c->Put(Hash128{0x32, 1}, 48, d.data(), d.size());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted) << full.status();
  EXPECT_THAT(full.status().message(), HasSubstr("host tier full"));
  EXPECT_EQ(Inline(), inline_before);
  for (uint64_t l : leases) ASSERT_TRUE(c->ReleaseLease(l).ok());
  auto room = c->Put(Hash128{0x32, 1}, 48, d.data(), d.size());
  ASSERT_TRUE(room.ok()) << room.status();
  EXPECT_EQ(Inline(), inline_before + 1);
  ExpectStored(*c, Hash128{0x32, 1}, d);
}

TEST_F(InlinePutE2eTest, NamespacesAndTokensApplyAsForThreeStepPuts) {
  const TempDir dir("kvd-inline-auth-");
  const std::string tokens = (dir.path() / "tokens").string();
  {
    std::FILE* f = std::fopen(tokens.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("namespace team-a token-a\nnamespace team-b token-b\nadmin token-admin\n", f);
    std::fclose(f);
  }
  KvdConfig config;
  ::chmod(tokens.c_str(), 0600);
  config.tokens_file = tokens;
  ASSERT_NO_FATAL_FAILURE(Start(config, "token-admin"));
  auto oa = kvd_->EngineOptions("a");
  oa.name_space = "team-a";
  oa.auth_token = "token-a";
  auto ob = kvd_->UnixEngineOptions("b");
  ob.name_space = "team-b";
  ob.auth_token = "token-b";
  auto a = ConnectOrFail(oa);
  auto b = ConnectOrFail(ob);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const ModelLayout layout = oa.layout;
  auto da = RandomBytes(layout.ChunkBytes(8), 1);
  auto db = RandomBytes(layout.ChunkBytes(8), 2);
  const Hash128 h{0x40, 1};
  const uint64_t inline_before = Inline();
  ASSERT_TRUE(a->Put(h, 8, da.data(), da.size()).ok());
  // The same key in another namespace is another chunk: not a dedup, not visible across.
  auto rb = b->Put(h, 8, db.data(), db.size());
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_FALSE(rb->already_stored);
  EXPECT_EQ(Inline() - inline_before, 2u);
  ExpectStored(*a, h, da);
  ExpectStored(*b, h, db);
  // A wrong token never gets as far as a put.
  oa.auth_token = "token-b";
  auto wrong = client::Client::Connect(oa);
  EXPECT_EQ(wrong.status().code(), StatusCode::kPermissionDenied) << wrong.status();
}

TEST_F(InlinePutE2eTest, AcknowledgedInlinePutsSurviveKillNineWithADiskTier) {
  const TempDir dir("kvd-inline-disk-");
  KvdConfig config;
  config.ucx_tls = "tcp";
  config.disk_path = (dir.path() / "db").string();
  ASSERT_NO_FATAL_FAILURE(Start(config));
  auto c = ConnectOrFail(kvd_->EngineOptions("durable"));
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  std::vector<std::vector<uint8_t>> data;
  std::vector<client::PutItem> items;
  for (uint64_t n = 0; n < 24; ++n) data.push_back(RandomBytes(layout.ChunkBytes(32), 900 + n));
  for (uint64_t n = 0; n < 24; ++n) {
    items.push_back({Hash128{0x50, n}, 32, data[n].data(), data[n].size()});
  }
  const uint64_t inline_before = Inline();
  auto put = c->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(Inline() - inline_before, 24u);
  c.reset();
  admin_.reset();
  kvd_->Kill();  // SIGKILL right after the acknowledgements
  kvd_.reset();
  ASSERT_NO_FATAL_FAILURE(Start(config));
  c = ConnectOrFail(kvd_->EngineOptions("durable-check"));
  ASSERT_NE(c, nullptr);
  for (uint64_t n = 0; n < 24; ++n) ExpectStored(*c, items[n].hash, data[n]);
}

}  // namespace
}  // namespace kvd::e2e
