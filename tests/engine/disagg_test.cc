// kvd/llama/disagg.h on stories260K: chunked prefill hands out exactly the session's own K/V and
// each chunk's own last-W queries; caches rebuilt from raw or compact chunks continue like the
// prefill session; the compression budget is met per chunk; bad inputs get specific errors.
#include "kvd/llama/disagg.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "kvd/common/dtype.h"
#include "kvd/llama/model.h"
#include "test_models.h"

namespace kvd::llama {
namespace {

constexpr int kChunk = 64;
constexpr int kWindow = 8;

class DisaggTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVD_REQUIRE_STORIES();
    auto m = LlamaModel::Load(testing::Stories260KPath());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    layout_ = model_->config().ToModelLayout();  // float32: no rounding on the way
  }
  std::vector<int32_t> Prompt(int n) const {
    std::vector<int32_t> t = {1};
    for (int i = 1; i < n; ++i) t.push_back(3 + (i * 37) % (model_->config().vocab_size - 3));
    return t;
  }
  ChunkedPrefillOptions Opts() const { return {.chunk_tokens = kChunk, .window = kWindow}; }

  std::unique_ptr<LlamaModel> model_;
  ModelLayout layout_;
};

TEST_F(DisaggTest, ChunksHoldTheSessionsKvAndEachChunksOwnWindowQueries) {
  const std::vector<int32_t> prompt = Prompt(2 * kChunk + 10);
  LlamaSession s(*model_, {.threads = 1});
  auto pre = PrefillChunks(s, prompt, layout_, Opts());
  ASSERT_TRUE(pre.ok()) << pre.status();
  ASSERT_EQ(pre->chunks.size(), 2u);  // the 10 tokens after them make no chunk
  EXPECT_EQ(s.position(), static_cast<int>(prompt.size()));
  const LlamaConfig& cfg = model_->config();
  const size_t row = static_cast<size_t>(cfg.num_kv_heads) * cfg.head_dim;
  for (int c = 0; c < 2; ++c) {
    const PrefillChunk& ch = pre->chunks[c];
    EXPECT_EQ(ch.first_position, c * kChunk);
    EXPECT_EQ(ch.tokens, kChunk);
    ASSERT_EQ(ch.raw.size(), layout_.ChunkBytes(kChunk));
    for (int l = 0; l < cfg.num_layers; ++l) {
      const std::vector<float> k = s.LayerKeys(l), v = s.LayerValues(l);
      const uint8_t* blk = ch.raw.data() + layout_.LayerOffset(l, kChunk);
      const size_t n = kChunk * row * sizeof(float);
      EXPECT_EQ(std::memcmp(blk, k.data() + c * kChunk * row, n), 0) << "K layer " << l;
      EXPECT_EQ(std::memcmp(blk + n, v.data() + c * kChunk * row, n), 0) << "V layer " << l;
    }
    // The queries of this chunk's last W tokens: a fresh session that runs the chunks up to
    // this one with capture_queries = W captures the same floats.
    LlamaSession ref(*model_, {.threads = 1});
    for (int p = 0; p <= c; ++p) {
      ASSERT_TRUE(ref.Forward(std::span<const int32_t>(prompt).subspan(p * kChunk, kChunk),
                              {.capture_queries = p == c ? kWindow : 0})
                      .ok());
    }
    const size_t q_layer = static_cast<size_t>(kWindow) * cfg.num_q_heads * cfg.head_dim;
    ASSERT_EQ(ch.window_queries.size(), q_layer * cfg.num_layers);
    for (int l = 0; l < cfg.num_layers; ++l) {
      EXPECT_EQ(std::memcmp(ch.window_queries.data() + l * q_layer,
                            ref.captured_queries()[l].data(), q_layer * sizeof(float)),
                0)
          << "queries layer " << l;
    }
  }
}

TEST_F(DisaggTest, DenseCacheFromRawChunksContinuesLikeThePrefillSession) {
  const std::vector<int32_t> prompt = Prompt(2 * kChunk);
  LlamaSession s(*model_, {.threads = 1});
  auto pre = PrefillChunks(s, prompt, layout_, Opts());
  ASSERT_TRUE(pre.ok()) << pre.status();
  std::vector<RawChunkView> views;
  for (const auto& c : pre->chunks) views.push_back({c.tokens, c.raw});
  auto dense = DenseFromRawChunks(layout_, views);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(dense->next_position, 2 * kChunk);
  LlamaSession d(*model_, {.threads = 1});
  ASSERT_TRUE(d.LoadDense(*dense).ok());
  const std::vector<int32_t> next = {5, 17, 29};
  auto a = s.Forward(next, {.all_logits = true});
  auto b = d.Forward(next, {.all_logits = true});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);  // the same floats in the same order: bit-identical
}

