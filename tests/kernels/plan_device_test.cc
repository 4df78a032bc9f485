// Device-resident plan (plan_device.h). Without a device: the budgets equal the CPU plan's slot
// counts for every supported composition, unsupported options and bad input get their specific
// errors before any device is touched. With a device (DevicePlanCuda*, run by
// tests/gpu/run_device_checks.sh): the device plan's chunk against the CPU plan's on the same
// chunk, selection and copied K/V bit for bit, scores and routing within float32 bounds.
#include "kvd/kernels/plan_device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvd/kernels/convert.h"
#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/scorers.h"
#include "kvd/kernels/snapkv.h"
#include "raw_layer.h"
#include "reference.h"

#if KVD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kFirstPosition = 1000;

// A chunk of random K/V and window queries in the engine layout (model dtype), the per-head
// float32 queries the CPU plan takes, and VECTOR weights calibrated on the chunk itself.
struct DeviceFixture {
  ModelLayout layout;
  int64_t n = 0;
  int64_t window = 0;
  std::vector<int64_t> positions;
  std::vector<uint8_t> raw;
  std::vector<uint8_t> query_bytes;  // [L, W, Hq, d]
  std::vector<Matrix> queries;       // [L*H] of [W*G, d]
  std::vector<ConstMatrixView> query_views;
  VectorWeights weights;         // linear: v = W kpre
  VectorWeights affine_weights;  // affine: v = W kpre + b

  CompressionInput CpuInput(bool with_queries) const {
    CompressionInput in;
    in.raw = raw;
    in.positions = positions;
    if (with_queries) in.window_queries = query_views;
    in.weights = &weights;
    return in;
  }
  size_t LayerQueryBytes() const {
    return static_cast<size_t>(window * layout.num_q_heads * layout.head_dim) *
           DTypeSize(layout.dtype);
  }
};

DeviceFixture MakeFixture(int64_t n, int d, int group, int64_t window, uint64_t seed,
                          DType dtype = DType::kBFloat16) {
  DeviceFixture f;
  f.layout = {
      .num_layers = 2, .num_kv_heads = 2, .num_q_heads = 2 * group, .head_dim = d, .dtype = dtype};
  f.layout.rope.theta = 10000.0;
  f.n = n;
  f.window = window;
  f.positions = testing::SequentialPositions(n, kFirstPosition);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto fill = [&](std::vector<uint8_t>* bytes, size_t elements) {
    std::vector<float> x(elements);
    for (float& v : x) v = normal(rng);
    bytes->assign(elements * DTypeSize(dtype), 0);
    ConvertFromFloat(dtype, x.data(), bytes->data(), elements);
  };
  fill(&f.raw, f.layout.ChunkBytes(static_cast<int>(n)) / DTypeSize(dtype));
  fill(&f.query_bytes, f.LayerQueryBytes() * f.layout.num_layers / DTypeSize(dtype));
  for (int l = 0; l < f.layout.num_layers; ++l) {
    auto q = GatherWindowQueries(f.layout, f.query_bytes.data() + l * f.LayerQueryBytes(), window);
    EXPECT_TRUE(q.ok()) << q.status();
    for (Matrix& m : *q) f.queries.push_back(std::move(m));
  }
  for (const Matrix& q : f.queries) f.query_views.push_back(q.View());
  auto w = testing::CalibrateOnChunk(f.layout, f.raw, f.positions);
  EXPECT_TRUE(w.ok()) << w.status();
  f.weights = std::move(*w);
  auto a = testing::CalibrateOnChunk(f.layout, f.raw, f.positions, {.affine = true});
  EXPECT_TRUE(a.ok()) << a.status();
  f.affine_weights = std::move(*a);
  return f;
}

struct DeviceComposition {
  const char* name;
  ScoreStage score;
  bool queries;               // window queries given
  int64_t keydiff_block = 0;  // KeyDiff: 0 = one-shot
  MergeStage merge = MergeStage::kNone;
};

const DeviceComposition kDeviceCompositions[] = {
    {"snapkv", ScoreStage::kSnapKv, true},
    {"pyramidkv", ScoreStage::kPyramidKv, true},
    {"recency", ScoreStage::kNone, false},
    {"recency+window", ScoreStage::kNone, true},
    {"keydiff", ScoreStage::kKeyDiff, false},
    {"keydiff+window", ScoreStage::kKeyDiff, true},
    {"keydiff block 64", ScoreStage::kKeyDiff, false, 64},
    {"keydiff block 100+window", ScoreStage::kKeyDiff, true, 100},
    {"snapkv+kvslimmer", ScoreStage::kSnapKv, true, 0, MergeStage::kKvSlimmer},
    {"keydiff+kvslimmer", ScoreStage::kKeyDiff, false, 0, MergeStage::kKvSlimmer},
    {"keydiff+kvslimmer+window", ScoreStage::kKeyDiff, true, 0, MergeStage::kKvSlimmer},
};

CompressionPlanOptions Options(const DeviceComposition& c, RouteStage route, double p_c,
                               int64_t window) {
  return {.score = c.score,
          .merge = c.merge,
          .route = route,
          .p_c = p_c,
          .window = window,
          .keydiff_block = c.keydiff_block};
}

std::string Name(const DeviceComposition& c, RouteStage route, double p_c) {
  return std::string(c.name) + (route == RouteStage::kVector ? "+vector" : "") +
         " p_c=" + std::to_string(p_c);
}

