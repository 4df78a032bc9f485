// The forward pass on stories260K (llama2.c): the reference greedy ids, prefill/decode agreement,
// and continuing from external dense and compact caches at the original positions.
#include "kvd/llama/engine.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "kvd/llama/eval.h"
#include "kvd/llama/model.h"
#include "test_models.h"

namespace kvd::llama {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVD_REQUIRE_STORIES();
    auto m = LlamaModel::Load(testing::Stories260KPath());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
  }
  const LlamaConfig& cfg() const { return model_->config(); }

  // A deterministic prompt of n tokens (BOS then ids spread over the vocabulary).
  std::vector<int32_t> Prompt(int n) const {
    std::vector<int32_t> t = {1};
    for (int i = 1; i < n; ++i) t.push_back(3 + (i * 37) % (cfg().vocab_size - 3));
    return t;
  }

  static double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double m = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      m = std::max(m, double(std::fabs(a[i] - b[i])));
    return m;
  }
  // max |a - b| / max |a|: the difference relative to the tensor's scale. Elementwise relative
  // error is meaningless for outputs of long dot products (an element near 0 after cancellation
  // has an arbitrary relative error), so the tensor's largest magnitude is the scale.
  static double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
    double scale = 0;
    for (float x : a) scale = std::max(scale, double(std::fabs(x)));
    return MaxAbsDiff(a, b) / std::max(scale, 1e-30);
  }
  // Tolerance for two computations of the same float32 forward pass that differ only in the
  // shape of their BLAS calls (one-shot vs chunked prefill, batched vs one token at a time).
  // The calls sum the same products in another order (and OpenBLAS picks kernels by shape and
  // by OPENBLAS_CORETYPE), so each dot product of length K may differ by up to about
  // K * u * sum|x_i y_i| with u = 2^-24 ~ 6e-8. In stories260K the longest accumulation is
  // K ~ 300 (attention over 300 positions; dim 64, hidden 172) and the error passes through
  // 5 layers whose RMSNorm keeps the scale, so the bound relative to the tensor's largest
  // magnitude is about 5 * 300 * 6e-8 ~ 1e-4. Observed differences are ~1e-6; a real bug
  // (a wrong position, a dropped token) gives O(1e-1) and more.
  static constexpr double kReorderTol = 1e-4;

  std::unique_ptr<LlamaModel> model_;
};

// Reference ids from an independent numpy implementation of llama2.c's run.c, greedy from BOS.
TEST_F(EngineTest, GreedyFromBosMatchesReference) {
  const std::vector<int32_t> want = {461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435, 299,
                                     362, 409, 283, 264, 283, 452, 288, 13,  431, 431, 431, 431,
                                     431, 431, 431, 431, 431, 431, 431, 431, 431, 293, 430, 417,
                                     363, 416, 315, 342, 418, 424, 400, 442, 402, 303, 266, 299};
  LlamaSession s(*model_);
  const std::vector<int32_t> bos = {1};
  auto r = GenerateGreedy(s, bos, 48);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, want);
  EXPECT_EQ(s.position(), 48);  // BOS + 47 fed back
}

TEST_F(EngineTest, PrefillThenDecodeEqualsTokenByToken) {
  const std::vector<int32_t> p = Prompt(40);
  LlamaSession batched(*model_);
  auto all = batched.Forward(p, {.all_logits = true});
  ASSERT_TRUE(all.ok());
  LlamaSession stepwise(*model_);
  const int V = cfg().vocab_size;
  for (size_t t = 0; t < p.size(); ++t) {
    auto one = stepwise.Forward(std::span<const int32_t>(&p[t], 1));
    ASSERT_TRUE(one.ok());
    std::vector<float> row(all->begin() + t * V, all->begin() + (t + 1) * V);
    EXPECT_LT(MaxRelDiff(*one, row), kReorderTol) << "token " << t;
    EXPECT_EQ(Argmax(*one), Argmax(row));
  }
  // Then both decode the same continuation.
  std::vector<int32_t> next = {Argmax(std::span<const float>(all->data() + (p.size() - 1) * V, V))};
  auto a = batched.Forward(next);
  auto b = stepwise.Forward(next);
  EXPECT_LT(MaxRelDiff(*a, *b), kReorderTol);
  // Caches agree too.
  for (int l = 0; l < cfg().num_layers; ++l) {
    EXPECT_LT(MaxRelDiff(batched.LayerKeys(l), stepwise.LayerKeys(l)), kReorderTol);
    EXPECT_LT(MaxRelDiff(batched.LayerValues(l), stepwise.LayerValues(l)), kReorderTol);
  }
}

