// Google Benchmark of every compression stage on Llama-3.1-8B-like shapes: 8 KV heads, d = 128,
// N = 4096 tokens, G = 4 query heads per KV head, bf16 input; one layer per iteration, ONE core
// (ExecOptions::num_threads = 1, OpenBLAS limited to 1 thread).
//
// Each stage reports its ratio against a limit measured in this same binary and run:
//   x_memcpy: stage input bytes per second / memcpy bytes per second for a copy of the same
//             number of bytes (bytes-bound stages; goal >= 0.5);
//   x_sgemm:  stage useful FLOP/s / OpenBLAS sgemm FLOP/s on [N, d] x [d, d] (d x d stages;
//             goal >= 0.5).
// Both counters are printed for every stage; docs/benchmarks.md says which goal applies.
// Flags: the usual --benchmark_* (e.g. --benchmark_min_time=0.2s); KVD_BENCH_TOKENS overrides N.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <vector>

#if KVD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "kvd/common/dtype.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/convert.h"
#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/kvslimmer.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/quantize.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/serving.h"
#include "kvd/kernels/snapkv.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {
namespace {

constexpr int kHeads = 8;
constexpr int kDim = 128;
constexpr int kGroup = 4;
constexpr int kWindow = 64;
const ExecOptions kOneCore{.backend = Backend::kCpu, .num_threads = 1};

int64_t Tokens() {
  static const int64_t n = [] {
    const char* env = std::getenv("KVD_BENCH_TOKENS");
    return env != nullptr ? std::max<int64_t>(kWindow + 8, std::atoll(env)) : int64_t{4096};
  }();
  return n;
}

// Thread CPU seconds: Google Benchmark's rates (and so the stages' side of every ratio) use CPU
// time, so the limits do too; wall time on a shared machine would inflate the ratios.
double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds per call of fn, best of 5 batches of >= min_seconds / 5 each.
double Seconds(const std::function<void()>& fn, double min_seconds) {
  fn();  // warm up
  double best = 1e30;
  for (int batch = 0; batch < 5; ++batch) {
    int64_t iters = 0;
    const double start = ThreadCpuSeconds();
    double elapsed = 0;
    do {
      fn();
      ++iters;
      elapsed = ThreadCpuSeconds() - start;
    } while (elapsed < min_seconds / 5);
    best = std::min(best, elapsed / static_cast<double>(iters));
  }
  return best;
}

// memcpy bytes/s for a copy of `bytes` bytes, measured now (best of 5 short batches). The
// machine is shared, so every stage re-measures its limits right after its own run: stage and
// limit see the same load.
double MemcpyRate(size_t bytes, double seconds = 0.1) {
  std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
  const double s = Seconds(
      [&] {
        std::memcpy(b.data(), a.data(), bytes);
        benchmark::DoNotOptimize(b.data());
        benchmark::ClobberMemory();
      },
      seconds);
  return static_cast<double>(bytes) / s;
}

// OpenBLAS sgemm FLOP/s on [N, d] x [d, d]^T (the shape of VECTOR's GEMMs), measured now.
double SgemmRate(double seconds = 0.1) {
  const int64_t n = Tokens();
  std::vector<float> a(n * kDim, 0.5f), w(kDim * kDim, 0.25f), c(n * kDim);
  const double s = Seconds(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), kDim, kDim, 1.0f,
                    a.data(), kDim, w.data(), kDim, 0.0f, c.data(), kDim);
        benchmark::DoNotOptimize(c.data());
      },
      seconds);
  return 2.0 * n * kDim * kDim / s;
}

// Sets the ratio counters: per iteration the stage reads `bytes` and does `flops`.
void Report(benchmark::State& state, double bytes, double flops) {
  const double iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes * iters));
  // kIsRate divides by the measured time: (work / limit_rate) / time = stage_rate / limit_rate.
  state.counters["x_memcpy"] = benchmark::Counter(
      bytes * iters / MemcpyRate(static_cast<size_t>(bytes)), benchmark::Counter::kIsRate);
  if (flops > 0) {
    state.counters["GFLOPs"] =
        benchmark::Counter(flops * iters * 1e-9, benchmark::Counter::kIsRate);
    state.counters["x_sgemm"] =
        benchmark::Counter(flops * iters / SgemmRate(), benchmark::Counter::kIsRate);
  }
}

// One layer of synthetic data: per head pre/post-RoPE keys, values, window queries, W.
struct LayerData {
  int64_t n = 0;
  RopeConfig rope_config{.theta = 500000.0,
                         .pairing = RopePairing::kHalves,
                         .scaling = RopeScaling::kLlama3,
                         .factor = 8.0};
  std::vector<uint16_t> k_bf16, v_bf16;  // [N, H, d] engine layout
  std::vector<int64_t> positions;
  std::vector<Matrix> keys, kpre, values, queries;  // [H] of [N, d] / [W*G, d]
  std::vector<Matrix> w;                            // [H] of [d, d]
  RopeTable rope;

  static const LayerData& Get() {
    static const LayerData* data = [] {
      auto* d = new LayerData();
      d->Init();
      return d;
    }();
    return *data;
  }