TEST(DevicePlan, UnsupportedOptionsAreNamed) {
  const struct {
    CompressionPlanOptions o;
    const char* message;
  } cases[] = {
      {{.score = ScoreStage::kNone, .merge = MergeStage::kKvSlimmer},
       "merge kKvSlimmer without a score stage (KVSlimmer's pairwise rounds) is not implemented"},
      {{.score = ScoreStage::kSnapKv,
        .merge = MergeStage::kKvSlimmer,
        .route = RouteStage::kVector},
       "route kVector after merge kKvSlimmer is not implemented on the device"},
      {{.score = ScoreStage::kSnapKv, .merge = MergeStage::kKvSlimmer, .hybrid_error_aware = true},
       "hybrid_error_aware is not implemented on the device"},
      {{.score = ScoreStage::kKeyDiff, .merge = MergeStage::kKvSlimmer, .merge_gate = true},
       "merge_gate is not implemented on the device"},
      {{.score = ScoreStage::kSnapKv, .head_budget = HeadBudget::kAdaptive},
       "head_budget kAdaptive is not implemented on the device"},
      {{.route = RouteStage::kVector, .route_adaptive = true},
       "route_adaptive is not implemented on the device"},
  };
  for (const auto& c : cases) {
    Status s = CheckDevicePlanSupported(c.o);
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_EQ(DevicePlan::Create(c.o, MakeFixture(64, 32, 2, 8, 1).layout).status().code(),
              StatusCode::kUnimplemented);
  }
  // Invalid options report Validate's error, not "unsupported".
  Status bad = CheckDevicePlanSupported({.p_c = 1.0});
  EXPECT_EQ(bad.code(), StatusCode::kOutOfRange) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("p_c must be in [0, 1)"));
  EXPECT_TRUE(CheckDevicePlanSupported({}).ok());
  // KeyDiff (kvd's default policy), one-shot and block-wise, with and without routing.
  for (int64_t block : {0, 128}) {
    for (RouteStage route : {RouteStage::kNone, RouteStage::kVector}) {
      const CompressionPlanOptions keydiff{
          .score = ScoreStage::kKeyDiff, .route = route, .keydiff_block = block};
      EXPECT_TRUE(CheckDevicePlanSupported(keydiff).ok()) << block;
    }
#if KVD_HAVE_CUDA
    if (!CudaDeviceAvailable()) {  // accepted up to the device check
      auto plan = DevicePlan::Create({.score = ScoreStage::kKeyDiff, .keydiff_block = block},
                                     MakeFixture(64, 32, 2, 8, 1).layout);
      EXPECT_EQ(plan.status().code(), StatusCode::kUnavailable) << plan.status();
    }
#endif
  }
  // The hybrid (a score stage, then merge kKvSlimmer) with its group options.
  for (ScoreStage score : {ScoreStage::kSnapKv, ScoreStage::kPyramidKv, ScoreStage::kKeyDiff}) {
    const CompressionPlanOptions hybrid{.score = score,
                                        .merge = MergeStage::kKvSlimmer,
                                        .position = RepresentativePosition::kWeighted,
                                        .hybrid_max_group = 8,
                                        .hybrid_min_cos = 0.3,
                                        .merge_guard = MergeGuard::kMean};
    EXPECT_TRUE(CheckDevicePlanSupported(hybrid).ok()) << ScoreStageName(score);
  }
}

TEST(DevicePlan, BudgetsAreTheCpuPlansSlotCounts) {
  for (int64_t n : {48, 301}) {
    const DeviceFixture f = MakeFixture(n, 32, 2, 8, 7);
    for (const DeviceComposition& c : kDeviceCompositions) {
      for (RouteStage route : {RouteStage::kNone, RouteStage::kVector}) {
        for (double p_c : {0.0, 0.5, 0.75, 0.9}) {
          SCOPED_TRACE(Name(c, route, p_c) + " n=" + std::to_string(n));
          const CompressionPlanOptions o = Options(c, route, p_c, f.window);
          CompressionStats cpu_stats;
          auto cpu = Compress(o, f.layout, f.CpuInput(c.queries), &cpu_stats);
          auto budget = ComputeDevicePlanBudget(o, f.layout.num_layers, n, c.queries,
                                                route == RouteStage::kVector);
          if (c.merge != MergeStage::kNone && route == RouteStage::kVector) {
            EXPECT_EQ(budget.status().code(), StatusCode::kUnimplemented) << budget.status();
            continue;
          }
          ASSERT_EQ(cpu.ok(), budget.ok()) << cpu.status() << " vs " << budget.status();
          if (!cpu.ok()) {
            EXPECT_EQ(cpu.status().code(), budget.status().code());
            continue;
          }
          EXPECT_EQ(budget->window, c.queries ? f.window : 0);
          int64_t slots = 0, rebuild = 0, reductions = 0;
          for (int l = 0; l < f.layout.num_layers; ++l) {
            for (int h = 0; h < f.layout.num_kv_heads; ++h) {
              const CompactHead& head = cpu->Head(l, h);
              EXPECT_EQ(head.slots(), budget->slots[l]) << "layer " << l;
              EXPECT_EQ(head.slots() - head.value_slots(), budget->rebuild_slots[l]);
              EXPECT_EQ(head.slots() + head.value_slots(), 2 * budget->kept_pairs[l]);
              slots += budget->slots[l];
              rebuild += budget->rebuild_slots[l];
              reductions += budget->reduced[l];
            }
          }
          EXPECT_EQ(slots, cpu_stats.slots);
          EXPECT_EQ(rebuild, cpu_stats.rebuild_slots);
          EXPECT_EQ(reductions, cpu_stats.route_reductions);
        }
      }
    }
  }
}

TEST(DevicePlan, BudgetErrorsAreTheCpuPlans) {
  // N smaller than sinks + window.
  auto small = ComputeDevicePlanBudget({.window = 16, .sinks = 4}, 2, 19, true, false);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("N=19 is smaller than sinks (4) + window (16)"));
  // A budget that cannot hold sinks + window (M = 10 < 20), with and without routing.
  for (bool routing : {false, true}) {
    auto tight =
        ComputeDevicePlanBudget({.p_c = 0.9, .window = 16, .sinks = 4}, 2, 100, true, routing);
    EXPECT_EQ(tight.status().code(), StatusCode::kOutOfRange) << tight.status();
    EXPECT_THAT(tight.status().message(), HasSubstr("plan: layer 0"));
  }
  auto no_layers = ComputeDevicePlanBudget({}, 0, 100, true, false);
  EXPECT_EQ(no_layers.status().code(), StatusCode::kInvalidArgument);
}

