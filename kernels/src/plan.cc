// Compression plan entry (plan.h): input checks, per-layer conversion, exact layer budgets,
// parallel per-head pipelines (plan_head.cc).
#include "kvd/kernels/plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kvd/kernels/convert.h"
#include "kvd/kernels/pyramidkv.h"
#include "kvd/kernels/quantize.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/stages.h"
#include "plan_internal.h"

namespace kvd::kernels {
namespace {

using Clock = std::chrono::steady_clock;

int64_t NanosSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

std::string HeadName(int layer, int head) {
  return "layer " + std::to_string(layer) + " head " + std::to_string(head);
}

// stage_keys: each a key of the plan's score, merge or route stage or, with quant on, of a
// quantize stage, with a value that fits it.
Status ValidateStageKeys(const CompressionPlanOptions& o) {
  for (const auto& [name, value] : o.stage_keys) {
    const StagePolicyKey* key = nullptr;
    const StageRegistration* owner = StageRegistry::Global().FindPolicyKey(name, &key);
    if (owner == nullptr || (owner != FindStage(o.score) && owner != FindStage(o.merge) &&
                             owner != FindStage(o.route) &&
                             !(owner->kind == StageKind::kQuantize && o.quant.quantized()))) {
      return Status::InvalidArgument("plan: stage key " + name +
                                     " is not a key of the plan's score, merge, route or "
                                     "quantize stage");
    }
    KVD_RETURN_IF_ERROR(CheckStagePolicyKey(*key, value).WithContext("plan"));
  }
  return Status::Ok();
}

}  // namespace

namespace internal {

// PyramidKV layer budgets adjusted so that they sum to exactly layers * m (see plan.h).
StatusOr<std::vector<int64_t>> ExactPyramidBudgets(int64_t n, int layers, int64_t m, int64_t forced,
                                                   const CompressionPlanOptions& o) {
  KVD_ASSIGN_OR_RETURN(
      PyramidKvBudgets pb,
      PyramidKvLayerBudgets(n, layers, o.p_c, {.window = o.window, .beta = o.pyramid_beta}));
  std::vector<int64_t> b = pb.per_layer;
  for (int64_t& x : b) x = std::clamp(x, forced, n);
  int64_t diff = static_cast<int64_t>(layers) * m - std::accumulate(b.begin(), b.end(), int64_t{0});
  std::vector<int> order(static_cast<size_t>(layers));
  std::iota(order.begin(), order.end(), 0);
  // Over budget: take from the largest layers first; under: give to the smallest first.
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return diff < 0 ? b[x] > b[y] : b[x] < b[y]; });
  while (diff != 0) {
    bool moved = false;
    for (int l : order) {
      if (diff == 0) break;
      if (diff > 0 && b[l] < n) {
        ++b[l];
        --diff;
        moved = true;
      } else if (diff < 0 && b[l] > forced) {
        --b[l];
        ++diff;
        moved = true;
      }
    }
    if (!moved) {
      return Status::OutOfRange("PyramidKV: layer budgets cannot sum to " +
                                std::to_string(static_cast<int64_t>(layers) * m));
    }
  }
  return b;
}

QuantDescription ChunkQuant(const QuantDescription& q, std::span<const int64_t> positions) {
  QuantDescription out = q;
  uint32_t rows = 0;
  while (rows < q.sinks && rows < positions.size() &&
         positions[rows] < static_cast<int64_t>(q.sinks)) {
    ++rows;
  }
  out.sinks = rows;
  return out;
}

}  // namespace internal