  // The layer as a chunk of a one-layer model (bf16, kHeads KV heads, group kGroup), its raw
  // bytes (K then V, engine layout) and its W as calibrated VECTOR weights (r2 0.9: every head
  // routes).
  ModelLayout Layout() const {
    return {.num_layers = 1,
            .num_kv_heads = kHeads,
            .num_q_heads = kHeads * kGroup,
            .head_dim = kDim,
            .dtype = DType::kBFloat16,
            .rope = rope_config};
  }
  std::vector<uint8_t> RawChunk() const {
    std::vector<uint8_t> raw(Layout().ChunkBytes(static_cast<int>(n)));
    std::memcpy(raw.data(), k_bf16.data(), raw.size() / 2);
    std::memcpy(raw.data() + raw.size() / 2, v_bf16.data(), raw.size() / 2);
    return raw;
  }
  VectorWeights Weights() const {
    VectorWeights weights{.num_layers = 1, .num_kv_heads = kHeads, .head_dim = kDim};
    for (const Matrix& m : w) weights.heads.push_back({.w = m, .r2 = 0.9, .count = 65536});
    weights.version = weights.ComputeVersion();
    return weights;
  }

 private:
  void Init() {
    n = Tokens();
    std::mt19937_64 rng(42);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    rope = *RopeTable::Create(rope_config, kDim);
    positions.resize(n);
    for (int64_t i = 0; i < n; ++i) positions[i] = i;
    k_bf16.resize(n * kHeads * kDim);
    v_bf16.resize(k_bf16.size());
    for (auto& x : k_bf16) x = FloatToBFloat16(dist(rng));
    for (auto& x : v_bf16) x = FloatToBFloat16(dist(rng));
    EngineTensorShape shape{.tokens = n, .num_heads = kHeads, .head_dim = kDim};
    keys = *GatherHeads(shape, k_bf16.data(), kOneCore);
    values = *GatherHeads(shape, v_bf16.data(), kOneCore);
    for (int h = 0; h < kHeads; ++h) {
      Matrix kp(n, kDim);
      (void)ApplyRope(rope, RopeDirection::kDerotate, positions, keys[h].View(), kp.View(),
                      kOneCore);
      kpre.push_back(std::move(kp));
      Matrix q(kWindow * kGroup, kDim);
      for (float& x : q.values) x = dist(rng);
      queries.push_back(std::move(q));
      Matrix wm(kDim, kDim);
      for (float& x : wm.values) x = 0.1f * dist(rng);
      w.push_back(std::move(wm));
    }
  }
};

// ---- limits, as benchmarks of their own (the ratios use the same measurements) ----

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(Tokens()) * kHeads * kDim * 2;
  std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  Report(state, static_cast<double>(bytes), 0);
}
BENCHMARK(BM_Memcpy);

void BM_Sgemm(benchmark::State& state) {
  const int64_t n = Tokens();
  std::vector<float> a(n * kDim, 0.5f), w(kDim * kDim, 0.25f), c(n * kDim);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), kDim, kDim, 1.0f,
                a.data(), kDim, w.data(), kDim, 0.0f, c.data(), kDim);
    benchmark::DoNotOptimize(c.data());
  }
  Report(state, static_cast<double>(n) * kDim * 4, 2.0 * n * kDim * kDim);
}
BENCHMARK(BM_Sgemm);

// ---- bytes-bound stages (one layer: 8 heads) ----

void BM_ConvertBf16(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  EngineTensorShape shape{.tokens = d.n, .num_heads = kHeads, .head_dim = kDim};
  std::vector<Matrix> out(kHeads, Matrix(d.n, kDim));
  std::vector<MatrixView> views;
  for (Matrix& m : out) views.push_back(m.View());
  for (auto _ : state) {
    benchmark::DoNotOptimize(GatherHeads(shape, d.k_bf16.data(), views, kOneCore, false));
  }
  Report(state, static_cast<double>(d.k_bf16.size()) * 2, 0);
}
BENCHMARK(BM_ConvertBf16);

void BM_Derotate(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  std::vector<Matrix> work = d.keys;
  std::vector<MatrixView> views;
  for (Matrix& m : work) views.push_back(m.View());
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        ApplyRope(d.rope, RopeDirection::kDerotate, d.positions, views, kOneCore, false));
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 4, 0);
}
BENCHMARK(BM_Derotate);

void BM_SnapKvScores(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  std::vector<float> scores(d.n);
  SnapKvOptions o{.window = kWindow, .group_size = kGroup};
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(
          SnapKvScores(d.queries[h].View(), d.keys[h].View(), o, scores, kOneCore));
    }
  }
  // Q K^T plus P's exp: the GEMM part is 2 * (W G) * N * d per head.
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 4,
         2.0 * kWindow * kGroup * d.n * kDim * kHeads);
}
BENCHMARK(BM_SnapKvScores);

void BM_KeyDiffScores(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  std::vector<float> scores(d.n);
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(KeyDiffScores(d.keys[h].View(), scores, kOneCore));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 4, 0);
}
BENCHMARK(BM_KeyDiffScores);

