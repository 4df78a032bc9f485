// Cluster-scope lookups and peer fetch between three real kvd processes (127.0.0.2-4, UCX over
// tcp) on a real etcd-server: which node holds how long a prefix; a chunk a peer holds is fetched
// byte-exact and served like a local one; a wrong cluster token and a differing layout are
// refused naming why; a peer killed with SIGKILL during fetches gives misses, never wrong bytes,
// never a hang; bytes damaged in flight are a miss, never stored; a prefill engine puts to the
// decode node's kvd (named, or chosen by the placement rule) and the decode node reads it local.
// Skipped when etcd is not installed.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "kvd/cluster/placement.h"
#include "peer_cluster.h"

namespace kvd::e2e {
namespace {

class PeerFetchE2eTest : public PeerClusterTest {};

TEST_F(PeerFetchE2eTest, ClusterLookupNamesEachNodesPrefixAndPeerFetchIsByteExact) {
  auto a = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  auto b = ConnectOrFail(kvds_[1]->EngineOptions("writer-b"));
  auto c = ConnectOrFail(kvds_[2]->EngineOptions("writer-c"));
  ASSERT_TRUE(a && b && c);
  EXPECT_TRUE(a->session().cluster_lookup);
  auto chain = a->hasher().ChunkChain(RandomTokens(4 * 256, 7), true);
  ASSERT_EQ(chain.size(), 4u);
  auto bytes = PutPrefix(*b, chain, 4, 100);  // b holds 4 chunks, c the first 2
  PutPrefix(*c, chain, 2, 100);

  auto local = a->Lookup(chain);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->matched_chunks, 0u);
  EXPECT_TRUE(local->holders.empty());

  auto hit = a->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->holders.size(), 3u);
  EXPECT_EQ(hit->holders[0].node, "a");
  const auto* hb = HolderOf(*hit, "b");
  const auto* hc = HolderOf(*hit, "c");
  ASSERT_TRUE(hb && hc);
  EXPECT_EQ(hb->matched_chunks, 4u) << hb->error;
  EXPECT_EQ(hc->matched_chunks, 2u) << hc->error;
  EXPECT_EQ(hb->error, "");
  // Where b and c hold them: their host tiers (a has none before the fetch).
  ASSERT_EQ(hb->found_in.size(), 1u);
  EXPECT_EQ(hb->found_in[0].tier, "host");
  EXPECT_EQ(hb->found_in[0].chunks, 4u);
  ASSERT_EQ(hc->found_in.size(), 1u);
  EXPECT_EQ(hc->found_in[0].chunks, 2u);
  EXPECT_EQ(hit->fetched_chunks, 4u);
  ASSERT_EQ(hit->matched_chunks, 4u);
  EXPECT_EQ(hit->holders[0].matched_chunks, 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    std::vector<uint8_t> out(bytes[i].size());
    auto got = a->Get(hit->lease_id, i, out.data(), out.size());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i << " differs";
  }
  ASSERT_TRUE(a->ReleaseLease(hit->lease_id).ok());
  // a's metrics count the lookup, the two members asked and the fetch.
  double fetched_bytes = 0;
  for (const auto& b : bytes) fetched_bytes += static_cast<double>(b.size());
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_lookups_total"), 1);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_peer_asks_total"), 2);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_peer_errors_total"), 0);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetches_total"), 1);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetched_chunks_total"), 4);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetched_bytes_total"), fetched_bytes);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetch_failures_total"), 0);

  // Stored on a now: a local lookup finds them, a cluster one fetches nothing more.
  auto again = a->Lookup(chain);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->matched_chunks, 4u);
  if (again->lease_id != 0) EXPECT_TRUE(a->ReleaseLease(again->lease_id).ok());
  auto cluster_again = a->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(cluster_again.ok()) << cluster_again.status();
  EXPECT_EQ(cluster_again->fetched_chunks, 0u);
  EXPECT_EQ(cluster_again->matched_chunks, 4u);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_lookups_total"), 2);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetches_total"), 1);
}