namespace {

// CompressionPlanOptions::Validate's checks, in its order: the stages, p_c, quantization and the
// budget's window and sinks; the scorers' knobs; the merge knobs (hybrid, head budget, guard,
// gate); adaptive routing.
Status ValidateStagesAndBudget(const CompressionPlanOptions& o) {
  if (FindStage(o.score) == nullptr ||
      (o.merge != MergeStage::kNone && FindStage(o.merge) == nullptr) ||
      (o.route != RouteStage::kNone && FindStage(o.route) == nullptr)) {
    return Status::InvalidArgument("plan: unknown stage");
  }
  if (!(o.p_c >= 0.0 && o.p_c < 1.0)) {
    return Status::OutOfRange("plan: p_c must be in [0, 1), got " + std::to_string(o.p_c));
  }
  if (o.quant.quantized()) KVD_RETURN_IF_ERROR(ValidateQuantize(o.quant).WithContext("plan"));
  if (!o.quant.quantized() && !(o.quant == QuantDescription{})) {
    return Status::InvalidArgument("plan: quant groups or recent window without a format");
  }
  if (o.window < 1) return Status::InvalidArgument("plan: window must be >= 1");
  if (o.sinks < 0) return Status::InvalidArgument("plan: sinks must be >= 0");
  if (o.quant.sinks > o.sinks) {
    return Status::InvalidArgument(
        "plan: " + std::string(internal::kQuantSinks) + " (quant.sinks) " +
        std::to_string(o.quant.sinks) + " exceeds sinks " + std::to_string(o.sinks) +
        ": only the tokens the plan always keeps can stay unquantized; lower " +
        internal::kQuantSinks + " or raise sinks");
  }
  return Status::Ok();
}

Status ValidateScoreKnobs(const CompressionPlanOptions& o) {
  if (o.pooling_kernel < 1 || o.pooling_kernel % 2 == 0) {
    return Status::InvalidArgument("plan: pooling_kernel must be odd and >= 1");
  }
  if (o.keydiff_block < 0) return Status::InvalidArgument("plan: keydiff_block must be >= 0");
  if (!(o.pyramid_beta >= 1.0)) return Status::InvalidArgument("plan: pyramid_beta must be >= 1");
  if (!(o.route_eps >= 0.0 && o.route_eps < 1.0)) {
    return Status::InvalidArgument("plan: route_eps must be in [0, 1)");
  }
  return Status::Ok();
}

Status ValidateHybridAndBudget(const CompressionPlanOptions& o) {
  if (o.hybrid_max_group < 1) {
    return Status::InvalidArgument("plan: hybrid_max_group must be >= 1, got " +
                                   std::to_string(o.hybrid_max_group));
  }
  if (!(o.hybrid_min_cos >= -1.0 && o.hybrid_min_cos <= 1.0)) {
    return Status::InvalidArgument("plan: hybrid_min_cos must be in [-1, 1]");
  }
  if (o.hybrid_error_aware && (o.score == ScoreStage::kNone || o.merge != MergeStage::kKvSlimmer)) {
    return Status::InvalidArgument(
        "plan: hybrid_error_aware needs the hybrid (a score stage and merge kKvSlimmer)");
  }
  if (static_cast<uint8_t>(o.head_budget) > static_cast<uint8_t>(HeadBudget::kAdaptive)) {
    return Status::InvalidArgument("plan: unknown head_budget");
  }
  if (!(o.adaptive_floor >= 0.0 && o.adaptive_floor <= 1.0)) {
    return Status::InvalidArgument("plan: adaptive_floor must be in [0, 1]");
  }
  return Status::Ok();
}

Status ValidateMergeGuardAndGate(const CompressionPlanOptions& o) {
  if (static_cast<uint8_t>(o.merge_guard) > static_cast<uint8_t>(MergeGuard::kMean)) {
    return Status::InvalidArgument("plan: unknown merge_guard");
  }
  if (!(o.merge_guard_alpha_margin >= 0.0 && o.merge_guard_alpha_margin <= 0.5)) {
    return Status::InvalidArgument("plan: merge_guard_alpha_margin must be in [0, 0.5], got " +
                                   std::to_string(o.merge_guard_alpha_margin));
  }
  if (o.merge_gate && o.merge != MergeStage::kKvSlimmer) {
    return Status::InvalidArgument("plan: merge_gate needs a merge stage (merge kKvSlimmer)");
  }
  if (!(o.merge_gate_min_cos >= -1.0 && o.merge_gate_min_cos <= 1.0)) {
    return Status::InvalidArgument("plan: merge_gate_min_cos must be in [-1, 1], got " +
                                   std::to_string(o.merge_gate_min_cos));
  }
  if (!(o.merge_gate_layer_min >= -1.0 && o.merge_gate_layer_min <= 1.0)) {
    return Status::InvalidArgument("plan: merge_gate_layer_min must be in [-1, 1], got " +
                                   std::to_string(o.merge_gate_layer_min));
  }
  return Status::Ok();
}

Status ValidateRouteAdaptive(const CompressionPlanOptions& o) {
  if (!o.route_adaptive) return Status::Ok();
  if (o.route != RouteStage::kVector) {
    return Status::InvalidArgument("plan: route_adaptive needs route kVector");
  }
  if (!(std::isfinite(o.route_max_error) && o.route_max_error >= 0.0)) {
    return Status::InvalidArgument("plan: route_max_error must be finite and >= 0, got " +
                                   std::to_string(o.route_max_error));
  }
  if (!(std::isfinite(o.route_min_r2) && o.route_min_r2 <= 1.0)) {
    return Status::InvalidArgument("plan: route_min_r2 must be finite and <= 1, got " +
                                   std::to_string(o.route_min_r2));
  }
  return Status::Ok();
}

}  // namespace

