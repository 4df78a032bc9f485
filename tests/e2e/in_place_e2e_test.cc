// Zero-copy access to the shared-memory arena against a real kvd: ReadInPlace views of pinned
// chunks where they lie, and ReservePut slots an engine writes itself before CommitPut.
#include <cstring>
#include <set>
#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

class InPlaceE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvdConfig config;
    config.host_capacity = "64MiB";
    config.host_segment = "8MiB";  // stories260k chunks: 320 KiB, 25 to a segment
    config.lease_ttl_ms = 30000;
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(admin_, nullptr);
  }
  std::unique_ptr<client::Client> Shm(const std::string& id, const std::string& ns = "") {
    client::ClientOptions o = kvd_->UnixEngineOptions(id);
    o.name_space = ns;
    auto c = ConnectOrFail(o);
    if (c != nullptr) {
      EXPECT_TRUE(c->session().shared_memory) << kvd_->Log();
    }
    return c;
  }
  // Puts `bytes` through ReservePut + CommitPut.
  void PutInPlace(client::Client& c, const Hash128& h, const std::vector<uint8_t>& bytes) {
    auto slot = c.ReservePut(h, 256, bytes.size());
    ASSERT_TRUE(slot.ok()) << slot.status();
    ASSERT_FALSE(slot->already_stored());
    ASSERT_NE(slot->data(), nullptr);
    ASSERT_EQ(slot->size(), bytes.size());
    std::memcpy(slot->data(), bytes.data(), bytes.size());
    auto put = c.CommitPut(std::move(slot).value());
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_FALSE(put->already_stored);
    EXPECT_EQ(put->bytes, bytes.size());
  }
  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> admin_;
};

bool InSegments(client::Client& c, const std::byte* p, size_t bytes) {
  for (const auto& seg : c.SharedSegments()) {
    if (p >= seg.data && p + bytes <= seg.data + seg.size) return true;
  }
  return false;
}

std::vector<uint8_t> Bytes(const client::ChunkView& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  return std::vector<uint8_t>(p, p + v.size());
}

TEST_F(InPlaceE2eTest, BothWaysAreByteExactAgainstTheCopyingPaths) {
  // With the writable view and with the mprotect route for the slot.
  for (const bool view : {true, false}) {
    SCOPED_TRACE(view ? "shm_writable_view" : "mprotect route");
    client::ClientOptions o = kvd_->UnixEngineOptions(view ? "view" : "mprotect");
    o.shm_writable_view = view;
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->session().shared_memory) << kvd_->Log();
    auto tcp = ConnectOrFail(kvd_->EngineOptions("tcp"));  // the transport path
    ASSERT_NE(tcp, nullptr);
    const size_t bytes = c->options().layout.ChunkBytes(256);
    constexpr uint64_t kChunks = 6;
    const uint64_t salt = view ? 0 : 100;
    std::vector<std::vector<uint8_t>> data;
    std::vector<Hash128> chain;
    for (uint64_t i = 0; i < kChunks; ++i) {
      chain.push_back(Hash128{0x1a91ace + salt, i});
      data.push_back(RandomBytes(bytes, 500 + salt + i));
      // Even chunks written in place, odd ones put by copy.
      if (i % 2 == 0) {
        PutInPlace(*c, chain[i], data[i]);
      } else {
        ASSERT_TRUE(c->Put(chain[i], 256, data[i].data(), bytes).ok());
      }
    }
    // Read in place, and by a copying get on both paths.
    auto hit = c->Lookup(chain);
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, kChunks);
    const auto before = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < kChunks; ++i) {
      auto v = c->ReadInPlace(hit->lease_id, i);
      ASSERT_TRUE(v.ok()) << v.status();
      EXPECT_TRUE(v->verified());
      EXPECT_EQ(v->size(), bytes);
      EXPECT_EQ(v->result().tokens, 256u);
      EXPECT_EQ(v->result().form, client::ChunkForm::kRaw);
      EXPECT_EQ(v->result().checksum, Checksum64(data[i].data(), bytes));
      EXPECT_TRUE(InSegments(*c, v->data(), v->size())) << "the view is not in the arena";
      EXPECT_GT(v->pinned_until(), before + 50s) << "the read TTL (default 60 s) is not known";
      EXPECT_EQ(Bytes(*v), data[i]) << "chunk " << i;
    }
    for (client::Client* reader : {c.get(), tcp.get()}) {
      auto h = reader->Lookup(chain);
      ASSERT_TRUE(h.ok() && h->matched_chunks == kChunks);
      for (uint32_t i = 0; i < kChunks; ++i) {
        std::vector<uint8_t> out(bytes);
        ASSERT_TRUE(reader->Get(h->lease_id, i, out.data(), out.size()).ok());
        EXPECT_EQ(out, data[i]) << "chunk " << i;
      }
      EXPECT_TRUE(reader->ReleaseLease(h->lease_id).ok());
    }
    // A chunk kvd already has: no slot, nothing written, the commit says so.
    auto again = c->ReservePut(chain[0], 256, bytes);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->already_stored());
    EXPECT_EQ(again->data(), nullptr);
    auto put = c->CommitPut(std::move(again).value());
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_TRUE(put->already_stored);
    EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
    // The releases (and ended reads) go out with each client's next request.
    SendNextRequest(*c);
    SendNextRequest(*tcp);
  }
  // Every view ended and every lease was released: nothing stays pinned or reserved.
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
  EXPECT_EQ(HostTier(*admin_).pinned_bytes, 0u);
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
}

