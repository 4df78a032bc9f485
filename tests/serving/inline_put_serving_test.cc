// One-exchange puts (InlinePut) of a model with a compression policy: the ingest pool compresses
// and stores them exactly as a three-step put, and the ingest admission refuses them the same
// way when its queue is full.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "e2e_common.h"
#include "serving_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

class InlinePutServingTest : public ServingFixture {
 protected:
  // A client that sends every put of this test's sizes inline (a 256-token stories chunk and
  // its window queries: 368,640 bytes).
  std::unique_ptr<client::Client> ConnectInline(const std::string& model, size_t threshold) {
    auto o = kvd_->EngineOptions("inline-" + model);
    o.model = model;
    o.inline_put_bytes = threshold;
    auto c = client::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status() << "\n" << kvd_->Log();
    return c.ok() ? std::move(*c) : nullptr;
  }
};

TEST_F(InlinePutServingTest, InlinePutStoresTheSameCompactChunkAsThreeSteps) {
  StartKvd(PolicyModel("stories-snapkv", kSnapKv));
  auto inline_client = ConnectInline("stories-snapkv", client::ClientOptions::kMaxInlinePutBytes);
  auto three_steps = ConnectInline("stories-snapkv", 0);
  auto admin = client::Client::Connect(kvd_->AdminOptions());
  ASSERT_NE(inline_client, nullptr);
  ASSERT_NE(three_steps, nullptr);
  ASSERT_TRUE(admin.ok()) << admin.status();
  const ModelLayout layout = inline_client->options().layout;
  Chunk chunk = MakeChunk(layout, kTokens, 7);
  // The same chunk under two keys, one put per path.
  auto a = inline_client->PutChunks(std::vector<client::PutItem>{Item({21, 1}, chunk, 256)});
  ASSERT_TRUE(a.ok()) << a.status() << "\n" << kvd_->Log();
  EXPECT_EQ(CounterValue(**admin, "puts_inline"), 1u);
  auto b = three_steps->PutChunks(std::vector<client::PutItem>{Item({21, 2}, chunk, 256)});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(CounterValue(**admin, "puts_inline"), 1u);
  EXPECT_EQ(CounterValue(**admin, "chunks_compressed"), 2u);
  EXPECT_EQ((*a)[0].codec_id, inline_client->session().codec_id);
  EXPECT_EQ((*a)[0].bytes, (*b)[0].bytes);
  EXPECT_EQ((*a)[0].stored_bytes, (*b)[0].stored_bytes);
  EXPECT_LT((*a)[0].stored_bytes, chunk.raw.size());

  auto expected = InProcess(layout, chunk, 256, SnapKvOptions());
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (uint64_t key : {1, 2}) {
    auto hit = inline_client->Lookup(std::vector<Hash128>{{21, key}});
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 1u);
    EXPECT_TRUE(GetCompact(*inline_client, hit->lease_id, 0) == *expected) << key;
  }
  // A put without the window queries the policy needs: refused as a Reserve is.
  auto no_queries =
      inline_client->PutChunks(std::vector<client::PutItem>{Item({21, 3}, chunk, 0, false)});
  EXPECT_EQ(no_queries.status().code(), StatusCode::kFailedPrecondition) << no_queries.status();
  EXPECT_THAT(no_queries.status().message(), HasSubstr("needs the window queries"));
}

TEST_F(InlinePutServingTest, FullIngestQueueRefusesInlinePutsAndRetriesStore) {
  StartKvd(PolicyModel("stories-q2",
                       "{stages: [snapkv], p_c: 0.5, worker_threads: 1, "
                       "queue_depth: 2}"));
  auto c = ConnectInline("stories-q2", client::ClientOptions::kMaxInlinePutBytes);
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  // 32 inline puts go out back to back, in windows of max_in_flight (8): a put that finds 2
  // admitted is refused before any of its bytes is reserved. (One window alone may slip through
  // when the worker keeps up, as on a machine busy with other work; four windows do not.)
  constexpr int kFlood = 32;
  std::vector<Chunk> flood;
  for (int i = 0; i < kFlood; ++i) flood.push_back(MakeChunk(layout, kTokens, 200 + i));
  std::vector<client::PutItem> items;
  for (int i = 0; i < kFlood; ++i) {
    items.push_back(Item({22, static_cast<uint64_t>(i)}, flood[i], 0));
  }
  auto r = c->PutChunks(items);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("ingest queue of model stories-q2 is full"));
  // Retried one at a time, every one stores; nothing refused was acknowledged.
  for (const auto& it : items) {
    auto one = c->PutChunks({&it, 1});
    ASSERT_TRUE(one.ok()) << one.status();
  }
  for (const auto& it : items) {
    auto hit = c->Lookup(std::vector<Hash128>{it.hash});
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->matched_chunks, 1u);
    ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  }
  auto stats = c->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(CounterValue(*stats, "ingest_rejected"), 1u);
  EXPECT_EQ(CounterValue(*stats, "chunks_compressed"), static_cast<uint64_t>(kFlood));
}

}  // namespace
}  // namespace kvd::e2e
