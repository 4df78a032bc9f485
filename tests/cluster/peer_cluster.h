// The cluster of the peer-fetch, placement and fault tests: three real kvd processes on
// 127.0.0.2-4 in one cluster on a real etcd-server (the fixture's etcd_), UCX over tcp between
// them. Skipped when etcd is not installed.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "e2e_common.h"
#include "etcd_server.h"

namespace kvd::e2e {

using std::chrono::milliseconds;

inline constexpr char kToken[] = "peer-fetch-token";
inline constexpr int kPeerTimeoutMs = 1000;

// A model registered with another layout on node c (same name, same chain hashes).
inline constexpr char kTinyModel[] = "tiny";
inline ModelLayout TinyLayout(int head_dim) {
  ModelLayout l;
  l.num_layers = 2;
  l.num_kv_heads = 2;
  l.num_q_heads = 2;
  l.head_dim = head_dim;
  l.dtype = DType::kFloat32;
  l.rope.pairing = RopePairing::kInterleaved;
  return l;
}
inline std::string TinyModelYaml(int head_dim) {
  return "  - name: tiny\n    layout: {layers: 2, kv_heads: 2, q_heads: 2, head_dim: " +
         std::to_string(head_dim) +
         ", dtype: float32, rope: {theta: 10000, pairing: interleaved, scaling: none}}\n";
}

// Every live kvd of `kvds` reports kvd_cluster_reachable == `reachable` (1: etcd answers) and,
// when `members` >= 0, that many members (itself included), within `timeout`.
inline bool ClusterAllSee(const std::vector<std::unique_ptr<KvdProcess>>& kvds, double members,
                          double reachable, milliseconds timeout) {
  return Eventually(
      [&] {
        for (auto& kvd : kvds) {
          if (!kvd->Alive()) continue;
          if (MetricValue(*kvd, "kvd_cluster_reachable") != reachable) return false;
          if (members >= 0 && MetricValue(*kvd, "kvd_cluster_members") != members) return false;
        }
        return true;
      },
      timeout);
}

// Three kvds a, b, c on 127.0.0.2-4 in cluster "pf" (token kToken, lease TTL 3 s, UCX over
// tcp); c registers model tiny with another layout than a and b.
class PeerClusterTest : public cluster_test::EtcdTest {
 protected:
  void SetUp() override {
    EtcdTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    for (int i = 0; i < 3; ++i) {
      kvds_.push_back(
          StartNode(std::string(1, static_cast<char>('a' + i)), 2 + i, kToken, i == 2 ? 16 : 8));
      ASSERT_NE(kvds_.back(), nullptr);
    }
    ASSERT_TRUE(AllSeeMembers(3)) << kvds_[0]->Log();
  }
  void TearDown() override {
    for (auto& kvd : kvds_) {
      if (kvd && kvd->Alive()) {
        EXPECT_EQ(kvd->Stop(), 0) << kvd->Log();
      }
    }
  }

  std::unique_ptr<KvdProcess> StartNode(const std::string& node, int ip_last, const char* token,
                                        int tiny_head_dim) {
    KvdConfig c;
    c.ucx_tls = "tcp";
    c.host_capacity = "96MiB";
    c.listen = "127.0.0." + std::to_string(ip_last) + ":0";
    c.metrics = true;
    c.extra_models = TinyModelYaml(tiny_head_dim);
    c.extra_yaml = "cluster:\n  etcd: [" + etcd_->endpoint() + "]\n  name: pf\n  node: " + node +
                   "\n  lease_ttl_s: 3\n  token: " + token +
                   "\n  peer_timeout_ms: " + std::to_string(kPeerTimeoutMs) + "\n";
    if (!peer_fetch_.empty()) c.extra_yaml += "  peer_fetch: " + peer_fetch_ + "\n";
    return StartKvd(c);
  }

  // Every live kvd lists `members` members (this node included).
  bool AllSeeMembers(double members) {
    return Eventually(
        [&] {
          for (auto& kvd : kvds_) {
            if (kvd->Alive() && MetricValue(*kvd, "kvd_cluster_members") != members) return false;
          }
          return true;
        },
        milliseconds(10000));
  }

  bool AllSee(double members, double reachable, milliseconds timeout) {
    return ClusterAllSee(kvds_, members, reachable, timeout);
  }

  std::vector<std::unique_ptr<KvdProcess>> kvds_;
  std::string peer_fetch_;  // cluster.peer_fetch of every node ("": the default, store)
};

// Puts chunks [0, n) of `chain` on `c`, returning their bytes.
inline std::vector<std::vector<uint8_t>> PutPrefix(client::Client& c,
                                                   const std::vector<Hash128>& chain, size_t n,
                                                   uint64_t seed) {
  std::vector<std::vector<uint8_t>> bytes;
  for (size_t i = 0; i < n; ++i) bytes.push_back(PutChunk(c, chain[i], seed + i));
  return bytes;
}

// How many leading chunks of `chain` `kvd` holds itself.
inline uint32_t LocalPrefix(KvdProcess& kvd, const std::vector<Hash128>& chain) {
  auto c = ConnectOrFail(kvd.EngineOptions("probe"));
  if (c == nullptr) return ~0u;
  auto hit = c->Lookup(chain);
  if (!hit.ok()) return ~0u;
  if (hit->lease_id != 0) c->ReleaseLease(hit->lease_id).IgnoreError();
  return hit->matched_chunks;
}

inline const client::PrefixHolder* HolderOf(const client::LookupResult& r,
                                            const std::string& node) {
  for (const auto& h : r.holders) {
    if (h.node == node) return &h;
  }
  return nullptr;
}

}  // namespace kvd::e2e
