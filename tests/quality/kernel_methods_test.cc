// Kernel methods of the harness on a synthetic prefix (no model): registration, budgets in
// half-pairs, the conversion to the engine's compact cache, VECTOR calibration and its errors.
#include "kernel_methods.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "harness.h"

namespace kvd::quality {
namespace {

constexpr int kLayers = 3, kKvHeads = 2, kQHeads = 4, kDim = 8, kTokens = 96, kWindow = 8;

llama::LlamaConfig Config() {
  llama::LlamaConfig c;
  c.dim = kQHeads * kDim;
  c.hidden_dim = 64;
  c.num_layers = kLayers;
  c.num_q_heads = kQHeads;
  c.num_kv_heads = kKvHeads;
  c.head_dim = kDim;
  c.vocab_size = 32;
  c.context_length = 512;
  c.rope.theta = 10000.0;
  return c;
}

// Random keys; values = a fixed linear map (drawn from `map_seed`) of the de-rotated keys plus
// `noise` (so VECTOR's fit is exact when noise == 0). Keys are rotated here with the engine's
// interleaved RoPE.
PrefixCapture MakePrefix(const llama::LlamaConfig* cfg, uint32_t seed, double noise,
                         uint32_t map_seed = 7) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  PrefixCapture p;
  p.config = cfg;
  p.cache.num_tokens = kTokens;
  p.cache.next_position = kTokens;
  for (int t = 0; t < kTokens; ++t) p.cache.positions.push_back(t);
  p.cache.layers.resize(kLayers);
  std::mt19937 wrng(map_seed);  // same map for every seed
  std::vector<float> w(kDim * kDim);
  for (float& x : w) x = g(wrng) * 0.3f;
  for (int l = 0; l < kLayers; ++l) {
    auto& L = p.cache.layers[l];
    L.k.resize(static_cast<size_t>(kTokens) * kKvHeads * kDim);
    L.v.resize(L.k.size());
    for (int t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kKvHeads; ++h) {
        float kpre[kDim];
        for (float& x : kpre) x = g(rng);
        float* k = &L.k[(static_cast<size_t>(t) * kKvHeads + h) * kDim];
        float* v = &L.v[(static_cast<size_t>(t) * kKvHeads + h) * kDim];
        for (int r = 0; r < kDim; ++r) {
          double s = 0;
          for (int c = 0; c < kDim; ++c) s += w[r * kDim + c] * kpre[c];
          v[r] = static_cast<float>(s + noise * g(rng));
        }
        for (int i = 0; i < kDim / 2; ++i) {
          const double ang = t * std::pow(10000.0, -2.0 * i / kDim);
          const double a = kpre[2 * i], b = kpre[2 * i + 1];
          k[2 * i] = static_cast<float>(a * std::cos(ang) - b * std::sin(ang));
          k[2 * i + 1] = static_cast<float>(a * std::sin(ang) + b * std::cos(ang));
        }
      }
    }
  }
  p.window = kWindow;
  p.window_queries.resize(kLayers);
  for (auto& q : p.window_queries) {
    q.resize(static_cast<size_t>(kWindow) * kQHeads * kDim);
    for (float& x : q) x = g(rng);
  }
  return p;
}

TEST(KernelMethodsTest, EveryKernelMethodIsRegisteredGloballyUnderItsOwnName) {
  const std::vector<std::string> names = MethodRegistry::Global().Names();
  for (const std::string& n : DefaultMethodList()) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
  std::vector<std::string> kernel = KernelMethodNames();
  for (const std::string& n : kernel) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
  std::sort(kernel.begin(), kernel.end());
  EXPECT_EQ(std::adjacent_find(kernel.begin(), kernel.end()), kernel.end());
  // The harness defaults (a subset sized to fit 20 minutes on 2 cores) and the quick preset name
  // registered methods only.
  for (const auto& list : {HarnessOptions{}.methods, HarnessOptions::Quick().methods}) {
    for (const std::string& n : list) {
      EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
    }
  }
}

TEST(KernelMethodsTest, RegisteringTwiceIsAlreadyExists) {
  MethodRegistry r;
  ASSERT_TRUE(RegisterKernelMethods(&r).ok());
  Status s = RegisterKernelMethods(&r);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("snapkv"), std::string::npos) << s;
}