TEST_F(InPlaceE2eTest, AHeldViewKeepsItsChunkUntilItEnds) {
  auto c = Shm("holder");
  auto other = Shm("other");
  ASSERT_TRUE(c && other);
  const Hash128 a{0x40a, 1}, b{0x40b, 1};
  const std::vector<uint8_t> data_a = PutChunk(*c, a, 41);
  PutChunk(*c, b, 42);
  auto hit = c->Lookup({&a, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto view = c->ReadInPlace(hit->lease_id, 0);
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());  // the view alone pins it now
  EXPECT_GE(HostTier(*admin_).pinned_bytes, data_a.size());

  // Capacity pressure: another client puts twice the arena's worth; the view's chunk stays.
  const size_t bytes = data_a.size();
  const std::vector<uint8_t> filler = RandomBytes(bytes, 43);
  for (uint64_t i = 0; i < 2 * (64u << 20) / bytes; ++i) {
    ASSERT_TRUE(other->Put(Hash128{0xf111, i}, 256, filler.data(), bytes).ok()) << i;
  }
  EXPECT_GT(HostTier(*admin_).evictions, 0u);
  EXPECT_EQ(Bytes(*view), data_a) << "the pinned chunk's slot was reused";
  EXPECT_TRUE(view->Verify().ok());
  EXPECT_EQ(Present(*c, b), 0u) << "the unpinned chunk was not evicted";
  EXPECT_EQ(Present(*c, a), 1u) << "the pinned chunk was evicted";

  // Once the view ended (its end goes with this client's next request), pressure can evict it
  // like any other chunk.
  view->Release();
  EXPECT_FALSE(view->valid());
  EXPECT_EQ(Present(*c, b), 0u);
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
  for (uint64_t i = 0; i < 2 * (64u << 20) / bytes; ++i) {
    ASSERT_TRUE(other->Put(Hash128{0xf222, i}, 256, filler.data(), bytes).ok()) << i;
  }
  EXPECT_EQ(Present(*c, a), 0u) << "the chunk stayed after its view ended";

  // Admin evict skips a chunk while a view of it lives, and frees it once the view ended (its
  // end rides on the next request).
  const Hash128 d{0x40d, 1};
  const std::vector<uint8_t> data_d = PutChunk(*c, d, 44);
  hit = c->Lookup({&d, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  view = c->ReadInPlace(hit->lease_id, 0);
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  auto e = admin_->Evict({client::EvictFilter::Kind::kChunk, "", d});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->skipped_pinned, 1u);
  EXPECT_EQ(Bytes(*view), data_d);
  EXPECT_TRUE(view->Verify().ok());
  view->Release();
  EXPECT_EQ(Present(*c, d), 0u);
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
  EXPECT_EQ(HostTier(*admin_).pinned_bytes, 0u);
}

// Ended views' reads ride on the client's next request; 16 queued go at once with their own
// exchange, so an engine that reads many chunks in place and then goes quiet pins few. Views
// may outlive their Client (the closed connection ended their reads).
TEST_F(InPlaceE2eTest, EndedViewsAreFlushedWithoutAnotherCall) {
  auto c = Shm("many");
  ASSERT_NE(c, nullptr);
  constexpr uint32_t kViews = 20;  // the flush comes at 16
  std::vector<Hash128> chain;
  std::vector<std::vector<uint8_t>> data;
  for (uint64_t i = 0; i < kViews; ++i) {
    chain.push_back(Hash128{0xf105, i});
    data.push_back(PutChunk(*c, chain.back(), 900 + i, 16));  // small chunks: 20 KiB
  }
  auto hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == kViews);
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());  // views outlive the lease
  std::vector<client::ChunkView> views;
  for (uint32_t i = 0; i < kViews; ++i) {
    auto v = c->ReadInPlace(hit->lease_id, i);
    if (i == 0) {
      // The lease was released: ABORTED saying so, and no view.
      ASSERT_FALSE(v.ok());
      EXPECT_EQ(v.status().code(), StatusCode::kAborted) << v.status();
      hit = c->Lookup(chain);
      ASSERT_TRUE(hit.ok() && hit->matched_chunks == kViews);
      v = c->ReadInPlace(hit->lease_id, i);
    }
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(Bytes(*v), data[i]);
    views.push_back(std::move(v).value());
  }
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), kViews);
  // Moving a view moves its pin; ending 16 flushes them without another call of this client.
  client::ChunkView moved = std::move(views[0]);
  EXPECT_FALSE(views[0].valid());
  EXPECT_EQ(Bytes(moved), data[0]);
  moved = client::ChunkView();
  for (uint32_t i = 1; i < 16; ++i) views[i].Release();
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), kViews - 16);
  // The rest outlive the client: its connection's end ends their reads; the bytes stay mapped.
  c.reset();
  EXPECT_TRUE(Eventually([&] { return CounterValue(*admin_, "host_reads_open") == 0; }, 5s));
  EXPECT_EQ(Bytes(views[kViews - 1]), data[kViews - 1]);
  views.clear();
  EXPECT_EQ(HostTier(*admin_).pinned_bytes, 0u);
}

