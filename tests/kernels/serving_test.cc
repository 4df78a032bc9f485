// Serving forms: compact (bias ln l) vs dense expansion vs float64 reference; value rebuild.
#include "kvd/kernels/serving.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RandomMatrix;
using testing::RefMatrix;
using testing::ToRef;

ServingHead RandomServingHead(int64_t s, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ServingHead h;
  h.keys = RandomMatrix(s, d, seed + 1);
  h.values = RandomMatrix(s, d, seed + 2);
  for (int64_t j = 0; j < s; ++j) {
    h.cardinality.push_back(1 + static_cast<int32_t>(rng() % 6));
    h.positions.push_back(j * 3);
    h.bias.push_back(std::log(static_cast<float>(h.cardinality.back())));
  }
  return h;
}

TEST(Serving, CompactBiasAndDenseExpansionGiveTheSameAttention) {
  for (int d : {64, 128}) {
    for (int64_t s : {1, 2, 37, 1000}) {
      ServingHead h = RandomServingHead(s, d, 100 * s + d);
      const int64_t nq = 5;
      Matrix q = RandomMatrix(nq, d, 7 * s + d);
      Matrix compact(nq, d);
      ASSERT_TRUE(
          SlotAttention(q.View(), h.keys.View(), h.values.View(), h.bias, 0.0f, compact.View())
              .ok());
      auto dense = ExpandDense(h);
      ASSERT_TRUE(dense.ok()) << dense.status();
      int64_t t = 0;
      for (int32_t l : h.cardinality) t += l;
      ASSERT_EQ(dense->keys.rows, t);
      Matrix expanded(nq, d);
      ASSERT_TRUE(SlotAttention(q.View(), dense->keys.View(), dense->values.View(), {}, 0.0f,
                                expanded.View())
                      .ok());
      // float64 reference from value SUMS (docs/algorithms.md 1).
      RefMatrix sums = ToRef(h.values.View());
      std::vector<double> card(h.cardinality.begin(), h.cardinality.end());
      for (int64_t j = 0; j < s; ++j)
        for (int c = 0; c < d; ++c) sums.at(j, c) *= card[j];
      RefMatrix keys = ToRef(h.keys.View());
      for (int64_t i = 0; i < nq; ++i) {
        std::vector<double> qi(q.Row(i), q.Row(i) + d);
        std::vector<double> ref = testing::RefCompactAttention(qi, keys, sums, card);
        for (int c = 0; c < d; ++c) {
          // Outputs are softmax-weighted means of N(0, 1) values (|v| < 5), so an absolute
          // tolerance is relative to max|v|. Against float64: each logit is a d-term float32 dot
          // product, off by <= (d + 1) u sum|q_c k_c| / sqrt(d) ~ 1e-5 (worst case, d = 128), which
          // the exp turns into the same relative error of each weight (twice with the softmax
          // sum), plus the float32 sums over <= 1000 slots: ~2.5e-5 max|v| ~ 1e-4 worst case
          // (observed 4.2e-7). Compact and dense differ only in the order of the same sums and
          // the bias ln l vs l copies of a key: each rounding is u times a partial sum of weighted
          // values (|partial| <~ 1), ~sqrt(t) u ~ 4e-6 typical for t ~ 3500 tokens; 1e-5
          // (observed 2.4e-7). A missing ln l bias is off by 1e-1.
          ASSERT_NEAR(compact.Row(i)[c], ref[c], 1e-4) << "s=" << s;
          ASSERT_NEAR(expanded.Row(i)[c], compact.Row(i)[c], 1e-5);
        }
      }
    }
  }
}