// KVSlimmer: N -> N/2 slots per head (one round of statistics and merges).
void BM_KvSlimmerHalve(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  KvSlimmerOptions o{.sinks = 4, .window = kWindow, .group_size = kGroup};
  std::span<const int64_t> qpos = std::span(d.positions).subspan(d.n - kWindow);
  std::vector<SlotSet> base;
  for (int h = 0; h < kHeads; ++h) {
    base.push_back(
        *SlotsFromTokens(d.rope, d.keys[h].View(), d.values[h].View(), d.positions, kOneCore));
  }
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<SlotSet> slots = base;
    state.ResumeTiming();
    for (int h = 0; h < kHeads; ++h) {
      KvSlimmerStats st;
      benchmark::DoNotOptimize(KvSlimmerCompress(d.rope, d.queries[h].View(), qpos, d.n / 2, o,
                                                 &slots[h], &st, kOneCore));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 4 * 2,
         2.0 * kWindow * kGroup * d.n * kDim * kHeads);
}
BENCHMARK(BM_KvSlimmerHalve);

// ---- d x d stages (VECTOR) ----

void BM_VectorCalibrate(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  auto cal = VectorCalibrator::Create(1, kHeads, kDim);
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(cal->Add(0, h, d.kpre[h].View(), d.values[h].View(), kOneCore));
    }
  }
  // G (N d^2 multiply-adds) and C (N d^2): 4 N d^2 FLOP per head, done in float64.
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 8, 4.0 * d.n * kDim * kDim * kHeads);
}
BENCHMARK(BM_VectorCalibrate);

void BM_VectorResiduals(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  std::vector<float> res(d.n);
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(
          VectorResiduals(d.kpre[h].View(), d.values[h].View(), d.w[h].View(), res, kOneCore));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 8, 2.0 * d.n * kDim * kDim * kHeads);
}
BENCHMARK(BM_VectorResiduals);

void BM_VectorRebuild(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  Matrix out(d.n, kDim);
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(
          RebuildValues(d.kpre[h].View(), d.w[h].View(), out.View(), kOneCore));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 4, 2.0 * d.n * kDim * kDim * kHeads);
}
BENCHMARK(BM_VectorRebuild);

// Serve-time rebuild including the de-rotation of the stored keys (what BuildServingHead does).
void BM_VectorRebuildWithDerotate(benchmark::State& state) {
  const LayerData& d = LayerData::Get();
  Matrix k(d.n, kDim), out(d.n, kDim);
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      (void)ApplyRope(d.rope, RopeDirection::kDerotate, d.positions, d.keys[h].View(), k.View(),
                      kOneCore);
      benchmark::DoNotOptimize(RebuildValues(k.View(), d.w[h].View(), out.View(), kOneCore));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 4, 2.0 * d.n * kDim * kDim * kHeads);
}
BENCHMARK(BM_VectorRebuildWithDerotate);

// ---- format ----

CompactChunk LayerChunk() {
  const LayerData& d = LayerData::Get();
  CompactChunk c;
  c.num_layers = 1;
  c.num_kv_heads = kHeads;
  c.head_dim = kDim;
  c.dtype = DType::kBFloat16;
  c.original_tokens = d.n;
  c.codec.route = RouteStage::kVector;
  c.codec.p_c = 0.5;
  c.heads.resize(kHeads);
  const int64_t s = d.n * 3 / 4;  // p_c = 0.5 with VECTOR: 0.75 N keys, 0.25 N values
  for (CompactHead& h : c.heads) {
    h.flags.assign(s, 0);
    for (int64_t j = 0; j < s; j += 3) h.flags[j] = kSlotRebuildValue;
    for (int64_t j = 1; j < s && h.value_slots() > d.n / 4; j += 3) h.flags[j] = kSlotRebuildValue;
    h.cardinality.assign(s, 1);
    h.positions.resize(s);
    for (int64_t j = 0; j < s; ++j) h.positions[j] = j;
    h.keys.assign(s * kDim * 2, 7);
    h.values.assign(h.value_slots() * kDim * 2, 9);
  }
  return c;
}

void BM_EncodeCompactChunk(benchmark::State& state) {
  const CompactChunk c = LayerChunk();
  size_t bytes = 0;
  for (auto _ : state) {
    auto out = EncodeCompactChunk(c);
    bytes = out->size();
    benchmark::DoNotOptimize(out->data());
  }
  Report(state, static_cast<double>(bytes), 0);
}
BENCHMARK(BM_EncodeCompactChunk);

void BM_DecodeCompactChunk(benchmark::State& state) {
  const std::vector<uint8_t> bytes = *EncodeCompactChunk(LayerChunk());
  for (auto _ : state) {
    auto c = DecodeCompactChunk(bytes);
    benchmark::DoNotOptimize(c->heads.data());
  }
  Report(state, static_cast<double>(bytes.size()), 0);
}
BENCHMARK(BM_DecodeCompactChunk);