Status CompressionPlanOptions::Validate() const {
  KVD_RETURN_IF_ERROR(ValidateStagesAndBudget(*this));
  KVD_RETURN_IF_ERROR(ValidateScoreKnobs(*this));
  KVD_RETURN_IF_ERROR(ValidateHybridAndBudget(*this));
  KVD_RETURN_IF_ERROR(ValidateMergeGuardAndGate(*this));
  KVD_RETURN_IF_ERROR(ValidateRouteAdaptive(*this));
  if (const StageRegistration* s = FindStage(score); s->validate != nullptr) {
    KVD_RETURN_IF_ERROR(s->validate(*this));
  }
  KVD_RETURN_IF_ERROR(ValidateStageKeys(*this));
  if (head_budget == HeadBudget::kAdaptive) {
    if (score == ScoreStage::kNone) {
      return Status::InvalidArgument(
          "plan: head_budget kAdaptive needs a score stage (SnapKV, KeyDiff or PyramidKV)");
    }
    if (keydiff_block > 0) {
      return Status::InvalidArgument(
          "plan: head_budget kAdaptive is not supported with block-wise KeyDiff");
    }
  }
  return Status::Ok();
}

CompressionStageTimes& CompressionStageTimes::operator+=(const CompressionStageTimes& o) {
  convert_ns += o.convert_ns;
  derotate_ns += o.derotate_ns;
  score_ns += o.score_ns;
  select_ns += o.select_ns;
  merge_ns += o.merge_ns;
  route_ns += o.route_ns;
  encode_ns += o.encode_ns;
  return *this;
}

CodecDescription CompressionPlanOptions::Codec(uint64_t calibration_version) const {
  return {.score = score,
          .merge = merge,
          .merge_norm = merge_norm,
          .route = route,
          .position = position,
          .p_c = p_c,
          .calibration_version = calibration_version,
          .quant = {}};  // set by the quantize stage (QuantizeChunk)
}

