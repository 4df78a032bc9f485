// A route stage registered in this process (tests/kernels/mean_value_stage.h) served end to end:
// the in-process daemon compresses a put with `stages: [keydiff, mean_value]`, a client gets the
// compact chunk, and the client library serves it compact (CompactChunkReader::CompactLayer) and
// dense (GetDense) through the stage's rebuild, with no VECTOR weights.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "../kernels/mean_value_stage.h"
#include "daemon_test_util.h"
#include "kvd/client/client.h"
#include "kvd/client/expand.h"
#include "kvd/daemon/config.h"
#include "kvd/kernels/compact_chunk.h"
#include "loopback_client.h"

namespace kvd::daemon::testing {
namespace {

constexpr int kTokens = 64;

class StageServingTest : public DaemonTest {
 protected:
  // The daemon's one model: `toy` with the policy `compression`, in chunks of kTokens.
  void AddModel(const std::string& compression) {
    auto parsed = ParseConfigYaml(
        "models: [{name: toy, layout: {layers: 2, kv_heads: 2, q_heads: 4, head_dim: 8, dtype: "
        "float32}, compression: " +
        compression + "}]");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    config_.models = {parsed->models[0]};
    config_.chunk_tokens = kTokens;
  }
  client::ClientOptions Options() const {
    client::ClientOptions o =
        LoopbackClientOptions(TcpAddress(), loopback_domain_, "toy", Layout("toy"));
    o.chunk_tokens = kTokens;
    return o;
  }
};

// Every (layer, head) of the served chunk, compact and dense, against a float64 reference from the
// raw put: a slot that kept its value serves its token's value; a dropped value is the mean of the
// values of the head's kept tokens (each slot holds one token: keydiff evicts, mean_value merges
// nothing).
TEST_F(StageServingTest, AToyRouteStagesChunksAreServedCompactAndDense) {
  ASSERT_TRUE(kernels::testing::RegisterMeanValueStage().ok());
  AddModel("{stages: [keydiff, mean_value], p_c: 0.5, window: 4, sinks: 2, device: cpu}");
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto c = client::Client::Connect(Options());
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelLayout layout = Layout("toy");
  const int64_t heads = layout.num_kv_heads, d = layout.head_dim;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> raw(layout.ChunkBytes(kTokens) / sizeof(float));
  for (float& x : raw) x = dist(rng);
  const Hash128 hash{31, 32};
  client::PutItem put{
      .hash = hash, .tokens = kTokens, .data = raw.data(), .bytes = raw.size() * sizeof(float)};
  ASSERT_TRUE((*c)->PutChunks({&put, 1}).ok());
  auto hit = (*c)->Lookup(std::vector<Hash128>{hash});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);

