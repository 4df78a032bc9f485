// The topology's `cluster` section: absent -> a single node; present -> bound; invalid -> an
// INVALID_ARGUMENT naming the key.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "config_cases.h"
#include "kvd/daemon/config.h"

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;

TEST(ClusterConfigTest, AbsentIsASingleNode) {
  auto c = ParseConfigYaml("node: n1\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->cluster.has_value());
  EXPECT_FALSE(c->ResolvedCluster().has_value());
}

TEST(ClusterConfigTest, BindsEveryKeyAndDefaultsNodeToTheNodeName) {
  auto c = ParseConfigYaml(
      "node: n1\n"
      "cluster:\n"
      "  etcd: [127.0.0.1:2379, \"etcd-2:2379\"]\n"
      "  name: prod\n"
      "  lease_ttl_s: 7\n"
      "  token: s3cret\n");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->cluster.has_value());
  EXPECT_EQ(c->cluster->etcd, (std::vector<std::string>{"127.0.0.1:2379", "etcd-2:2379"}));
  EXPECT_EQ(c->cluster->name, "prod");
  EXPECT_EQ(c->cluster->node, "");
  EXPECT_EQ(c->ResolvedCluster()->node, "n1");
  EXPECT_EQ(c->cluster->lease_ttl_s, 7);
  EXPECT_EQ(c->cluster->token, "s3cret");

  auto one = ParseConfigYaml("cluster: {etcd: 10.0.0.1:2379, name: c, node: other}\n");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->cluster->etcd, std::vector<std::string>{"10.0.0.1:2379"});
  EXPECT_EQ(one->ResolvedCluster()->node, "other");
  EXPECT_EQ(one->cluster->lease_ttl_s, 10);  // the default
  EXPECT_EQ(one->peer_fetch.policy, PeerFetchOptions::Policy::kStore);  // the default
  EXPECT_EQ(one->peer_fetch.timeout_ms, 2000);

  auto off = ParseConfigYaml(
      "cluster: {etcd: [h:1], name: c, peer_fetch: \"off\", peer_timeout_ms: 250}\n");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->peer_fetch.policy, PeerFetchOptions::Policy::kOff);
  EXPECT_EQ(off->peer_fetch.timeout_ms, 250);

  auto serve = ParseConfigYaml("cluster: {etcd: [h:1], name: c, peer_fetch: serve}\n");
  ASSERT_TRUE(serve.ok()) << serve.status();
  EXPECT_EQ(serve->peer_fetch.policy, PeerFetchOptions::Policy::kServe);
}

// A token kept in a file (a mounted Kubernetes Secret): read at load, one trailing newline
// dropped; with `token` as well, or unreadable, the load fails naming the key.
TEST(ClusterConfigTest, TokenFileIsReadAtLoad) {
  char dir[] = "/tmp/kvd-cluster-token-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/token";
  std::ofstream(path) << "s3cret\n";
  auto c = ParseConfigYaml("cluster: {etcd: [h:1], name: c, token_file: " + path + "}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->cluster->token, "s3cret");

  auto both = ParseConfigYaml("cluster: {etcd: [h:1], name: c, token: x, token_file: " + path +
                              "}\n");
  ASSERT_FALSE(both.ok());
  EXPECT_THAT(both.status().message(), HasSubstr("cluster.token_file"));

  std::ofstream(path) << "";
  auto empty = ParseConfigYaml("cluster: {etcd: [h:1], name: c, token_file: " + path + "}\n");
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(empty.status().message(), HasSubstr("cluster.token_file"));
  unlink(path.c_str());
  rmdir(dir);

  auto missing = ParseConfigYaml("cluster: {etcd: [h:1], name: c, token_file: " + path + "}\n");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("cluster.token_file"));
  EXPECT_THAT(missing.status().message(), HasSubstr(path));
}

TEST(ClusterConfigTest, InvalidValuesNameTheKey) {
  ExpectInvalidNamingKey({
      {"cluster: {name: c}\n", "cluster.etcd: required"},
      {"cluster: {etcd: [\"no-port\"], name: c}\n", "cluster.etcd"},
      {"cluster: {etcd: [{a: 1}], name: c}\n", "cluster.etcd[0]"},
      {"cluster: {etcd: [h:1]}\n", "cluster.name: required"},
      {"cluster: {etcd: [h:1], name: \"a/b\"}\n", "cluster.name"},
      {"cluster: {etcd: [h:1], name: c, node: \"x y\"}\n", "cluster.node"},
      {"node: \"has space\"\ncluster: {etcd: [h:1], name: c}\n", "cluster.node"},
      {"cluster: {etcd: [h:1], name: c, lease_ttl_s: 1}\n", "cluster.lease_ttl_s"},
      {"cluster: {etcd: [h:1], name: c, members: 3}\n", "cluster.members: unknown key"},
      {"cluster: {etcd: [h:1], name: c, peer_fetch: copy}\n", "cluster.peer_fetch"},
      {"cluster: {etcd: [h:1], name: c, peer_timeout_ms: 0}\n", "cluster.peer_timeout_ms"},
      {"cluster: [h:1]\n", "cluster: must be a mapping"},
  });
}

}  // namespace
}  // namespace kvd::daemon
