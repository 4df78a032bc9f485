// One (layer, KV head) of a compression plan: score -> select -> merge -> route -> encode. The
// merge and route steps are the registered stages' (stages.h MergeFn, RouteFn; the built-in ones
// are merge_kvslimmer.cc and route_vector.cc). The contract (stages, budget, hybrid merge) is the
// file comment of plan.h.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/observation.h"
#include "kvd/kernels/scorers.h"
#include "kvd/kernels/snapkv.h"
#include "kvd/kernels/stages.h"
#include "plan_internal.h"

namespace kvd::kernels::internal {
namespace {

void CopyRow(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }

// Exclusive stage times (plan.h CompressionStageTimes): the time between two switches goes to
// the stage that was open.
struct StageClock {
  using Clock = std::chrono::steady_clock;
  int64_t* open = nullptr;
  Clock::time_point mark;
  void Switch(int64_t* to) {
    const Clock::time_point now = Clock::now();
    if (open != nullptr) {
      *open += std::chrono::duration_cast<std::chrono::nanoseconds>(now - mark).count();
    }
    open = to;
    mark = now;
  }
};

// Attributes the time until its end to `stage`, pausing the enclosing stage meanwhile.
class StageScope {
 public:
  StageScope(StageClock* clock, int64_t* stage) : clock_(clock), outer_(clock->open) {
    clock_->Switch(stage);
  }
  ~StageScope() { clock_->Switch(outer_); }
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

 private:
  StageClock* clock_;
  int64_t* outer_;
};

// One head's pipeline; it is the HeadCache (stages.h) of its merge and route stages.
class HeadPipeline final : public HeadCache {
 public:
  explicit HeadPipeline(const HeadInput& in)
      : in_(in), opt_(*in.head.options), n_(in.head.keys.rows), d_(in.head.keys.cols) {}

  Status Run(CompactHead* out, CompressionStats* stats);

  StatusOr<ConstMatrixView> KeysPre() override;
  StatusOr<std::span<const float>> Mass() override;
  StatusOr<std::span<const float>> Center() override;

 private:
  bool IsForced(int64_t i) const { return i < opt_.sinks || i >= n_ - in_.head.window; }
  Status EnsureKeysPre();
  Status EnsureScores();
  Status EnsureMass();
  Status EnsureCenter();  // merge_gate: the head's mean pre-RoPE key
  StatusOr<std::vector<int32_t>> SelectPool(int64_t pool);
  Status BuildEviction(const std::vector<int32_t>& pool, HeadSlots* t);
  // The `pool` slots of the head: the plan's merge stage's (its MergeFn), else eviction.
  Status BuildSlots(const StageRegistration* merge, int64_t pool, HeadSlots* t);
  // Per slot: the route stage's cost of dropping its value (RouteFn), +Inf where it may not.
  Status RouteErrors(const StageRegistration& route, const HeadSlots& t, std::vector<float>* err);
  static int64_t Eligible(const std::vector<float>& err);
  Status Route(int64_t key_only, const std::vector<float>& err, HeadSlots* t);
  void Encode(const HeadSlots& t, CompactHead* out) const;
  void AddStats(const HeadSlots& t, const CompactHead& out, int64_t a, bool reduced,
                bool floor_head, CompressionStats* stats) const;

