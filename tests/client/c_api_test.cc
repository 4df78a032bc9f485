// The C ABI: error codes, kvd_last_error, and a round trip through the fake daemon.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
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

// A newer header's version of the versioned struct T: this library's fields, then 16 bytes of
// fields it does not know, then a guard that nothing may write.
template <typename T>
struct Newer {
  T known;
  uint64_t later[2];
  uint64_t guard;
};

// A Newer<T> filled with `fill`, its struct_size covering `later` but not the guard.
template <typename T>
Newer<T> FilledNewer(uint8_t fill) {
  Newer<T> n;
  std::memset(&n, fill, sizeof n);
  n.known.struct_size = offsetof(Newer<T>, guard);
  return n;
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

// The loaded library's ABI version is the header's (KVD_CLIENT_ABI_VERSION, the SONAME's number).
TEST(CApiTest, LoadedLibraryHasTheHeadersAbiVersion) {
  EXPECT_EQ(kvd_client_abi_version(), KVD_CLIENT_ABI_VERSION);
  EXPECT_GE(KVD_CLIENT_ABI_VERSION, 1);  // 1: the struct_size versioning
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
  Newer<kvd_config> newer = FilledNewer<kvd_config>(0xAB);
  kvd_config_init_sized(&newer.known, newer.known.struct_size);
  EXPECT_EQ(newer.known.struct_size, offsetof(Newer<kvd_config>, guard));
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

// kvd_lookup_result and kvd_get_result are versioned by struct_size too (set by their inline
// inits). A result whose struct_size was not set is refused before the call does anything; a
// call writes only the caller's struct_size bytes (an older header's smaller struct) and zeroes
// the fields of a newer header's larger struct that this library does not fill.
TEST(CApiTest, ResultSizesAreTheCallersAndAreChecked) {
  kvd::client::testing::FakeDaemon daemon("default", {});
  const std::string address = daemon.address();
  kvd_config c = TinyConfig(address);
  c.address = address.c_str();
  kvd_client* client = nullptr;
  ASSERT_EQ(kvd_client_connect(&c, &client), KVD_OK) << kvd_last_error();
  std::vector<int32_t> tokens(32, 5);
  kvd_hash128 chain[1];
  size_t n = 0;
  ASSERT_EQ(kvd_client_chunk_chain(client, tokens.data(), 32, 0, chain, 1, &n), KVD_OK);
  std::vector<uint8_t> raw(32 * 2 * 2 * 2 * 8 * 4);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_EQ(kvd_client_put(client, chain[0], 32, raw.data(), raw.size(), nullptr), KVD_OK)
      << kvd_last_error();

  // The inits: zero, struct_size = sizeof.
  kvd_lookup_result init_hit;
  std::memset(&init_hit, 0xAB, sizeof init_hit);
  kvd_lookup_result_init(&init_hit);
  EXPECT_EQ(init_hit.struct_size, sizeof(kvd_lookup_result));
  EXPECT_EQ(init_hit.lease_id, 0u);
  EXPECT_EQ(init_hit.lease_ttl_ms, 0u);
  kvd_get_result init_got;
  std::memset(&init_got, 0xAB, sizeof init_got);
  kvd_get_result_init(&init_got);
  EXPECT_EQ(init_got.struct_size, sizeof(kvd_get_result));
  EXPECT_EQ(init_got.tokens, 0u);

  // A struct_size no init set: refused naming it, before anything reaches the daemon (no lease,
  // no read), and the result is left as it was.
  const size_t lookup_min = offsetof(kvd_lookup_result, lease_ttl_ms) + sizeof(uint32_t);
  const size_t get_min = offsetof(kvd_get_result, tokens) + sizeof(uint32_t);
  std::vector<uint8_t> out(raw.size(), 0x11);
  for (size_t bad : {size_t{0}, size_t{8}, lookup_min - 1, size_t{1} << 20}) {
    SCOPED_TRACE(bad);
    kvd_lookup_result hit;
    std::memset(&hit, 0xCD, sizeof hit);
    hit.struct_size = bad;  // e.g. `kvd_lookup_result hit{}`, or a program built without it
    EXPECT_EQ(kvd_client_lookup(client, chain, 1, &hit), KVD_INVALID_ARGUMENT);
    std::string error = kvd_last_error();
    EXPECT_NE(error.find("kvd_lookup_result.struct_size is " + std::to_string(bad)),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("call kvd_lookup_result_init"), std::string::npos) << error;
    EXPECT_EQ(hit.lease_id, 0xCDCDCDCDCDCDCDCDull);
  }
  EXPECT_EQ(daemon.seen("lookup"), 0);
  kvd_lookup_result hit;
  kvd_lookup_result_init(&hit);
  ASSERT_EQ(kvd_client_lookup(client, chain, 1, &hit), KVD_OK) << kvd_last_error();
  ASSERT_EQ(hit.matched_chunks, 1u);
  EXPECT_EQ(hit.struct_size, sizeof(kvd_lookup_result));
  for (size_t bad : {size_t{0}, get_min - 1, size_t{4097}}) {
    SCOPED_TRACE(bad);
    kvd_get_result got;
    std::memset(&got, 0xCD, sizeof got);
    got.struct_size = bad;
    EXPECT_EQ(kvd_client_get(client, hit.lease_id, 0, out.data(), out.size(), &got),
              KVD_INVALID_ARGUMENT);
    std::string error = kvd_last_error();
    EXPECT_NE(error.find("kvd_get_result.struct_size is " + std::to_string(bad)), std::string::npos)
        << error;
    EXPECT_NE(error.find("call kvd_get_result_init"), std::string::npos) << error;
    void* k[2] = {out.data(), out.data() + out.size() / 4};
    void* v[2] = {out.data() + out.size() / 2, out.data() + 3 * out.size() / 4};
    EXPECT_EQ(kvd_client_get_layers(client, hit.lease_id, 0, k, v, 32, &got), KVD_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvd_last_error()).find("kvd_get_result.struct_size"), std::string::npos);
    EXPECT_EQ(got.bytes, 0xCDCDCDCDCDCDCDCDull);
  }
  EXPECT_EQ(daemon.seen("get"), 0);
  EXPECT_EQ(out, std::vector<uint8_t>(raw.size(), 0x11)) << "a refused get read nothing";

  // An older header's struct, as small as the first sized one (it lacks the trailing padding):
  // every field it has is filled, nothing past its struct_size is written.
  kvd_get_result older;
  std::memset(&older, 0xCD, sizeof older);
  older.struct_size = get_min;
  ASSERT_EQ(kvd_client_get(client, hit.lease_id, 0, out.data(), out.size(), &older), KVD_OK)
      << kvd_last_error();
  EXPECT_EQ(out, raw);
  EXPECT_EQ(older.struct_size, get_min);
  EXPECT_EQ(older.bytes, raw.size());
  EXPECT_EQ(older.tokens, 32u);
  const auto* tail = reinterpret_cast<const uint8_t*>(&older) + get_min;
  EXPECT_EQ(std::vector<uint8_t>(tail, tail + (sizeof older - get_min)),
            std::vector<uint8_t>(sizeof older - get_min, 0xCD))
      << "written past struct_size";
  const uint64_t checksum = older.checksum;

  // A newer header's structs: this library's fields, then 16 bytes it does not know (zeroed),
  // then a guard it must not touch.
  Newer<kvd_get_result> newer_got = FilledNewer<kvd_get_result>(0xCD);
  std::fill(out.begin(), out.end(), 0x11);
  ASSERT_EQ(kvd_client_get(client, hit.lease_id, 0, out.data(), out.size(), &newer_got.known),
            KVD_OK)
      << kvd_last_error();
  EXPECT_EQ(out, raw);
  EXPECT_EQ(newer_got.known.struct_size, offsetof(Newer<kvd_get_result>, guard));
  EXPECT_EQ(newer_got.known.bytes, raw.size());
  EXPECT_EQ(newer_got.known.checksum, checksum);
  EXPECT_EQ(newer_got.known.tokens, 32u);
  EXPECT_EQ(newer_got.later[0], 0u);
  EXPECT_EQ(newer_got.later[1], 0u);
  EXPECT_EQ(newer_got.guard, 0xCDCDCDCDCDCDCDCDull) << "written past struct_size";
  ASSERT_EQ(kvd_client_release_lease(client, hit.lease_id), KVD_OK);

  Newer<kvd_lookup_result> newer_hit = FilledNewer<kvd_lookup_result>(0xCD);
  ASSERT_EQ(kvd_client_lookup(client, chain, 1, &newer_hit.known), KVD_OK) << kvd_last_error();
  EXPECT_EQ(newer_hit.known.matched_chunks, 1u);
  EXPECT_EQ(newer_hit.known.matched_tokens, 32u);
  EXPECT_NE(newer_hit.known.lease_id, 0u);
  EXPECT_EQ(newer_hit.known.lease_ttl_ms, 5000u);
  EXPECT_EQ(newer_hit.later[0], 0u);
  EXPECT_EQ(newer_hit.later[1], 0u);
  EXPECT_EQ(newer_hit.guard, 0xCDCDCDCDCDCDCDCDull) << "written past struct_size";
  // Without a result at all, a get still reads.
  std::fill(out.begin(), out.end(), 0x11);
  EXPECT_EQ(kvd_client_get(client, newer_hit.known.lease_id, 0, out.data(), out.size(), nullptr),
            KVD_OK)
      << kvd_last_error();
  EXPECT_EQ(out, raw);
  EXPECT_EQ(kvd_client_release_lease(client, newer_hit.known.lease_id), KVD_OK);
  kvd_client_close(client);
}

// A daemon in no cluster: placement and cluster-scope lookups fail with FAILED_PRECONDITION naming
// why (the session JSON says so up front), and hand out nothing.
TEST(CApiTest, ClusterCallsOnADaemonInNoClusterAreRefusedNamingWhy) {
  kvd::client::testing::FakeDaemon daemon("default", {});
  std::string address = daemon.address();
  kvd_config c = TinyConfig(address);
  c.address = address.c_str();
  kvd_client* client = nullptr;
  ASSERT_EQ(kvd_client_connect(&c, &client), KVD_OK) << kvd_last_error();
  char* session = nullptr;
  ASSERT_EQ(kvd_client_session_json(client, &session), KVD_OK);
  auto s = nlohmann::json::parse(session);
  kvd_free_string(session);
  EXPECT_EQ(s["cluster_lookup"], false);
  EXPECT_EQ(s["cluster_placement"], false);

  const kvd_hash128 chain[1] = {{1, 2}};
  kvd_lookup_result r;
  kvd_lookup_result_init(&r);
  char* holders = reinterpret_cast<char*>(0x1);
  EXPECT_EQ(kvd_client_lookup_cluster(client, chain, 1, &r, &holders), KVD_FAILED_PRECONDITION);
  EXPECT_EQ(holders, nullptr);
  EXPECT_NE(std::string(kvd_last_error()).find("not a cluster member"), std::string::npos)
      << kvd_last_error();
  kvd_placement* placement = reinterpret_cast<kvd_placement*>(0x1);
  EXPECT_EQ(kvd_client_place(client, chain, 1, nullptr, &placement), KVD_FAILED_PRECONDITION);
  EXPECT_EQ(placement, nullptr);
  EXPECT_NE(std::string(kvd_last_error()).find("not a cluster member"), std::string::npos)
      << kvd_last_error();
  EXPECT_EQ(kvd_placement_count(nullptr), 0u);
  EXPECT_EQ(kvd_placement_target(nullptr, 0, nullptr, nullptr, nullptr), KVD_INVALID_ARGUMENT);
  kvd_client_close(client);
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
  kvd_lookup_result_init(&hit);
  ASSERT_EQ(kvd_client_lookup(client, chain, 2, &hit), KVD_OK);
  EXPECT_EQ(hit.matched_chunks, 2u);
  std::vector<std::vector<float>> k2(2, std::vector<float>(half / 4)), v2 = k2;
  void* kq[2] = {k2[0].data(), k2[1].data()};
  void* vq[2] = {v2[0].data(), v2[1].data()};
  kvd_get_result got;
  kvd_get_result_init(&got);
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