// A kvd older than Request.releaseReads (a current one with protocol.releases_on_requests off):
// each ended view's read goes with a ReleaseRead exchange of its own, at once.
TEST_F(InPlaceE2eTest, ViewsOfAnOlderKvdEndWithTheirOwnReleaseRead) {
  OlderKvd older = StartKvdWithout("releases_on_requests");
  ASSERT_TRUE(older.ok());
  auto& admin = older.admin;
  auto& c = older.engine;
  ASSERT_TRUE(c->session().shared_memory) << older.kvd->Log();
  ASSERT_FALSE(c->session().releases_on_requests);
  std::vector<Hash128> chain;
  std::vector<std::vector<uint8_t>> data;
  for (uint64_t i = 0; i < 3; ++i) {
    chain.push_back(Hash128{0x01d, i});
    data.push_back(PutChunk(*c, chain.back(), 60 + i));
  }
  auto hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 3u);
  std::vector<client::ChunkView> views;
  for (uint32_t i = 0; i < 3; ++i) {
    auto v = c->ReadInPlace(hit->lease_id, i);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(Bytes(*v), data[i]);
    views.push_back(std::move(v).value());
  }
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  EXPECT_EQ(CounterValue(*admin, "host_reads_open"), 3u);
  for (uint64_t open = 3; open > 0; --open) {
    views[open - 1].Release();
    EXPECT_EQ(CounterValue(*admin, "host_reads_open"), open - 1);
  }
  EXPECT_EQ(HostTier(*admin).pinned_bytes, 0u);
}

TEST_F(InPlaceE2eTest, AStrayWriteThroughAViewFaults) {
  auto c = Shm("stray");
  ASSERT_NE(c, nullptr);
  const Hash128 h{0x57a7, 9};
  const std::vector<uint8_t> data = PutChunk(*c, h, 77);
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto v = c->ReadInPlace(hit->lease_id, 0);
  ASSERT_TRUE(v.ok()) << v.status();
  auto* p = const_cast<std::byte*>(v->data() + 4096);
  const int status = WaitStatusOfChild([p] { *reinterpret_cast<volatile char*>(p) ^= 1; });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV)
      << "a write through a read view did not fault (wait status " << status << ")";
  EXPECT_EQ(Bytes(*v), data);
  EXPECT_TRUE(v->Verify().ok());
  EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
}

TEST_F(InPlaceE2eTest, AnUncommittedSlotLeavesNoChunk) {
  auto c = Shm("dropper");
  ASSERT_NE(c, nullptr);
  const size_t bytes = c->options().layout.ChunkBytes(256);
  // Dropped, and aborted explicitly: the reservation goes at once.
  for (const bool explicit_abort : {false, true}) {
    const Hash128 h{0xab0, explicit_abort ? 2u : 1u};
    {
      auto slot = c->ReservePut(h, 256, bytes);
      ASSERT_TRUE(slot.ok()) << slot.status();
      std::memset(slot->data(), 0x11, bytes);
      EXPECT_GE(HostTier(*admin_).reserved_bytes, bytes);
      if (explicit_abort) {
        EXPECT_TRUE(slot->Abort().ok());
        EXPECT_FALSE(slot->valid());
        // An empty slot commits nothing.
        auto put = c->CommitPut(std::move(slot).value());
        EXPECT_EQ(put.status().code(), StatusCode::kInvalidArgument) << put.status();
      }
    }
    EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
    EXPECT_EQ(Present(*c, h), 0u);
  }
  // A slot of another client is refused by this one (and aborted by its own).
  auto d = Shm("other");
  ASSERT_NE(d, nullptr);
  auto slot = c->ReservePut(Hash128{0xab0, 3}, 256, bytes);
  ASSERT_TRUE(slot.ok()) << slot.status();
  auto put = d->CommitPut(std::move(slot).value());
  EXPECT_EQ(put.status().code(), StatusCode::kInvalidArgument) << put.status();
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
  // A byte count the layout does not give is refused before anything is reserved.
  auto bad = c->ReservePut(Hash128{0xab0, 4}, 256, bytes - 1);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status();
  ExpectServes(*c, 81);
}