namespace {

// Adds one head's counters to the plan's.
void AddHeadStats(const CompressionStats& s, CompressionStats* total) {
  total->heads += s.heads;
  total->input_tokens += s.input_tokens;
  total->slots += s.slots;
  total->rebuild_slots += s.rebuild_slots;
  total->merged_tokens += s.merged_tokens;
  total->evicted_tokens += s.evicted_tokens;
  total->budget_half_pairs += s.budget_half_pairs;
  total->half_pairs += s.half_pairs;
  total->route_reductions += s.route_reductions;
  total->route_floor_heads += s.route_floor_heads;
  total->error_aware_evicted += s.error_aware_evicted;
  total->gate_evicted_tokens += s.gate_evicted_tokens;
  total->kvslimmer += s.kvslimmer;
  total->stage += s.stage;
}

// The window queries and VECTOR weights Compress needs, checked against the options and the
// layout (`group` query heads per KV head). Returns the weights to route with (null: no route).
StatusOr<const VectorWeights*> CheckQueriesAndWeights(const CompressionPlanOptions& options,
                                                      const ModelLayout& layout,
                                                      const CompressionInput& input, int group) {
  const int L = layout.num_layers;
  const int H = layout.num_kv_heads;
  const int64_t d = layout.head_dim;
  const bool have_queries = !input.window_queries.empty();
  // A merge stage needs the queries only on its own (the hybrid weighs uniformly without them).
  const StageRegistration* needy =
      options.score == ScoreStage::kNone && options.merge != MergeStage::kNone
          ? FindStage(options.merge)
          : FindStage(options.score);
  if (needy->needs_window_queries && !have_queries) {
    return Status::FailedPrecondition("plan: " + needy->name + " needs window queries");
  }
  if (options.hybrid_error_aware && !have_queries) {
    return Status::FailedPrecondition(
        "plan: hybrid_error_aware needs window queries (its error estimate uses them)");
  }
  if (have_queries) {
    if (input.window_queries.size() != static_cast<size_t>(L) * H) {
      return Status::InvalidArgument(
          "plan: window_queries must hold num_layers * num_kv_heads views");
    }
    for (size_t i = 0; i < input.window_queries.size(); ++i) {
      const ConstMatrixView& q = input.window_queries[i];
      if (q.rows != options.window * group || q.cols != d || q.ld < q.cols || q.data == nullptr) {
        return Status::InvalidArgument("plan: window queries of " +
                                       HeadName(static_cast<int>(i) / H, static_cast<int>(i) % H) +
                                       " must be [window * G, d] = [" +
                                       std::to_string(options.window * group) + ", " +
                                       std::to_string(d) + "]");
      }
      KVD_RETURN_IF_ERROR(CheckFinite(q, "window queries"));
    }
  }
  const StageRegistration* route = FindStage(options.route);
  if (route == nullptr || !route->needs_calibration) return nullptr;
  const VectorWeights* weights = input.weights;
  if (weights == nullptr) {
    return Status::FailedPrecondition("plan: " + route->name + " routing needs weights");
  }
  if (weights->num_layers != L || weights->num_kv_heads != H || weights->head_dim != d ||
      weights->heads.size() != static_cast<size_t>(L) * H) {
    return Status::FailedPrecondition("plan: VECTOR weights shape does not match the layout");
  }
  return weights;
}

// The chunk's shape against the layout: tokens, raw bytes, positions, query heads per KV head.
Status CheckChunk(const ModelLayout& layout, const CompressionInput& input) {
  const int64_t n = static_cast<int64_t>(input.positions.size());
  if (n < 1) return Status::InvalidArgument("plan: the chunk has no tokens");
  if (input.raw.size() != layout.ChunkBytes(static_cast<int>(n))) {
    return Status::InvalidArgument("plan: raw chunk has " + std::to_string(input.raw.size()) +
                                   " bytes, layout needs " +
                                   std::to_string(layout.ChunkBytes(static_cast<int>(n))) +
                                   " for " + std::to_string(n) + " tokens");
  }
  for (int64_t p : input.positions) {
    if (p < 0) return Status::InvalidArgument("plan: negative position");
  }
  if (layout.num_q_heads % layout.num_kv_heads != 0) {
    return Status::InvalidArgument("plan: num_q_heads is not a multiple of num_kv_heads");
  }
  return Status::Ok();
}

// Query statistics, when given, must have the layout's layers, query heads and head_dim.
Status CheckQueryStatsShape(const QueryStatistics* query_stats, const ModelLayout& layout) {
  if (query_stats != nullptr && (query_stats->num_layers() != layout.num_layers ||
                                 query_stats->num_q_heads() != layout.num_q_heads ||
                                 query_stats->head_dim() != layout.head_dim)) {
    return Status::FailedPrecondition(
        "plan: query statistics shape does not match the layout (layers, query heads, "
        "head_dim)");
  }
  return Status::Ok();
}

// The pairs each layer keeps: m = round((1 - p_c) * n) per layer, or the score's layer budgets.
// Fails when the chunk is shorter than its sinks and window.
StatusOr<std::vector<int64_t>> LayerPairs(const StageRegistration& score,
                                          const CompressionPlanOptions& options, int64_t n,
                                          int layers, int64_t window) {
  const int64_t forced = std::min<int64_t>(n, options.sinks) + window;
  if (n < options.sinks + window) {
    return Status::InvalidArgument("plan: N=" + std::to_string(n) + " is smaller than sinks (" +
                                   std::to_string(options.sinks) + ") + window (" +
                                   std::to_string(window) + ")");
  }
  const int64_t m = std::llround((1.0 - options.p_c) * static_cast<double>(n));
  std::vector<int64_t> layer_pairs(static_cast<size_t>(layers), m);
  if (score.layer_budgets != nullptr) {
    KVD_ASSIGN_OR_RETURN(layer_pairs, score.layer_budgets(n, layers, m, forced, options));
  }
  return layer_pairs;
}

// What every layer of one Compress call reads; its input and options are checked.
struct PlanRun {
  const CompressionPlanOptions& options;
  const ModelLayout& layout;
  const CompressionInput& input;
  const ExecOptions& exec;
  ExecOptions convert_exec;            // exec's backend, threads and stream
  const QueryStatistics* query_stats;  // null unless the score reads expected queries
  const VectorWeights* weights;        // null unless routing with VECTOR weights
  const RopeTable& rope;
  int group;              // query heads per KV head
  int64_t window;         // options.window with window queries, else 0
  int64_t last_position;  // the chunk's largest position