// ---- the quantize stage (one layer: 8 heads, keys and values) ----

// Quantized forms of docs/quality.md: int8, int4, int4 keys with int4z values, the same rotated
// (the 0.28 row), and the 0.20 row (3-bit keys over 37 slots, symmetric 2-bit values, both
// rotated). Keys per channel over the group's slots, values per slot over 64 channels.
const QuantDescription kQuantInt8{.format = QuantFormat::kInt8, .key_group = 64, .value_group = 64};
const QuantDescription kQuantInt4{.format = QuantFormat::kInt4, .key_group = 64, .value_group = 64};
const QuantDescription kQuantInt4z{.format = QuantFormat::kInt4,
                                   .key_group = 64,
                                   .value_group = 64,
                                   .value_format = QuantFormat::kInt4Zero};
const QuantDescription kQuantInt4zRot{.format = QuantFormat::kInt4,
                                      .key_group = 64,
                                      .value_group = 64,
                                      .rotation = QuantRotation::kHadamard,
                                      .value_format = QuantFormat::kInt4Zero};
const QuantDescription kQuant3k2sv{.format = QuantFormat::kInt3,
                                   .key_group = 37,
                                   .value_group = 64,
                                   .rotation = QuantRotation::kHadamard,
                                   .value_format = QuantFormat::kInt2Sym};

// Every head's keys and values of the layer through QuantizeRows (`quantize`) or, from their
// quantized bytes, DequantizeRows; the bytes counted are the float32 rows read or written.
void BM_QuantizeLayer(benchmark::State& state, const QuantDescription& q, bool quantize) {
  const LayerData& d = LayerData::Get();
  std::vector<std::vector<uint8_t>> bytes;
  for (int h = 0; h < 2 * kHeads; ++h) {
    const bool keys = h < kHeads;
    const Matrix& x = keys ? d.keys[h] : d.values[h - kHeads];
    bytes.emplace_back(QuantizedRowsBytes(d.n, kDim, DType::kBFloat16, q, keys));
    if (!QuantizeRows(x.View(), DType::kBFloat16, q, keys, bytes.back(), kOneCore).ok()) {
      state.SkipWithError("QuantizeRows failed");
      return;
    }
  }
  Matrix out(d.n, kDim);
  for (auto _ : state) {
    for (int h = 0; h < 2 * kHeads; ++h) {
      const bool keys = h < kHeads;
      const Matrix& x = keys ? d.keys[h] : d.values[h - kHeads];
      benchmark::DoNotOptimize(
          quantize ? QuantizeRows(x.View(), DType::kBFloat16, q, keys, bytes[h], kOneCore)
                   : DequantizeRows(bytes[h], DType::kBFloat16, q, keys, out.View(), kOneCore));
    }
  }
  Report(state, 2.0 * kHeads * static_cast<double>(d.n) * kDim * sizeof(float), 0);
}
BENCHMARK_CAPTURE(BM_QuantizeLayer, quantize_int8, kQuantInt8, true);
BENCHMARK_CAPTURE(BM_QuantizeLayer, quantize_int4, kQuantInt4, true);
BENCHMARK_CAPTURE(BM_QuantizeLayer, quantize_int4k_int4zv, kQuantInt4z, true);
BENCHMARK_CAPTURE(BM_QuantizeLayer, quantize_int4k_int4zv_rot, kQuantInt4zRot, true);
BENCHMARK_CAPTURE(BM_QuantizeLayer, quantize_int3k_int2sv_rot_kg37, kQuant3k2sv, true);
BENCHMARK_CAPTURE(BM_QuantizeLayer, dequantize_int8, kQuantInt8, false);
BENCHMARK_CAPTURE(BM_QuantizeLayer, dequantize_int4, kQuantInt4, false);
BENCHMARK_CAPTURE(BM_QuantizeLayer, dequantize_int4k_int4zv, kQuantInt4z, false);
BENCHMARK_CAPTURE(BM_QuantizeLayer, dequantize_int4k_int4zv_rot, kQuantInt4zRot, false);
BENCHMARK_CAPTURE(BM_QuantizeLayer, dequantize_int3k_int2sv_rot_kg37, kQuant3k2sv, false);

// ---- whole plans, one layer (for context; no goal) ----