  std::vector<uint8_t> stored(client::MaxCompactChunkBytes(layout, kTokens));
  client::GetItem item{.chunk_index = 0, .out = stored.data(), .capacity = stored.size()};
  auto got = (*c)->GetChunks(hit->lease_id, {&item, 1});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ((*got)[0].form, client::ChunkForm::kCompact);
  stored.resize((*got)[0].bytes);
  auto chunk = kernels::DecodeCompactChunk(stored);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->codec.route, kernels::testing::kMeanValue);
  auto reader = client::CompactChunkReader::Open(stored, layout);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->required_weights_version(), 0u);

  std::vector<float> dense(raw.size());
  int64_t t = 0;
  auto got_dense =
      client::GetDense(**c, hit->lease_id, 0, dense.data(), dense.size() * sizeof(float), &t);
  ASSERT_TRUE(got_dense.ok()) << got_dense.status();
  ASSERT_EQ(t, chunk->heads[0].slots());  // one token per slot

  int64_t dropped = 0;
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    const float* k_raw = raw.data() + 2 * layer * kTokens * heads * d;  // K[N, H, d], V[N, H, d]
    const float* v_raw = k_raw + kTokens * heads * d;
    const float* k_dense = dense.data() + 2 * layer * t * heads * d;
    const float* v_dense = k_dense + t * heads * d;
    std::vector<std::vector<float>> keys(heads), values(heads), bias(heads);
    std::vector<client::CompactHeadOut> out(heads);
    for (int h = 0; h < heads; ++h) {
      keys[h].resize(t * d), values[h].resize(t * d), bias[h].resize(t);
      out[h] = {keys[h].data(), values[h].data(), bias[h].data(), nullptr, t};
    }
    ASSERT_TRUE((*reader)->CompactLayer(layer, out).ok());
    for (int h = 0; h < heads; ++h) {
      const kernels::CompactHead& head = chunk->Head(layer, h);
      ASSERT_EQ(head.slots(), t);
      std::vector<double> mean(d, 0.0);
      for (int64_t j = 0; j < t; ++j) {
        if (head.flags[j] & kernels::kSlotRebuildValue) continue;
        for (int64_t c = 0; c < d; ++c) {
          mean[c] += v_raw[(head.positions[j] * heads + h) * d + c] / double(head.value_slots());
        }
      }
      for (int64_t j = 0; j < t; ++j) {
        const bool rebuilt = head.flags[j] & kernels::kSlotRebuildValue;
        dropped += rebuilt ? 1 : 0;
        for (int64_t c = 0; c < d; ++c) {
          const float v = values[h][j * d + c];
          if (rebuilt) {
            EXPECT_FLOAT_EQ(v, static_cast<float>(mean[c])) << layer << "/" << h << " slot " << j;
          } else {
            EXPECT_EQ(v, v_raw[(head.positions[j] * heads + h) * d + c]) << "slot " << j;
          }
          EXPECT_EQ(keys[h][j * d + c], k_raw[(head.positions[j] * heads + h) * d + c]);
          EXPECT_EQ(v_dense[(j * heads + h) * d + c], v) << layer << "/" << h << " slot " << j;
          EXPECT_EQ(k_dense[(j * heads + h) * d + c], keys[h][j * d + c]);
        }
      }
    }
  }
  EXPECT_GT(dropped, 0);
  ASSERT_TRUE((*c)->ReleaseLease(hit->lease_id).ok());
}

// The weights version a reader asks for is the calibration of a route stage that needs one: a
// chunk of mean_value (registered without needs_calibration) asks for none whatever version it
// records; the same chunk routed by vector asks for its version.
TEST_F(StageServingTest, OnlyARouteStageThatNeedsACalibrationAsksForWeights) {
  ASSERT_TRUE(kernels::testing::RegisterMeanValueStage().ok());
  AddModel("{stages: [keydiff, mean_value], p_c: 0.5, device: cpu}");
  const ModelLayout layout = Layout("toy");
  for (const kernels::RouteStage route :
       {kernels::testing::kMeanValue, kernels::RouteStage::kVector}) {
    kernels::CodecDescription codec;
    codec.score = kernels::ScoreStage::kKeyDiff;
    codec.route = route;
    codec.p_c = 0.5;
    codec.calibration_version = 9;
    kernels::CompactChunk chunk = kernels::CompactChunk::ForLayout(layout, 4, codec);
    for (kernels::CompactHead& h : chunk.heads) {
      h.flags = {0, kernels::kSlotRebuildValue, 0, 0};
      h.cardinality = {1, 1, 1, 1};
      h.positions = {0, 1, 2, 3};
      h.keys.assign(4 * layout.head_dim * sizeof(float), 0);
      h.values.assign(3 * layout.head_dim * sizeof(float), 0);
    }
    auto bytes = kernels::EncodeCompactChunk(chunk);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto reader = client::CompactChunkReader::Open(*bytes, layout);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ((*reader)->required_weights_version(),
              route == kernels::RouteStage::kVector ? 9u : 0u)
        << kernels::RouteStageName(route);
  }
}

}  // namespace
}  // namespace kvd::daemon::testing
