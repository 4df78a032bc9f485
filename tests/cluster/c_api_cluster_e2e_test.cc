// The C ABI's cluster calls (kvd_client_place, kvd_client_connect_placed,
// kvd_client_lookup_cluster) against three real kvd processes on a real etcd-server
// (PeerClusterTest): a prefill engine on a puts a chain to decode node b through the placement,
// and a cluster lookup from a lists b's prefix and fetches it byte-exact. Skipped when etcd is
// not installed.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "e2e_common.h"
#include "kvd/client/kvd_client.h"
#include "peer_cluster.h"

namespace kvd::e2e {
namespace {

class CApiClusterE2eTest : public PeerClusterTest {};

TEST_F(CApiClusterE2eTest, PutThroughThePlacementToBThenAClusterLookupFromAFetchesIt) {
  const client::ClientOptions on_a = kvds_[0]->EngineOptions("c-prefill-a");
  kvd_config config = CConfig(on_a);  // e2e_common.h
  config.connect_timeout_ms = config.request_timeout_ms = config.transfer_timeout_ms = 5000;
  kvd_client* a = nullptr;
  ASSERT_EQ(kvd_client_connect(&config, &a), KVD_OK) << kvd_last_error();
  const size_t chunk_bytes = on_a.layout.ChunkBytes(on_a.chunk_tokens);
  const std::vector<int32_t> tokens = RandomTokens(3 * 256, 31);
  std::vector<kvd_hash128> chain(3);
  size_t n = 0;
  ASSERT_EQ(kvd_client_chunk_chain(a, tokens.data(), tokens.size(), 1, chain.data(), 3, &n),
            KVD_OK);
  ASSERT_EQ(n, 3u);
  std::vector<Hash128> hashes;
  for (const auto& h : chain) hashes.push_back({h.hi, h.lo});

  kvd_placement* placement = nullptr;
  ASSERT_EQ(kvd_client_place(a, chain.data(), chain.size(), "b", &placement), KVD_OK)
      << kvd_last_error();
  ASSERT_EQ(kvd_placement_count(placement), 1u);
  EXPECT_EQ(kvd_placement_membership_current(placement), 1);
  EXPECT_EQ(kvd_placement_membership_age_ms(placement), 0u);
  EXPECT_EQ(kvd_placement_membership_age_ms(nullptr), 0u);
  const char* node = nullptr;
  const char* address = nullptr;
  int local = -1;
  ASSERT_EQ(kvd_placement_target(placement, 0, &node, &address, &local), KVD_OK);
  EXPECT_STREQ(node, "b");
  EXPECT_EQ(std::string(address), kvds_[1]->tcp_address());
  EXPECT_EQ(local, 0);
  EXPECT_EQ(kvd_placement_target(placement, 1, &node, nullptr, nullptr), KVD_OUT_OF_RANGE);

  kvd_client* to_b = nullptr;
  ASSERT_EQ(kvd_client_connect_placed(a, placement, 0, &to_b), KVD_OK) << kvd_last_error();
  kvd_placement_free(placement);
  std::vector<std::vector<uint8_t>> bytes;
  for (size_t i = 0; i < chain.size(); ++i) {
    bytes.push_back(RandomBytes(chunk_bytes, 700 + i));
    int already = -1;
    ASSERT_EQ(kvd_client_put(to_b, chain[i], 256, bytes[i].data(), chunk_bytes, &already), KVD_OK)
        << kvd_last_error();
    EXPECT_EQ(already, 0);
  }
  kvd_client_close(to_b);
  EXPECT_EQ(LocalPrefix(*kvds_[1], hashes), 3u) << "the placed client put to b";
  EXPECT_EQ(LocalPrefix(*kvds_[0], hashes), 0u);

  kvd_lookup_result hit;
  kvd_lookup_result_init(&hit);
  char* holders = nullptr;
  ASSERT_EQ(kvd_client_lookup_cluster(a, chain.data(), chain.size(), &hit, &holders), KVD_OK)
      << kvd_last_error();
  ASSERT_NE(holders, nullptr);
  auto listed = nlohmann::json::parse(holders);
  kvd_free_string(holders);
  EXPECT_EQ(hit.matched_chunks, 3u);
  EXPECT_EQ(hit.fetched_chunks, 3u);
  EXPECT_EQ(hit.num_holders, 3u);
  EXPECT_EQ(hit.membership_current, 1u) << "etcd answers: the member list is current";
  EXPECT_EQ(hit.membership_age_ms, 0u);
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0]["node"], "a");
  EXPECT_EQ(listed[0]["matched_chunks"], 3) << "a's own prefix, the fetched chunks included";
  for (const auto& h : listed) {
    if (h["node"] != "b") continue;
    EXPECT_EQ(h["matched_chunks"], 3);
    EXPECT_EQ(h["error"], "");
    EXPECT_EQ(h["found_in"][0]["tier"], "host");
  }
  for (uint32_t i = 0; i < 3; ++i) {
    std::vector<uint8_t> out(chunk_bytes);
    ASSERT_EQ(kvd_client_get(a, hit.lease_id, i, out.data(), out.size(), nullptr), KVD_OK)
        << kvd_last_error();
    EXPECT_TRUE(out == bytes[i]) << "chunk " << i << " differs";
  }
  EXPECT_EQ(kvd_client_release_lease(a, hit.lease_id), KVD_OK);

  // The placement rule: best first, and a member that is not up is named.
  ASSERT_EQ(kvd_client_place(a, chain.data(), chain.size(), nullptr, &placement), KVD_OK)
      << kvd_last_error();
  EXPECT_GE(kvd_placement_count(placement), 2u);  // a and b serve stories260k alike
  kvd_placement_free(placement);
  EXPECT_EQ(kvd_client_place(a, chain.data(), chain.size(), "zz", &placement), KVD_NOT_FOUND);
  EXPECT_EQ(placement, nullptr);
  EXPECT_NE(std::string(kvd_last_error()).find("zz"), std::string::npos) << kvd_last_error();
  kvd_client_close(a);
}

}  // namespace
}  // namespace kvd::e2e