void BM_PlanOneLayer(benchmark::State& state, ScoreStage score, MergeStage merge,
                     RouteStage route) {
  const LayerData& d = LayerData::Get();
  const ModelLayout layout = d.Layout();
  const std::vector<uint8_t> raw = d.RawChunk();
  std::vector<ConstMatrixView> qv;
  for (const Matrix& q : d.queries) qv.push_back(q.View());
  const VectorWeights w = d.Weights();
  CompressionPlanOptions o{
      .score = score, .merge = merge, .route = route, .p_c = 0.5, .window = kWindow};
  CompressionInput in{.raw = raw, .positions = d.positions, .window_queries = qv, .weights = &w};
  for (auto _ : state) {
    auto c = Compress(o, layout, in, nullptr, kOneCore);
    if (!c.ok()) {
      state.SkipWithError(c.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(c->heads.data());
  }
  Report(state, static_cast<double>(raw.size()), 0);
}
BENCHMARK_CAPTURE(BM_PlanOneLayer, snapkv, ScoreStage::kSnapKv, MergeStage::kNone,
                  RouteStage::kNone);
BENCHMARK_CAPTURE(BM_PlanOneLayer, keydiff_vector, ScoreStage::kKeyDiff, MergeStage::kNone,
                  RouteStage::kVector);
BENCHMARK_CAPTURE(BM_PlanOneLayer, hybrid_snapkv_vector, ScoreStage::kSnapKv,
                  MergeStage::kKvSlimmer, RouteStage::kVector);

// ---- whole plans, one chunk of the demo model (SmolLM2-135M: what kvd's ingest does) ----

// One 256-token chunk of SmolLM2-135M-Instruct as the demo puts it: 30 layers x 3 KV heads x d 64,
// 9 query heads (G = 3), bf16, the queries of the chunk's last 32 tokens, 4 sinks (p_c, W below);
// `threads` = ExecOptions::num_threads (kvd's ingest default: worker_threads 2 per model, one
// chunk per worker, so 1 thread per chunk). Reported per chunk; the raw chunk is 5.6 MiB.
struct DemoChunk {
  static constexpr int kLayers = 30, kKvHeads = 3, kQHeads = 9, kD = 64, kN = 256, kW = 32;
  ModelLayout layout{.num_layers = kLayers,
                     .num_kv_heads = kKvHeads,
                     .num_q_heads = kQHeads,
                     .head_dim = kD,
                     .dtype = DType::kBFloat16,
                     .rope = {.theta = 100000.0, .pairing = RopePairing::kInterleaved}};
  std::vector<uint8_t> raw;
  std::vector<int64_t> positions;
  std::vector<Matrix> queries;  // [layers * kv_heads] of [W * G, d]
  VectorWeights weights;

  static const DemoChunk& Get() {
    static const DemoChunk* c = [] {
      auto* d = new DemoChunk();
      d->Init();
      return d;
    }();
    return *c;
  }

 private:
  void Init() {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    raw.resize(layout.ChunkBytes(kN));
    auto* bf = reinterpret_cast<uint16_t*>(raw.data());
    for (size_t i = 0; i < raw.size() / 2; ++i) bf[i] = FloatToBFloat16(dist(rng));
    positions.resize(kN);
    for (int i = 0; i < kN; ++i) positions[i] = 256 + i;  // the prompt's second chunk
    weights.num_layers = kLayers;
    weights.num_kv_heads = kKvHeads;
    weights.head_dim = kD;
    for (int h = 0; h < kLayers * kKvHeads; ++h) {
      Matrix q(kW * (kQHeads / kKvHeads), kD);
      for (float& x : q.values) x = dist(rng);
      queries.push_back(std::move(q));
      Matrix wm(kD, kD);
      for (float& x : wm.values) x = 0.1f * dist(rng);
      weights.heads.push_back({.w = std::move(wm), .r2 = 0.9, .count = 65536});
    }
    weights.version = weights.ComputeVersion();
  }
};

// Args: {threads, p_c in percent}. Window 32, except 16 at p_c 0.9 (a 256-token chunk keeps 26
// tokens: room for 4 sinks + 16 window tokens only; the queries of the last 16 tokens). Counters,
// per chunk: the plan's stage times (CompressionStats::stage, ms; thread time summed over heads,
// so with 2 threads they add up to about twice the wall time), serialize_ms (EncodeCompactChunk),
// and memcpy_ms: one memcpy of the 5.6 MiB raw chunk measured right after, in the same run.
void BM_PlanDemoChunk(benchmark::State& state, ScoreStage score, MergeStage merge,
                      RouteStage route) {
  const DemoChunk& d = DemoChunk::Get();
  const double p_c = static_cast<double>(state.range(1)) / 100.0;
  const int64_t window = state.range(1) >= 90 ? 16 : DemoChunk::kW;
  const int64_t g = DemoChunk::kQHeads / DemoChunk::kKvHeads;
  std::vector<ConstMatrixView> qv;
  for (const Matrix& q : d.queries) {
    const int64_t skip = (DemoChunk::kW - window) * g;  // rows of the earlier window tokens
    qv.push_back(ConstMatrixView{q.Row(skip), window * g, DemoChunk::kD, DemoChunk::kD});
  }
  CompressionPlanOptions o{
      .score = score, .merge = merge, .route = route, .p_c = p_c, .window = window, .sinks = 4};
  CompressionInput in{
      .raw = d.raw, .positions = d.positions, .window_queries = qv, .weights = &d.weights};
  const ExecOptions exec{.backend = Backend::kCpu, .num_threads = static_cast<int>(state.range(0))};
  size_t encoded = 0;
  CompressionStageTimes stage;
  int64_t total_ns = 0;
  double serialize_s = 0;
  for (auto _ : state) {
    CompressionStats stats;
    auto c = Compress(o, d.layout, in, &stats, exec);
    if (!c.ok()) {
      state.SkipWithError(c.status().ToString().c_str());
      break;
    }
    const auto serialize_start = std::chrono::steady_clock::now();
    auto bytes = EncodeCompactChunk(*c);
    serialize_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - serialize_start).count();
    if (!bytes.ok()) {
      state.SkipWithError(bytes.status().ToString().c_str());
      break;
    }
    stage += stats.stage;
    total_ns += stats.total_ns;
    encoded = bytes->size();
    benchmark::DoNotOptimize(bytes->data());
  }
  const double iters = std::max<double>(1.0, static_cast<double>(state.iterations()));
  const auto ms = [&](int64_t ns) { return static_cast<double>(ns) * 1e-6 / iters; };
  state.counters["convert_ms"] = ms(stage.convert_ns);
  state.counters["derotate_ms"] = ms(stage.derotate_ns);
  state.counters["score_ms"] = ms(stage.score_ns);
  state.counters["select_ms"] = ms(stage.select_ns);
  state.counters["merge_ms"] = ms(stage.merge_ns);
  state.counters["route_ms"] = ms(stage.route_ns);
  state.counters["encode_ms"] = ms(stage.encode_ns);
  state.counters["plan_ms"] = ms(total_ns);
  state.counters["serialize_ms"] = serialize_s * 1e3 / iters;
  state.counters["memcpy_ms"] = static_cast<double>(d.raw.size()) / MemcpyRate(d.raw.size()) * 1e3;
  state.counters["stored_over_raw"] =
      static_cast<double>(encoded) / static_cast<double>(d.raw.size());
}
// Wall time: with 2 threads the plan's heads run on two cores.
#define KVD_DEMO_PLAN(name, score, merge, route)                 \
  BENCHMARK_CAPTURE(BM_PlanDemoChunk, name, score, merge, route) \
      ->ArgsProduct({{1, 2}, {50, 75, 90}})                      \
      ->UseRealTime()                                            \
      ->Unit(benchmark::kMillisecond)
KVD_DEMO_PLAN(snapkv, ScoreStage::kSnapKv, MergeStage::kNone, RouteStage::kNone);
KVD_DEMO_PLAN(keydiff, ScoreStage::kKeyDiff, MergeStage::kNone, RouteStage::kNone);
KVD_DEMO_PLAN(kvslimmer, ScoreStage::kNone, MergeStage::kKvSlimmer, RouteStage::kNone);
KVD_DEMO_PLAN(snapkv_vector, ScoreStage::kSnapKv, MergeStage::kNone, RouteStage::kVector);
KVD_DEMO_PLAN(hybrid_snapkv_kvslimmer, ScoreStage::kSnapKv, MergeStage::kKvSlimmer,
              RouteStage::kNone);
#undef KVD_DEMO_PLAN

// ---- CUDA twins (skipped without a device) ----

void BM_CudaVectorResiduals(benchmark::State& state) {
  if (!CudaDeviceAvailable()) {
    state.SkipWithError("no CUDA device");
    for (auto _ : state) {
    }
    return;
  }
  const LayerData& d = LayerData::Get();
  std::vector<float> res(d.n);
  const ExecOptions gpu{.backend = Backend::kCuda};
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(
          VectorResiduals(d.kpre[h].View(), d.values[h].View(), d.w[h].View(), res, gpu));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 8, 2.0 * d.n * kDim * kDim * kHeads);
}
BENCHMARK(BM_CudaVectorResiduals)->UseRealTime();

