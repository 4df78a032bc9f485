// A Hello's checks (daemon/src/hello_check.h) without a socket or a daemon: every refusal with
// its code, and what a served Hello is granted.
#include "hello_check.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "kvd/common/hash.h"

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;

class HelloCheckTest : public ::testing::Test {
 protected:
  HelloCheckTest() {
    config_.transport.backend = "loopback";
    terms_.config = &config_;
    terms_.auth = &auth_;
    terms_.shared_memory_arena = true;
    const ModelConfig& model = config_.models.front();
    hello_.protocol_version = proto::PROTOCOL_VERSION;
    hello_.client_id = "engine-1";
    hello_.model = model.name;
    hello_.layout = model.layout;
    hello_.hash_seed_digest = Digest64(config_.hash_seed);
    hello_.chunk_tokens = static_cast<uint32_t>(config_.chunk_tokens);
    hello_.worker_address = "loopback:1";
  }
  StatusOr<Grant> Check() { return CheckHello(terms_, hello_, peer_); }
  void ExpectRefused(StatusCode code, const std::string& text) {
    auto grant = Check();
    ASSERT_FALSE(grant.ok());
    EXPECT_EQ(grant.status().code(), code) << grant.status();
    EXPECT_THAT(grant.status().message(), HasSubstr(text));
  }

  DaemonConfig config_;
  AuthTokens auth_;
  HelloTerms terms_;
  HelloFields hello_;
  HelloPeer peer_;
};

TEST_F(HelloCheckTest, AnEngineHelloThatMatchesIsGrantedTheModelAndItsNamespace) {
  auto grant = Check();
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_TRUE(grant->engine);
  EXPECT_EQ(grant->model, &config_.models.front());
  EXPECT_EQ(grant->codec, nullptr);
  EXPECT_EQ(grant->layout_digest, config_.models.front().layout.Digest());
  EXPECT_EQ(grant->name_space, "default");
  EXPECT_EQ(grant->client_id, "engine-1");
  EXPECT_EQ(grant->worker_address, "loopback:1");
  EXPECT_FALSE(grant->shared_memory);
}

TEST_F(HelloCheckTest, SharedMemoryNeedsTheUnixSocketAndAnArena) {
  hello_.shared_memory = true;
  EXPECT_FALSE(Check()->shared_memory);  // over TCP
  peer_.on_unix = true;
  EXPECT_TRUE(Check()->shared_memory);
  terms_.shared_memory_arena = false;
  EXPECT_FALSE(Check()->shared_memory);
}

TEST_F(HelloCheckTest, RefusesAnotherProtocolVersion) {
  hello_.protocol_version = proto::PROTOCOL_VERSION + 1;
  ExpectRefused(StatusCode::kFailedPrecondition, "protocol version mismatch");
}

TEST_F(HelloCheckTest, RefusesAnUnknownRole) {
  hello_.role = static_cast<proto::Role>(7);
  ExpectRefused(StatusCode::kInvalidArgument, "unknown role 7");
}

TEST_F(HelloCheckTest, RefusesNamesThatAreNotUtf8) {
  hello_.name_space = "ns\xff";
  ExpectRefused(StatusCode::kInvalidArgument, "Hello.namespace");
  hello_.name_space = "";
  hello_.client_id = "id\xc3";
  ExpectRefused(StatusCode::kInvalidArgument, "Hello.clientId");
}

TEST_F(HelloCheckTest, WithTokensAnEngineNeedsItsNamespacesToken) {
  auth_.enabled = true;
  auth_.namespaces["tenant"] = "secret";
  hello_.name_space = "tenant";
  ExpectRefused(StatusCode::kPermissionDenied, "no token for namespace \"tenant\"");
  hello_.auth_token = "guess";
  ExpectRefused(StatusCode::kPermissionDenied, "wrong token for namespace \"tenant\"");
  hello_.name_space = "other";
  ExpectRefused(StatusCode::kPermissionDenied, "has no token in auth.tokens_file");
  hello_.name_space = "tenant";
  hello_.auth_token = "secret";
  EXPECT_TRUE(Check().ok());
}

TEST_F(HelloCheckTest, AdminOverTcpWithTokensNeedsTheAdminToken) {
  hello_.role = proto::Role::ADMIN;
  auth_.enabled = true;
  ExpectRefused(StatusCode::kPermissionDenied, "has no admin line");
  auth_.admin = "root-token";
  ExpectRefused(StatusCode::kPermissionDenied, "no admin token");
  hello_.auth_token = "root-token";
  auto grant = Check();
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_FALSE(grant->engine);
  EXPECT_EQ(grant->model, nullptr);
}

TEST_F(HelloCheckTest, AdminOverTheUnixSocketNeedsTheDaemonsUserOrRoot) {
  hello_.role = proto::Role::ADMIN;
  peer_.info.unix_socket = true;
  peer_.info.uid = static_cast<int64_t>(::geteuid());
  EXPECT_TRUE(Check().ok());
  peer_.info.uid = static_cast<int64_t>(::geteuid()) + 12345;
  if (peer_.info.uid == 0) return;
  ExpectRefused(StatusCode::kPermissionDenied, "admin role over the unix socket");
}

TEST_F(HelloCheckTest, RefusesAnUnknownModel) {
  hello_.model = "no-such-model";
  ExpectRefused(StatusCode::kNotFound, "unknown model \"no-such-model\"");
}

TEST_F(HelloCheckTest, RefusesALayoutThatDiffersFromTheModels) {
  ModelLayout other = config_.models.front().layout;
  other.num_layers += 1;
  hello_.layout = other;
  ExpectRefused(StatusCode::kFailedPrecondition, "layout mismatch for model");
  hello_.layout = Status::InvalidArgument("bad dtype");
  ExpectRefused(StatusCode::kInvalidArgument, "layout of model");
}

TEST_F(HelloCheckTest, RefusesAnotherHashSeedOrChunkSize) {
  hello_.hash_seed_digest ^= 1;
  ExpectRefused(StatusCode::kFailedPrecondition, "hash seed mismatch");
  hello_.hash_seed_digest ^= 1;
  hello_.chunk_tokens += 1;
  ExpectRefused(StatusCode::kFailedPrecondition, "chunk size mismatch");
}

TEST_F(HelloCheckTest, RefusesACodecForARawModel) {
  hello_.codec_id = 5;
  ExpectRefused(StatusCode::kFailedPrecondition, "has no compression policy");
}

TEST_F(HelloCheckTest, AnEngineNeedsAWorkerAddress) {
  hello_.worker_address.clear();
  ExpectRefused(StatusCode::kInvalidArgument, "engine role needs workerAddress");
}

TEST_F(HelloCheckTest, WithoutABulkTransportAnEngineNeedsSharedMemory) {
  config_.transport.backend = "none";
  ExpectRefused(StatusCode::kFailedPrecondition, "transport.backend: none");
  peer_.on_unix = true;
  hello_.shared_memory = true;
  EXPECT_TRUE(Check().ok());
}

}  // namespace
}  // namespace kvd::daemon