TEST(Serving, TwoIdenticalKeysMergeExactly) {
  const int d = 64;
  Matrix k = RandomMatrix(3, d, 5);
  Matrix v = RandomMatrix(3, d, 6);
  std::memcpy(k.Row(2), k.Row(1), d * sizeof(float));  // tokens 1 and 2 share a key
  Matrix q = RandomMatrix(4, d, 8);
  Matrix raw_out(4, d);
  ASSERT_TRUE(SlotAttention(q.View(), k.View(), v.View(), {}, 0.0f, raw_out.View()).ok());
  Matrix mk(2, d), mv(2, d);
  for (int c = 0; c < d; ++c) {
    mk.Row(0)[c] = k.Row(0)[c];
    mk.Row(1)[c] = k.Row(1)[c];
    mv.Row(0)[c] = v.Row(0)[c];
    mv.Row(1)[c] = 0.5f * (v.Row(1)[c] + v.Row(2)[c]);
  }
  std::vector<float> bias = {0.0f, std::log(2.0f)};
  Matrix merged_out(4, d);
  ASSERT_TRUE(SlotAttention(q.View(), mk.View(), mv.View(), bias, 0.0f, merged_out.View()).ok());
  EXPECT_LT(testing::MaxAbsDiff(raw_out.View(), merged_out.View()), 1e-6);
}

// A float32 chunk whose routed slots must be rebuilt as W RoPE^-1(k, pos).
struct RebuildFixture {
  RopeConfig rope_config{.theta = 500000.0, .pairing = RopePairing::kHalves};
  CompactChunk chunk;
  VectorWeights weights;
  Matrix kpre;  // [S, d]
};

RebuildFixture MakeRebuildFixture(int d, int64_t s) {
  RebuildFixture f;
  f.kpre = RandomMatrix(s, d, 1);
  Matrix v = RandomMatrix(s, d, 2);
  f.weights.num_layers = 1;
  f.weights.num_kv_heads = 1;
  f.weights.head_dim = d;
  f.weights.heads.resize(1);
  f.weights.heads[0].w = RandomMatrix(d, d, 3, 1.0f / std::sqrt(float(d)));
  f.weights.version = f.weights.ComputeVersion();
  auto table = RopeTable::Create(f.rope_config, d);
  std::vector<int64_t> pos = testing::RandomIncreasingPositions(s, 4, 10, 50);
  Matrix kpost(s, d);
  EXPECT_TRUE(ApplyRope(*table, RopeDirection::kRotate, pos, f.kpre.View(), kpost.View()).ok());
  CompactChunk& c = f.chunk;
  c.num_layers = 1;
  c.num_kv_heads = 1;
  c.head_dim = d;
  c.dtype = DType::kFloat32;
  c.original_tokens = pos.back() + 1;
  c.codec.route = RouteStage::kVector;
  c.codec.p_c = 0.5;
  c.codec.calibration_version = f.weights.version;
  c.heads.resize(1);
  CompactHead& h = c.heads[0];
  h.positions = pos;
  h.keys.resize(s * d * 4);
  std::memcpy(h.keys.data(), kpost.values.data(), h.keys.size());
  for (int64_t j = 0; j < s; ++j) {
    const bool rebuild = j % 3 == 1;
    h.flags.push_back(rebuild ? kSlotRebuildValue : 0);
    h.cardinality.push_back(1);
    if (!rebuild) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(v.Row(j));
      h.values.insert(h.values.end(), p, p + d * 4);
    }
  }
  return f;
}

TEST(Serving, RebuildsRoutedValuesFromKeys) {
  for (int d : {64, 128}) {
    RebuildFixture f = MakeRebuildFixture(d, 301);
    auto table = RopeTable::Create(f.rope_config, d);
    auto sh = BuildServingHead(f.chunk, 0, 0, &*table, &f.weights);
    ASSERT_TRUE(sh.ok()) << sh.status();
    const Matrix& w = f.weights.heads[0].w;
    for (int64_t j = 1; j < 301; j += 3) {
      for (int r = 0; r < d; ++r) {
        double ref = 0.0, mag = 0.0;
        for (int c = 0; c < d; ++c) {
          ref += double(w.Row(r)[c]) * f.kpre.Row(j)[c];
          mag += std::abs(double(w.Row(r)[c]) * f.kpre.Row(j)[c]);
        }
        // Rotate then de-rotate in float32 (angles reduced in float64): ~1e-6 relative per key
        // element, amplified by the W row's l1 mass.
        ASSERT_NEAR(sh->values.Row(j)[r], ref, 1e-5 * (1.0 + mag)) << "slot " << j;
      }
    }
    // Stored values are passed through untouched.
    EXPECT_EQ(std::memcmp(sh->values.Row(0), f.chunk.heads[0].values.data(), d * 4), 0);
  }
}