TEST_F(InPlaceE2eTest, AClientKilledBetweenReserveAndCommitLeavesNoChunk) {
  const client::ClientOptions o = kvd_->UnixEngineOptions("driver");
  auto child = ChildProcess::Spawn({KVD_E2E_DRIVER, "hold-in-place", o.address, UcxTls(o), "shm"});
  ASSERT_TRUE(child.ok()) << child.status();
  auto line = (*child)->ReadLine(10s);
  ASSERT_TRUE(line.ok()) << line.status() << "\n" << kvd_->Log();
  ASSERT_EQ(*line, "WRITTEN");
  EXPECT_GT(HostTier(*admin_).reserved_bytes, 0u);
  const pid_t pid = (*child)->pid();
  (*child)->Kill();
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, 5s))
      << "the killed writer's reservation was not reclaimed";
  auto good = Shm("good");
  ASSERT_NE(good, nullptr);
  EXPECT_EQ(Present(*good, Hash128{0xdead, static_cast<uint64_t>(pid)}), 0u);
  EXPECT_EQ(HostTier(*admin_).chunks, 0u);
  // Its slot is free again: a put of the same chunk lands.
  const std::vector<uint8_t> data = RandomBytes(good->options().layout.ChunkBytes(256), 5);
  PutInPlace(*good, Hash128{0xdead, static_cast<uint64_t>(pid)}, data);
}

TEST_F(InPlaceE2eTest, NamespacesStayApart) {
  auto a = Shm("a", "tenant-a");
  auto b = Shm("b", "tenant-b");
  ASSERT_TRUE(a && b);
  const Hash128 h{0x15a, 1};
  const std::vector<uint8_t> secret = RandomBytes(a->options().layout.ChunkBytes(256), 6);
  PutInPlace(*a, h, secret);
  auto hit = a->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto v = a->ReadInPlace(hit->lease_id, 0);
  ASSERT_TRUE(v.ok()) << v.status();
  // b neither finds the chunk nor can use a's lease, and has nothing of a's mapped.
  EXPECT_EQ(Present(*b, h), 0u);
  auto stolen = b->ReadInPlace(hit->lease_id, 0);
  EXPECT_EQ(stolen.status().code(), StatusCode::kNotFound) << stolen.status();
  ExpectServes(*b, 7);
  EXPECT_FALSE(InSegments(*b, v->data(), v->size()));
  for (const auto& seg : b->SharedSegments()) {
    EXPECT_EQ(::memmem(seg.data, seg.size, secret.data() + 4096, 256), nullptr)
        << "a's bytes are visible in b's segment " << seg.index;
  }
  std::set<uint32_t> segs_a;
  for (const auto& s : a->SharedSegments()) segs_a.insert(s.index);
  for (const auto& s : b->SharedSegments()) EXPECT_EQ(segs_a.count(s.index), 0u);
  EXPECT_TRUE(a->ReleaseLease(hit->lease_id).ok());
}

