// The C ABI: error codes, kvd_last_error, and a round trip through the fake daemon.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fake_daemon.h"
#include "kvd/client/kvd_client.h"

namespace {

kvd_config TinyConfig(const std::string& address) {
  kvd_config c;
  kvd_config_init(&c);
  c.model = "tiny";
  c.layout.num_layers = 2;
  c.layout.num_kv_heads = 2;
  c.layout.num_q_heads = 4;
  c.layout.head_dim = 8;
  c.layout.dtype = KVD_DTYPE_FLOAT32;
  c.chunk_tokens = 32;
  c.transport_backend = "loopback";
  return c;
}

TEST(CApiTest, ConnectFailureSetsCodeAndMessage) {
  kvd_config c = TinyConfig("unix:/tmp/kvd-c-api-none.sock");
  c.address = "unix:/tmp/kvd-c-api-none.sock";
  kvd_client* client = reinterpret_cast<kvd_client*>(0x1);
  EXPECT_EQ(kvd_client_connect(&c, &client), KVD_UNAVAILABLE);
  EXPECT_EQ(client, nullptr);
  EXPECT_NE(std::string(kvd_last_error()).find("cannot connect"), std::string::npos);
  EXPECT_STREQ(kvd_error_name(KVD_UNAVAILABLE), "UNAVAILABLE");
  EXPECT_EQ(kvd_client_connect(nullptr, &client), KVD_INVALID_ARGUMENT);
  c.chunk_tokens = 30;  // not a multiple of 16
  EXPECT_EQ(kvd_client_connect(&c, &client), KVD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvd_last_error()).find("chunk_tokens"), std::string::npos);
  c.chunk_tokens = 32;
  c.inline_put_bytes = 2 << 20;  // over the 1 MiB maximum (0 = the default, < 0 = off)
  EXPECT_EQ(kvd_client_connect(&c, &client), KVD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvd_last_error()).find("inline_put_bytes must be <= 1048576"),
            std::string::npos)
      << kvd_last_error();
}

// kvd_config is versioned by struct_size (set by the inline kvd_config_init, i.e. the caller's
// sizeof). A config that did not come from kvd_config_init is refused naming struct_size; one
// from a newer header (a larger struct) is taken when its unknown fields are zero.
TEST(CApiTest, ConfigSizeIsTheCallersAndIsChecked) {
  kvd_config c = TinyConfig("unused");
  EXPECT_EQ(c.struct_size, sizeof(kvd_config));
  c.address = "unix:/tmp/kvd-c-api-none.sock";
  kvd_client* client = nullptr;
  for (size_t bad : {size_t{0}, size_t{8}, sizeof(kvd_config) / 2, size_t{1} << 20}) {
    SCOPED_TRACE(bad);
    kvd_config unset = c;
    unset.struct_size = bad;  // e.g. a struct filled by hand, or a program built without it
    EXPECT_EQ(kvd_client_connect(&unset, &client), KVD_INVALID_ARGUMENT);
    const std::string error = kvd_last_error();
    EXPECT_NE(error.find("kvd_config.struct_size is " + std::to_string(bad)), std::string::npos)
        << error;
    EXPECT_NE(error.find("kvd_config_init"), std::string::npos) << error;
  }

  // A newer header's struct: this library's fields, then 16 bytes of fields it does not know.
  struct Newer {
    kvd_config known;
    uint64_t later[2];
    uint64_t guard;
  } newer;
  std::memset(&newer, 0xAB, sizeof newer);
  kvd_config_init_sized(&newer.known, offsetof(Newer, guard));
  EXPECT_EQ(newer.known.struct_size, offsetof(Newer, guard));
  EXPECT_EQ(newer.later[0], 0u) << "init zeroes the fields it does not know";
  EXPECT_EQ(newer.later[1], 0u);
  EXPECT_EQ(newer.guard, 0xABABABABABABABABull) << "init wrote past struct_size";
  EXPECT_EQ(newer.known.layout.tp_size, 1);  // this library's defaults
  const size_t size = newer.known.struct_size;
  newer.known = c;
  newer.known.struct_size = size;
  // Unknown fields left zero: taken (it then fails only because nothing listens there).
  EXPECT_EQ(kvd_client_connect(&newer.known, &client), KVD_UNAVAILABLE) << kvd_last_error();
  // One set: refused, saying why.
  newer.later[1] = 7;
  EXPECT_EQ(kvd_client_connect(&newer.known, &client), KVD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvd_last_error()).find("fields this libkvd_client does not know"),
            std::string::npos)
      << kvd_last_error();
  EXPECT_EQ(client, nullptr);

  // Below the first sized kvd_config, init writes nothing.
  kvd_config untouched;
  std::memset(&untouched, 0x5A, sizeof untouched);
  kvd_config_init_sized(&untouched, 16);
  EXPECT_EQ(untouched.layout.tp_size, 0x5A5A5A5A);
}