void BM_CudaVectorCalibrate(benchmark::State& state) {
  if (!CudaDeviceAvailable()) {
    state.SkipWithError("no CUDA device");
    for (auto _ : state) {
    }
    return;
  }
  const LayerData& d = LayerData::Get();
  auto cal = VectorCalibrator::Create(1, kHeads, kDim);
  const ExecOptions gpu{.backend = Backend::kCuda};
  for (auto _ : state) {
    for (int h = 0; h < kHeads; ++h) {
      benchmark::DoNotOptimize(cal->Add(0, h, d.kpre[h].View(), d.values[h].View(), gpu));
    }
  }
  Report(state, static_cast<double>(d.n) * kHeads * kDim * 8, 4.0 * d.n * kDim * kDim * kHeads);
}
BENCHMARK(BM_CudaVectorCalibrate)->UseRealTime();

// ---- device-resident plan (plan_device.h) against the device's own copy bandwidth ----
#if KVD_HAVE_CUDA

// Device bytes uploaded once, freed at exit of the benchmark.
struct DeviceCopy {
  void* ptr = nullptr;
  explicit DeviceCopy(const void* host, size_t bytes) {
    if (cudaMalloc(&ptr, bytes) == cudaSuccess)
      cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice);
  }
  ~DeviceCopy() { cudaFree(ptr); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
};