TEST(Serving, RebuildNeedsMatchingWeights) {
  RebuildFixture f = MakeRebuildFixture(64, 10);
  auto table = RopeTable::Create(f.rope_config, 64);
  auto missing = BuildServingHead(f.chunk, 0, 0, &*table, nullptr);
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("needs VECTOR weights"));
  VectorWeights other = f.weights;
  other.heads[0].w.values[0] += 1.0f;
  other.version = other.ComputeVersion();
  auto mismatch = BuildServingHead(f.chunk, 0, 0, &*table, &other);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(mismatch.status().message(), HasSubstr("calibration version mismatch"));
  EXPECT_EQ(BuildServingHead(f.chunk, 1, 0, &*table, &f.weights).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Serving, DenseChunkUsesTheEngineLayout) {
  RebuildFixture f = MakeRebuildFixture(64, 12);
  f.chunk.heads[0].cardinality[3] = 2;  // 13 tokens
  auto table = RopeTable::Create(f.rope_config, 64);
  int64_t tokens = 0;
  auto bytes = ExpandDenseChunk(f.chunk, &*table, &f.weights, &tokens);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(tokens, 13);
  ModelLayout layout{.num_layers = 1,
                     .num_kv_heads = 1,
                     .num_q_heads = 1,
                     .head_dim = 64,
                     .dtype = DType::kFloat32};
  EXPECT_EQ(bytes->size(), layout.ChunkBytes(13));
  // Token 4 is the second copy of slot 3: same key bytes.
  EXPECT_EQ(std::memcmp(bytes->data() + 4 * 256, f.chunk.heads[0].keys.data() + 3 * 256, 256), 0);

  // Two heads expanding to different counts cannot share one engine tensor.
  CompactChunk two = f.chunk;
  two.num_kv_heads = 2;
  two.heads.push_back(f.chunk.heads[0]);
  two.heads[1].cardinality[0] = 3;
  auto uneven = ExpandDenseChunk(two, &*table, &f.weights, &tokens);
  EXPECT_EQ(uneven.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(uneven.status().message(), HasSubstr("different token counts"));
}

TEST(Serving, RejectsBadInput) {
  ServingHead h = RandomServingHead(4, 64, 1);
  h.cardinality[2] = 0;
  EXPECT_THAT(ExpandDense(h).status().message(), HasSubstr("cardinality < 1 at slot 2"));
  Matrix q = RandomMatrix(1, 64, 2), out(1, 64);
  h = RandomServingHead(4, 64, 1);
  h.keys.Row(1)[0] = NAN;
  Status s = SlotAttention(q.View(), h.keys.View(), h.values.View(), h.bias, 0.0f, out.View());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("keys"));
}

TEST(ServingCuda, DenseExpansionMatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  for (int64_t s : {1, 77, 4096}) {
    ServingHead h = RandomServingHead(s, 128, s);
    auto c = ExpandDense(h);
    auto g = ExpandDense(h, {.backend = Backend::kCuda});
    ASSERT_TRUE(c.ok() && g.ok()) << g.status();
    EXPECT_EQ(c->keys.values, g->keys.values);
    EXPECT_EQ(c->values.values, g->values.values);
  }
}

}  // namespace
}  // namespace kvd::kernels