TEST(CApiTest, RoundTripThroughTheFakeDaemon) {
  // The C config has no loopback domain: the C ABI uses the default one.
  kvd::client::testing::FakeDaemon daemon("default", {});
  std::string address = daemon.address();
  kvd_config c = TinyConfig(address);
  c.address = address.c_str();
  kvd_client* client = nullptr;
  ASSERT_EQ(kvd_client_connect(&c, &client), KVD_OK) << kvd_last_error();

  std::vector<int32_t> tokens(64);
  for (int i = 0; i < 64; ++i) tokens[i] = i;
  kvd_hash128 chain[4];
  size_t n = 0;
  EXPECT_EQ(kvd_client_chunk_chain(client, tokens.data(), 64, 1, chain, 1, &n), KVD_OUT_OF_RANGE);
  EXPECT_EQ(n, 2u);
  ASSERT_EQ(kvd_client_chunk_chain(client, tokens.data(), 64, 1, chain, 4, &n), KVD_OK);

  const size_t half = 32 * 2 * 8 * 4;
  std::vector<std::vector<float>> k(2, std::vector<float>(half / 4)), v = k;
  for (int l = 0; l < 2; ++l)
    for (size_t i = 0; i < half / 4; ++i) k[l][i] = l + i * 0.5f, v[l][i] = -1.0f * i - l;
  const void* kp[2] = {k[0].data(), k[1].data()};
  const void* vp[2] = {v[0].data(), v[1].data()};
  int already = -1;
  ASSERT_EQ(kvd_client_put_layers(client, chain[0], 32, kp, vp, &already), KVD_OK)
      << kvd_last_error();
  EXPECT_EQ(already, 0);
  std::vector<uint8_t> raw(2 * half * 2, 7);
  ASSERT_EQ(kvd_client_put(client, chain[1], 32, raw.data(), raw.size(), &already), KVD_OK);
  EXPECT_EQ(kvd_client_put(client, chain[1], 32, raw.data(), 5, &already), KVD_INVALID_ARGUMENT);

  kvd_lookup_result hit;
  ASSERT_EQ(kvd_client_lookup(client, chain, 2, &hit), KVD_OK);
  EXPECT_EQ(hit.matched_chunks, 2u);
  std::vector<std::vector<float>> k2(2, std::vector<float>(half / 4)), v2 = k2;
  void* kq[2] = {k2[0].data(), k2[1].data()};
  void* vq[2] = {v2[0].data(), v2[1].data()};
  kvd_get_result got;
  ASSERT_EQ(kvd_client_get_layers(client, hit.lease_id, 0, kq, vq, 32, &got), KVD_OK)
      << kvd_last_error();
  EXPECT_EQ(k, k2);
  EXPECT_EQ(v, v2);
  std::vector<uint8_t> raw2(raw.size());
  ASSERT_EQ(kvd_client_get(client, hit.lease_id, 1, raw2.data(), raw2.size(), &got), KVD_OK);
  EXPECT_EQ(raw, raw2);
  EXPECT_EQ(kvd_client_get(client, hit.lease_id, 5, raw2.data(), raw2.size(), &got), KVD_NOT_FOUND);
  EXPECT_EQ(kvd_client_release_lease(client, hit.lease_id), KVD_OK);

  char* json = nullptr;
  ASSERT_EQ(kvd_client_stats_json(client, &json), KVD_OK);
  auto j = nlohmann::json::parse(json);
  kvd_free_string(json);
  EXPECT_EQ(j["tiers"][0]["name"], "host");
  EXPECT_EQ(j["tiers"][0]["chunks"], 2);
  EXPECT_EQ(kvd_client_evict(client, "bogus", nullptr, nullptr), KVD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvd_last_error()).find("evict scope"), std::string::npos);
  kvd_client_close(client);
}

}  // namespace