TEST_F(EngineTest, ChunkedPrefillEqualsOneShot) {
  // 300 tokens in one call (two 256-row attention blocks) against 3 calls of 100 (cache reuse).
  const std::vector<int32_t> p = Prompt(300);
  LlamaSession one(*model_), chunked(*model_);
  auto a = one.Forward(p, {.all_logits = true});
  ASSERT_TRUE(a.ok());
  const int V = cfg().vocab_size;
  for (int c = 0; c < 3; ++c) {
    auto b =
        chunked.Forward(std::span<const int32_t>(p.data() + 100 * c, 100), {.all_logits = true});
    ASSERT_TRUE(b.ok());
    std::vector<float> rows(a->begin() + size_t(100) * c * V,
                            a->begin() + size_t(100) * (c + 1) * V);
    EXPECT_LT(MaxRelDiff(*b, rows), kReorderTol) << "chunk " << c;
  }
  EXPECT_LT(MaxRelDiff(one.LayerKeys(4), chunked.LayerKeys(4)), kReorderTol);
}

TEST_F(EngineTest, CacheShapesAndCapturedQueries) {
  const std::vector<int32_t> p = Prompt(20);
  LlamaSession s(*model_);
  ASSERT_TRUE(s.Forward(p, {.capture_queries = 6}).ok());
  const int nkv = cfg().num_kv_heads, d = cfg().head_dim, nq = cfg().num_q_heads;
  EXPECT_EQ(s.position(), 20);
  EXPECT_EQ(s.LayerKeys(0).size(), size_t(20) * nkv * d);
  ASSERT_EQ(s.captured_queries().size(), size_t(cfg().num_layers));
  EXPECT_EQ(s.captured_query_count(), 6);
  EXPECT_EQ(s.captured_queries()[2].size(), size_t(6) * nq * d);
  // The queries of the last 6 tokens, one at a time, equal the captured window.
  LlamaSession t(*model_);
  ASSERT_TRUE(t.Forward(std::span<const int32_t>(p.data(), 14)).ok());
  std::vector<float> q_layer2;
  for (int i = 14; i < 20; ++i) {
    ASSERT_TRUE(t.Forward(std::span<const int32_t>(&p[i], 1), {.capture_queries = 1}).ok());
    q_layer2.insert(q_layer2.end(), t.captured_queries()[2].begin(), t.captured_queries()[2].end());
  }
  EXPECT_LT(MaxRelDiff(q_layer2, s.captured_queries()[2]), kReorderTol);
  auto dense = s.ExportDense();
  ASSERT_TRUE(dense.ok());
  EXPECT_EQ(dense->num_tokens, 20);
  EXPECT_EQ(dense->positions.back(), 19);
  EXPECT_EQ(dense->next_position, 20);
}

TEST_F(EngineTest, DenseExternalCacheGivesIdenticalLogits) {
  const std::vector<int32_t> p = Prompt(30);
  LlamaSession own(*model_);
  ASSERT_TRUE(own.Forward(p).ok());
  auto cache = own.ExportDense();
  ASSERT_TRUE(cache.ok());
  LlamaSession ext(*model_);
  ASSERT_TRUE(ext.LoadDense(*cache).ok());
  EXPECT_EQ(ext.position(), 30);
  const std::vector<int32_t> next = {77, 99, 123};
  for (int32_t tok : next) {
    auto a = own.Forward(std::span<const int32_t>(&tok, 1));
    auto b = ext.Forward(std::span<const int32_t>(&tok, 1));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);  // same entries, same code path: bit-identical
  }
}

// Builds a compact cache holding exactly the dense entries with l = 1 (bias 0).
CompactKvCache CompactFromDense(const DenseKvCache& c, int nkv, int d) {
  CompactKvCache out;
  out.next_position = c.next_position;
  out.layers.resize(c.layers.size());
  for (size_t l = 0; l < c.layers.size(); ++l) {
    out.layers[l].resize(nkv);
    for (int h = 0; h < nkv; ++h) {
      CompactHeadKv& hk = out.layers[l][h];
      hk.num_slots = c.num_tokens;
      for (int t = 0; t < c.num_tokens; ++t) {
        const float* k = &c.layers[l].k[(size_t(t) * nkv + h) * d];
        const float* v = &c.layers[l].v[(size_t(t) * nkv + h) * d];
        hk.k.insert(hk.k.end(), k, k + d);
        hk.v.insert(hk.v.end(), v, v + d);
        hk.bias.push_back(0.0f);
      }
    }
  }
  return out;
}