TEST_F(InPlaceE2eTest, WithoutSharedMemoryTheCallsSayWhy) {
  client::ClientOptions off = kvd_->UnixEngineOptions("off");
  off.shared_memory = false;
  for (const client::ClientOptions& o : {kvd_->EngineOptions("tcp"), off}) {
    auto c = ConnectOrFail(o);
    ASSERT_NE(c, nullptr);
    ASSERT_FALSE(c->session().shared_memory);
    const std::vector<uint8_t> data = PutChunk(*c, Hash128{0x0ff, 1}, 8);
    Hash128 h{0x0ff, 1};
    auto hit = c->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
    auto v = c->ReadInPlace(hit->lease_id, 0);
    EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition) << v.status();
    EXPECT_NE(v.status().message().find(o.shared_memory ? "TCP" : "shared_memory is false"),
              std::string::npos)
        << v.status();
    EXPECT_NE(v.status().message().find("use Get"), std::string::npos) << v.status();
    auto slot = c->ReservePut(Hash128{0x0ff, 2}, 256, data.size());
    EXPECT_EQ(slot.status().code(), StatusCode::kFailedPrecondition) << slot.status();
    EXPECT_NE(slot.status().message().find("use Put"), std::string::npos) << slot.status();
    // Nothing was asked of kvd: the chunk still serves by copy.
    std::vector<uint8_t> out(data.size());
    ASSERT_TRUE(c->Get(hit->lease_id, 0, out.data(), out.size()).ok());
    EXPECT_EQ(out, data);
    EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
    ASSERT_TRUE(admin_->Evict({client::EvictFilter::Kind::kAll, "", {}}).ok());
  }
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
}

TEST_F(InPlaceE2eTest, TheCApiReadsAndWritesInPlace) {
  const client::ClientOptions o = kvd_->UnixEngineOptions("c-engine");
  kvd_config config = CConfig(o);
  kvd_client* c = nullptr;
  ASSERT_EQ(kvd_client_connect(&config, &c), KVD_OK) << kvd_last_error();
  const size_t bytes = o.layout.ChunkBytes(256);
  const std::vector<uint8_t> data = RandomBytes(bytes, 12);
  const kvd_hash128 h{0xc1, 1};

  // Write in place and commit.
  kvd_put_slot* slot = nullptr;
  void* at = nullptr;
  int already = -1;
  ASSERT_EQ(kvd_client_reserve_put(c, h, 256, bytes, &slot, &at, &already), KVD_OK)
      << kvd_last_error();
  ASSERT_NE(at, nullptr);
  EXPECT_EQ(already, 0);
  std::memcpy(at, data.data(), bytes);
  uint64_t stored = 0;
  ASSERT_EQ(kvd_client_commit_put(c, slot, &stored), KVD_OK) << kvd_last_error();
  EXPECT_EQ(stored, bytes);
  // An aborted one leaves nothing.
  ASSERT_EQ(kvd_client_reserve_put(c, kvd_hash128{0xc1, 2}, 256, bytes, &slot, &at, nullptr),
            KVD_OK)
      << kvd_last_error();
  kvd_put_slot_abort(slot);
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
  // A bad byte count: INVALID_ARGUMENT, no slot.
  EXPECT_EQ(kvd_client_reserve_put(c, kvd_hash128{0xc1, 3}, 256, bytes + 1, &slot, &at, nullptr),
            KVD_INVALID_ARGUMENT);
  EXPECT_EQ(slot, nullptr);

  // Read it in place, with and without the checksum check.
  kvd_lookup_result hit;
  kvd_lookup_result_init(&hit);
  ASSERT_EQ(kvd_client_lookup(c, &h, 1, &hit), KVD_OK) << kvd_last_error();
  ASSERT_EQ(hit.matched_chunks, 1u);
  for (const uint32_t flags : {0u, uint32_t{KVD_READ_NO_VERIFY}}) {
    kvd_chunk_view* view = nullptr;
    const void* bytes_at = nullptr;
    kvd_get_result got;
    kvd_get_result_init(&got);
    ASSERT_EQ(kvd_client_read_in_place(c, hit.lease_id, 0, flags, &view, &bytes_at, &got), KVD_OK)
        << kvd_last_error();
    ASSERT_EQ(got.bytes, bytes);
    EXPECT_EQ(got.checksum, Checksum64(data.data(), bytes));
    EXPECT_EQ(std::memcmp(bytes_at, data.data(), bytes), 0);
    kvd_chunk_view_release(view);
  }
  EXPECT_EQ(kvd_client_release_lease(c, hit.lease_id), KVD_OK) << kvd_last_error();
  // A view may be released after its client is closed.
  ASSERT_EQ(kvd_client_lookup(c, &h, 1, &hit), KVD_OK) << kvd_last_error();
  // That lookup carried the ended views' reads and the released lease.
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
  kvd_chunk_view* late = nullptr;
  const void* late_at = nullptr;
  ASSERT_EQ(kvd_client_read_in_place(c, hit.lease_id, 0, 0, &late, &late_at, nullptr), KVD_OK)
      << kvd_last_error();
  kvd_client_close(c);
  EXPECT_EQ(std::memcmp(late_at, data.data(), bytes), 0);
  kvd_chunk_view_release(late);
  EXPECT_TRUE(Eventually([&] { return CounterValue(*admin_, "host_reads_open") == 0; }, 5s));
}

}  // namespace
}  // namespace kvd::e2e