TEST_F(DisaggTest, UncompressedPlanGivesTheDenseLogitsAndHalfRatioMeetsTheBudget) {
  const std::vector<int32_t> prompt = Prompt(2 * kChunk);
  LlamaSession s(*model_, {.threads = 1});
  auto pre = PrefillChunks(s, prompt, layout_, Opts());
  ASSERT_TRUE(pre.ok()) << pre.status();
  for (double p_c : {0.0, 0.5}) {
    kernels::CompressionPlanOptions plan;
    plan.p_c = p_c;
    plan.window = kWindow;
    std::vector<kernels::CompactChunk> chunks;
    for (const auto& c : pre->chunks) {
      auto cc = CompressPrefillChunk(plan, layout_, c, nullptr);
      ASSERT_TRUE(cc.ok()) << cc.status();
      // Every (layer, head) meets 2 M half-pairs, M = llround((1 - p_c) N).
      const int64_t m = std::llround((1 - p_c) * kChunk);
      EXPECT_EQ(cc->HalfPairs(), 2 * m * layout_.num_layers * layout_.num_kv_heads);
      chunks.push_back(std::move(*cc));
    }
    auto compact = CompactFromChunks(chunks, layout_.rope, 2 * kChunk, nullptr);
    ASSERT_TRUE(compact.ok()) << compact.status();
    LlamaSession c(*model_, {.threads = 1});
    ASSERT_TRUE(c.LoadCompact(*compact).ok());
    LlamaSession full(*model_, {.threads = 1});
    ASSERT_TRUE(full.Forward(prompt).ok());
    const std::vector<int32_t> next = {5, 17, 29};
    auto a = full.Forward(next, {.all_logits = true});
    auto b = c.Forward(next, {.all_logits = true});
    ASSERT_TRUE(a.ok() && b.ok());
    double scale = 0, diff = 0;
    for (size_t i = 0; i < a->size(); ++i) {
      scale = std::max(scale, double(std::fabs((*a)[i])));
      diff = std::max(diff, double(std::fabs((*a)[i] - (*b)[i])));
    }
    if (p_c == 0.0) {
      // Every token kept with bias ln 1 = 0: the same attention; only the summation order of the
      // prefill (one Forward per chunk vs one over the prompt) differs, float32 over <= 131 keys
      // and 5 layers: well under 1e-4 of the logits' scale (EngineTest's reorder bound).
      EXPECT_LT(diff / scale, 1e-4);
    } else {
      // Half the tokens gone: the logits move (a plan that kept everything would be a bug).
      EXPECT_GT(diff / scale, 1e-4);
    }
  }
}

TEST_F(DisaggTest, BadInputsGetSpecificErrors) {
  LlamaSession s(*model_, {.threads = 1});
  const std::vector<int32_t> prompt = Prompt(kChunk);
  auto bad_window = PrefillChunks(s, prompt, layout_, {.chunk_tokens = kChunk, .window = 65});
  EXPECT_EQ(bad_window.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_window.status().message().find("window must be in [1, chunk_tokens=64]"),
            std::string::npos)
      << bad_window.status();

  ModelLayout other = layout_;
  other.num_kv_heads = 2;
  other.num_q_heads = 4;
  auto bad_layout = PrefillChunks(s, prompt, other, Opts());
  EXPECT_EQ(bad_layout.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_layout.status().message().find("does not describe the model"), std::string::npos)
      << bad_layout.status();

  ASSERT_TRUE(s.Forward(prompt).ok());
  auto not_empty = PrefillChunks(s, prompt, layout_, Opts());
  EXPECT_EQ(not_empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_empty.status().message().find("needs an empty session"), std::string::npos);

  std::vector<uint8_t> short_raw(layout_.ChunkBytes(kChunk) - 4);
  const RawChunkView view{kChunk, short_raw};
  auto dense = DenseFromRawChunks(layout_, std::span<const RawChunkView>(&view, 1));
  EXPECT_EQ(dense.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dense.status().message().find("chunk 0 has"), std::string::npos) << dense.status();

  auto no_tail = ScoreContinuation(
      *model_, {.threads = 1}, [](LlamaSession&) { return Status::Ok(); }, {},
      std::vector<int32_t>{5}, 1);
  EXPECT_EQ(no_tail.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_tail.status().message().find("at least one prompt token"), std::string::npos);
}

}  // namespace
}  // namespace kvd::llama