TEST(KernelMethodsTest, UnknownNameIsNotFound) {
  auto m = CreateKernelMethod("snapkv+magic");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("snapkv+magic"), std::string::npos);
}

TEST(KernelMethodsTest, EveryMethodMeetsTheHalfPairBudgetAndKeepsPositions) {
  const llama::LlamaConfig cfg = Config();
  const PrefixCapture p = MakePrefix(&cfg, 1, 0.05);
  const PrefixCapture calib = MakePrefix(&cfg, 2, 0.05);
  for (const std::string& name : KernelMethodNames()) {
    auto m = CreateKernelMethod(name);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE((*m)->Calibrate({calib}).ok()) << name;
    for (double p_c : {0.5, 0.75}) {
      auto c = (*m)->Compress(p, p_c);
      ASSERT_TRUE(c.ok()) << name << " " << p_c << ": " << c.status();
      ASSERT_TRUE(c->cache.Validate(kLayers, kKvHeads, kDim).ok()) << name;
      EXPECT_EQ(c->cache.next_position, kTokens) << name;
      const double m_pairs = std::llround((1 - p_c) * kTokens);
      // The stored fraction is exact in half-pairs (2M per head): a ratio of integer counts,
      // so only one float64 division rounds (2^-53 relative); 1e-12 is far below one half-pair.
      EXPECT_NEAR(c->stored_fraction, m_pairs / kTokens, 1e-12) << name << " " << p_c;
      // Encoded bytes over raw bfloat16 bytes: a bfloat16 chunk is the kept rows plus its header,
      // metadata and checksum (a few percent of this small chunk); VECTOR stores fewer values
      // than keys within the same half-pairs; the quantize stage stores less than the rows'
      // bfloat16 bytes, except with a recent window that holds every slot of this prefix.
      EXPECT_LT(c->stored_bytes_fraction, m_pairs / kTokens + 0.05) << name << " " << p_c;
      const bool quantized =
          name.find("int") != std::string::npos || name.find("fp8") != std::string::npos;
      if (!quantized) {
        EXPECT_GT(c->stored_bytes_fraction, m_pairs / kTokens) << name << " " << p_c;
      } else if (name.find("recent") == std::string::npos) {
        EXPECT_LT(c->stored_bytes_fraction, m_pairs / kTokens) << name << " " << p_c;
      }
      int64_t slots = 0;
      bool merged = false;
      for (const auto& layer : c->cache.layers) {
        for (const auto& h : layer) {
          slots += h.num_slots;
          for (float b : h.bias) merged |= b > 0.0f;
        }
      }
      const bool hybrid = name.rfind("hybrid", 0) == 0;  // hybrid, hybrid_ea, hybrid_ea_mean
      const bool vector = name.find("vector") != std::string::npos || hybrid;
      const int64_t budget = static_cast<int64_t>(m_pairs) * kLayers * kKvHeads;
      if (name.find("adaptive") != std::string::npos) {
        // Routes only where its weighted residual is small: at least the budget's keys.
        EXPECT_GE(slots, budget) << name;
      } else if (vector) {
        EXPECT_GT(slots, budget) << name << ": VECTOR keeps more keys than pairs";
      } else {
        EXPECT_EQ(slots, budget) << name;
      }
      // Only the merging methods produce slots with l > 1 (bias ln l > 0); the error-aware
      // hybrids and the gated methods merge only where their estimate or gate allows (they may
      // merge nothing).
      const bool merging = name.find("kvslimmer") == 0 || hybrid;
      const bool conditional =
          name.rfind("hybrid_ea", 0) == 0 || name.find("gated") != std::string::npos;
      if (!merging) {
        EXPECT_FALSE(merged) << name;
      } else if (!conditional) {
        EXPECT_TRUE(merged) << name;
      }
    }
  }
}

TEST(KernelMethodsTest, VectorWithoutCalibrationIsFailedPrecondition) {
  const llama::LlamaConfig cfg = Config();
  auto m = CreateKernelMethod("snapkv+vector");
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE((*m)->NeedsCalibration());
  auto c = (*m)->Compress(MakePrefix(&cfg, 1, 0.0), 0.5);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("Calibrate"), std::string::npos) << c.status();
  Status s = (*m)->Calibrate({});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
}