// Every node with cluster.peer_fetch: serve.
class PeerServeE2eTest : public PeerClusterTest {
 protected:
  PeerServeE2eTest() { peer_fetch_ = "serve"; }
};

// Chunks [0, bytes.size()) of `lease` read on `c` are `bytes`.
void ExpectLeaseReads(client::Client& c, uint64_t lease,
                      const std::vector<std::vector<uint8_t>>& bytes) {
  for (uint32_t i = 0; i < bytes.size(); ++i) {
    std::vector<uint8_t> out(bytes[i].size());
    auto got = c.Get(lease, i, out.data(), out.size());
    ASSERT_TRUE(got.ok()) << "chunk " << i << ": " << got.status();
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i << " differs";
  }
}

// Releases `lease` and sends what `c` deferred (a released lease and the reads of its gets
// ride the next request) at once.
void EndLease(client::Client& c, uint64_t lease) {
  ASSERT_TRUE(c.ReleaseLease(lease).ok());
  ASSERT_TRUE(c.FlushReleases().ok());
}

// Served through: a's cluster lookup serves b's chunks byte-exact under one lease; a second
// reader's own lease keeps them readable after the first is released; once no lease holds them
// they are gone from a's host tier (a local lookup misses, a cluster lookup fetches again); a
// lease ended by a disconnect lets them go too; a chunk put on a while served stays.
TEST_F(PeerServeE2eTest, ServedChunksLeaveTheHostTierWithTheLastLease) {
  auto a = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  auto second = ConnectOrFail(kvds_[0]->EngineOptions("second-reader-a"));
  auto b = ConnectOrFail(kvds_[1]->EngineOptions("writer-b"));
  auto admin = ConnectOrFail(kvds_[0]->AdminOptions());
  ASSERT_TRUE(a && second && b && admin);
  auto chain = a->hasher().ChunkChain(RandomTokens(4 * 256, 17), true);
  ASSERT_EQ(chain.size(), 4u);
  auto bytes = PutPrefix(*b, chain, 4, 500);

  auto hit = a->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->fetched_chunks, 4u);
  ASSERT_EQ(hit->matched_chunks, 4u);
  ExpectLeaseReads(*a, hit->lease_id, bytes);
  EXPECT_EQ(HostTier(*admin).chunks, 4u);  // held while leased

  auto own = second->Lookup(chain);  // a local lookup while they are held: found, leased
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->matched_chunks, 4u);
  EndLease(*a, hit->lease_id);
  ExpectLeaseReads(*second, own->lease_id, bytes);  // still there for the second reader
  EXPECT_EQ(HostTier(*admin).chunks, 4u);
  EndLease(*second, own->lease_id);

  EXPECT_EQ(LocalPrefix(*kvds_[0], chain), 0u);
  EXPECT_EQ(HostTier(*admin).chunks, 0u);
  EXPECT_EQ(HostTier(*admin).used_bytes, 0u);
  EXPECT_EQ(LocalPrefix(*kvds_[1], chain), 4u);  // b keeps its own

  // Fetched again by the next cluster lookup; a disconnect ends that lease, and they go.
  {
    auto leaver = ConnectOrFail(kvds_[0]->EngineOptions("leaver-a"));
    ASSERT_NE(leaver, nullptr);
    auto again = leaver->Lookup(chain, {.cluster = true});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->fetched_chunks, 4u);
    EXPECT_EQ(again->matched_chunks, 4u);
  }
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin).chunks == 0; }, milliseconds(5000)));
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetched_chunks_total"), 8);

  // A put of chunk 0 on a while it is served stores it: it stays, the rest go.
  auto writer = ConnectOrFail(kvds_[0]->EngineOptions("writer-a"));
  ASSERT_NE(writer, nullptr);
  auto third = a->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->fetched_chunks, 4u);
  PutChunk(*writer, chain[0], 500);
  EndLease(*a, third->lease_id);
  EXPECT_EQ(LocalPrefix(*kvds_[0], chain), 1u);
  EXPECT_EQ(HostTier(*admin).chunks, 1u);
}