// cudaMemcpy device-to-device bytes per second (bytes copied, i.e. read once and written once),
// best of 5 batches of 20 copies timed with events: the limit of the device's bytes-bound stages.
double D2DRate(size_t bytes) {
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return 0.0;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);  // warm-up
  float best_ms = 1e30f;
  for (int batch = 0; batch < 5; ++batch) {
    cudaEventRecord(start);
    for (int i = 0; i < 20; ++i) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    best_ms = std::min(best_ms, ms / 20.0f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return static_cast<double>(bytes) / (static_cast<double>(best_ms) * 1e-3);
}

bool SkipWithoutDevice(benchmark::State& state) {
  if (CudaDeviceAvailable()) return false;
  state.SkipWithError("no CUDA device");
  for (auto _ : state) {
  }
  return true;
}

// The limit as its own row: D2D copy of `range(0)` MiB.
void BM_CudaD2DCopy(benchmark::State& state) {
  if (SkipWithoutDevice(state)) return;
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  double rate = 0.0;
  for (auto _ : state) rate = D2DRate(bytes);
  state.counters["GBps"] = rate * 1e-9;
}
BENCHMARK(BM_CudaD2DCopy)->Arg(6)->Arg(64)->Iterations(1)->Unit(benchmark::kMillisecond);

// Engine-layout window queries [L, W, Hq, d] (bf16) from per-(layer, KV head) float [Wmax*G, d]
// matrices, keeping the last `window` of their Wmax rows groups.
std::vector<uint8_t> EngineQueries(const std::vector<Matrix>& per_head, int layers, int kv_heads,
                                   int group, int64_t window, int64_t d) {
  const int hq = kv_heads * group;
  std::vector<uint8_t> out(static_cast<size_t>(layers * window * hq * d) * 2);
  for (int l = 0; l < layers; ++l) {
    for (int64_t w = 0; w < window; ++w) {
      for (int q = 0; q < hq; ++q) {
        const Matrix& m = per_head[static_cast<size_t>(l * kv_heads + q / group)];
        const int64_t skip = m.rows / group - window;
        ConvertFromFloat(DType::kBFloat16, m.Row((skip + w) * group + q % group),
                         out.data() + static_cast<size_t>(((l * window + w) * hq + q) * d) * 2,
                         static_cast<size_t>(d));
      }
    }
  }
  return out;
}

// One chunk through DevicePlan (K/V and queries already on the device, the compact arrays copied
// back each iteration) and through the CPU plan (Compress, 1 thread, a few iterations) in the same
// run. Counters: plan_ms (wall per chunk, device plan), the device stage times (ms; events),
// cpu_plan_ms, x_cpu = cpu_plan_ms / plan_ms (goal >= 20), and against cudaMemcpy D2D measured
// here: x_d2d_convert = a D2D copy's time for the convert stage's traffic / the stage's time (the
// stage reads the bf16 chunk, writes it as float32 and reads that back for the finiteness check:
// 5x the raw bytes moved, a copy of B bytes moves 2B; goal >= 0.6), x_d2d_plan = a D2D copy of
// the raw chunk / the whole device plan (one pass over the chunk would be 1).
void RunDevicePlan(benchmark::State& state, const ModelLayout& layout,
                   const std::vector<uint8_t>& raw, const std::vector<int64_t>& positions,
                   const std::vector<Matrix>& queries, const VectorWeights* weights,
                   const CompressionPlanOptions& o) {
  if (SkipWithoutDevice(state)) return;
  const int g = layout.num_q_heads / layout.num_kv_heads;
  const std::vector<uint8_t> qbytes =
      EngineQueries(queries, layout.num_layers, layout.num_kv_heads, g, o.window, layout.head_dim);
  const DeviceCopy draw(raw.data(), raw.size()), dq(qbytes.data(), qbytes.size());
  auto plan = DevicePlan::Create(o, layout, weights, {.time_stages = true});
  if (!plan.ok()) {
    state.SkipWithError(plan.status().ToString().c_str());
    for (auto _ : state) {
    }
    return;
  }
  const DeviceChunkInput in{
      .raw = draw.ptr, .raw_bytes = raw.size(), .positions = positions, .window_queries = dq.ptr};
  if (auto warm = (*plan)->Compress(in); !warm.ok()) {
    state.SkipWithError(warm.status().ToString().c_str());
    for (auto _ : state) {
    }
    return;
  }
  CompressionStageTimes stage;
  int64_t total_ns = 0;
  for (auto _ : state) {
    CompressionStats stats;
    auto c = (*plan)->Compress(in, &stats);
    if (!c.ok()) {
      state.SkipWithError(c.status().ToString().c_str());
      break;
    }
    stage += stats.stage;
    total_ns += stats.total_ns;
    benchmark::DoNotOptimize(c->heads.data());
  }
  const double iters = std::max<double>(1.0, static_cast<double>(state.iterations()));
  const auto ms = [&](int64_t ns) { return static_cast<double>(ns) * 1e-6 / iters; };
  // The CPU plan on the same chunk (float32 queries of the same bf16 values), 1 thread.
  std::vector<Matrix> qf;
  std::vector<ConstMatrixView> qv;
  for (int l = 0; l < layout.num_layers; ++l) {
    auto q = GatherWindowQueries(layout, qbytes.data() + qbytes.size() / layout.num_layers * l,
                                 o.window);
    if (!q.ok()) break;
    for (Matrix& m : *q) qf.push_back(std::move(m));
  }
  for (const Matrix& m : qf) qv.push_back(m.View());
  const CompressionInput cin{
      .raw = raw, .positions = positions, .window_queries = qv, .weights = weights};
  double cpu_s = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto c = Compress(o, layout, cin, nullptr, kOneCore);
    benchmark::DoNotOptimize(c.ok());
    cpu_s = std::min(cpu_s,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double d2d = D2DRate(raw.size());
  const double plan_s = static_cast<double>(total_ns) * 1e-9 / iters;
  const double convert_s = static_cast<double>(stage.convert_ns) * 1e-9 / iters;
  state.counters["plan_ms"] = plan_s * 1e3;
  state.counters["convert_ms"] = ms(stage.convert_ns);
  state.counters["score_ms"] = ms(stage.score_ns);
  state.counters["select_ms"] = ms(stage.select_ns);
  state.counters["derotate_ms"] = ms(stage.derotate_ns);
  state.counters["route_ms"] = ms(stage.route_ns);
  state.counters["encode_ms"] = ms(stage.encode_ns);
  state.counters["cpu_plan_ms"] = cpu_s * 1e3;
  state.counters["x_cpu"] = cpu_s / plan_s;
  state.counters["d2d_GBps"] = d2d * 1e-9;
  state.counters["x_d2d_convert"] =
      convert_s > 0 ? (2.5 * static_cast<double>(raw.size()) / d2d) / convert_s : 0.0;
  state.counters["x_d2d_plan"] = (static_cast<double>(raw.size()) / d2d) / plan_s;
}

// The demo chunk (SmolLM2-135M, 256 tokens, 30 layers). Args: {p_c in percent}.
void BM_DevicePlanDemoChunk(benchmark::State& state, ScoreStage score, RouteStage route) {
  const DemoChunk& d = DemoChunk::Get();
  const int64_t window = state.range(0) >= 90 ? 16 : DemoChunk::kW;
  const CompressionPlanOptions o{.score = score,
                                 .route = route,
                                 .p_c = static_cast<double>(state.range(0)) / 100.0,
                                 .window = window,
                                 .sinks = 4};
  RunDevicePlan(state, d.layout, d.raw, d.positions, d.queries, &d.weights, o);
}
BENCHMARK_CAPTURE(BM_DevicePlanDemoChunk, snapkv, ScoreStage::kSnapKv, RouteStage::kNone)
    ->Arg(50)
    ->Arg(75)
    ->Arg(90)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DevicePlanDemoChunk, snapkv_vector, ScoreStage::kSnapKv, RouteStage::kVector)
    ->Arg(50)
    ->Arg(75)
    ->Arg(90)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// kvd's default policy (KeyDiff, p_c 0.5).
BENCHMARK_CAPTURE(BM_DevicePlanDemoChunk, keydiff, ScoreStage::kKeyDiff, RouteStage::kNone)
    ->Arg(50)
    ->Arg(90)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// One Llama-3.1-8B-like layer (LayerData: N tokens, 8 KV heads, d 128, G 4, W 64) as a chunk of
// one layer: large enough that the bytes-bound stages are not launch-bound. Args: {p_c %}.
void BM_DevicePlanLayer(benchmark::State& state, RouteStage route) {
  const LayerData& d = LayerData::Get();
  const ModelLayout layout = d.Layout();
  const std::vector<uint8_t> raw = d.RawChunk();
  const VectorWeights weights = d.Weights();
  const CompressionPlanOptions o{.score = ScoreStage::kSnapKv,
                                 .route = route,
                                 .p_c = static_cast<double>(state.range(0)) / 100.0,
                                 .window = kWindow,
                                 .sinks = 4};
  RunDevicePlan(state, layout, raw, d.positions, d.queries, &weights, o);
}
BENCHMARK_CAPTURE(BM_DevicePlanLayer, snapkv, RouteStage::kNone)
    ->Arg(50)
    ->Arg(90)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DevicePlanLayer, snapkv_vector, RouteStage::kVector)
    ->Arg(50)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

#endif  // KVD_HAVE_CUDA

}  // namespace
}  // namespace kvd::kernels

int main(int argc, char** argv) {
  openblas_set_num_threads(1);  // per-core figures: the limits and the stages on one thread
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("kvd kernels bench: N=%lld tokens, %d KV heads, d=%d, G=%d, W=%d, bf16, 1 core\n",
              static_cast<long long>(kvd::kernels::Tokens()), kvd::kernels::kHeads,
              kvd::kernels::kDim, kvd::kernels::kGroup, kvd::kernels::kWindow);
  std::printf(
      "limits: sgemm [N,d]x[d,d] %.1f GFLOP/s; memcpy of one layer's bf16 K %.2f GB/s\n",
      kvd::kernels::SgemmRate(0.3) * 1e-9,
      kvd::kernels::MemcpyRate(static_cast<size_t>(kvd::kernels::Tokens()) * 8 * 128 * 2, 0.3) *
          1e-9);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
