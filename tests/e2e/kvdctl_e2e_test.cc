// kvdctl against a real kvd: every command's --json parses and its exit codes are documented.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using nlohmann::json;

// A TCP port bound (so nobody else takes it) but not listening: connecting is refused.
class RefusingPort {
 public:
  RefusingPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&sin), sizeof sin);
    socklen_t len = sizeof sin;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sin), &len);
    address_ = "127.0.0.1:" + std::to_string(ntohs(sin.sin_port));
  }
  ~RefusingPort() { ::close(fd_); }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

class KvdctlE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kvd_ = StartKvd({});
    ASSERT_NE(kvd_, nullptr);
  }
  void TearDown() override {
    if (kvd_ && kvd_->Alive()) {
      EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    }
  }
  int Kvdctl(std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(), {KVDCTL_BINARY, "--addr", kvd_->tcp_address()});
    return RunProgram(args, out, std::chrono::seconds(20));
  }
  std::unique_ptr<KvdProcess> kvd_;
};

TEST_F(KvdctlE2eTest, JsonOutputParsesAndReflectsTheCache) {
  auto c = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_NE(c, nullptr);
  for (uint64_t i = 0; i < 3; ++i) PutChunk(*c, {77, i}, i);

  std::string out;
  ASSERT_EQ(Kvdctl({"stats", "--json"}, &out), 0) << out;
  json stats = json::parse(out);
  ASSERT_FALSE(stats["tiers"].empty());
  EXPECT_EQ(stats["tiers"][0]["name"], "host");
  EXPECT_EQ(stats["tiers"][0]["capacity_bytes"], 64u << 20);
  EXPECT_EQ(stats["tiers"][0]["chunks"], 3);
  EXPECT_EQ(stats["node"], "kvd-e2e");
  bool found = false;
  for (const auto& m : stats["models"]) {
    if (m["name"] == "stories260k") {
      found = true;
      EXPECT_EQ(m["chunks"], 3);
    }
  }
  EXPECT_TRUE(found) << out;

  out.clear();
  ASSERT_EQ(Kvdctl({"ls", "--json", "--model", "stories260k", "--limit", "2"}, &out), 0) << out;
  json ls = json::parse(out);
  EXPECT_EQ(ls["total"], 3);
  ASSERT_EQ(ls["chunks"].size(), 2u);
  EXPECT_EQ(ls["chunks"][0]["hash"].get<std::string>().size(), 32u);
  EXPECT_EQ(ls["chunks"][0]["namespace"], "default");

  out.clear();
  ASSERT_EQ(Kvdctl({"health", "--json"}, &out), 0) << out;
  EXPECT_EQ(json::parse(out)["ok"], true);

  out.clear();
  ASSERT_EQ(Kvdctl({"evict", "--chunk", Hash128{77, 0}.ToHex(), "--json"}, &out), 0) << out;
  EXPECT_EQ(json::parse(out)["chunks"], 1);
  out.clear();
  ASSERT_EQ(Kvdctl({"evict", "--model", "stories260k", "--json"}, &out), 0) << out;
  EXPECT_EQ(json::parse(out)["chunks"], 2);
  out.clear();
  ASSERT_EQ(Kvdctl({"evict", "--all", "--json"}, &out), 0) << out;
  EXPECT_EQ(json::parse(out)["chunks"], 0);
}

TEST_F(KvdctlE2eTest, HumanOutputIsATableWithUnits) {
  std::string out;
  ASSERT_EQ(Kvdctl({"stats"}, &out), 0) << out;
  EXPECT_NE(out.find("TIER"), std::string::npos) << out;
  EXPECT_NE(out.find("64.0 MiB"), std::string::npos) << out;
  EXPECT_NE(out.find("smollm2-135m"), std::string::npos) << out;  // registered models
  out.clear();
  ASSERT_EQ(Kvdctl({"health"}, &out), 0) << out;
  EXPECT_EQ(out.rfind("OK", 0), 0u) << out;
}

TEST_F(KvdctlE2eTest, ExitCodes) {
  std::string out;
  EXPECT_EQ(Kvdctl({"frobnicate"}, &out), 2);
  EXPECT_EQ(Kvdctl({"evict"}, &out), 2);                           // no scope
  EXPECT_EQ(Kvdctl({"evict", "--all", "--model", "m"}, &out), 2);  // two scopes
  EXPECT_EQ(Kvdctl({"ls", "--limit", "lots"}, &out), 2);
  EXPECT_EQ(Kvdctl({"evict", "--chunk", "xyz"}, &out), 2);
  out.clear();
  RefusingPort nobody;
  EXPECT_EQ(RunProgram({KVDCTL_BINARY, "--addr", nobody.address(), "stats", "--json"}, &out), 3);
  EXPECT_EQ(json::parse(out)["code"], "UNAVAILABLE");
  kvd_->Kill();
  EXPECT_EQ(Kvdctl({"health"}, &out), 3);
}

}  // namespace
}  // namespace kvd::e2e