TEST_F(PeerFetchE2eTest, AWrongClusterTokenIsRefusedNamingWhy) {
  client::ClientOptions o = kvds_[1]->EngineOptions("impostor");
  o.cluster_token = "not-the-token";
  auto refused = client::Client::Connect(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("cluster token mismatch"), std::string::npos)
      << refused.status();

  // The right token is a read-only peer session.
  o.cluster_token = kToken;
  auto peer = ConnectOrFail(o);
  ASSERT_NE(peer, nullptr);
  EXPECT_TRUE(peer->session().read_only);

  // A kvd of the same cluster name with another token is never a member, so never asked.
  auto d = StartNode("d", 5, "another-token", 8);
  ASSERT_NE(d, nullptr);
  auto writer = ConnectOrFail(d->EngineOptions("writer-d"));
  auto reader = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  ASSERT_TRUE(writer && reader);
  auto chain = reader->hasher().ChunkChain(RandomTokens(256, 9), true);
  PutPrefix(*writer, chain, 1, 300);
  ASSERT_TRUE(Eventually([&] { return MetricValue(*kvds_[0], "kvd_cluster_refused") >= 1; },
                         milliseconds(10000)));
  auto hit = reader->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched_chunks, 0u);
  EXPECT_EQ(HolderOf(*hit, "d"), nullptr);
  EXPECT_EQ(d->Stop(), 0);
}

TEST_F(PeerFetchE2eTest, AChunkNeverTravelsToANodeWhoseLayoutDiffers) {
  // c registers "tiny" with head_dim 16, a and b with 8.
  client::ClientOptions on_c = kvds_[2]->EngineOptions("writer-c");
  on_c.model = kTinyModel;
  on_c.layout = TinyLayout(16);
  auto writer = ConnectOrFail(on_c);
  client::ClientOptions on_a = kvds_[0]->EngineOptions("reader-a");
  on_a.model = kTinyModel;
  on_a.layout = TinyLayout(8);
  auto reader = ConnectOrFail(on_a);
  ASSERT_TRUE(writer && reader);
  auto chain = reader->hasher().ChunkChain(RandomTokens(256, 11), true);
  PutPrefix(*writer, chain, 1, 400);

  auto hit = reader->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched_chunks, 0u);
  EXPECT_EQ(hit->fetched_chunks, 0u);
  const auto* hc = HolderOf(*hit, "c");
  ASSERT_NE(hc, nullptr);
  EXPECT_EQ(hc->matched_chunks, 0u);
  EXPECT_NE(hc->error.find("layout of model tiny differs"), std::string::npos) << hc->error;

  // And c itself refuses a peer of a's layout, naming the field.
  client::ClientOptions peer = on_a;
  peer.address = kvds_[2]->tcp_address();
  peer.cluster_token = kToken;
  auto refused = client::Client::Connect(peer);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("layout mismatch"), std::string::npos)
      << refused.status();
}

// The decode node's view of a chain a prefill engine placed on it: every chunk local and
// byte-exact.
void ExpectDecodesLocally(KvdProcess& kvd, const std::vector<Hash128>& chain,
                          const std::vector<std::vector<uint8_t>>& bytes) {
  auto decode = ConnectOrFail(kvd.EngineOptions("decode"));
  ASSERT_NE(decode, nullptr);
  auto hit = decode->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, chain.size());
  for (uint32_t i = 0; i < chain.size(); ++i) {
    std::vector<uint8_t> out(bytes[i].size());
    auto got = decode->Get(hit->lease_id, i, out.data(), out.size());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i << " differs";
  }
  EXPECT_TRUE(decode->ReleaseLease(hit->lease_id).ok());
}

