// Expected-attention scoring through real kvd processes (label `serving`): puts with window
// queries build the model's query statistics; until they hold ea_min_queries per layer chunks are
// scored with KeyDiff (score stage code 2), then with expected attention (code 4), byte for byte
// what the kernels store in-process from the same puts' queries; the statistics survive a
// restart (a chunk put after it is scored with every query seen before it). Stats (the client,
// `kvdctl stats` and its --json, /metrics) show how many queries they hold and whether they score.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kvd/kernels/expected_attention.h"
#include "kvd/kernels/rope.h"
#include "serving_common.h"

namespace kvd::e2e {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;

const std::string kEaModel = "stories-ea";
constexpr char kEaPolicy[] =
    "{stages: [expected_attention], p_c: 0.5, window: 32, sinks: 4, ea_min_queries: 64, "
    "worker_threads: 1, queue_depth: 4, device: cpu}";

kk::CompressionPlanOptions EaOptions() {
  kk::CompressionPlanOptions o;
  o.score = kk::ScoreStage::kExpectedAttention;
  o.p_c = 0.5;
  o.window = kWindow;
  o.sinks = 4;
  o.expected_attention_min_queries = 64;
  return o;
}

class QueryStatisticsE2eTest : public ServingDirFixture {
 protected:
  void Restart() {
    if (kvd_ && kvd_->Alive()) ASSERT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    kvd_.reset();
    KvdConfig config;
    config.extra_models = PolicyModel(kEaModel, kEaPolicy);
    config.extra_yaml = "state_dir: " + dir_ + "/state\n";
    config.metrics = true;
    auto kvd = KvdProcess::Start(config);
    ASSERT_TRUE(kvd.ok()) << kvd.status();
    kvd_ = std::move(*kvd);
  }
  // The model's statistics as stats report them: `queries` window queries per layer of the 64
  // they score from, active (expected attention scores chunks) or KeyDiff's fallback.
  void ExpectStatsShow(client::Client& c, uint64_t queries, bool active) {
    auto stats = c.GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_EQ(stats->compression.size(), 1u);
    const client::ModelIngestStats& m = stats->compression[0];
    EXPECT_EQ(m.ea_queries, queries);
    EXPECT_EQ(m.ea_min_queries, 64u);
    EXPECT_EQ(m.ExpectedAttentionActive(), active);
    const std::string q = std::to_string(queries);
    const std::string state = active ? "active" : "keydiff-fallback";
#ifdef KVDCTL_BINARY
    std::string out;
    ASSERT_EQ(RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "stats"}, &out), 0) << out;
    EXPECT_THAT(out, HasSubstr("model " + kEaModel + " expected attention: " + state + " (" + q +
                               " window queries per layer, scores from 64)"));
    ASSERT_EQ(RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "--json", "stats"}, &out),
              0)
        << out;
    EXPECT_THAT(out, ContainsRegex("\"expected_attention\": \\{[[:space:]]*\"min_queries\": 64,"
                                   "[[:space:]]*\"queries\": " +
                                   q + ",[[:space:]]*\"state\": \"" + state + "\""));
#endif
    auto scrape = HttpGet(kvd_->metrics_address(), "/metrics");
    ASSERT_TRUE(scrape.ok()) << scrape.status();
    EXPECT_THAT(*scrape, ContainsRegex("kvd_expected_attention_queries\\{[^}]*model=\"" + kEaModel +
                                       "\"\\} " + q + "\n"));
    EXPECT_THAT(*scrape, ContainsRegex("kvd_expected_attention_active\\{[^}]*model=\"" + kEaModel +
                                       "\"\\} " + (active ? "1" : "0") + "\n"));
  }
  // Puts chunk `index` of prompt {5, .} (positions index * 256 ...), then gets it back compact.
  std::vector<uint8_t> PutAndGet(client::Client& c, const Chunk& chunk, uint64_t index) {
    const Hash128 hash{5, index};
    auto put = c.PutChunks(std::vector<client::PutItem>{Item(hash, chunk, index * kTokens)});
    EXPECT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();
    auto hit = c.Lookup(std::vector<Hash128>{hash});
    EXPECT_TRUE(hit.ok() && hit->matched_chunks == 1) << kvd_->Log();
    if (!hit.ok() || hit->matched_chunks != 1) return {};
    std::vector<uint8_t> out = GetCompact(c, hit->lease_id, 0);
    EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
    return out;
  }
};

