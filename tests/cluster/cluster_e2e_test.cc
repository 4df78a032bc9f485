// Three real kvd processes (on 127.0.0.2-4) in one cluster on a real etcd-server: they register
// and see each other, a node killed with SIGKILL leaves within the lease TTL, and with etcd gone
// they keep serving puts and gets, report the cluster unreachable, and register again once etcd
// is back. Skipped when etcd is not installed.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "peer_cluster.h"

namespace kvd::e2e {
namespace {

constexpr int kLeaseTtlS = 3;

class ClusterE2eTest : public cluster_test::EtcdTest {
 protected:
  void SetUp() override {
    EtcdTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    for (int i = 0; i < 3; ++i) {
      const std::string node = std::string(1, static_cast<char>('a' + i));
      KvdConfig c;
      c.ucx_tls = "tcp";
      c.listen = "127.0.0." + std::to_string(2 + i) + ":0";
      c.metrics = true;
      c.extra_yaml = "cluster:\n  etcd: [" + etcd_->endpoint() + "]\n  name: e2e\n  node: " + node +
                     "\n  lease_ttl_s: " + std::to_string(kLeaseTtlS) + "\n";
      kvds_.push_back(StartKvd(c));
      ASSERT_NE(kvds_.back(), nullptr);
    }
  }
  void TearDown() override {
    for (auto& kvd : kvds_) {
      if (kvd && kvd->Alive()) {
        EXPECT_EQ(kvd->Stop(), 0) << kvd->Log();
      }
    }
  }

  // Waits until every live kvd reports `members` members and reachable == `reachable`.
  bool AllSee(double members, double reachable, milliseconds timeout) {
    return ClusterAllSee(kvds_, members, reachable, timeout);
  }

  std::string Kvdctl(int* rc) {
    std::string out;
    *rc = RunProgram(
        {KVDCTL_BINARY, "--json", "cluster", "--etcd", etcd_->endpoint(), "--name", "e2e"}, &out,
        std::chrono::seconds(20));
    return out;
  }

  std::vector<std::unique_ptr<KvdProcess>> kvds_;
};

// A put and a byte-exact get on `kvd`.
void ExpectServesPutAndGet(KvdProcess& kvd, uint64_t seed) {
  auto c = ConnectOrFail(kvd.EngineOptions("cluster-e2e"));
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  auto chain = c->hasher().ChunkChain(RandomTokens(256, seed), true);
  ASSERT_EQ(chain.size(), 1u);
  auto data = RandomBytes(layout.ChunkBytes(256), seed);
  auto put = c->Put(chain[0], 256, data.data(), data.size());
  ASSERT_TRUE(put.ok()) << put.status();
  auto found = c->Lookup(chain);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->matched_chunks, 1u);
  std::vector<uint8_t> out(data.size());
  std::vector<client::GetItem> gets = {{0, out.data(), out.size()}};
  auto got = c->GetChunks(found->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(out == data);
  EXPECT_TRUE(c->ReleaseLease(found->lease_id).ok());
}

TEST_F(ClusterE2eTest, NodesRegisterSeeEachOtherAndAKilledNodeLeavesWithinTheLeaseTtl) {
  ASSERT_TRUE(AllSee(3, 1, milliseconds(10000)))
      << "a: " << MetricValue(*kvds_[0], "kvd_cluster_members") << "\n"
      << kvds_[0]->Log();
  int rc = 0;
  std::string out = Kvdctl(&rc);
  ASSERT_EQ(rc, 0) << out;
  auto view = nlohmann::json::parse(out);
  ASSERT_EQ(view["members"].size(), 3u) << out;
  for (size_t i = 0; i < 3; ++i) {
    const auto& m = view["members"][i];
    EXPECT_EQ(m["node"], std::string(1, static_cast<char>('a' + i)));
    EXPECT_EQ(m["health"], "up");
    EXPECT_EQ(m["control"], kvds_[i]->tcp_address());
    EXPECT_EQ(m["lease_granted_ttl_s"], kLeaseTtlS);
    EXPECT_FALSE(m["tiers"].empty());
    ASSERT_FALSE(m["models"].empty()) << out;
    EXPECT_EQ(m["models"][0]["layout_digest"].get<std::string>().size(), 16u) << out;
  }

  const auto killed = std::chrono::steady_clock::now();
  kvds_[1]->Kill();
  ASSERT_TRUE(AllSee(2, 1, milliseconds(kLeaseTtlS * 1000 + 5000)));
  const double seen_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf(
      "[cluster] SIGKILLed node b left the others' member lists after %.2f s "
      "(lease TTL %d s)\n",
      seen_s, kLeaseTtlS);
  // The contract: within the TTL of b's last keepalive, plus etcd's expiry check (every 0.5 s)
  // and the watch's delivery; 2 s of slack for a loaded machine.
  EXPECT_LE(seen_s, kLeaseTtlS + 2.0);
  out = Kvdctl(&rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["members"].size(), 2u) << out;
}

TEST_F(ClusterE2eTest, EtcdGoneNodesKeepServingReportUnreachableThenRegisterAgain) {
  ASSERT_TRUE(AllSee(3, 1, milliseconds(10000))) << kvds_[0]->Log();
  etcd_->Kill();
  ASSERT_TRUE(AllSee(-1, 0, milliseconds(5000)));
  for (size_t i = 0; i < kvds_.size(); ++i) ExpectServesPutAndGet(*kvds_[i], 100 + i);
  int rc = 0;
  std::string out = Kvdctl(&rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["reachable"], false) << out;

  const auto down = std::chrono::steady_clock::now();
  ASSERT_TRUE(etcd_->Restart().ok());
  const auto restarted = std::chrono::steady_clock::now();
  ASSERT_TRUE(AllSee(3, 1, milliseconds(15000)));
  std::printf("[cluster] etcd restarted in %.2f s; all three kvds registered again %.2f s later\n",
              std::chrono::duration<double>(restarted - down).count(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - restarted).count());
  for (auto& kvd : kvds_) EXPECT_GE(MetricValue(*kvd, "kvd_cluster_registrations_total"), 2);
  out = Kvdctl(&rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["members"].size(), 3u) << out;
  for (size_t i = 0; i < kvds_.size(); ++i) ExpectServesPutAndGet(*kvds_[i], 200 + i);
}

}  // namespace
}  // namespace kvd::e2e