// Puts `chain` through a client of `base`'s daemon to the member `target` names: over UCX's tcp
// lane to that kvd, as between two hosts (no inline puts, and no same-host copy: every byte
// through UCX).
std::vector<std::vector<uint8_t>> PutPlaced(const client::ClientOptions& base,
                                            const client::PlacementTarget& target,
                                            const std::vector<Hash128>& chain, uint64_t seed) {
  client::ClientOptions o = client::PlacedOptions(base, target);
  o.client_id = "prefill-to-" + target.node;
  o.inline_put_bytes = 0;
  transport::MutableBackendOptions<transport::UcxOptions>(&o.transport).cma_threshold_bytes = 0;
  auto to = ConnectOrFail(o);
  if (to == nullptr) return {};
  EXPECT_EQ(to->session().transport.find("ucx"), 0u) << to->session().transport;
  return PutPrefix(*to, chain, chain.size(), seed);
}

TEST_F(PeerFetchE2eTest, PrefillOnAPutsToTheNamedDecodeNodeBAndDecodeOnBReadsItLocal) {
  const client::ClientOptions on_a = kvds_[0]->EngineOptions("prefill-a");
  auto prefill = ConnectOrFail(on_a);
  ASSERT_NE(prefill, nullptr);
  EXPECT_TRUE(prefill->session().cluster_placement);
  auto chain = prefill->hasher().ChunkChain(RandomTokens(3 * 256, 21), true);
  ASSERT_EQ(chain.size(), 3u);

  auto placed = prefill->Place(chain, {.node = "b"});
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_TRUE(placed->membership_current);
  EXPECT_EQ(placed->membership_age_ms, 0u);
  ASSERT_EQ(placed->targets.size(), 1u);
  EXPECT_EQ(placed->targets[0].node, "b");
  EXPECT_EQ(placed->targets[0].control_address, kvds_[1]->tcp_address());
  EXPECT_FALSE(placed->targets[0].local);

  auto bytes = PutPlaced(on_a, placed->targets[0], chain, 600);
  ASSERT_EQ(bytes.size(), 3u);
  ExpectDecodesLocally(*kvds_[1], chain, bytes);
  EXPECT_EQ(LocalPrefix(*kvds_[0], chain), 0u) << "the chunks are on a, where no one decodes";
  EXPECT_EQ(LocalPrefix(*kvds_[2], chain), 0u);

  // b's cluster view agrees: b holds all three, the others none, nothing to fetch.
  auto decode = ConnectOrFail(kvds_[1]->EngineOptions("decode-b"));
  ASSERT_NE(decode, nullptr);
  auto seen = decode->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->fetched_chunks, 0u);
  EXPECT_TRUE(seen->membership_current);
  EXPECT_EQ(seen->membership_age_ms, 0u);
  ASSERT_NE(HolderOf(*seen, "a"), nullptr);
  EXPECT_EQ(HolderOf(*seen, "a")->matched_chunks, 0u);
  EXPECT_EQ(HolderOf(*seen, "b")->matched_chunks, 3u);
}