TEST(KernelMethodsTest, CalibrationR2IsPerLayerAndExactOnALinearMap) {
  const llama::LlamaConfig cfg = Config();
  auto m = CreateKernelMethod("hybrid");
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE((*m)->Calibrate({MakePrefix(&cfg, 3, 0.0)}).ok());
  const std::vector<double> r2 = (*m)->CalibrationR2();
  ASSERT_EQ(r2.size(), static_cast<size_t>(kLayers));
  // v = W kpre exactly, so 1 - R^2 is rounding only: the float32 RoPE round trip (~1e-6 of |k|)
  // squared relative to the variance, plus the ridge's shrinkage (~1e-6 relative): 1e-6 as in
  // the kernels' test of the same fit (tests/kernels/plan_test.cc); a wrong de-rotation costs
  // far more.
  for (double r : r2) EXPECT_GT(r, 1.0 - 1e-6);
  // The rebuilt values of "rebuild me" slots then equal the true values: same cache as the
  // same plan's stored values would give, so the output is finite and the budget exact.
  auto c = (*m)->Compress(MakePrefix(&cfg, 4, 0.0), 0.75);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->stored_fraction, 0.25, 1e-12);

  auto noisy = CreateKernelMethod("snapkv+vector");
  ASSERT_TRUE((*noisy)->Calibrate({MakePrefix(&cfg, 3, 1.0)}).ok());
  for (double r : (*noisy)->CalibrationR2()) EXPECT_LT(r, 0.9);
  EXPECT_TRUE(CreateKernelMethod("snapkv").value()->CalibrationR2().empty());
}

// Smallest max-abs distance from each served value row to any true value row of the same
// (layer, head): 0 when every value is a token's own (stored or exactly rebuilt).
double WorstValueMismatch(const PrefixCapture& p, const CompressedPrefix& c) {
  double worst = 0.0;
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kKvHeads; ++h) {
      const llama::CompactHeadKv& hk = c.cache.layers[l][h];
      for (int j = 0; j < hk.num_slots; ++j) {
        double best = 1e300;
        for (int t = 0; t < kTokens; ++t) {
          double dist = 0.0;
          for (int r = 0; r < kDim; ++r) {
            const float want =
                p.cache.layers[l].v[(static_cast<size_t>(t) * kKvHeads + h) * kDim + r];
            dist = std::max(dist, std::abs(double(hk.v[j * kDim + r]) - want));
          }
          best = std::min(best, dist);
        }
        worst = std::max(worst, best);
      }
    }
  }
  return worst;
}

// Online calibration fits W on the served document (here: values from another map than the
// calibration texts'): its rebuilt values are the tokens' own, the fixed calibration's are not.
TEST(KernelMethodsTest, OnlineCalibrationFitsTheServedDocument) {
  const llama::LlamaConfig cfg = Config();
  const PrefixCapture served = MakePrefix(&cfg, 5, 0.0, /*map_seed=*/99);
  auto online = CreateKernelMethod("snapkv+vector_online");
  ASSERT_TRUE(online.ok());
  EXPECT_FALSE((*online)->NeedsCalibration());
  auto fixed = CreateKernelMethod("snapkv+vector");
  ASSERT_TRUE((*fixed)->Calibrate({MakePrefix(&cfg, 3, 0.0)}).ok());
  auto co = (*online)->Compress(served, 0.75);
  auto cf = (*fixed)->Compress(served, 0.75);
  ASSERT_TRUE(co.ok()) << co.status();
  ASSERT_TRUE(cf.ok()) << cf.status();
  EXPECT_NEAR(co->stored_fraction, 0.25, 1e-12);
  // float32 solve of an exact map, RoPE round trip: ~1e-5 of values ~1.
  EXPECT_LT(WorstValueMismatch(served, *co), 1e-3);
  EXPECT_GT(WorstValueMismatch(served, *cf), 0.1);
}