TEST_F(EngineTest, CompactCacheWithUnitCardinalityEqualsDense) {
  const std::vector<int32_t> p = Prompt(25);
  LlamaSession own(*model_);
  ASSERT_TRUE(own.Forward(p).ok());
  auto dense = own.ExportDense();
  ASSERT_TRUE(dense.ok());
  LlamaSession compact(*model_);
  ASSERT_TRUE(
      compact.LoadCompact(CompactFromDense(*dense, cfg().num_kv_heads, cfg().head_dim)).ok());
  EXPECT_FALSE(compact.is_dense());
  EXPECT_EQ(compact.ExportDense().status().code(), StatusCode::kFailedPrecondition);
  for (int32_t tok : {5, 300, 41}) {
    auto a = own.Forward(std::span<const int32_t>(&tok, 1));
    auto b = compact.Forward(std::span<const int32_t>(&tok, 1));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
  }
  // A multi-token (prefill path) continuation agrees as well.
  const std::vector<int32_t> more = Prompt(12);
  auto a = own.Forward(more);
  auto b = compact.Forward(more);
  EXPECT_EQ(*a, *b);
}

TEST_F(EngineTest, MergingTwoIdenticalKeysWithLogCardinalityBiasIsExact) {
  // Cache A: the prompt's entries with entry j duplicated in every (layer, head), l = 1 each.
  // Cache B: the same without the duplicate, slot j carrying bias ln 2 (l_j = 2, mean value =
  // the value itself). Attention over A and B is mathematically identical (docs/algorithms.md 1).
  const std::vector<int32_t> p = Prompt(18);
  LlamaSession own(*model_);
  ASSERT_TRUE(own.Forward(p).ok());
  auto dense = own.ExportDense();
  ASSERT_TRUE(dense.ok());
  const int nkv = cfg().num_kv_heads, d = cfg().head_dim, j = 7;
  CompactKvCache dup = CompactFromDense(*dense, nkv, d);
  CompactKvCache merged = dup;
  for (auto& layer : dup.layers) {
    for (auto& hk : layer) {
      std::vector<float> k(hk.k.begin() + j * d, hk.k.begin() + (j + 1) * d);
      std::vector<float> v(hk.v.begin() + j * d, hk.v.begin() + (j + 1) * d);
      hk.k.insert(hk.k.begin() + (j + 1) * d, k.begin(), k.end());
      hk.v.insert(hk.v.begin() + (j + 1) * d, v.begin(), v.end());
      hk.bias.insert(hk.bias.begin() + j + 1, 0.0f);
      ++hk.num_slots;
    }
  }
  for (auto& layer : merged.layers) {
    for (auto& hk : layer) hk.bias[j] = std::log(2.0f);
  }
  LlamaSession a(*model_), b(*model_), plain(*model_);
  ASSERT_TRUE(a.LoadCompact(dup).ok());
  ASSERT_TRUE(b.LoadCompact(merged).ok());
  ASSERT_TRUE(plain.LoadDense(*dense).ok());
  EXPECT_EQ(a.num_slots(0, 0), 19);
  EXPECT_EQ(b.num_slots(0, 0), 18);
  for (int32_t tok : {9, 250, 480}) {
    auto la = a.Forward(std::span<const int32_t>(&tok, 1));
    auto lb = b.Forward(std::span<const int32_t>(&tok, 1));
    auto lp = plain.Forward(std::span<const int32_t>(&tok, 1));
    ASSERT_TRUE(la.ok() && lb.ok() && lp.ok());
    EXPECT_LT(MaxRelDiff(*la, *lb), kReorderTol);
    // The duplicate does change attention: the check above is not vacuous.
    EXPECT_GT(MaxAbsDiff(*la, *lp), 1e-3);
  }
}