TEST_F(QueryStatisticsE2eTest, PutsBuildStatisticsThatScoreChunksAndSurviveARestart) {
  Restart();
  auto c = Connect(kEaModel);
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  EXPECT_TRUE(c->session().needs_queries) << "the statistics are built from the window queries";
  auto rope = kk::RopeTable::Create(layout.rope, layout.head_dim);
  ASSERT_TRUE(rope.ok());
  auto stats = kk::QueryStatistics::Create(layout.num_layers, layout.num_q_heads, *rope);
  ASSERT_TRUE(stats.ok());
  // What kvd accumulates: each put's window queries at its last kWindow positions, in put order.
  auto add = [&](const Chunk& chunk, uint64_t index) {
    std::vector<int64_t> pos(kWindow);
    for (int w = 0; w < kWindow; ++w)
      pos[w] = static_cast<int64_t>((index + 1) * kTokens - kWindow + w);
    const size_t per_layer = chunk.queries.size() / layout.num_layers;
    for (int l = 0; l < layout.num_layers; ++l) {
      ASSERT_TRUE(
          stats
              ->Add(l, std::span<const float>(chunk.queries).subspan(per_layer * l, per_layer), pos)
              .ok());
    }
  };
  std::vector<Chunk> chunks;
  for (uint32_t i = 0; i < 3; ++i) chunks.push_back(MakeChunk(layout, kTokens, 40 + i));
  ExpectStatsShow(*c, 0, false);

  // Chunk 0: 32 queries per layer < 64: KeyDiff scored it (the plan's fallback, code 2).
  const std::vector<uint8_t> first = PutAndGet(*c, chunks[0], 0);
  add(chunks[0], 0);
  ASSERT_GT(first.size(), 21u);
  EXPECT_EQ(first[21], static_cast<uint8_t>(kk::ScoreStage::kKeyDiff));
  auto want0 = InProcess(layout, chunks[0], 0, EaOptions(), nullptr, &*stats);
  ASSERT_TRUE(want0.ok()) << want0.status();
  EXPECT_TRUE(first == *want0);
  ExpectStatsShow(*c, 32, false);

  // Chunk 1: 64 queries: expected attention (code 4), the kernels' bytes for the same statistics.
  const std::vector<uint8_t> second = PutAndGet(*c, chunks[1], 1);
  add(chunks[1], 1);
  ASSERT_GT(second.size(), 21u);
  EXPECT_EQ(second[21], static_cast<uint8_t>(kk::ScoreStage::kExpectedAttention));
  auto want1 = InProcess(layout, chunks[1], kTokens, EaOptions(), nullptr, &*stats);
  ASSERT_TRUE(want1.ok()) << want1.status();
  EXPECT_TRUE(second == *want1) << "kvd's chunk differs from the CPU kernels' on the same input";
  auto decoded = kk::DecodeCompactChunk(second);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->codec.score, kk::ScoreStage::kExpectedAttention);
  ExpectStatsShow(*c, 64, true);

  // Restart: the statistics come back (without them chunk 2 would be scored by KeyDiff).
  c.reset();
  Restart();
  c = Connect(kEaModel);
  ASSERT_NE(c, nullptr);
  EXPECT_NE(kvd_->Log().find("query statistics reloaded"), std::string::npos) << kvd_->Log();
  ExpectStatsShow(*c, 64, true);
  const std::vector<uint8_t> third = PutAndGet(*c, chunks[2], 2);
  add(chunks[2], 2);
  ASSERT_GT(third.size(), 21u);
  EXPECT_EQ(third[21], static_cast<uint8_t>(kk::ScoreStage::kExpectedAttention));
  auto want2 = InProcess(layout, chunks[2], 2 * kTokens, EaOptions(), nullptr, &*stats);
  ASSERT_TRUE(want2.ok()) << want2.status();
  EXPECT_TRUE(third == *want2);
}

// The policy's ea_covariance and ea_keydiff_share reach the plan: kvd stores what the kernels
// store with those options, not what they store without them.
TEST_F(QueryStatisticsE2eTest, CovarianceAndKeyDiffShareReachThePlan) {
  StartKvd(PolicyModel(kEaModel,
                       "{stages: [expected_attention], p_c: 0.5, window: 32, sinks: 4, "
                       "ea_min_queries: 32, ea_covariance: false, ea_keydiff_share: 0.5, "
                       "worker_threads: 1, queue_depth: 4, device: cpu}"),
           "state_dir: " + dir_ + "/state\n");
  auto c = Connect(kEaModel);
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  auto rope = kk::RopeTable::Create(layout.rope, layout.head_dim);
  ASSERT_TRUE(rope.ok());
  auto stats = kk::QueryStatistics::Create(layout.num_layers, layout.num_q_heads, *rope);
  ASSERT_TRUE(stats.ok());
  const Chunk chunk = MakeChunk(layout, kTokens, 50);
  std::vector<int64_t> pos(kWindow);
  for (int w = 0; w < kWindow; ++w) pos[w] = static_cast<int64_t>(kTokens - kWindow + w);
  const size_t per_layer = chunk.queries.size() / layout.num_layers;
  for (int l = 0; l < layout.num_layers; ++l) {
    ASSERT_TRUE(
        stats->Add(l, std::span<const float>(chunk.queries).subspan(per_layer * l, per_layer), pos)
            .ok());
  }
  const std::vector<uint8_t> got = PutAndGet(*c, chunk, 0);
  ASSERT_GT(got.size(), 21u);
  EXPECT_EQ(got[21], static_cast<uint8_t>(kk::ScoreStage::kExpectedAttention));
  kk::CompressionPlanOptions o = EaOptions();
  o.expected_attention_min_queries = 32;
  auto plain = InProcess(layout, chunk, 0, o, nullptr, &*stats);
  o.expected_attention.use_covariance = false;
  o.expected_attention.keydiff_share = 0.5;
  auto want = InProcess(layout, chunk, 0, o, nullptr, &*stats);
  ASSERT_TRUE(plain.ok() && want.ok());
  EXPECT_TRUE(got == *want) << "kvd's chunk differs from the kernels' with the policy's options";
  EXPECT_FALSE(got == *plain) << "the options changed nothing: the test cannot tell";
}

}  // namespace
}  // namespace kvd::e2e