  const HeadInput& in_;
  const CompressionPlanOptions& opt_;
  const int64_t n_;
  const int64_t d_;
  Matrix kpre_;                    // [N, d] de-rotated keys (lazy)
  std::vector<float> own_scores_;  // [N] when the pipeline scores the head
  std::span<const float> scores_;  // [N] (lazy): in_.scores or own_scores_
  std::vector<float> mass_;        // [N] attention mass (lazy; empty without queries)
  bool have_kpre_ = false, have_scores_ = false, have_mass_ = false;
  std::unique_ptr<MergeState> merge_state_;  // the merge stage's, across route budget retries
  CompressionStageTimes times_;
  StageClock clock_;
  std::vector<float> center_;  // merge_gate (lazy)
  bool have_center_ = false;
};

StatusOr<ConstMatrixView> HeadPipeline::KeysPre() {
  KVD_RETURN_IF_ERROR(EnsureKeysPre());
  return std::as_const(kpre_).View();
}

StatusOr<std::span<const float>> HeadPipeline::Mass() {
  KVD_RETURN_IF_ERROR(EnsureMass());
  return std::span<const float>(mass_);
}

StatusOr<std::span<const float>> HeadPipeline::Center() {
  KVD_RETURN_IF_ERROR(EnsureCenter());
  return std::span<const float>(center_);
}

Status HeadPipeline::EnsureCenter() {
  if (have_center_) return Status::Ok();
  KVD_RETURN_IF_ERROR(EnsureKeysPre());
  MeanCentredAdjacentCosine(kpre_.View(), &center_);
  have_center_ = true;
  return Status::Ok();
}

Status HeadPipeline::EnsureKeysPre() {
  if (have_kpre_) return Status::Ok();
  StageScope scope(&clock_, &times_.derotate_ns);
  kpre_ = Matrix(n_, d_);
  KVD_RETURN_IF_ERROR(ApplyRope(*in_.head.rope, RopeDirection::kDerotate, in_.head.positions,
                                in_.head.keys, kpre_.View(), {.num_threads = 1}));
  have_kpre_ = true;
  return Status::Ok();
}

Status HeadPipeline::EnsureScores() {
  if (have_scores_) return Status::Ok();
  if (in_.scores != nullptr) {  // the plan scored the head already (HeadInput::scores)
    scores_ = *in_.scores;
  } else {
    StageScope scope(&clock_, &times_.score_ns);
    KVD_RETURN_IF_ERROR(HeadScores(opt_, in_.head.keys, in_.head.values, in_.head.queries,
                                   in_.head.window, in_.head.group_size, in_.kept_pairs,
                                   in_.expected, &own_scores_));
    scores_ = own_scores_;
  }
  have_scores_ = true;
  return Status::Ok();
}

Status HeadPipeline::EnsureMass() {
  if (have_mass_) return Status::Ok();
  have_mass_ = true;
  if (in_.head.queries.rows == 0) return Status::Ok();
  mass_.assign(static_cast<size_t>(n_), 0.0f);
  ObservationHead head;
  head.queries = in_.head.queries;
  head.keys = in_.head.keys;
  ObservationOptions oo{.mask = MaskKind::kCausalWindow, .group_size = in_.head.group_size};
  return ComputeAttentionMass(head, oo, mass_, {.num_threads = 1});
}

StatusOr<std::vector<int32_t>> HeadPipeline::SelectPool(int64_t pool) {
  StageScope scope(&clock_, &times_.select_ns);
  SelectionOptions sel{.sinks = opt_.sinks, .window = in_.head.window};
  if (opt_.score == ScoreStage::kKeyDiff && opt_.keydiff_block > 0) {
    return KeyDiffBlockwiseSelect(in_.head.keys, pool,
                                  {.block_size = opt_.keydiff_block, .selection = sel},
                                  {.num_threads = 1});
  }
  KVD_RETURN_IF_ERROR(EnsureScores());
  return SelectTopK(scores_, pool, sel);
}

Status HeadPipeline::BuildEviction(const std::vector<int32_t>& pool, HeadSlots* t) {
  StageScope scope(&clock_, &times_.select_ns);
  t->Resize(static_cast<int64_t>(pool.size()), d_);
  for (size_t j = 0; j < pool.size(); ++j) {
    const int64_t i = pool[j];
    CopyRow(in_.head.keys.Row(i), t->keys_post.Row(j), d_);
    CopyRow(in_.head.values.Row(i), t->value_sums.Row(j), d_);
    if (have_kpre_) CopyRow(kpre_.Row(i), t->keys_pre.Row(j), d_);
    t->positions[j] = in_.head.positions[i];
    t->forced[j] = IsForced(i);
    t->token[j] = i;
  }
  return Status::Ok();
}

Status HeadPipeline::BuildSlots(const StageRegistration* merge, int64_t pool, HeadSlots* t) {
  const bool selected = opt_.score != ScoreStage::kNone;
  std::vector<int32_t> sel;
  if (merge == nullptr || selected) {
    KVD_ASSIGN_OR_RETURN(sel, SelectPool(pool));
  }
  if (merge == nullptr) return BuildEviction(sel, t);
  StageScope scope(&clock_, &times_.merge_ns);
  MergeHeadInput in = in_.head;
  in.slots = pool;
  in.pool = sel;
  in.selected = selected;
  in.cache = this;
  in.state = &merge_state_;
  return merge->merge(in, t);
}

Status HeadPipeline::RouteErrors(const StageRegistration& route, const HeadSlots& t,
                                 std::vector<float>* err) {
  StageScope scope(&clock_, &times_.route_ns);
  const RouteHeadInput in{
      .options = &opt_, .values = in_.head.values, .fit = in_.fit, .cache = this};
  return route.route(in, t, err);
}

int64_t HeadPipeline::Eligible(const std::vector<float>& err) {
  int64_t e = 0;
  for (float x : err) e += std::isfinite(x) ? 1 : 0;
  return e;
}

Status HeadPipeline::Route(int64_t key_only, const std::vector<float>& err, HeadSlots* t) {
  if (key_only == 0) return Status::Ok();
  StageScope scope(&clock_, &times_.route_ns);
  std::vector<int64_t> order;
  for (int64_t j = 0; j < t->size(); ++j) {
    if (std::isfinite(err[j])) order.push_back(j);
  }
  if (static_cast<int64_t>(order.size()) < key_only) {
    return Status::Internal("plan: fewer routable slots than the key-only count");
  }
  std::nth_element(
      order.begin(), order.begin() + (key_only - 1), order.end(),
      [&](int64_t x, int64_t y) { return err[x] != err[y] ? err[x] < err[y] : x < y; });
  for (int64_t r = 0; r < key_only; ++r) t->rebuild[order[r]] = 1;
  return Status::Ok();
}

void HeadPipeline::Encode(const HeadSlots& t, CompactHead* out) const {
  const int64_t s = t.size();
  const size_t e = DTypeSize(in_.dtype);
  out->flags.assign(static_cast<size_t>(s), 0);
  out->cardinality = t.cardinality;
  out->positions = t.positions;
  out->keys.resize(static_cast<size_t>(s * d_) * e);
  ConvertFromFloat(in_.dtype, t.keys_post.values.data(), out->keys.data(),
                   static_cast<size_t>(s * d_));
  out->values.clear();
  std::vector<float> mean(static_cast<size_t>(d_));
  std::vector<uint8_t> row(static_cast<size_t>(d_) * e);
  for (int64_t j = 0; j < s; ++j) {
    if (t.rebuild[j]) {
      out->flags[j] = kSlotRebuildValue;
      continue;
    }
    const float inv = 1.0f / static_cast<float>(t.cardinality[j]);
    for (int64_t c = 0; c < d_; ++c) mean[c] = t.value_sums.Row(j)[c] * inv;
    ConvertFromFloat(in_.dtype, mean.data(), row.data(), static_cast<size_t>(d_));
    out->values.insert(out->values.end(), row.begin(), row.end());
  }
}

void HeadPipeline::AddStats(const HeadSlots& t, const CompactHead& out, int64_t a, bool reduced,
                            bool floor_head, CompressionStats* stats) const {
  stats->heads += 1;
  stats->input_tokens += n_;
  stats->slots += t.size();
  stats->rebuild_slots += 2 * a;
  int64_t covered = 0;
  for (int64_t j = 0; j < t.size(); ++j) {
    covered += t.cardinality[j];
    if (t.cardinality[j] > 1) stats->merged_tokens += t.cardinality[j];
  }
  stats->evicted_tokens += n_ - covered;
  stats->budget_half_pairs += 2 * in_.kept_pairs;
  stats->half_pairs += out.slots() + out.value_slots();
  stats->route_reductions += reduced ? 1 : 0;
  stats->route_floor_heads += floor_head ? 1 : 0;
  if (merge_state_ != nullptr) merge_state_->AddStats(stats);
  stats->stage += times_;
}

Status HeadPipeline::Run(CompactHead* out, CompressionStats* stats) {
  const int64_t forced = std::min(n_, opt_.sinks) + in_.head.window;
  if (n_ < opt_.sinks + in_.head.window) {
    return Status::InvalidArgument("N=" + std::to_string(n_) + " is smaller than sinks (" +
                                   std::to_string(opt_.sinks) + ") + window (" +
                                   std::to_string(in_.head.window) + ")");
  }
  const StageRegistration* merge = FindStage(opt_.merge);  // null: eviction
  const StageRegistration* route = FindStage(opt_.route);  // null: no routing
  const int64_t m = in_.kept_pairs;
  int64_t a = 0;
  bool floor_head = false;
  std::vector<float> route_err;
  if (route != nullptr) {
    RouteOptions ro{.p_c = opt_.p_c, .eps = opt_.route_eps, .kept_pairs = m};
    KVD_ASSIGN_OR_RETURN(RouteBudget b, ComputeRouteBudget(n_, forced, ro));
    a = b.key_only / 2;
    if (opt_.route_adaptive && in_.fit->r2 < opt_.route_min_r2) {
      a = 0;
      floor_head = true;
    }
    KVD_RETURN_IF_ERROR(EnsureKeysPre());
  } else if (m < forced) {
    return Status::OutOfRange("budget of " + std::to_string(m) + " tokens cannot keep the " +
                              std::to_string(forced) + " sink and window tokens");
  }
  HeadSlots t;
  bool reduced = false;
  for (;;) {
    KVD_RETURN_IF_ERROR(BuildSlots(merge, m + a, &t));
    if (a == 0) break;
    KVD_RETURN_IF_ERROR(RouteErrors(*route, t, &route_err));
    const int64_t eligible = Eligible(route_err);
    if (2 * a <= eligible) break;
    a -= (2 * a - eligible + 1) / 2;  // >= 1 step down; a == 0 always fits
    reduced = true;
  }
  KVD_RETURN_IF_ERROR(Route(2 * a, route_err, &t));
  {
    StageScope scope(&clock_, &times_.encode_ns);
    Encode(t, out);
  }
  AddStats(t, *out, a, reduced, floor_head, stats);
  if (out->slots() + out->value_slots() != 2 * m) {
    return Status::Internal("plan: head used " + std::to_string(out->slots() + out->value_slots()) +
                            " half-pairs, budget " + std::to_string(2 * m));
  }
  return Status::Ok();
}

}  // namespace

Status HeadScores(const CompressionPlanOptions& options, ConstMatrixView keys,
                  ConstMatrixView values, ConstMatrixView queries, int64_t window, int group_size,
                  int64_t kept, const ExpectedQueries* expected, std::vector<float>* scores) {
  scores->assign(static_cast<size_t>(keys.rows), 0.0f);
  const StageRegistration* stage = FindStage(options.score);
  if (stage == nullptr) return Status::InvalidArgument("plan: unknown stage");
  const ScoreHeadInput in{.options = &options,
                          .keys = keys,
                          .values = values,
                          .queries = queries,
                          .window = window,
                          .group_size = group_size,
                          .kept = kept,
                          .expected = stage->needs_query_stats ? expected : nullptr};
  return stage->score(in, *scores);
}

StatusOr<double> LayerCentredAdjacentCosine(const RopeTable& rope, std::span<const Matrix> keys,
                                            std::span<const int64_t> positions) {
  if (keys.empty()) return 0.0;
  double total = 0.0;
  std::vector<float> center;
  for (const Matrix& k : keys) {
    Matrix kpre(k.rows, k.cols);
    KVD_RETURN_IF_ERROR(ApplyRope(rope, RopeDirection::kDerotate, positions, k.View(), kpre.View(),
                                  {.num_threads = 1}));
    total += MeanCentredAdjacentCosine(kpre.View(), &center);
  }
  return total / static_cast<double>(keys.size());
}

Status CompressHead(const HeadInput& in, CompactHead* out, CompressionStats* stats) {
  HeadPipeline pipeline(in);
  return pipeline.Run(out, stats);
}

}  // namespace kvd::kernels::internal