  int kv_heads() const { return layout.num_kv_heads; }
  int64_t tokens() const { return static_cast<int64_t>(input.positions.size()); }
  // The window queries of (layer, h); empty without window queries.
  ConstMatrixView Queries(int layer, int64_t h) const {
    return input.window_queries.empty()
               ? ConstMatrixView{}
               : input.window_queries[static_cast<size_t>(layer) * kv_heads() + h];
  }
};

// The layer's key and value heads, converted from the raw chunk; the time goes to convert_ns.
Status GatherLayer(const PlanRun& run, int layer, std::vector<Matrix>* keys,
                   std::vector<Matrix>* values, CompressionStats* total) {
  const int64_t n = run.tokens();
  const ModelLayout& layout = run.layout;
  const EngineTensorShape shape{.tokens = n,
                                .num_heads = layout.num_kv_heads,
                                .head_dim = layout.head_dim,
                                .dtype = layout.dtype};
  const uint8_t* k_bytes = run.input.raw.data() + layout.LayerOffset(layer, static_cast<int>(n));
  const uint8_t* v_bytes = k_bytes + static_cast<size_t>(n) * layout.TokenBytes();
  const Clock::time_point convert_start = Clock::now();
  KVD_ASSIGN_OR_RETURN(*keys, GatherHeads(shape, k_bytes, run.convert_exec));
  KVD_ASSIGN_OR_RETURN(*values, GatherHeads(shape, v_bytes, run.convert_exec));
  total->stage.convert_ns += NanosSince(convert_start);
  return Status::Ok();
}

// The expected queries of each KV head of the layer; empty without query statistics.
StatusOr<std::vector<ExpectedQueries>> LayerExpectedQueries(const PlanRun& run, int layer) {
  std::vector<ExpectedQueries> expected(
      run.query_stats != nullptr ? static_cast<size_t>(run.kv_heads()) : 0);
  for (size_t h = 0; h < expected.size(); ++h) {
    KVD_ASSIGN_OR_RETURN(expected[h],
                         ExpectedQueriesFor(*run.query_stats, layer, static_cast<int>(h), run.group,
                                            run.last_position, run.options.expected_attention));
  }
  return expected;
}

// One layer's heads as the plan hands them to the per-head pipeline.
struct LayerHeads {
  std::vector<Matrix> keys, values;       // [H] of [N, d]
  std::vector<ExpectedQueries> expected;  // [H], or empty without query statistics
  std::vector<int64_t> pairs;             // [H] the pairs each head keeps
  // HeadBudget::kAdaptive: [H] the scores that shared out the layer's budget, which the heads'
  // pools are selected with (each head is scored once); else empty (the pipeline scores).
  std::vector<std::vector<float>> scores;
  bool merge_open = true;  // the merge gate's verdict on the layer (plan.h merge_gate)
};

// HeadBudget::kAdaptive: scores every head of `heads` (kept = the layer's budget) into
// heads->scores and shares `layer_pairs` among them by those scores into heads->pairs; the
// scoring time goes to score_ns.
Status AdaptiveLayerHeadPairs(const PlanRun& run, int layer, int64_t layer_pairs, LayerHeads* heads,
                              CompressionStats* total) {
  const int H = run.kv_heads();
  std::vector<std::vector<float>>& scores = heads->scores;
  scores.assign(static_cast<size_t>(H), {});
  std::vector<Status> head_status(static_cast<size_t>(H));
  std::vector<int64_t> score_ns(static_cast<size_t>(H), 0);
  ParallelFor(H, run.exec.num_threads, [&](int64_t h) {
    const Clock::time_point score_start = Clock::now();
    head_status[h] = internal::HeadScores(
        run.options, heads->keys[h].View(), heads->values[h].View(), run.Queries(layer, h),
        run.window, run.group, layer_pairs,
        heads->expected.empty() ? nullptr : &heads->expected[static_cast<size_t>(h)], &scores[h]);
    score_ns[h] += NanosSince(score_start);
  });
  for (int h = 0; h < H; ++h) {
    KVD_RETURN_IF_ERROR(head_status[h].WithContext("plan: scores of " + HeadName(layer, h)));
  }
  for (int64_t ns : score_ns) total->stage.score_ns += ns;
  KVD_ASSIGN_OR_RETURN(heads->pairs, AdaptiveHeadBudgets(scores, layer_pairs, run.options.sinks,
                                                         run.window, run.options.adaptive_floor));
  return Status::Ok();
}

// Whether the merge gate lets the layer merge (always without the gate); a closed layer is
// counted in gate_closed_layers.
StatusOr<bool> MergeLayerOpen(const PlanRun& run, const std::vector<Matrix>& keys,
                              CompressionStats* total) {
  if (!run.options.merge_gate) return true;
  KVD_ASSIGN_OR_RETURN(const double adjacent,
                       internal::LayerCentredAdjacentCosine(run.rope, keys, run.input.positions));
  const bool open = adjacent >= run.options.merge_gate_layer_min;
  total->gate_closed_layers += open ? 0 : 1;
  return open;
}

// Compresses one layer's heads in parallel into `chunk`, each keeping its pairs.
Status CompressLayerHeads(const PlanRun& run, int layer, const LayerHeads& heads,
                          CompactChunk* chunk, CompressionStats* total) {
  const int H = run.kv_heads();
  std::vector<CompressionStats> head_stats(static_cast<size_t>(H));
  std::vector<Status> head_status(static_cast<size_t>(H));
  ParallelFor(H, run.exec.num_threads, [&](int64_t h) {
    internal::HeadInput hi;
    hi.head.options = &run.options;
    hi.head.rope = &run.rope;
    hi.head.keys = heads.keys[h].View();
    hi.head.values = heads.values[h].View();
    hi.head.positions = run.input.positions;
    hi.head.queries = run.Queries(layer, h);
    hi.head.window = run.window;
    hi.head.group_size = run.group;
    hi.head.layer_open = heads.merge_open;
    hi.expected = heads.expected.empty() ? nullptr : &heads.expected[static_cast<size_t>(h)];
    hi.scores = heads.scores.empty() ? nullptr : &heads.scores[static_cast<size_t>(h)];
    hi.kept_pairs = heads.pairs[h];
    hi.fit = run.weights != nullptr ? &run.weights->Head(layer, static_cast<int>(h)) : nullptr;
    hi.dtype = run.layout.dtype;
    head_stats[h] = CompressionStats{};
    head_status[h] =
        internal::CompressHead(hi, &chunk->Head(layer, static_cast<int>(h)), &head_stats[h]);
  });
  for (int h = 0; h < H; ++h) {
    KVD_RETURN_IF_ERROR(head_status[h].WithContext("plan: " + HeadName(layer, h)));
    AddHeadStats(head_stats[h], total);
  }
  return Status::Ok();
}

// One layer of the plan: convert, budget the heads, gate the merges, compress each head.
Status CompressLayer(const PlanRun& run, int layer, int64_t layer_pairs, CompactChunk* chunk,
                     CompressionStats* total) {
  LayerHeads heads;
  KVD_RETURN_IF_ERROR(GatherLayer(run, layer, &heads.keys, &heads.values, total));
  heads.pairs.assign(static_cast<size_t>(run.kv_heads()), layer_pairs);
  KVD_ASSIGN_OR_RETURN(heads.expected, LayerExpectedQueries(run, layer));
  if (run.options.head_budget == HeadBudget::kAdaptive) {
    KVD_RETURN_IF_ERROR(AdaptiveLayerHeadPairs(run, layer, layer_pairs, &heads, total));
  }
  KVD_ASSIGN_OR_RETURN(heads.merge_open, MergeLayerOpen(run, heads.keys, total));
  return CompressLayerHeads(run, layer, heads, chunk, total);
}

// `o` with every policy key of its score, merge and route stages that it leaves unset set to its
// default (StageKeyValue), so that the stages read their keys per head as map hits, without a
// registry lookup.
CompressionPlanOptions WithStageKeyDefaults(const CompressionPlanOptions& o) {
  CompressionPlanOptions out = o;
  for (const StageRegistration* stage :
       {FindStage(o.score), FindStage(o.merge), FindStage(o.route)}) {
    if (stage == nullptr) continue;
    for (const StagePolicyKey& key : stage->policy_keys) {
      if (!out.stage_keys.contains(key.name)) {
        out.stage_keys[key.name] = StageKeyValue(o.stage_keys, key.name);
      }
    }
  }
  return out;
}

}  // namespace