// Pre-RoPE keys: `offset` (per layer, head and channel, drawn from `seed`) plus `noise`, rotated
// at their positions with the engine's interleaved RoPE; values random.
PrefixCapture MakeOffsetKeysPrefix(const llama::LlamaConfig* cfg, uint32_t seed, float offset,
                                   float noise) {
  PrefixCapture p = MakePrefix(cfg, seed, 0.0);
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kKvHeads; ++h) {
      float base[kDim];
      for (float& x : base) x = offset * g(rng);
      for (int t = 0; t < kTokens; ++t) {
        float* k = &p.cache.layers[l].k[(static_cast<size_t>(t) * kKvHeads + h) * kDim];
        for (int i = 0; i < kDim / 2; ++i) {
          const double ang = t * std::pow(10000.0, -2.0 * i / kDim);
          const double a = base[2 * i] + noise * g(rng), b = base[2 * i + 1] + noise * g(rng);
          k[2 * i] = static_cast<float>(a * std::cos(ang) - b * std::sin(ang));
          k[2 * i + 1] = static_cast<float>(a * std::sin(ang) + b * std::cos(ang));
        }
      }
    }
  }
  return p;
}

// Largest absolute difference between a dense method's served keys and the prefix's keys
// (slot j is token j at p_c 0).
double WorstKeyError(const PrefixCapture& p, const CompressedPrefix& c) {
  double worst = 0.0;
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kKvHeads; ++h) {
      const llama::CompactHeadKv& hk = c.cache.layers[l][h];
      EXPECT_EQ(hk.num_slots, kTokens);
      for (int t = 0; t < std::min(hk.num_slots, kTokens); ++t) {
        for (int r = 0; r < kDim; ++r) {
          const float want =
              p.cache.layers[l].k[(static_cast<size_t>(t) * kKvHeads + h) * kDim + r];
          worst = std::max(worst, std::abs(double(hk.k[t * kDim + r]) - want));
        }
      }
    }
  }
  return worst;
}

// Keys whose pre-RoPE channels hold a stable offset: quantized post-RoPE, each channel's group
// spans the rotation of its pair (about 2 |offset|); de-rotated first (the prerope rows), only the
// noise; and the served keys are post-RoPE again.
TEST(KernelMethodsTest, PreRopeKeysQuantizeTheStableOffsetAway) {
  const llama::LlamaConfig cfg = Config();
  const PrefixCapture p = MakeOffsetKeysPrefix(&cfg, 11, 4.0f, 0.1f);
  for (const auto& [post, pre] : {std::pair{"int4", "int4_prerope"},
                                  std::pair{"int4_kg96_sinks1", "int4_prerope_kg96_sinks1"},
                                  std::pair{"int3k_int2sv_rot_kg37_exactsinks",
                                            "int3k_int2sv_rot_prerope_kg37_exactsinks"}}) {
    auto mpost = CreateKernelMethod(post);
    auto mpre = CreateKernelMethod(pre);
    ASSERT_TRUE(mpost.ok()) << mpost.status();
    ASSERT_TRUE(mpre.ok()) << mpre.status();
    auto cpost = (*mpost)->Compress(p, 0.0);
    auto cpre = (*mpre)->Compress(p, 0.0);
    ASSERT_TRUE(cpost.ok()) << post << ": " << cpost.status();
    ASSERT_TRUE(cpre.ok()) << pre << ": " << cpre.status();
    // The rotation adds no bytes.
    EXPECT_EQ(cpre->stored_bytes_fraction, cpost->stored_bytes_fraction) << pre;
    const double e_post = WorstKeyError(p, *cpost), e_pre = WorstKeyError(p, *cpre);
    // Post-RoPE groups span ~8 (4-bit step ~0.5); pre-RoPE ones ~0.6 (the noise's +-3 sigma),
    // plus the bfloat16 rounding of keys ~4 (2^-8 relative): a quarter is a wide margin.
    EXPECT_LT(e_pre, 0.25 * e_post) << pre << " " << e_pre << " vs " << post << " " << e_post;
  }
}

TEST(KernelMethodsTest, BadRatioIsOutOfRange) {
  const llama::LlamaConfig cfg = Config();
  auto m = CreateKernelMethod("snapkv");
  auto c = (*m)->Compress(MakePrefix(&cfg, 1, 0.0), 1.0);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfRange) << c.status();
}

}  // namespace
}  // namespace kvd::quality