TEST(DevicePlan, CreateChecksItsInputBeforeTheDevice) {
  const DeviceFixture f = MakeFixture(64, 32, 2, 8, 3);
  const CompressionPlanOptions vector{.route = RouteStage::kVector, .window = 8};
  auto no_weights = DevicePlan::Create(vector, f.layout, nullptr);
  EXPECT_EQ(no_weights.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_weights.status().message(), HasSubstr("vector routing needs weights"));
  VectorWeights wrong = f.weights;
  wrong.num_layers = 3;
  auto mis_shaped = DevicePlan::Create(vector, f.layout, &wrong);
  EXPECT_EQ(mis_shaped.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(mis_shaped.status().message(), HasSubstr("weights shape does not match"));
  // Affine weights (an intercept per head) are implemented; a bias of the wrong size or with a
  // non-finite entry is refused before the device.
  VectorWeights bad_bias = f.affine_weights;
  bad_bias.heads[1].bias.pop_back();
  auto short_bias = DevicePlan::Create(vector, f.layout, &bad_bias);
  EXPECT_EQ(short_bias.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(short_bias.status().message(),
              HasSubstr("VECTOR head 1 has a bias of 31 entries, head_dim is 32"));
  bad_bias = f.affine_weights;
  bad_bias.heads[2].bias[0] = NAN;
  auto nan_bias = DevicePlan::Create(vector, f.layout, &bad_bias);
  EXPECT_EQ(nan_bias.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(nan_bias.status().message(), HasSubstr("VECTOR head 2 has a non-finite bias"));
  ASSERT_FALSE(f.affine_weights.heads[0].bias.empty());
#if KVD_HAVE_CUDA
  if (!CudaDeviceAvailable()) {  // accepted up to the device check
    auto affine = DevicePlan::Create(vector, f.layout, &f.affine_weights);
    EXPECT_EQ(affine.status().code(), StatusCode::kUnavailable) << affine.status();
  }
#endif
  ModelLayout odd = f.layout;
  odd.num_q_heads = 3;
  auto gqa = DevicePlan::Create({}, odd);
  EXPECT_EQ(gqa.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DevicePlan::Create({}, f.layout, nullptr, {.device = -2}).status().code(),
            StatusCode::kInvalidArgument);
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: DevicePlanCuda covers it";
  auto plan = DevicePlan::Create({}, f.layout);
#if KVD_HAVE_CUDA
  EXPECT_EQ(plan.status().code(), StatusCode::kUnavailable) << plan.status();
  EXPECT_THAT(plan.status().message(), HasSubstr("DevicePlan: backend cuda: no CUDA device"));
#else
  EXPECT_EQ(plan.status().code(), StatusCode::kUnimplemented) << plan.status();
  EXPECT_THAT(plan.status().message(), HasSubstr("this build has no CUDA kernels"));
#endif
}

// CheckDevicePlanDevice: what kvd's ingest asks before it picks the CUDA plan.
TEST(DevicePlan, CheckDeviceSaysWhyNot) {
  const Status negative = CheckDevicePlanDevice(-1);
  EXPECT_EQ(negative.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("device must be >= 0"));
  if (CudaDeviceAvailable()) {
    EXPECT_TRUE(CheckDevicePlanDevice(0).ok());
    const Status far = CheckDevicePlanDevice(4096);
    EXPECT_EQ(far.code(), StatusCode::kUnavailable) << far;
    EXPECT_THAT(far.message(), HasSubstr("no CUDA device 4096 (this machine has"));
    return;
  }
  const Status none = CheckDevicePlanDevice(0);
#if KVD_HAVE_CUDA
  EXPECT_EQ(none.code(), StatusCode::kUnavailable) << none;
  EXPECT_THAT(none.message(), HasSubstr("no CUDA device"));
#else
  EXPECT_EQ(none.code(), StatusCode::kUnimplemented) << none;
  EXPECT_THAT(none.message(), HasSubstr("built without CUDA"));
#endif
}

#if KVD_HAVE_CUDA

// Device memory for one test, freed at scope exit.
struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(const std::vector<uint8_t>& host) {
    EXPECT_EQ(cudaMalloc(&ptr, host.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(ptr); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// Float32 error bound of a SnapKV score, relative: each logit q.k / sqrt(d) is a float32 dot
// product of d terms (the device scales q first and uses fma; for unit-scale inputs its error
// stays within d ulp of the logit's own scale), each probability carries that error plus its
// exp's (a few ulp) and its softmax normaliser's (a float32 sum of <= N terms: <= N ulp); the
// mass adds R = W*G positive probabilities (<= R ulp, in any order: the device adds with atomics,
// the CPU in float64); mean and pooling add a few ulp. Both sides carry such an error, hence 4x.
double ScoreTolerance(int64_t n, int64_t rows, int64_t d) {
  return 4.0 * static_cast<double>(n + rows + d + 8) * testing::kF32Unit;
}

// Absolute error bound of a KeyDiff score -(k_i . a) / (|k_i| |a|) (scores in [-1, 1]), from both
// sides' float32 steps. Unit key: |k_i|^2 is a d-term float32 sum (d ulp), then 1/sqrt (the CPU
// rounds twice, the device's rsqrtf is within 2 ulp): <= (d/2 + 4) ulp relative. Anchor
// a = sum_i k_i / |k_i|: every term carries that error plus its product's; the CPU also adds the
// unit keys in float32 over blocks of 256 (<= 256 ulp of the absolute sums), the device in
// float64. So |da| <= (256 + d/2 + 5) u A1 on the CPU and (d/2 + 5) u A1 on the device, A1 =
// |sum_i |k_i| / |k_i||_2 (component-wise absolute sums), and the unit anchor's direction moves
// by <= 2 |da| / |a| + u. The score's dot product is a d-term float32 sum of terms <= |k_i| |a^|
// (<= (d + 1) ulp of |k_i|) times 1/|k_i| (its own error above). Summed over the two sides.
double KeyDiffTolerance(const Matrix& keys) {
  const int64_t n = keys.rows, d = keys.cols;
  std::vector<double> anchor(static_cast<size_t>(d), 0.0), abs_sum(static_cast<size_t>(d), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0.0;
    for (int64_t c = 0; c < d; ++c) ss += double(keys.Row(i)[c]) * keys.Row(i)[c];
    const double inv = 1.0 / std::sqrt(ss);
    for (int64_t c = 0; c < d; ++c) {
      anchor[c] += keys.Row(i)[c] * inv;
      abs_sum[c] += std::abs(keys.Row(i)[c]) * inv;
    }
  }
  double a = 0.0, a1 = 0.0;
  for (int64_t c = 0; c < d; ++c) {
    a += anchor[c] * anchor[c];
    a1 += abs_sum[c] * abs_sum[c];
  }
  const double direction = 2.0 * (256.0 + d + 10.0) * std::sqrt(a1 / a) + 2.0;
  const double dot = 2.0 * (d + 1.0), unit_key = 2.0 * (d / 2.0 + 4.0);
  return (direction + dot + unit_key) * testing::kF32Unit;
}

// The head's per-token float32 K or V, from the raw bytes.
Matrix HeadTensor(const DeviceFixture& f, int layer, int head, bool values) {
  const int64_t d = f.layout.head_dim;
  const size_t e = DTypeSize(f.layout.dtype);
  const uint8_t* base = f.raw.data() + f.layout.LayerOffset(layer, static_cast<int>(f.n)) +
                        (values ? f.n * f.layout.TokenBytes() : 0);
  Matrix m(f.n, d);
  for (int64_t i = 0; i < f.n; ++i) {
    ConvertToFloat(f.layout.dtype, base + i * f.layout.TokenBytes() + head * d * e, m.Row(i),
                   static_cast<size_t>(d));
  }
  return m;
}

std::vector<int64_t> SlotTokens(const CompactHead& h) {
  std::vector<int64_t> t;
  for (int64_t p : h.positions) t.push_back(p - kFirstPosition);
  return t;
}

// Compares one head of the device chunk with the CPU chunk (file comment). Returns the number of
// tokens selected differently (near-ties of the float32 scores).
int64_t CompareHead(const DeviceFixture& f, const VectorWeights& weights,
                    const CompressionPlanOptions& o, int layer, int head, const CompactHead& dev,
                    const CompactHead& cpu, std::span<const float> dscores, bool queries) {
  const int64_t n = f.n, d = f.layout.head_dim;
  const int64_t w = queries ? o.window : 0, sinks = std::min<int64_t>(n, o.sinks);
  const size_t e = DTypeSize(f.layout.dtype);
  const Matrix keys = HeadTensor(f, layer, head, false), values = HeadTensor(f, layer, head, true);
  const std::vector<int64_t> dtok = SlotTokens(dev), ctok = SlotTokens(cpu);
  std::vector<int64_t> diff;
  std::set_symmetric_difference(dtok.begin(), dtok.end(), ctok.begin(), ctok.end(),
                                std::back_inserter(diff));
  if (o.score == ScoreStage::kKeyDiff && o.keydiff_block > 0) {
    // Block-wise: no per-token scores to compare (each block step has its own anchor); the CPU
    // chunk is KeyDiffBlockwiseSelect's choice, and a token chosen by one side only is counted
    // (the caller bounds the count: near-ties of one step can change the later candidates).
    auto expect = KeyDiffBlockwiseSelect(
        keys.View(), cpu.slots(),
        {.block_size = o.keydiff_block, .selection = {.sinks = sinks, .window = w}});
    EXPECT_TRUE(expect.ok()) << expect.status();
    EXPECT_TRUE(std::equal(ctok.begin(), ctok.end(), expect->begin(), expect->end()));
    EXPECT_EQ(dev.slots(), cpu.slots());
    for (int64_t j = 0; j < sinks; ++j) EXPECT_EQ(dtok[j], j) << "sink slot " << j;
    for (int64_t j = 0; j < w; ++j) {
      EXPECT_EQ(dtok[dev.slots() - w + j], n - w + j) << "window slot " << j;
    }
  } else {
    // CPU scores of this head, and the float32 error bound of a score (absolute for KeyDiff,
    // whose scores are cosines; relative for the attention masses).
    std::vector<float> cscores(static_cast<size_t>(n));
    double abs_tol = 1e-30, rel = 0.0;
    if (o.score == ScoreStage::kNone) {
      for (int64_t i = 0; i < n; ++i) cscores[i] = static_cast<float>(i);
    } else if (o.score == ScoreStage::kKeyDiff) {
      EXPECT_TRUE(KeyDiffScores(keys.View(), cscores).ok());
      abs_tol = KeyDiffTolerance(keys);
    } else {
      const int group = f.layout.num_q_heads / f.layout.num_kv_heads;
      EXPECT_TRUE(SnapKvScores(f.query_views[layer * f.layout.num_kv_heads + head], keys.View(),
                               {.window = static_cast<int>(o.window),
                                .kernel_size = o.pooling_kernel,
                                .pooling = o.pooling,
                                .group_size = group},
                               cscores)
                      .ok());
      rel = ScoreTolerance(n, w * group, d);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (std::isinf(cscores[i])) {
        EXPECT_TRUE(std::isinf(dscores[i])) << "token " << i;
        continue;
      }
      EXPECT_LE(std::abs(double(dscores[i]) - cscores[i]), rel * std::abs(cscores[i]) + abs_tol)
          << "score of token " << i;
    }
    // Selection: exactly the top-k of the device's own scores (ties to the lower index).
    auto expect = SelectTopK(dscores, dev.slots(), {.sinks = sinks, .window = w});
    EXPECT_TRUE(expect.ok());
    EXPECT_TRUE(std::equal(dtok.begin(), dtok.end(), expect->begin(), expect->end()))
        << "the device did not select the top-k of its own scores";
    // Against the CPU's selection: a token chosen by one side only scores within the float32
    // bound of the CPU's lowest selected middle score.
    float boundary = INFINITY;
    for (int64_t t : ctok) {
      if (t >= sinks && t < n - w) boundary = std::min(boundary, cscores[t]);
    }
    for (int64_t t : diff) {
      EXPECT_LE(std::abs(double(cscores[t]) - boundary), 2.0 * (rel * std::abs(boundary) + abs_tol))
          << "token " << t << " selected differently, not a near-tie";
    }
  }
  // Copied keys and values: the raw bytes of the slot's token, bit for bit.
  const uint8_t* kb = f.raw.data() + f.layout.LayerOffset(layer, static_cast<int>(n));
  const uint8_t* vb = kb + n * f.layout.TokenBytes();
  int64_t v = 0;
  for (int64_t j = 0; j < dev.slots(); ++j) {
    const int64_t t = dtok[j];
    EXPECT_EQ(std::memcmp(dev.keys.data() + j * d * e,
                          kb + t * f.layout.TokenBytes() + head * d * e, d * e),
              0)
        << "key of slot " << j;
    EXPECT_EQ(dev.cardinality[j], 1);
    if (dev.flags[j] & kSlotRebuildValue) continue;
    EXPECT_EQ(std::memcmp(dev.values.data() + v * d * e,
                          vb + t * f.layout.TokenBytes() + head * d * e, d * e),
              0)
        << "value of slot " << j;
    ++v;
  }
  if (diff.empty()) {
    EXPECT_EQ(dev.keys, cpu.keys);
    EXPECT_EQ(dev.positions, cpu.positions);
    EXPECT_EQ(dev.cardinality, cpu.cardinality);
    if (dev.flags == cpu.flags) EXPECT_EQ(dev.values, cpu.values);
  }
  // Routing: the rebuilt slots are the smallest residuals up to float32 near-ties.
  if (o.route == RouteStage::kVector && diff.empty() && dev.flags != cpu.flags) {
    const int64_t s = dev.slots(), first = sinks, last = s - w;  // eligible [first, last)
    Matrix kpre(last - first, d), vals(last - first, d);
    std::vector<int64_t> pos;
    for (int64_t j = first; j < last; ++j) {
      std::memcpy(kpre.Row(j - first), keys.Row(dtok[j]), d * sizeof(float));
      std::memcpy(vals.Row(j - first), values.Row(dtok[j]), d * sizeof(float));
      pos.push_back(dev.positions[j]);
    }
    auto rope = RopeTable::Create(f.layout.rope, static_cast<int>(d));
    EXPECT_TRUE(ApplyRope(*rope, RopeDirection::kDerotate, pos, kpre.View(), kpre.View()).ok());
    // The CPU's residual, |(v - b) - W k|^2 for an affine head (checked against float64 in
    // vector_affine_test.cc).
    const VectorHeadFit& fit = weights.Head(layer, head);
    const Matrix& wm = fit.w;
    std::vector<float> res(static_cast<size_t>(last - first));
    EXPECT_TRUE(VectorResiduals(kpre.View(), vals.View(), fit, res).ok());
    double wnorm = 0.0, bnorm = 0.0;
    for (float x : wm.values) wnorm += double(x) * x;
    for (float x : fit.bias) bnorm += double(x) * x;
    wnorm = std::sqrt(wnorm);
    bnorm = std::sqrt(bnorm);
    float worst_kept = -INFINITY;  // the CPU's largest rebuilt residual
    float tol_max = 0.0f;
    for (int64_t j = first; j < last; ++j) {
      double kn = 0.0, vn = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        kn += double(kpre.Row(j - first)[c]) * kpre.Row(j - first)[c];
        vn += double(vals.Row(j - first)[c]) * vals.Row(j - first)[c];
      }
      // |(v - b) - W k|^2 in float32: dot products of d terms and a d-term square sum, after a
      // de-rotation of a few ulp (and v - b rounded once on both sides, identically): bounded by
      // 8 (d + 2) ulp of (|v| + |b| + |W|_F |k|)^2.
      const double bound = 8.0 * (d + 2) * testing::kF32Unit *
                           std::pow(std::sqrt(vn) + bnorm + wnorm * std::sqrt(kn), 2.0);
      tol_max = std::max(tol_max, static_cast<float>(bound));
      if (cpu.flags[j] & kSlotRebuildValue) {
        worst_kept = std::max(worst_kept, res[j - first]);
      }
    }
    for (int64_t j = first; j < last; ++j) {
      if ((dev.flags[j] ^ cpu.flags[j]) & kSlotRebuildValue) {
        EXPECT_LE(std::abs(res[j - first] - worst_kept), 2.0f * tol_max)
            << "slot " << j << " routed differently, not a near-tie";
      }
    }
  }
  return static_cast<int64_t>(diff.size());
}

TEST(DevicePlanCuda, MatchesTheCpuPlan) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DevicePlan needs one";
  for (int64_t n : {301, 1024}) {
    const DeviceFixture f = MakeFixture(n, 64, 4, 32, 11 + n);
    const DeviceBytes raw(f.raw), queries(f.query_bytes);
    for (const DeviceComposition& c : kDeviceCompositions) {
      if (c.merge != MergeStage::kNone) continue;  // HybridMatchesTheCpuPlan
      // Routes: none, VECTOR with linear weights, VECTOR with affine weights (intercepts).
      for (int r = 0; r < 3; ++r) {
        const RouteStage route = r == 0 ? RouteStage::kNone : RouteStage::kVector;
        const VectorWeights& weights = r == 2 ? f.affine_weights : f.weights;
        for (double p_c : {0.5, 0.75, 0.9}) {
          SCOPED_TRACE(Name(c, route, p_c) + (r == 2 ? " affine" : "") + " n=" + std::to_string(n));
          const CompressionPlanOptions o = Options(c, route, p_c, f.window);
          CompressionStats cpu_stats, dev_stats;
          CompressionInput cpu_input = f.CpuInput(c.queries);
          cpu_input.weights = &weights;
          auto cpu = Compress(o, f.layout, cpu_input, &cpu_stats);
          ASSERT_TRUE(cpu.ok()) << cpu.status();
          auto plan = DevicePlan::Create(o, f.layout, &weights);
          ASSERT_TRUE(plan.ok()) << plan.status();
          DeviceChunkInput in{.raw = raw.ptr,
                              .raw_bytes = f.raw.size(),
                              .positions = f.positions,
                              .window_queries = c.queries ? queries.ptr : nullptr};
          auto dev = (*plan)->Compress(in, &dev_stats);
          ASSERT_TRUE(dev.ok()) << dev.status();
          EXPECT_TRUE(dev->Validate().ok());
          EXPECT_EQ(dev->codec, cpu->codec);
          EXPECT_EQ(dev->layout_digest, cpu->layout_digest);
          EXPECT_EQ(dev_stats.slots, cpu_stats.slots);
          EXPECT_EQ(dev_stats.half_pairs, cpu_stats.half_pairs);
          EXPECT_EQ(dev_stats.rebuild_slots, cpu_stats.rebuild_slots);
          EXPECT_EQ(dev_stats.evicted_tokens, cpu_stats.evicted_tokens);
          auto scores = (*plan)->LastScores();
          ASSERT_TRUE(scores.ok()) << scores.status();
          int64_t differ = 0;
          for (int l = 0; l < f.layout.num_layers; ++l) {
            for (int h = 0; h < f.layout.num_kv_heads; ++h) {
              const size_t off = static_cast<size_t>((l * f.layout.num_kv_heads + h) * n);
              differ += CompareHead(f, weights, o, l, h, dev->Head(l, h), cpu->Head(l, h),
                                    std::span<const float>(scores->data() + off, n), c.queries);
            }
          }
          // Near-ties are rare on random data: most heads must match the CPU exactly.
          EXPECT_LE(differ, 2 * f.layout.num_layers * f.layout.num_kv_heads);
          RecordProperty("near_tie_tokens", static_cast<int>(differ));
        }
      }
    }
  }
}

// The quantize stage with the sequence's sink rows exact: the device plan records the CPU plan's
// quantize stage (4 sink rows for a chunk at position 0, none after) and its sink rows are the
// CPU plan's, byte for byte (always kept, never quantized).
TEST(DevicePlanCuda, QuantSinksAreTheCpuPlans) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DevicePlan needs one";
  DeviceFixture f = MakeFixture(301, 64, 4, 32, 23);
  const DeviceBytes raw(f.raw);
  CompressionPlanOptions o = Options(kDeviceCompositions[4], RouteStage::kNone, 0.5, f.window);
  o.quant = {.format = QuantFormat::kInt4,
             .key_group = 256,
             .value_group = 64,
             .sinks = 4,
             .rotation = QuantRotation::kHadamard,
             .value_format = QuantFormat::kInt2Sym};
  for (const int64_t offset : {int64_t{0}, int64_t{301}}) {
    for (int64_t& p : f.positions) p += offset;
    auto cpu = Compress(o, f.layout, f.CpuInput(false));
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto plan = DevicePlan::Create(o, f.layout, nullptr);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto dev =
        (*plan)->Compress({.raw = raw.ptr, .raw_bytes = f.raw.size(), .positions = f.positions});
    ASSERT_TRUE(dev.ok()) << dev.status();
    EXPECT_EQ(dev->codec, cpu->codec);
    EXPECT_EQ(dev->codec.quant.sinks, offset == 0 ? 4u : 0u);
    const size_t sink_bytes = 4 * 64 * DTypeSize(f.layout.dtype);
    for (size_t i = 0; offset == 0 && i < cpu->heads.size(); ++i) {
      EXPECT_TRUE(std::equal(cpu->heads[i].keys.begin(), cpu->heads[i].keys.begin() + sink_bytes,
                             dev->heads[i].keys.begin()));
      EXPECT_TRUE(std::equal(cpu->heads[i].values.begin(),
                             cpu->heads[i].values.begin() + sink_bytes,
                             dev->heads[i].values.begin()));
    }
  }
}

// Largest L2 norm of a key of the head (RoPE keeps it).
double MaxKeyNorm(const Matrix& keys) {
  double best = 0.0;
  for (int64_t i = 0; i < keys.rows; ++i) {
    double q = 0.0;
    for (int64_t c = 0; c < keys.cols; ++c) q += double(keys.Row(i)[c]) * keys.Row(i)[c];
    best = std::max(best, std::sqrt(q));
  }
  return best;
}

// The hybrid merge (score + merge kKvSlimmer) on the device against the CPU plan, float32 chunk
// (no model-dtype rounding between the two sides' keys). A head whose slots hold the same tokens
// (equal positions and cardinalities, which follows from the same pool) must match: single slots
// and every value bit for bit (a merged value is the float64 sum of the same values in token
// order, times 1/cardinality in float32, on both sides); merged keys within the float32 bound
// below. A head whose pool differs (a near-tie of the scores, as in MatchesTheCpuPlan) is counted
// and bounded.
//
// Merged key bound, per element, relative to the head's largest key norm |k|max: the weights are
// masses normalised by their sum, each mass within ScoreTolerance's relative bound r of the CPU's
// (the same attention mass), so each weight is within 2r + 2u and the weighted mean within
// (2r + 2u) |k|max (the weights sum to 1); the de-rotation of the members and the rotation of the
// mean are float32 products of a pair with float32 sin/cos (the device may fuse them): <= 4u each
// side; float64 sums rounded once to float32: u. Total (2r + 16u) |k|max; uniform weights (no
// queries, merge_guard kMean) drop the 2r.
TEST(DevicePlanCuda, HybridMatchesTheCpuPlan) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DevicePlan needs one";
  struct Variant {
    const char* name;
    int64_t max_group;
    double min_cos;
    RepresentativePosition position;
    MergeGuard guard;
  };
  const Variant variants[] = {
      {"default", 4, 0.0, RepresentativePosition::kLast, MergeGuard::kClamp},
      {"uncapped weighted", int64_t{1} << 20, 0.0, RepresentativePosition::kWeighted,
       MergeGuard::kClamp},
      {"cos gate, mean keys", 3, 0.1, RepresentativePosition::kLast, MergeGuard::kMean},
      {"no merging", 1, 0.0, RepresentativePosition::kLast, MergeGuard::kClamp},
  };
  for (int64_t n : {301, 1024}) {
    const DeviceFixture f = MakeFixture(n, 64, 4, 32, 31 + n, DType::kFloat32);
    const DeviceBytes raw(f.raw), queries(f.query_bytes);
    const int64_t d = f.layout.head_dim, group = f.layout.num_q_heads / f.layout.num_kv_heads;
    for (const DeviceComposition& c : kDeviceCompositions) {
      if (c.merge == MergeStage::kNone) continue;
      for (const Variant& v : variants) {
        for (double p_c : {0.5, 0.75, 0.9}) {
          SCOPED_TRACE(Name(c, RouteStage::kNone, p_c) + " " + v.name + " n=" + std::to_string(n));
          CompressionPlanOptions o = Options(c, RouteStage::kNone, p_c, f.window);
          o.hybrid_max_group = v.max_group;
          o.hybrid_min_cos = v.min_cos;
          o.position = v.position;
          o.merge_guard = v.guard;
          CompressionStats cpu_stats, dev_stats;
          auto cpu = Compress(o, f.layout, f.CpuInput(c.queries), &cpu_stats);
          ASSERT_TRUE(cpu.ok()) << cpu.status();
          auto plan = DevicePlan::Create(o, f.layout);
          ASSERT_TRUE(plan.ok()) << plan.status();
          auto dev = (*plan)->Compress({.raw = raw.ptr,
                                        .raw_bytes = f.raw.size(),
                                        .positions = f.positions,
                                        .window_queries = c.queries ? queries.ptr : nullptr},
                                       &dev_stats);
          ASSERT_TRUE(dev.ok()) << dev.status();
          EXPECT_TRUE(dev->Validate().ok());
          EXPECT_EQ(dev->codec, cpu->codec);
          EXPECT_EQ(dev_stats.slots, cpu_stats.slots);
          EXPECT_EQ(dev_stats.half_pairs, cpu_stats.half_pairs);
          if (v.max_group == 1) EXPECT_EQ(dev_stats.merged_tokens, 0);
          const bool uniform = !c.queries || v.guard == MergeGuard::kMean;
          const double rel = uniform ? 0.0 : ScoreTolerance(n, f.window * group, d);
          int64_t differing_heads = 0, merged_slots = 0;
          for (int l = 0; l < f.layout.num_layers; ++l) {
            for (int h = 0; h < f.layout.num_kv_heads; ++h) {
              const CompactHead& dh = dev->Head(l, h);
              const CompactHead& ch = cpu->Head(l, h);
              ASSERT_EQ(dh.slots(), ch.slots());
              if (dh.positions != ch.positions || dh.cardinality != ch.cardinality) {
                ++differing_heads;
                continue;
              }
              EXPECT_EQ(dh.flags, ch.flags);
              EXPECT_EQ(dh.values, ch.values) << "layer " << l << " head " << h;
              const double tol =
                  (2.0 * rel + 16.0 * testing::kF32Unit) * MaxKeyNorm(HeadTensor(f, l, h, false));
              const auto* dk = reinterpret_cast<const float*>(dh.keys.data());
              const auto* ck = reinterpret_cast<const float*>(ch.keys.data());
              for (int64_t j = 0; j < dh.slots(); ++j) {
                if (dh.cardinality[j] == 1) {
                  EXPECT_EQ(std::memcmp(dk + j * d, ck + j * d, d * sizeof(float)), 0)
                      << "single slot " << j;
                  continue;
                }
                ++merged_slots;
                for (int64_t e = 0; e < d; ++e) {
                  EXPECT_LE(std::abs(double(dk[j * d + e]) - ck[j * d + e]), tol)
                      << "merged slot " << j << " element " << e;
                }
              }
            }
          }
          // Near-ties are rare on random data: most heads must hold the CPU's slots.
          EXPECT_LE(differing_heads, 2);
          if (differing_heads == 0) {
            EXPECT_EQ(dev_stats.merged_tokens, cpu_stats.merged_tokens);
            EXPECT_EQ(dev_stats.evicted_tokens, cpu_stats.evicted_tokens);
          }
          if (v.max_group > 1 && v.min_cos == 0.0) EXPECT_GT(merged_slots, 0);
          RecordProperty("differing_heads", static_cast<int>(differing_heads));
        }
      }
    }
  }
}

TEST(DevicePlanCuda, NonFiniteInputIsRefusedAndThePlanKeepsServing) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DevicePlan needs one";
  DeviceFixture f = MakeFixture(128, 64, 4, 32, 5);
  auto plan = DevicePlan::Create({.window = f.window}, f.layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<uint8_t> bad = f.raw;
  const float nan = NAN;
  ConvertFromFloat(f.layout.dtype, &nan, bad.data() + f.layout.LayerOffset(1, 128), 1);
  const DeviceBytes bad_raw(bad), raw(f.raw), queries(f.query_bytes);
  DeviceChunkInput in{.raw = bad_raw.ptr,
                      .raw_bytes = bad.size(),
                      .positions = f.positions,
                      .window_queries = queries.ptr};
  auto refused = (*plan)->Compress(in);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("non-finite keys/values (NaN or Inf) in layer 1"));
  in.raw = raw.ptr;
  EXPECT_TRUE((*plan)->Compress(in).ok());
  in.raw_bytes = f.raw.size() - 1;
  auto short_raw = (*plan)->Compress(in);
  EXPECT_EQ(short_raw.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_raw.status().message(), HasSubstr("layout needs"));
  in.raw_bytes = f.raw.size();
  in.window_queries = nullptr;
  auto no_queries = (*plan)->Compress(in);
  EXPECT_EQ(no_queries.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_queries.status().message(), HasSubstr("needs window queries"));
}

// KeyDiff refuses a key of norm 0 (keydiff.h) as the CPU plan does, naming layer, head and
// token; one-shot and block-wise; the plan then compresses a good chunk.
TEST(DevicePlanCuda, KeyDiffRefusesAZeroNormKey) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DevicePlan needs one";
  const DeviceFixture f = MakeFixture(256, 64, 4, 32, 23);
  std::vector<uint8_t> bad = f.raw;
  // Layer 1, head 1, token 7: zero key.
  const size_t row = static_cast<size_t>(f.layout.head_dim) * DTypeSize(f.layout.dtype);
  std::memset(bad.data() + f.layout.LayerOffset(1, 256) + 7 * f.layout.TokenBytes() + row, 0, row);
  const DeviceBytes bad_raw(bad), raw(f.raw);
  for (int64_t block : {0, 64}) {
    SCOPED_TRACE("keydiff_block " + std::to_string(block));
    const CompressionPlanOptions o{
        .score = ScoreStage::kKeyDiff, .p_c = 0.5, .window = f.window, .keydiff_block = block};
    CompressionInput cpu_in = f.CpuInput(false);
    cpu_in.raw = bad;
    auto cpu = Compress(o, f.layout, cpu_in);
    EXPECT_EQ(cpu.status().code(), StatusCode::kInvalidArgument) << cpu.status();
    EXPECT_THAT(cpu.status().message(), HasSubstr("zero-norm key"));
    auto plan = DevicePlan::Create(o, f.layout);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto refused =
        (*plan)->Compress({.raw = bad_raw.ptr, .raw_bytes = bad.size(), .positions = f.positions});
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
    EXPECT_THAT(refused.status().message(),
                HasSubstr("plan: layer 1 head 1: keydiff: zero-norm key at token 7"));
    auto good =
        (*plan)->Compress({.raw = raw.ptr, .raw_bytes = f.raw.size(), .positions = f.positions});
    EXPECT_TRUE(good.ok()) << good.status();
  }
}