StatusOr<CompactChunk> Compress(const CompressionPlanOptions& given, const ModelLayout& layout,
                                const CompressionInput& input, CompressionStats* stats,
                                const ExecOptions& exec) {
  const Clock::time_point start = Clock::now();
  KVD_RETURN_IF_ERROR(given.Validate());
  const CompressionPlanOptions options = WithStageKeyDefaults(given);
  KVD_RETURN_IF_ERROR(layout.Validate());
  KVD_RETURN_IF_ERROR(CheckHeadDim(layout.head_dim).WithContext("plan"));
  KVD_RETURN_IF_ERROR(CheckChunk(layout, input));
  const int64_t n = static_cast<int64_t>(input.positions.size());
  const int group = layout.num_q_heads / layout.num_kv_heads;
  const QueryStatistics* query_stats = nullptr;
  const StageRegistration* score = FindStage(options.score);
  if (score->needs_query_stats) {
    query_stats = input.query_stats;
    KVD_RETURN_IF_ERROR(CheckQueryStatsShape(query_stats, layout));
    if (query_stats == nullptr ||
        query_stats->MinCount() < options.expected_attention_min_queries) {
      CompressionPlanOptions fallback = options;  // plan.h: one-shot KeyDiff until then
      fallback.score = ScoreStage::kKeyDiff;
      fallback.keydiff_block = 0;
      std::erase_if(fallback.stage_keys, [score](const auto& key) {  // the replaced stage's keys
        return StageRegistry::Global().FindPolicyKey(key.first) == score;
      });
      return Compress(fallback, layout, input, stats, exec);
    }
  }
  KVD_ASSIGN_OR_RETURN(const VectorWeights* weights,
                       CheckQueriesAndWeights(options, layout, input, group));
  const int64_t window = !input.window_queries.empty() ? options.window : 0;
  KVD_ASSIGN_OR_RETURN(const std::vector<int64_t> layer_pairs,
                       LayerPairs(*score, options, n, layout.num_layers, window));
  KVD_ASSIGN_OR_RETURN(RopeTable rope, RopeTable::Create(layout.rope, layout.head_dim));
  const PlanRun run{
      .options = options,
      .layout = layout,
      .input = input,
      .exec = exec,
      .convert_exec = {.backend = exec.backend,
                       .num_threads = exec.num_threads,
                       .cuda_stream = exec.cuda_stream},
      .query_stats = query_stats,
      .weights = weights,
      .rope = rope,
      .group = group,
      .window = window,
      .last_position = *std::max_element(input.positions.begin(), input.positions.end())};
  CompactChunk chunk =
      CompactChunk::ForLayout(layout, n, options.Codec(weights != nullptr ? weights->version : 0));
  CompressionStats total;
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    KVD_RETURN_IF_ERROR(CompressLayer(run, layer, layer_pairs[layer], &chunk, &total));
  }
  if (options.quant.quantized()) {
    const Clock::time_point quant_start = Clock::now();
    KVD_ASSIGN_OR_RETURN(chunk,
                         QuantizeChunk(chunk, internal::ChunkQuant(options.quant, input.positions),
                                       run.convert_exec));
    total.stage.encode_ns += NanosSince(quant_start);
  }
  total.total_ns = NanosSince(start);
  if (stats != nullptr) *stats = total;
  return chunk;
}

