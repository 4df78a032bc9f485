// Tenancy through real processes: namespace and admin tokens checked at the handshake, leases
// bound to the connection that took them, admin requests refused to engines, refusal to listen
// beyond loopback without tokens.
#include <gmock/gmock.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

class TenancyE2eTest : public TenantsE2eFixture {
 protected:
  TenancyE2eTest()
      : TenantsE2eFixture(
            "# kvd tokens\nnamespace team-a tok-a\nnamespace team-b tok-b\n"
            "admin tok-admin  # the operator\n") {}
  client::ClientOptions Engine(const std::string& ns, const std::string& token) {
    client::ClientOptions o = kvd_->EngineOptions("tenant-" + ns);
    o.name_space = ns;
    o.auth_token = token;
    return o;
  }
};

TEST_F(TenancyE2eTest, TokensAreCheckedAtTheHandshake) {
  KvdConfig c;
  c.tokens_file = tokens_;
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  auto a = ConnectOrFail(Engine("team-a", "tok-a"));
  ASSERT_NE(a, nullptr);
  ExpectServes(*a, 1);

  auto wrong = client::Client::Connect(Engine("team-a", "tok-b"));
  EXPECT_EQ(wrong.status().code(), StatusCode::kPermissionDenied) << wrong.status();
  EXPECT_THAT(wrong.status().message(), HasSubstr("wrong token for namespace \"team-a\""));
  auto none = client::Client::Connect(Engine("team-a", ""));
  EXPECT_EQ(none.status().code(), StatusCode::kPermissionDenied) << none.status();
  EXPECT_THAT(none.status().message(), HasSubstr("no token for namespace \"team-a\""));
  auto unlisted = client::Client::Connect(Engine("team-c", "tok-a"));
  EXPECT_EQ(unlisted.status().code(), StatusCode::kPermissionDenied) << unlisted.status();
  EXPECT_THAT(unlisted.status().message(), HasSubstr("\"team-c\" has no token"));

  // Admin over TCP needs the admin token; over the unix socket the daemon's own user suffices.
  client::ClientOptions admin = kvd_->AdminOptions();
  auto denied = client::Client::Connect(admin);
  EXPECT_EQ(denied.status().code(), StatusCode::kPermissionDenied) << denied.status();
  EXPECT_THAT(denied.status().message(), HasSubstr("no admin token"));
  admin.auth_token = "tok-a";
  EXPECT_EQ(client::Client::Connect(admin).status().code(), StatusCode::kPermissionDenied);
  admin.auth_token = "tok-admin";
  auto ok = ConnectOrFail(admin);
  ASSERT_NE(ok, nullptr);
  EXPECT_TRUE(ok->GetStats().ok());
  client::ClientOptions local = kvd_->AdminOptions();
  local.address = kvd_->unix_address();
  auto via_unix = ConnectOrFail(local);
  ASSERT_NE(via_unix, nullptr);
  EXPECT_TRUE(via_unix->GetHealth().ok());
  // The refused handshakes did not disturb the tenant already connected.
  ExpectServes(*a, 2);
}

TEST_F(TenancyE2eTest, LeaseOfOneTenantIsUselessToAnother) {
  KvdConfig c;
  c.tokens_file = tokens_;
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  auto a = ConnectOrFail(Engine("team-a", "tok-a"));
  auto b = ConnectOrFail(Engine("team-b", "tok-b"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const Hash128 h{0x7e7, 1};
  auto data = PutChunk(*a, h, 11, 64);
  auto lease = a->Lookup({&h, 1});
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->matched_chunks, 1u);
  // B sees nothing of A's namespace, and A's lease id gets B nothing.
  EXPECT_EQ(Present(*b, h), 0u);
  std::vector<uint8_t> out(data.size());
  auto stolen = b->Get(lease->lease_id, 0, out.data(), out.size());
  EXPECT_EQ(stolen.status().code(), StatusCode::kNotFound) << stolen.status();
  EXPECT_THAT(stolen.status().message(), HasSubstr("is not held by this client"));
  EXPECT_EQ(b->ReleaseLease(lease->lease_id).code(), StatusCode::kNotFound);
  // A's lease is intact.
  auto g = a->Get(lease->lease_id, 0, out.data(), out.size());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(out, data);
  EXPECT_TRUE(a->ReleaseLease(lease->lease_id).ok());
}

TEST_F(TenancyE2eTest, ListeningBeyondLoopbackWithoutTokensIsRefused) {
  KvdConfig c;
  c.listen = "0.0.0.0:0";
  auto k = KvdProcess::Start(c);
  ASSERT_FALSE(k.ok());
  EXPECT_THAT(k.status().message(),
              HasSubstr("reaches beyond loopback and auth.tokens_file is not set"));
  c.tokens_file = tokens_;
  kvd_ = StartKvd(c);  // with tokens it starts
  ASSERT_NE(kvd_, nullptr);
}

TEST_F(TenancyE2eTest, TheCApiSendsTheNamespaceToken) {
  KvdConfig c;
  c.tokens_file = tokens_;
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  const client::ClientOptions o = Engine("team-a", "");
  for (const char* token : {"tok-a", "tok-b", static_cast<const char*>(nullptr)}) {
    SCOPED_TRACE(token ? token : "no token");
    kvd_config config = CConfig(o);
    config.auth_token = token;
    kvd_client* client = nullptr;
    const int rc = kvd_client_connect(&config, &client);
    if (token != nullptr && std::string(token) == "tok-a") {
      ASSERT_EQ(rc, KVD_OK) << kvd_last_error();
      const kvd_hash128 h{0x7e4a, 1};
      std::vector<uint8_t> bytes = RandomBytes(o.layout.ChunkBytes(256), 5);
      int already = -1;
      EXPECT_EQ(kvd_client_put(client, h, 256, bytes.data(), bytes.size(), &already), KVD_OK)
          << kvd_last_error();
      EXPECT_EQ(already, 0);
      kvd_client_close(client);
    } else {
      EXPECT_EQ(rc, KVD_PERMISSION_DENIED);
      EXPECT_EQ(client, nullptr);
      EXPECT_THAT(std::string(kvd_last_error()),
                  HasSubstr(token ? "wrong token for namespace \"team-a\""
                                  : "no token for namespace \"team-a\""));
    }
  }
  // The refused connections stored nothing; the accepted one its chunk.
  auto a = ConnectOrFail(Engine("team-a", "tok-a"));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(Present(*a, Hash128{0x7e4a, 1}), 1u);
}

}  // namespace
}  // namespace kvd::e2e
