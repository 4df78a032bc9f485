// One kvd in a network namespace of its own, cut off from the others. A bridge in this
// namespace carries etcd and kvds a and b; kvd c runs in a namespace joined to the bridge by a
// veth pair; UCX over tcp on those links. c holds chains; a fetches one from c; then c's veth is
// set down: a and b see c leave within the lease TTL, and a's lookups of c's chains meanwhile
// are misses that end within the peer timeout, not hangs. With the link back, c registers
// again. Needs root and `ip netns` (skipped otherwise, saying why) and etcd (skipped when not
// installed). Every namespace, link and process it makes is removed, also when it fails.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "e2e_common.h"
#include "etcd_server.h"

namespace kvd::e2e {
namespace {

using std::chrono::milliseconds;

constexpr int kLeaseTtlS = 3;
constexpr int kPeerTimeoutMs = 1000;
constexpr char kToken[] = "netns-token";

std::string IpBinary() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (std::filesystem::exists(p)) return p;
  }
  return "";
}

// A bridge with an address here and one namespace joined to it by a veth pair; all removed by
// the destructor (deleting the namespace deletes its end of the pair and with it the other).
class NetnsLab {
 public:
  // "" and the lab, or why it could not be made (what was made is removed).
  static std::unique_ptr<NetnsLab> Create(std::string* why) {
    std::unique_ptr<NetnsLab> lab(new NetnsLab());
    lab->ip_ = IpBinary();
    if (lab->ip_.empty()) {
      *why = "no ip binary";
      return nullptr;
    }
    const std::string id = std::to_string(::getpid() % 100000);
    lab->bridge_ = "kvdbr" + id;
    lab->ns_ = "kvdns" + id;
    lab->veth_root_ = "kvdvr" + id;
    lab->veth_ns_ = "kvdvn" + id;
    const std::string net = "10.213." + std::to_string(::getpid() % 250) + ".";
    lab->root_ip_ = net + "1";
    lab->ns_ip_ = net + "2";
    const std::vector<std::vector<std::string>> steps = {
        {"link", "add", lab->bridge_, "type", "bridge"},
        {"addr", "add", lab->root_ip_ + "/24", "dev", lab->bridge_},
        {"link", "set", lab->bridge_, "up"},
        {"netns", "add", lab->ns_},
        {"link", "add", lab->veth_root_, "type", "veth", "peer", "name", lab->veth_ns_},
        {"link", "set", lab->veth_root_, "master", lab->bridge_},
        {"link", "set", lab->veth_root_, "up"},
        {"link", "set", lab->veth_ns_, "netns", lab->ns_},
        {"-n", lab->ns_, "addr", "add", lab->ns_ip_ + "/24", "dev", lab->veth_ns_},
        {"-n", lab->ns_, "link", "set", lab->veth_ns_, "up"},
        {"-n", lab->ns_, "link", "set", "lo", "up"},
    };
    for (const auto& step : steps) {
      if (Status s = lab->Ip(step); !s.ok()) {
        *why = s.ToString();
        return nullptr;  // the destructor removes what was made
      }
      if (step[0] == "link" && step.back() == lab->ns_) lab->veth_moved_ = true;
    }
    return lab;
  }
  ~NetnsLab() {
    const bool ns_gone = Ip({"netns", "del", ns_}).ok();
    // The pair goes with the namespace once its end is in there; else (Create failed before
    // moving it, or the namespace would not go) the root end is deleted by name.
    if (!ns_gone || !veth_moved_) Ip({"link", "del", veth_root_}).IgnoreError();
    Ip({"link", "del", bridge_}).IgnoreError();
  }

  // The namespace's link down (cut off) or up again.
  Status SetLink(bool up) { return Ip({"link", "set", veth_root_, up ? "up" : "down"}); }
  std::vector<std::string> ExecPrefix() const { return {ip_, "netns", "exec", ns_}; }
  const std::string& bridge() const { return bridge_; }
  const std::string& root_ip() const { return root_ip_; }
  const std::string& ns_ip() const { return ns_ip_; }
  const std::string& veth_ns() const { return veth_ns_; }

 private:
  NetnsLab() = default;
  Status Ip(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {ip_};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string out;
    const int rc = RunProgram(argv, &out, std::chrono::seconds(10));
    if (rc == 0) return Status::Ok();
    std::string cmd;
    for (const auto& a : argv) cmd += a + " ";
    return Status::Unavailable(cmd + "exited " + std::to_string(rc));
  }
  std::string ip_, bridge_, ns_, veth_root_, veth_ns_, root_ip_, ns_ip_;
  bool veth_moved_ = false;  // the pair's end is in the namespace
};

class ClusterNetnsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces)";
    if (cluster_test::EtcdServer::Binary().empty()) GTEST_SKIP() << "etcd is not installed";
    std::string why;
    lab_ = NetnsLab::Create(&why);
    if (lab_ == nullptr) GTEST_SKIP() << "cannot make a network namespace: " << why;
    auto etcd = cluster_test::EtcdServer::Start(lab_->root_ip());
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(etcd).value();
    kvds_.push_back(StartNode("a", lab_->root_ip(), lab_->bridge(), {}));
    kvds_.push_back(StartNode("b", lab_->root_ip(), lab_->bridge(), {}));
    kvds_.push_back(StartNode("c", lab_->ns_ip(), lab_->veth_ns(), lab_->ExecPrefix()));
    for (auto& kvd : kvds_) ASSERT_NE(kvd, nullptr);
  }
  void TearDown() override {
    for (auto& kvd : kvds_) {
      if (kvd && kvd->Alive()) kvd->Kill();
    }
    kvds_.clear();
    etcd_.reset();
    lab_.reset();
  }

  std::unique_ptr<KvdProcess> StartNode(const std::string& node, const std::string& ip,
                                        const std::string& device,
                                        std::vector<std::string> prefix) {
    KvdConfig c;
    c.ucx_tls = "tcp";
    c.listen = ip + ":0";
    c.net_devices = device;
    c.exec_prefix = std::move(prefix);
    c.metrics = true;
    c.extra_yaml = "cluster:\n  etcd: [" + etcd_->endpoint() + "]\n  name: ns\n  node: " + node +
                   "\n  lease_ttl_s: " + std::to_string(kLeaseTtlS) + "\n  token: " + kToken +
                   "\n  peer_timeout_ms: " + std::to_string(kPeerTimeoutMs) +
                   "\n"
                   // Beyond loopback, on links only this test makes.
                   "auth:\n  allow_unauthenticated: true\n";
    return StartKvd(c);
  }

  // Client options for `kvd` from this namespace: UCX over the bridge.
  client::ClientOptions Engine(const KvdProcess& kvd, const std::string& id) const {
    client::ClientOptions o = kvd.EngineOptions(id);
    transport::MutableBackendOptions<transport::UcxOptions>(&o.transport).net_devices =
        lab_->bridge();
    return o;
  }

  // a and b (this namespace: their /metrics answer here) list `members` members.
  bool RootNodesSee(double members, milliseconds timeout) {
    return Eventually(
        [&] {
          return MetricValue(*kvds_[0], "kvd_cluster_members") == members &&
                 MetricValue(*kvds_[1], "kvd_cluster_members") == members;
        },
        timeout);
  }

  std::unique_ptr<NetnsLab> lab_;
  std::unique_ptr<cluster_test::EtcdServer> etcd_;
  std::vector<std::unique_ptr<KvdProcess>> kvds_;
};

TEST_F(ClusterNetnsE2eTest, ANodeCutOffLeavesWithinTheLeaseTtlAndItsChunksAreMissesNotHangs) {
  ASSERT_TRUE(RootNodesSee(3, milliseconds(15000))) << kvds_[2]->Log();
  auto writer = ConnectOrFail(Engine(*kvds_[2], "writer-c"));
  auto reader = ConnectOrFail(Engine(*kvds_[0], "reader-a"));
  ASSERT_TRUE(writer && reader);
  auto fetched = reader->hasher().ChunkChain(RandomTokens(2 * 256, 31), true);
  auto stranded = reader->hasher().ChunkChain(RandomTokens(2 * 256, 32), true);
  std::vector<std::vector<uint8_t>> bytes;
  for (size_t i = 0; i < 2; ++i) {
    bytes.push_back(PutChunk(*writer, fetched[i], 400 + i));
    PutChunk(*writer, stranded[i], 500 + i);
  }
  writer.reset();

  // Across the namespace boundary, over the veth: a fetches c's chunks byte-exact.
  auto hit = reader->Lookup(fetched, {.cluster = true});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->fetched_chunks, 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    std::vector<uint8_t> out(bytes[i].size());
    ASSERT_TRUE(reader->Get(hit->lease_id, i, out.data(), out.size()).ok());
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i;
  }
  ASSERT_TRUE(reader->ReleaseLease(hit->lease_id).ok());

  ASSERT_TRUE(lab_->SetLink(false).ok());
  const auto cut = std::chrono::steady_clock::now();
  // c is still listed until its lease expires: asking it ends within the peer timeout.
  auto miss = reader->Lookup(stranded, {.cluster = true});
  const double asked_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cut).count();
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_EQ(miss->matched_chunks, 0u);
  bool c_listed = false;
  for (const auto& h : miss->holders) {
    if (h.node != "c") continue;
    c_listed = true;
    EXPECT_EQ(h.matched_chunks, 0u);
    EXPECT_NE(h.error, "");
  }
  EXPECT_LT(asked_s, 10.0);  // not a hang: a generous bound, not a speed

  ASSERT_TRUE(RootNodesSee(2, milliseconds(kLeaseTtlS * 1000 + 5000)));
  const double left_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cut).count();
  auto after = reader->Lookup(stranded, {.cluster = true});
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->matched_chunks, 0u);
  for (const auto& h : after->holders) EXPECT_NE(h.node, "c");
  std::printf(
      "[netns] c cut off: a's lookup of c's chain %s c (%s) and ended after %.3f s; a and b saw c "
      "leave after %.2f s (lease TTL %d s)\n",
      c_listed ? "listed" : "did not list", c_listed ? "a miss" : "-", asked_s, left_s, kLeaseTtlS);
  EXPECT_LE(left_s, kLeaseTtlS + 2.0);

  // The link back: c registers again (a new lease), and its chunks are found again.
  ASSERT_TRUE(lab_->SetLink(true).ok());
  ASSERT_TRUE(RootNodesSee(3, milliseconds(15000)));
  auto back = reader->Lookup(stranded, {.cluster = true});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->matched_chunks, 2u);
}

}  // namespace
}  // namespace kvd::e2e