StatusOr<std::vector<int64_t>> AdaptiveHeadBudgets(std::span<const std::vector<float>> scores,
                                                   int64_t kept, int64_t sinks, int64_t window,
                                                   double floor) {
  if (scores.empty()) return Status::InvalidArgument("AdaptiveHeadBudgets: no heads");
  if (!(floor >= 0.0 && floor <= 1.0)) {
    return Status::InvalidArgument("AdaptiveHeadBudgets: floor must be in [0, 1]");
  }
  const int64_t n = static_cast<int64_t>(scores[0].size());
  const int64_t heads = static_cast<int64_t>(scores.size());
  for (const auto& s : scores) {
    if (static_cast<int64_t>(s.size()) != n) {
      return Status::InvalidArgument("AdaptiveHeadBudgets: heads have different token counts");
    }
    for (float x : s) {
      if (std::isnan(x)) return Status::InvalidArgument("AdaptiveHeadBudgets: NaN score");
    }
  }
  const int64_t lo = std::min(n, std::max<int64_t>(0, sinks));
  const int64_t hi = std::max(lo, n - std::max<int64_t>(0, window));
  const int64_t forced = lo + (n - hi);
  const int64_t share = kept - forced;
  std::vector<int64_t> out(static_cast<size_t>(heads), kept);
  if (share <= 0 || hi <= lo) return out;
  const int64_t floor_n = std::min(hi - lo, static_cast<int64_t>(std::floor(floor * share)));
  struct Cand {
    float score;
    int64_t head, index;
  };
  std::vector<Cand> rest;
  rest.reserve(static_cast<size_t>(heads * (hi - lo)));
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<int64_t> idx(static_cast<size_t>(hi - lo));
    for (int64_t i = lo; i < hi; ++i) idx[i - lo] = i;
    const auto& sc = scores[h];
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return sc[a] > sc[b]; });
    out[h] = forced + floor_n;
    for (size_t k = static_cast<size_t>(floor_n); k < idx.size(); ++k) {
      rest.push_back({sc[idx[k]], h, idx[k]});
    }
  }
  const int64_t extra =
      std::min<int64_t>(static_cast<int64_t>(rest.size()), heads * (share - floor_n));
  std::nth_element(rest.begin(), rest.begin() + extra, rest.end(),
                   [](const Cand& a, const Cand& b) {
                     if (a.score != b.score) return a.score > b.score;
                     if (a.index != b.index) return a.index < b.index;
                     return a.head < b.head;
                   });
  for (int64_t k = 0; k < extra; ++k) ++out[rest[k].head];
  return out;
}