TEST_F(PeerFetchE2eTest, ThePlacementRuleIsRendezvousOnTheFirstChunkAndEveryNodeAgrees) {
  const client::ClientOptions on_a = kvds_[0]->EngineOptions("prefill-a");
  std::vector<std::unique_ptr<client::Client>> clients;
  for (auto& kvd : kvds_) clients.push_back(ConnectOrFail(kvd->EngineOptions("placer")));
  ASSERT_TRUE(clients[0] && clients[1] && clients[2]);
  const std::vector<std::string> nodes = {"a", "b", "c"};
  std::map<std::string, int> chosen;
  for (uint64_t seed = 0; seed < 12; ++seed) {
    auto chain = clients[0]->hasher().ChunkChain(RandomTokens(2 * 256, 700 + seed), true);
    std::vector<client::PlacementTarget> first_answer;
    for (size_t i = 0; i < clients.size(); ++i) {
      auto placed = clients[i]->Place(chain);
      ASSERT_TRUE(placed.ok()) << placed.status();
      ASSERT_EQ(placed->targets.size(), 3u);
      for (const auto& t : placed->targets) EXPECT_EQ(t.local, t.node == nodes[i]);
      if (i == 0) {
        first_answer = placed->targets;
        const auto order = cluster::RendezvousOrder(chain[0], nodes);
        for (size_t k = 0; k < 3; ++k) EXPECT_EQ(placed->targets[k].node, nodes[order[k]]);
        continue;
      }
      for (size_t k = 0; k < 3; ++k) {
        EXPECT_EQ(placed->targets[k].node, first_answer[k].node) << "node " << nodes[i];
        EXPECT_EQ(placed->targets[k].control_address, first_answer[k].control_address);
      }
    }
    // The rule keys on chunk 0 only: a longer chain with the same first chunk goes there too.
    auto longer = clients[1]->hasher().ChunkChain(RandomTokens(2 * 256, 700 + seed), true);
    longer.push_back(Hash128{seed, 1});
    auto same = clients[1]->Place(longer);
    ASSERT_TRUE(same.ok()) << same.status();
    EXPECT_EQ(same->targets[0].node, first_answer[0].node);
    if (seed >= 3) continue;
    // Put from a to the chosen node: only it holds the chain.
    const auto& target = first_answer[0];
    ++chosen[target.node];
    auto bytes = PutPlaced(on_a, target, chain, 800 + 10 * seed);
    ASSERT_EQ(bytes.size(), 2u);
    for (size_t i = 0; i < kvds_.size(); ++i) {
      if (nodes[i] == target.node) {
        ExpectDecodesLocally(*kvds_[i], chain, bytes);
      } else {
        EXPECT_EQ(LocalPrefix(*kvds_[i], chain), 0u) << nodes[i];
      }
    }
  }
}