TEST_F(EngineTest, DenseExpansionOfAMergedSlotEqualsTheBiasedCompactForm) {
  // docs/algorithms.md 1: a slot with l = 2 served as two identical dense entries (same key, mean
  // value, repeated position) attends exactly like one compact slot with bias ln 2.
  const std::vector<int32_t> p = Prompt(16);
  LlamaSession own(*model_);
  ASSERT_TRUE(own.Forward(p).ok());
  auto dense = own.ExportDense();
  ASSERT_TRUE(dense.ok());
  const int nkv = cfg().num_kv_heads, d = cfg().head_dim, j = 5;
  const size_t row = size_t(nkv) * d;
  DenseKvCache expanded = *dense;
  expanded.num_tokens += 1;
  expanded.positions.insert(expanded.positions.begin() + j + 1, expanded.positions[j]);
  for (auto& layer : expanded.layers) {
    std::vector<float> k(layer.k.begin() + j * row, layer.k.begin() + (j + 1) * row);
    std::vector<float> v(layer.v.begin() + j * row, layer.v.begin() + (j + 1) * row);
    layer.k.insert(layer.k.begin() + (j + 1) * row, k.begin(), k.end());
    layer.v.insert(layer.v.begin() + (j + 1) * row, v.begin(), v.end());
  }
  CompactKvCache merged = CompactFromDense(*dense, nkv, d);
  for (auto& layer : merged.layers) {
    for (auto& hk : layer) hk.bias[j] = std::log(2.0f);
  }
  LlamaSession a(*model_), b(*model_);
  ASSERT_TRUE(a.LoadDense(expanded).ok());
  ASSERT_TRUE(b.LoadCompact(merged).ok());
  EXPECT_TRUE(a.is_dense());
  EXPECT_EQ(a.position(), 16);
  for (int32_t tok : {3, 200}) {
    auto la = a.Forward(std::span<const int32_t>(&tok, 1));
    auto lb = b.Forward(std::span<const int32_t>(&tok, 1));
    ASSERT_TRUE(la.ok() && lb.ok());
    EXPECT_LT(MaxRelDiff(*la, *lb), kReorderTol);
  }
  // Decreasing positions are still rejected.
  DenseKvCache bad = *dense;
  std::swap(bad.positions[2], bad.positions[3]);
  Status st = a.LoadDense(bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("non-decreasing"), std::string::npos);
}

TEST_F(EngineTest, ContinuesAtOriginalPositionsAfterEviction) {
  // Drop the middle third of a dense cache: the next token must still sit at position N, which
  // a session re-prefilled with only the kept tokens (positions renumbered) would not reproduce.
  const std::vector<int32_t> p = Prompt(30);
  LlamaSession own(*model_);
  ASSERT_TRUE(own.Forward(p).ok());
  auto dense = own.ExportDense();
  ASSERT_TRUE(dense.ok());
  CompactKvCache c = CompactFromDense(*dense, cfg().num_kv_heads, cfg().head_dim);
  const int d = cfg().head_dim;
  for (auto& layer : c.layers) {
    for (auto& hk : layer) {
      hk.k.erase(hk.k.begin() + 10 * d, hk.k.begin() + 20 * d);
      hk.v.erase(hk.v.begin() + 10 * d, hk.v.begin() + 20 * d);
      hk.bias.erase(hk.bias.begin() + 10, hk.bias.begin() + 20);
      hk.num_slots -= 10;
    }
  }
  LlamaSession s(*model_);
  ASSERT_TRUE(s.LoadCompact(c).ok());
  EXPECT_EQ(s.position(), 30);
  EXPECT_EQ(s.num_slots(3, 1), 20);
  const int32_t tok = 17;
  ASSERT_TRUE(s.Forward(std::span<const int32_t>(&tok, 1)).ok());
  EXPECT_EQ(s.position(), 31);
  EXPECT_EQ(s.num_slots(3, 1), 21);
}

TEST_F(EngineTest, PromptLongerThanContextIsOutOfRange) {
  LlamaSession s(*model_);
  const std::vector<int32_t> p = Prompt(cfg().context_length + 1);
  auto r = s.Forward(p);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("exceed the model's context length 512"), std::string::npos)
      << r.status();
  EXPECT_EQ(s.position(), 0);  // unchanged
  // Filling exactly to the context works; one more token does not.
  const std::vector<int32_t> full = Prompt(cfg().context_length);
  ASSERT_TRUE(s.Forward(full).ok());
  const int32_t tok = 5;
  EXPECT_EQ(s.Forward(std::span<const int32_t>(&tok, 1)).status().code(), StatusCode::kOutOfRange);
}

TEST_F(EngineTest, RejectsBadTokensAndCaches) {
  LlamaSession s(*model_);
  const std::vector<int32_t> bad = {1, 512};
  auto r = s.Forward(bad);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("outside the vocabulary"), std::string::npos);
  EXPECT_EQ(s.Forward(std::vector<int32_t>{}).status().code(), StatusCode::kInvalidArgument);

  DenseKvCache wrong;
  wrong.num_tokens = 2;
  wrong.positions = {0, 1};
  wrong.next_position = 2;
  wrong.layers.resize(cfg().num_layers);  // empty K/V
  Status st = s.LoadDense(wrong);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expected"), std::string::npos);

  CompactKvCache far;
  far.next_position = 100000;
  far.layers.assign(cfg().num_layers, std::vector<CompactHeadKv>(cfg().num_kv_heads));
  EXPECT_EQ(s.LoadCompact(far).code(), StatusCode::kOutOfRange);
  CompactKvCache nan = far;
  nan.next_position = 4;
  nan.layers[0][0] = {
      1, std::vector<float>(cfg().head_dim), std::vector<float>(cfg().head_dim), {NAN}};
  EXPECT_EQ(s.LoadCompact(nan).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvd::llama