StatusOr<std::vector<Matrix>> GatherWindowQueries(const ModelLayout& layout, const void* q,
                                                  int64_t window) {
  KVD_RETURN_IF_ERROR(layout.Validate());
  const int H = layout.num_kv_heads;
  const int hq = layout.num_q_heads;
  if (window < 1 || q == nullptr || hq % H != 0) {
    return Status::InvalidArgument(
        "GatherWindowQueries: need window >= 1, queries, and "
        "num_q_heads a multiple of num_kv_heads");
  }
  const int g = hq / H;
  const int64_t d = layout.head_dim;
  const size_t e = DTypeSize(layout.dtype);
  std::vector<Matrix> out(static_cast<size_t>(H), Matrix(window * g, d));
  const auto* bytes = static_cast<const uint8_t*>(q);
  for (int64_t w = 0; w < window; ++w) {
    for (int qh = 0; qh < hq; ++qh) {
      const uint8_t* src = bytes + (static_cast<size_t>(w) * hq + qh) * d * e;
      ConvertToFloat(layout.dtype, src, out[qh / g].Row(w * g + qh % g), static_cast<size_t>(d));
    }
  }
  for (const Matrix& m : out) KVD_RETURN_IF_ERROR(CheckFinite(m.View(), "window queries"));
  return out;
}

Status CalibrateFromChunk(const ModelLayout& layout, std::span<const uint8_t> raw,
                          std::span<const int64_t> positions, VectorCalibrator* calibrator,
                          const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(layout.Validate());
  const int64_t n = static_cast<int64_t>(positions.size());
  if (raw.size() != layout.ChunkBytes(static_cast<int>(n))) {
    return Status::InvalidArgument("CalibrateFromChunk: raw size does not match the layout");
  }
  if (calibrator->num_layers() != layout.num_layers ||
      calibrator->num_kv_heads() != layout.num_kv_heads ||
      calibrator->head_dim() != layout.head_dim) {
    return Status::FailedPrecondition("CalibrateFromChunk: calibrator shape differs from layout");
  }
  KVD_ASSIGN_OR_RETURN(RopeTable rope, RopeTable::Create(layout.rope, layout.head_dim));
  const EngineTensorShape shape{.tokens = n,
                                .num_heads = layout.num_kv_heads,
                                .head_dim = layout.head_dim,
                                .dtype = layout.dtype};
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    const uint8_t* k_bytes = raw.data() + layout.LayerOffset(layer, static_cast<int>(n));
    const uint8_t* v_bytes = k_bytes + static_cast<size_t>(n) * layout.TokenBytes();
    KVD_ASSIGN_OR_RETURN(std::vector<Matrix> keys, GatherHeads(shape, k_bytes, exec));
    KVD_ASSIGN_OR_RETURN(std::vector<Matrix> values, GatherHeads(shape, v_bytes, exec));
    std::vector<MatrixView> views;
    views.reserve(keys.size());
    for (Matrix& k : keys) views.push_back(k.View());
    KVD_RETURN_IF_ERROR(ApplyRope(rope, RopeDirection::kDerotate, positions, views, exec));
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      KVD_RETURN_IF_ERROR(calibrator->Add(layer, h, keys[h].View(), values[h].View(), exec));
    }
  }
  return Status::Ok();
}

}  // namespace kvd::kernels