TEST_F(PeerFetchE2eTest, PlacementNeverNamesANodeWhoseLayoutDiffersAndSaysWhy) {
  // c registers "tiny" with head_dim 16, a and b with 8.
  client::ClientOptions on_a = kvds_[0]->EngineOptions("prefill-a");
  on_a.model = kTinyModel;
  on_a.layout = TinyLayout(8);
  auto prefill = ConnectOrFail(on_a);
  ASSERT_NE(prefill, nullptr);
  for (uint64_t seed = 0; seed < 8; ++seed) {
    auto chain = prefill->hasher().ChunkChain(RandomTokens(256, 900 + seed), true);
    auto placed = prefill->Place(chain);
    ASSERT_TRUE(placed.ok()) << placed.status();
    ASSERT_EQ(placed->targets.size(), 2u);
    for (const auto& t : placed->targets) EXPECT_NE(t.node, "c");
  }
  auto chain = prefill->hasher().ChunkChain(RandomTokens(256, 999), true);
  auto to_c = prefill->Place(chain, {.node = "c"});
  ASSERT_FALSE(to_c.ok());
  EXPECT_EQ(to_c.status().code(), StatusCode::kFailedPrecondition) << to_c.status();
  EXPECT_NE(to_c.status().message().find("layout of model tiny differs"), std::string::npos)
      << to_c.status();
  auto nowhere = prefill->Place(chain, {.node = "zz"});
  ASSERT_FALSE(nowhere.ok());
  EXPECT_EQ(nowhere.status().code(), StatusCode::kNotFound) << nowhere.status();
  EXPECT_NE(nowhere.status().message().find("members: a, b, c"), std::string::npos)
      << nowhere.status();
  EXPECT_EQ(prefill->Place({}).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PeerFetchE2eTest, APeerKilledDuringFetchesGivesMissesNeverWrongBytesNorAHang) {
  constexpr int kCycles = 50;
  constexpr size_t kChunks = 2;
  auto b = ConnectOrFail(kvds_[1]->EngineOptions("writer-b"));
  auto a = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  ASSERT_TRUE(a && b);
  std::vector<std::vector<Hash128>> chains;
  std::vector<std::vector<std::vector<uint8_t>>> bytes;
  for (int i = 0; i < kCycles; ++i) {
    chains.push_back(a->hasher().ChunkChain(RandomTokens(kChunks * 256, 1000 + i), true));
    bytes.push_back(PutPrefix(*b, chains.back(), kChunks, 5000 + 10 * i));
  }
  b.reset();

  std::atomic<int> cycle{0};
  std::thread killer([&] {
    while (cycle.load() < kCycles / 4) std::this_thread::sleep_for(milliseconds(1));
    std::this_thread::sleep_for(milliseconds(3));  // into a cycle's fetch
    kvds_[1]->Kill();
  });
  int fetched = 0, missed = 0, partial = 0;
  double longest_s = 0;
  for (int i = 0; i < kCycles; ++i) {
    cycle.store(i);
    const auto start = std::chrono::steady_clock::now();
    auto hit = a->Lookup(chains[i], {.cluster = true});
    longest_s = std::max(
        longest_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    ASSERT_TRUE(hit.ok()) << "cycle " << i << ": " << hit.status();
    for (uint32_t k = 0; k < hit->matched_chunks; ++k) {
      std::vector<uint8_t> out(bytes[i][k].size());
      auto got = a->Get(hit->lease_id, k, out.data(), out.size());
      ASSERT_TRUE(got.ok()) << "cycle " << i << " chunk " << k << ": " << got.status();
      ASSERT_TRUE(out == bytes[i][k]) << "wrong bytes: cycle " << i << " chunk " << k;
    }
    if (hit->lease_id != 0) EXPECT_TRUE(a->ReleaseLease(hit->lease_id).ok());
    if (hit->matched_chunks == kChunks) {
      ++fetched;
    } else if (hit->matched_chunks == 0) {
      ++missed;
    } else {
      ++partial;
    }
  }
  killer.join();
  std::printf(
      "[peer-fetch] %d cycles, peer b SIGKILLed at cycle %d: %d fetched whole, %d "
      "partial, %d misses; slowest cluster lookup %.3f s (peer timeout %d ms)\n",
      kCycles, kCycles / 4, fetched, partial, missed, longest_s, kPeerTimeoutMs);
  EXPECT_GE(fetched, kCycles / 4 - 1);
  EXPECT_GE(missed, kCycles / 2);
  // a's metrics agree: every cycle a cluster lookup, every chunk served fetched, and each miss
  // either the dead peer's error or a fetch it cut short.
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_lookups_total"), kCycles);
  EXPECT_GE(MetricValue(*kvds_[0], "kvd_cluster_fetched_chunks_total"),
            static_cast<double>(fetched * kChunks));
  EXPECT_GE(MetricValue(*kvds_[0], "kvd_cluster_peer_errors_total") +
                MetricValue(*kvds_[0], "kvd_cluster_fetch_failures_total"),
            missed);
  // No hang: every step with the dead peer is bounded by the peer timeout (connect, lookup,
  // one transfer), so a lookup ends within a few of them (a generous bound, not a speed).
  EXPECT_LT(longest_s, 10.0);
  // a still serves (and its peer c still answers).
  auto c_hit = a->Lookup(chains[0], {.cluster = true});
  ASSERT_TRUE(c_hit.ok()) << c_hit.status();
}

// Two peers that stop answering (SIGSTOP: their sockets accept, nothing replies) cost a cluster
// lookup one peer timeout, not one per peer: the members are asked at once.
TEST_F(PeerFetchE2eTest, SilentPeersCostOneTimeoutNotOnePerPeer) {
  auto a = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  ASSERT_TRUE(a);
  auto chain = a->hasher().ChunkChain(RandomTokens(256, 11), true);
  ASSERT_EQ(::kill(kvds_[1]->pid(), SIGSTOP), 0);
  ASSERT_EQ(::kill(kvds_[2]->pid(), SIGSTOP), 0);
  const auto start = std::chrono::steady_clock::now();
  auto hit = a->Lookup(chain, {.cluster = true});
  const double took_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::kill(kvds_[1]->pid(), SIGCONT);
  ::kill(kvds_[2]->pid(), SIGCONT);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched_chunks, 0u);
  ASSERT_EQ(hit->holders.size(), 3u);
  for (const char* node : {"b", "c"}) {
    const auto* h = HolderOf(*hit, node);
    ASSERT_NE(h, nullptr) << node;
    EXPECT_NE(h->error.find("DEADLINE_EXCEEDED"), std::string::npos) << node << ": " << h->error;
  }
  std::printf("[peer-fetch] two silent peers: cluster lookup took %.3f s (peer timeout %d ms)\n",
              took_s, kPeerTimeoutMs);
  // Asked one after the other, two peers take two timeouts (2 s); at once, one.
  EXPECT_LT(took_s, 1.8 * kPeerTimeoutMs / 1000.0);
}

// Every node's first peer client receives its first chunk damaged in one byte on the way
// (KVD_TEST_PEER_FETCH_CORRUPT_RECV, the daemon's fault-injection seam).
class DamagedPeerFetchE2eTest : public PeerClusterTest {
 protected:
  void SetUp() override {
    ::setenv("KVD_TEST_PEER_FETCH_CORRUPT_RECV", "1", 1);
    PeerClusterTest::SetUp();
    ::unsetenv("KVD_TEST_PEER_FETCH_CORRUPT_RECV");
  }
};

// Bytes damaged in flight during a peer fetch fail the checksum on a: the reader gets a miss
// (and recomputes), never wrong bytes; nothing damaged is stored on a (a local lookup misses, and
// the recomputed chunk's put is stored, not taken for a duplicate); a keeps serving and its next
// cluster lookup fetches the rest byte-exact.
TEST_F(DamagedPeerFetchE2eTest, DamagedBytesAreAMissNeverWrongBytesAndAreNotStored) {
  auto a = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  auto b = ConnectOrFail(kvds_[1]->EngineOptions("writer-b"));
  ASSERT_TRUE(a && b);
  auto chain = a->hasher().ChunkChain(RandomTokens(4 * 256, 11), true);
  ASSERT_EQ(chain.size(), 4u);
  auto bytes = PutPrefix(*b, chain, 4, 300);

  auto hit = a->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(hit.ok()) << hit.status();
  const auto* hb = HolderOf(*hit, "b");
  ASSERT_NE(hb, nullptr);
  EXPECT_EQ(hb->matched_chunks, 4u) << hb->error;
  for (uint32_t i = 0; i < hit->matched_chunks; ++i) {  // whatever matched reads back exact
    std::vector<uint8_t> out(bytes[i].size());
    ASSERT_TRUE(a->Get(hit->lease_id, i, out.data(), out.size()).ok());
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i << " differs";
  }
  if (hit->lease_id != 0) EXPECT_TRUE(a->ReleaseLease(hit->lease_id).ok());
  EXPECT_EQ(hit->matched_chunks, 0u);  // the damaged chunk is the first: a miss
  EXPECT_EQ(hit->fetched_chunks, 0u);
  EXPECT_EQ(MetricValue(*kvds_[0], "kvd_cluster_fetch_failures_total"), 1);
  EXPECT_NE(kvds_[0]->Log().find("checksum mismatch"), std::string::npos) << kvds_[0]->Log();
  EXPECT_EQ(LocalPrefix(*kvds_[0], chain), 0u);

  // The reader recomputes chunk 0 and puts it on a: stored (no damaged copy holds the key).
  EXPECT_TRUE(PutChunk(*a, chain[0], 300) == bytes[0]);
  EXPECT_EQ(LocalPrefix(*kvds_[0], chain), 1u);

  // a keeps serving: the next cluster lookup fetches chunks 1-3, byte-exact.
  ASSERT_TRUE(kvds_[0]->Alive());
  auto again = a->Lookup(chain, {.cluster = true});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->fetched_chunks, 3u);
  ASSERT_EQ(again->matched_chunks, 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    std::vector<uint8_t> out(bytes[i].size());
    ASSERT_TRUE(a->Get(again->lease_id, i, out.data(), out.size()).ok());
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i << " differs";
  }
  EXPECT_TRUE(a->ReleaseLease(again->lease_id).ok());
}

}  // namespace
}  // namespace kvd::e2e