// CompressHost = one upload + Compress: from host bytes, with the window queries in the model
// dtype or as float32 (kvd's wire layout; bf16 -> float32 is exact, so both give the same floats),
// the chunk is the one Compress makes from device copies of the same bytes. (The attention mass
// adds with atomics; two runs may differ in the last bits of a score and so at an exact near-tie,
// which on this random chunk does not occur.)
TEST(DevicePlanCuda, CompressHostIsCompressOfTheUploadedChunk) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DevicePlan needs one";
  const DeviceFixture f = MakeFixture(301, 64, 4, 32, 17);
  const CompressionPlanOptions o{.score = ScoreStage::kSnapKv, .p_c = 0.75, .window = f.window};
  auto plan = DevicePlan::Create(o, f.layout, nullptr, {.own_stream = true});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const DeviceBytes raw(f.raw), queries(f.query_bytes);
  auto on_device = (*plan)->Compress({.raw = raw.ptr,
                                      .raw_bytes = f.raw.size(),
                                      .positions = f.positions,
                                      .window_queries = queries.ptr});
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  auto from_host = (*plan)->CompressHost(
      {.raw = f.raw, .positions = f.positions, .window_queries = f.query_bytes});
  ASSERT_TRUE(from_host.ok()) << from_host.status();
  EXPECT_EQ(EncodeCompactChunk(*from_host).value(), EncodeCompactChunk(*on_device).value());
  const size_t elements = f.query_bytes.size() / DTypeSize(f.layout.dtype);
  std::vector<float> f32(elements);
  ConvertToFloat(f.layout.dtype, f.query_bytes.data(), f32.data(), elements);
  const auto* bytes = reinterpret_cast<const uint8_t*>(f32.data());
  auto float_queries = (*plan)->CompressHost({.raw = f.raw,
                                              .positions = f.positions,
                                              .window_queries = {bytes, elements * sizeof(float)},
                                              .window_queries_float32 = true});
  ASSERT_TRUE(float_queries.ok()) << float_queries.status();
  EXPECT_EQ(EncodeCompactChunk(*float_queries).value(), EncodeCompactChunk(*on_device).value());
  // Sizes are checked before anything is copied.
  auto short_queries = (*plan)->CompressHost(
      {.raw = f.raw, .positions = f.positions, .window_queries = {bytes, elements}});
  EXPECT_EQ(short_queries.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_queries.status().message(), HasSubstr("window queries have"));
  auto short_raw = (*plan)->CompressHost(
      {.raw = std::span(f.raw).first(f.raw.size() - 2), .positions = f.positions});
  EXPECT_EQ(short_raw.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_raw.status().message(), HasSubstr("layout needs"));
}

#endif  // KVD_HAVE_CUDA

}  // namespace
}  // namespace kvd::kernels
