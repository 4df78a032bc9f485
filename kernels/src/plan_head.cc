// One (layer, KV head) of a compression plan: score -> select -> merge -> route -> encode.
// The contract (stages, budget, hybrid merge) is the file comment of plan.h.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/observation.h"
#include "kvd/kernels/scorers.h"
#include "kvd/kernels/snapkv.h"
#include "plan_internal.h"
#include "window_error.h"

namespace kvd::kernels::internal {
namespace {

// Slots of one head before encoding.
struct SlotTable {
  Matrix keys_post;   // [S, d]
  Matrix keys_pre;    // [S, d] (filled when routing)
  Matrix value_sums;  // [S, d]
  std::vector<int32_t> cardinality;
  std::vector<int64_t> positions;
  std::vector<uint8_t> forced;   // sink or window slot
  std::vector<uint8_t> rebuild;  // VECTOR: value dropped
  std::vector<int64_t> token;    // the token of a cardinality-1 slot, -1 when not known
  int64_t size() const { return static_cast<int64_t>(cardinality.size()); }
  void Resize(int64_t s, int64_t d) {
    keys_post = Matrix(s, d);
    keys_pre = Matrix(s, d);
    value_sums = Matrix(s, d);
    cardinality.assign(s, 1);
    positions.assign(s, 0);
    forced.assign(s, 0);
    rebuild.assign(s, 0);
    token.assign(s, -1);
  }
};

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

class HeadPipeline {
 public:
  explicit HeadPipeline(const HeadInput& in)
      : in_(in), opt_(*in.options), n_(in.keys.rows), d_(in.keys.cols) {}

  Status Run(CompactHead* out, CompressionStats* stats);

 private:
  bool IsForced(int64_t i) const { return i < opt_.sinks || i >= n_ - in_.window; }
  Status EnsureKeysPre();
  Status EnsureScores();
  Status EnsureMass();
  Status EnsureCenter();  // merge_gate: the head's mean pre-RoPE key
  StatusOr<std::vector<int32_t>> SelectPool(int64_t pool);
  Status BuildEviction(const std::vector<int32_t>& pool, SlotTable* t);
  Status BuildHybrid(const std::vector<int32_t>& pool, SlotTable* t);
  // The merged slot of tokens `g` (token order, >= 2): mass-weighted mean pre-RoPE key rotated to
  // the slot's position, value sum, position (plan.h).
  Status MergeGroup(std::span<const int64_t> g, float* key_pre, float* key_post, double* value_sum,
                    int64_t* position) const;
  // hybrid_error_aware: keeps, of each slot's candidates (absorber first, the rest nearest
  // first), those whose merge is estimated to cost less than their eviction (plan.h).
  Status ErrorAwareGroups(std::vector<std::vector<int64_t>>* members);
  Status BuildKvSlimmer(int64_t pool, SlotTable* t);
  // Per slot: the routing error (plan.h: |v - W kpre - b|^2, or e_j with route_adaptive) of the
  // slots that may be routed, +Inf for the others (forced, merged, or above route_max_error).
  Status RouteErrors(const SlotTable& t, std::vector<float>* err);
  static int64_t Eligible(const std::vector<float>& err);
  Status Route(int64_t key_only, const std::vector<float>& err, SlotTable* t);
  void Encode(const SlotTable& t, CompactHead* out) const;

  const HeadInput& in_;
  const CompressionPlanOptions& opt_;
  const int64_t n_;
  const int64_t d_;
  Matrix kpre_;                // [N, d] de-rotated keys (lazy)
  std::vector<float> scores_;  // [N] (lazy)
  std::vector<float> mass_;    // [N] attention mass (lazy; empty without queries)
  double mean_mass_ = 0.0;     // route_adaptive: mean of mass_ (0 = uniform weights)
  double value_scale_ = -1.0;  // route_adaptive: s_v (lazy; < 0 = not computed)
  bool have_kpre_ = false, have_scores_ = false, have_mass_ = false;
  SlotSet kvslimmer_;  // merge-only state, merged further on each retry
  bool kvslimmer_started_ = false;
  KvSlimmerStats merge_stats_;
  std::optional<WindowErrorModel> window_error_;  // hybrid_error_aware (lazy)
  int64_t error_aware_evicted_ = 0;               // of the latest BuildHybrid
  CompressionStageTimes times_;
  StageClock clock_;
  std::vector<float> center_;  // merge_gate (lazy)
  bool have_center_ = false;
  int64_t gate_evicted_ = 0;  // merge_gate: hybrid tokens evicted by the gate (latest BuildHybrid)
};

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
  KVD_RETURN_IF_ERROR(ApplyRope(*in_.rope, RopeDirection::kDerotate, in_.positions, in_.keys,
                                kpre_.View(), {.num_threads = 1}));
  have_kpre_ = true;
  return Status::Ok();
}

Status HeadPipeline::EnsureScores() {
  if (have_scores_) return Status::Ok();
  StageScope scope(&clock_, &times_.score_ns);
  KVD_RETURN_IF_ERROR(
      HeadScores(opt_, in_.keys, in_.values, in_.queries, in_.window, in_.group_size,
                 in_.expected, &scores_));
  have_scores_ = true;
  return Status::Ok();
}

Status HeadPipeline::EnsureMass() {
  if (have_mass_) return Status::Ok();
  have_mass_ = true;
  if (in_.queries.rows == 0) return Status::Ok();
  mass_.assign(static_cast<size_t>(n_), 0.0f);
  ObservationHead head{.queries = in_.queries, .keys = in_.keys};
  ObservationOptions oo{.mask = MaskKind::kCausalWindow, .group_size = in_.group_size};
  return ComputeAttentionMass(head, oo, mass_, {.num_threads = 1});
}

StatusOr<std::vector<int32_t>> HeadPipeline::SelectPool(int64_t pool) {
  StageScope scope(&clock_, &times_.select_ns);
  SelectionOptions sel{.sinks = opt_.sinks, .window = in_.window};
  if (opt_.score == ScoreStage::kKeyDiff && opt_.keydiff_block > 0) {
    return KeyDiffBlockwiseSelect(
        in_.keys, pool, {.block_size = opt_.keydiff_block, .selection = sel}, {.num_threads = 1});
  }
  KVD_RETURN_IF_ERROR(EnsureScores());
  return SelectTopK(scores_, pool, sel);
}

Status HeadPipeline::BuildEviction(const std::vector<int32_t>& pool, SlotTable* t) {
  StageScope scope(&clock_, &times_.select_ns);
  t->Resize(static_cast<int64_t>(pool.size()), d_);
  for (size_t j = 0; j < pool.size(); ++j) {
    const int64_t i = pool[j];
    CopyRow(in_.keys.Row(i), t->keys_post.Row(j), d_);
    CopyRow(in_.values.Row(i), t->value_sums.Row(j), d_);
    if (have_kpre_) CopyRow(kpre_.Row(i), t->keys_pre.Row(j), d_);
    t->positions[j] = in_.positions[i];
    t->forced[j] = IsForced(i);
    t->token[j] = i;
  }
  return Status::Ok();
}

Status HeadPipeline::BuildHybrid(const std::vector<int32_t>& pool, SlotTable* t) {
  StageScope scope(&clock_, &times_.merge_ns);
  KVD_RETURN_IF_ERROR(EnsureKeysPre());
  KVD_RETURN_IF_ERROR(EnsureMass());
  const int64_t s = static_cast<int64_t>(pool.size());
  // owner[i] = slot index absorbing token i, or -1 (evicted).
  std::vector<int64_t> owner(static_cast<size_t>(n_), -1);
  std::vector<int64_t> absorber_slots;  // slot indices of non-forced pool tokens, ascending
  for (int64_t j = 0; j < s; ++j) {
    owner[pool[j]] = j;
    if (!IsForced(pool[j])) absorber_slots.push_back(j);
  }
  for (int64_t i = 0; i < n_; ++i) {
    if (owner[i] >= 0 || absorber_slots.empty()) continue;
    // Nearest absorber by token distance, ties to the left.
    auto right = std::lower_bound(absorber_slots.begin(), absorber_slots.end(), i,
                                  [&](int64_t slot, int64_t tok) { return pool[slot] < tok; });
    int64_t best = -1;
    if (right != absorber_slots.begin()) best = *(right - 1);
    if (right != absorber_slots.end() && (best < 0 || pool[*right] - i < i - pool[best])) {
      best = *right;
    }
    owner[i] = best;
  }
  // Similarity gate: a token joins its absorber only if cos(kpre_i, kpre_absorber) >= min_cos.
  if (opt_.hybrid_min_cos > 0.0) {
    auto norm = [&](int64_t i) {
      double q = 0.0;
      for (int64_t c = 0; c < d_; ++c) q += double(kpre_.Row(i)[c]) * kpre_.Row(i)[c];
      return std::sqrt(q);
    };
    for (int64_t i = 0; i < n_; ++i) {
      if (owner[i] < 0 || pool[owner[i]] == i) continue;
      const int64_t a = pool[owner[i]];
      double dot = 0.0;
      for (int64_t c = 0; c < d_; ++c) dot += double(kpre_.Row(i)[c]) * kpre_.Row(a)[c];
      const double den = norm(i) * norm(a);
      if (!(den > 0.0 && dot / den >= opt_.hybrid_min_cos)) owner[i] = -1;
    }
  }
  // Centred-similarity gate (plan.h merge_gate): closed layer = no merges; else a token joins its
  // absorber only if their centred cosine reaches merge_gate_min_cos.
  gate_evicted_ = 0;
  if (opt_.merge_gate) {
    KVD_RETURN_IF_ERROR(EnsureCenter());
    for (int64_t i = 0; i < n_; ++i) {
      if (owner[i] < 0 || pool[owner[i]] == i) continue;
      if (!in_.merge_layer_open || CentredCosine(kpre_.Row(i), kpre_.Row(pool[owner[i]]), center_,
                                                 d_) < opt_.merge_gate_min_cos) {
        owner[i] = -1;
        ++gate_evicted_;
      }
    }
  }
  // Group members per slot (absorber first, then the others by token distance, ties left); the
  // cap keeps the absorber and its (hybrid_max_group - 1) nearest members, evicting the rest
  // (error-aware: the members whose merge beats their eviction, up to the cap).
  std::vector<std::vector<int64_t>> members(static_cast<size_t>(s));
  for (int64_t j = 0; j < s; ++j) members[j].push_back(pool[j]);
  for (int64_t i = 0; i < n_; ++i) {
    if (owner[i] >= 0 && pool[owner[i]] != i) members[owner[i]].push_back(i);
  }
  for (int64_t j = 0; j < s; ++j) {
    std::vector<int64_t>& g = members[j];
    const int64_t a = pool[j];
    const auto dist_less = [a](int64_t x, int64_t y) {
      const int64_t dx = x < a ? a - x : x - a, dy = y < a ? a - y : y - a;
      return dx != dy ? dx < dy : x < y;
    };
    if (opt_.hybrid_error_aware) {
      std::sort(g.begin() + 1, g.end(), dist_less);
    } else if (static_cast<int64_t>(g.size()) > opt_.hybrid_max_group) {
      std::sort(g.begin() + 1, g.end(), dist_less);
      g.resize(static_cast<size_t>(opt_.hybrid_max_group));
    }
  }
  if (opt_.hybrid_error_aware) KVD_RETURN_IF_ERROR(ErrorAwareGroups(&members));
  for (auto& g : members) std::sort(g.begin(), g.end());  // token order
  t->Resize(s, d_);
  std::vector<double> vsum(static_cast<size_t>(d_));
  for (int64_t j = 0; j < s; ++j) {
    const std::vector<int64_t>& g = members[j];
    const int64_t head_token = pool[j];
    t->forced[j] = IsForced(head_token);
    t->cardinality[j] = static_cast<int32_t>(g.size());
    if (g.size() == 1) {
      CopyRow(in_.keys.Row(head_token), t->keys_post.Row(j), d_);
      CopyRow(kpre_.Row(head_token), t->keys_pre.Row(j), d_);
      CopyRow(in_.values.Row(head_token), t->value_sums.Row(j), d_);
      t->positions[j] = in_.positions[head_token];
      t->token[j] = head_token;
      continue;
    }
    KVD_RETURN_IF_ERROR(
        MergeGroup(g, t->keys_pre.Row(j), t->keys_post.Row(j), vsum.data(), &t->positions[j]));
    for (int64_t c = 0; c < d_; ++c) t->value_sums.Row(j)[c] = static_cast<float>(vsum[c]);
  }
  return Status::Ok();
}

Status HeadPipeline::MergeGroup(std::span<const int64_t> g, float* key_pre, float* key_post,
                                double* value_sum, int64_t* position) const {
  // merge_guard kMean: the plain mean key (total 0 selects the uniform weights below).
  double total = 0.0;
  if (opt_.merge_guard != MergeGuard::kMean) {
    for (int64_t i : g) total += mass_.empty() ? 0.0 : std::max(0.0f, mass_[i]);
  }
  std::vector<double> key(static_cast<size_t>(d_), 0.0);
  std::fill(value_sum, value_sum + d_, 0.0);
  double pos_weighted = 0.0;
  int64_t pos_last = 0;
  for (int64_t i : g) {
    const double w = total > 0.0 ? std::max(0.0f, mass_[i]) / total : 1.0 / g.size();
    for (int64_t c = 0; c < d_; ++c) {
      key[c] += w * kpre_.Row(i)[c];
      value_sum[c] += in_.values.Row(i)[c];
    }
    pos_weighted += w * static_cast<double>(in_.positions[i]);
    pos_last = std::max(pos_last, in_.positions[i]);
  }
  for (int64_t c = 0; c < d_; ++c) key_pre[c] = static_cast<float>(key[c]);
  *position =
      opt_.position == RepresentativePosition::kLast ? pos_last : std::llround(pos_weighted);
  return ApplyRope(*in_.rope, RopeDirection::kRotate, std::span(position, 1),
                   ConstMatrixView{key_pre, 1, d_, d_}, MatrixView{key_post, 1, d_, d_},
                   {.num_threads = 1});
}

Status HeadPipeline::ErrorAwareGroups(std::vector<std::vector<int64_t>>* members) {
  if (in_.queries.rows == 0) {
    return Status::FailedPrecondition("plan: hybrid_error_aware needs window queries");
  }
  if (!window_error_.has_value()) {
    KVD_ASSIGN_OR_RETURN(
        window_error_, WindowErrorModel::Create(in_.queries, in_.keys, in_.values, in_.group_size));
  }
  const WindowErrorModel& model = *window_error_;
  error_aware_evicted_ = 0;  // BuildHybrid may run again (route budget retries)
  std::vector<float> kpre(static_cast<size_t>(d_)), try_post(static_cast<size_t>(d_));
  std::vector<double> try_sum(static_cast<size_t>(d_));
  std::vector<int64_t> accepted, trial;
  WindowErrorModel::Group group;
  for (std::vector<int64_t>& g : *members) {
    if (g.size() < 2) continue;
    accepted.assign(1, g[0]);
    model.Start(g[0], &group);
    for (size_t k = 1; k < g.size(); ++k) {
      const int64_t i = g[k];
      if (static_cast<int64_t>(accepted.size()) >= opt_.hybrid_max_group) break;  // full: evicted
      trial = accepted;
      trial.insert(std::upper_bound(trial.begin(), trial.end(), i), i);
      int64_t pos = 0;
      KVD_RETURN_IF_ERROR(MergeGroup(trial, kpre.data(), try_post.data(), try_sum.data(), &pos));
      const ReplacementSlot merged{try_post.data(), try_sum.data(),
                                   static_cast<int64_t>(trial.size())};
      double evict_err = 0.0, merge_err = 0.0;
      model.Compare(group, i, merged, &evict_err, &merge_err);
      if (merge_err < evict_err) {
        accepted = trial;
        model.Accept(i, merged, &group);
      } else {
        ++error_aware_evicted_;
      }
    }
    g = accepted;
  }
  return Status::Ok();
}

Status HeadPipeline::BuildKvSlimmer(int64_t pool, SlotTable* t) {
  StageScope scope(&clock_, &times_.merge_ns);
  if (!kvslimmer_started_) {
    KVD_ASSIGN_OR_RETURN(kvslimmer_, SlotsFromTokens(*in_.rope, in_.keys, in_.values, in_.positions,
                                                     {.num_threads = 1}));
    kvslimmer_started_ = true;
  }
  KvSlimmerOptions ko{.norm = opt_.merge_norm,
                      .lambda = opt_.pair_lambda,
                      .position = opt_.position,
                      .sinks = opt_.sinks,
                      .window = in_.window,
                      .group_size = in_.group_size,
                      .mask = MaskKind::kByPosition,
                      .guard = opt_.merge_guard,
                      .guard_alpha_margin = opt_.merge_guard_alpha_margin};
  if (opt_.merge_gate) {
    KVD_RETURN_IF_ERROR(EnsureCenter());
    ko.gate_center = center_;
    ko.gate_min_cos = opt_.merge_gate_min_cos;
    ko.gate_evict_all = !in_.merge_layer_open;
  }
  std::span<const int64_t> qpos = in_.positions.subspan(static_cast<size_t>(n_ - in_.window));
  KVD_RETURN_IF_ERROR(KvSlimmerCompress(*in_.rope, in_.queries, qpos, pool, ko, &kvslimmer_,
                                        &merge_stats_, {.num_threads = 1}));
  const int64_t s = kvslimmer_.size();
  t->Resize(s, d_);
  KVD_RETURN_IF_ERROR(
      RotateSlotKeys(*in_.rope, kvslimmer_, t->keys_post.View(), {.num_threads = 1}));
  t->keys_pre = kvslimmer_.keys_pre;
  t->value_sums = kvslimmer_.value_sums;
  t->cardinality = kvslimmer_.cardinality;
  t->positions = kvslimmer_.positions;
  for (int64_t j = 0; j < s; ++j) t->forced[j] = j < opt_.sinks || j >= s - in_.window;
  return Status::Ok();
}

Status HeadPipeline::RouteErrors(const SlotTable& t, std::vector<float>* err) {
  StageScope scope(&clock_, &times_.route_ns);
  const float inf = std::numeric_limits<float>::infinity();
  err->assign(static_cast<size_t>(t.size()), inf);
  std::vector<int64_t> eligible;
  for (int64_t j = 0; j < t.size(); ++j) {
    if (!t.forced[j] && t.cardinality[j] == 1) eligible.push_back(j);
  }
  const int64_t e = static_cast<int64_t>(eligible.size());
  if (e == 0) return Status::Ok();
  Matrix k(e, d_), v(e, d_);
  for (int64_t r = 0; r < e; ++r) {
    CopyRow(t.keys_pre.Row(eligible[r]), k.Row(r), d_);
    CopyRow(t.value_sums.Row(eligible[r]), v.Row(r), d_);
  }
  std::vector<float> res(static_cast<size_t>(e));
  KVD_RETURN_IF_ERROR(VectorResiduals(k.View(), v.View(), *in_.fit, res, {.num_threads = 1}));
  if (!opt_.route_adaptive) {
    for (int64_t r = 0; r < e; ++r) (*err)[eligible[r]] = res[r];
    return Status::Ok();
  }
  KVD_RETURN_IF_ERROR(EnsureMass());
  if (value_scale_ < 0.0) {
    // s_v = mean_i |v_i - mean v|^2 over the head's N tokens (float64); mean window mass.
    std::vector<double> mean(static_cast<size_t>(d_), 0.0);
    for (int64_t i = 0; i < n_; ++i)
      for (int64_t c = 0; c < d_; ++c) mean[c] += in_.values.Row(i)[c];
    for (double& m : mean) m /= static_cast<double>(n_);
    double ss = 0.0;
    for (int64_t i = 0; i < n_; ++i)
      for (int64_t c = 0; c < d_; ++c) ss += std::pow(in_.values.Row(i)[c] - mean[c], 2);
    value_scale_ = ss / static_cast<double>(n_);
    double total = 0.0;
    for (float m : mass_) total += std::max(0.0f, m);
    mean_mass_ = mass_.empty() ? 0.0 : total / static_cast<double>(n_);
  }
  for (int64_t r = 0; r < e; ++r) {
    const int64_t tok = t.token[eligible[r]];
    const double w = (mean_mass_ > 0.0 && tok >= 0) ? std::max(0.0f, mass_[tok]) / mean_mass_ : 1.0;
    double rel;
    if (value_scale_ > 0.0) {
      rel = w * static_cast<double>(res[r]) / value_scale_;
    } else {  // every value equal: only an exact rebuild is harmless
      rel = res[r] > 0.0f ? std::numeric_limits<double>::infinity() : 0.0;
    }
    if (rel <= opt_.route_max_error) (*err)[eligible[r]] = static_cast<float>(rel);
  }
  return Status::Ok();
}

int64_t HeadPipeline::Eligible(const std::vector<float>& err) {
  int64_t e = 0;
  for (float x : err) e += std::isfinite(x) ? 1 : 0;
  return e;
}

Status HeadPipeline::Route(int64_t key_only, const std::vector<float>& err, SlotTable* t) {
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

void HeadPipeline::Encode(const SlotTable& t, CompactHead* out) const {
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

Status HeadPipeline::Run(CompactHead* out, CompressionStats* stats) {
  const int64_t forced = std::min(n_, opt_.sinks) + in_.window;
  if (n_ < opt_.sinks + in_.window) {
    return Status::InvalidArgument("N=" + std::to_string(n_) + " is smaller than sinks (" +
                                   std::to_string(opt_.sinks) + ") + window (" +
                                   std::to_string(in_.window) + ")");
  }
  const int64_t m = in_.kept_pairs;
  int64_t a = 0;
  bool floor_head = false;
  std::vector<float> route_err;
  if (in_.fit != nullptr) {
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
  SlotTable t;
  bool reduced = false;
  for (;;) {
    const int64_t pool = m + a;
    if (opt_.merge == MergeStage::kNone) {
      KVD_ASSIGN_OR_RETURN(auto sel, SelectPool(pool));
      KVD_RETURN_IF_ERROR(BuildEviction(sel, &t));
    } else if (opt_.score == ScoreStage::kNone) {
      KVD_RETURN_IF_ERROR(BuildKvSlimmer(pool, &t));
    } else {
      KVD_ASSIGN_OR_RETURN(auto sel, SelectPool(pool));
      KVD_RETURN_IF_ERROR(BuildHybrid(sel, &t));
    }
    if (a == 0) break;
    KVD_RETURN_IF_ERROR(RouteErrors(t, &route_err));
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
  stats->budget_half_pairs += 2 * m;
  stats->half_pairs += out->slots() + out->value_slots();
  stats->route_reductions += reduced ? 1 : 0;
  stats->route_floor_heads += floor_head ? 1 : 0;
  stats->error_aware_evicted += error_aware_evicted_;
  stats->gate_evicted_tokens += gate_evicted_ + merge_stats_.gate_evicted_tokens;
  stats->kvslimmer += merge_stats_;
  stats->stage += times_;
  if (out->slots() + out->value_slots() != 2 * m) {
    return Status::Internal("plan: head used " + std::to_string(out->slots() + out->value_slots()) +
                            " half-pairs, budget " + std::to_string(2 * m));
  }
  return Status::Ok();
}

}  // namespace

Status HeadScores(const CompressionPlanOptions& options, ConstMatrixView keys,
                  ConstMatrixView values, ConstMatrixView queries, int64_t window, int group_size,
                  const ExpectedQueries* expected, std::vector<float>* scores) {
  const int64_t n = keys.rows;
  scores->assign(static_cast<size_t>(n), 0.0f);
  switch (options.score) {
    case ScoreStage::kNone:  // recency: later tokens first
      for (int64_t i = 0; i < n; ++i) (*scores)[i] = static_cast<float>(i);
      break;
    case ScoreStage::kSnapKv:
    case ScoreStage::kPyramidKv: {
      SnapKvOptions so{.window = static_cast<int>(window),
                       .kernel_size = options.pooling_kernel,
                       .pooling = options.pooling,
                       .group_size = group_size};
      KVD_RETURN_IF_ERROR(SnapKvScores(queries, keys, so, *scores, {.num_threads = 1}));
      break;
    }
    case ScoreStage::kKeyDiff:
      KVD_RETURN_IF_ERROR(KeyDiffScores(keys, *scores, {.num_threads = 1}));
      break;
    case ScoreStage::kExpectedAttention:
      if (expected == nullptr) {
        return Status::Internal("plan: expected_attention scores without expected queries");
      }
      KVD_RETURN_IF_ERROR(ExpectedAttentionScores(
          *expected, keys, options.expected_attention.value_norm ? values : ConstMatrixView{},
          *scores, {.num_threads = 1}));
      if (options.expected_attention.keydiff_share > 0.0) {
        // Part of the evictable tokens by KeyDiff's rank (expected_attention.h).
        std::vector<float> keydiff(static_cast<size_t>(n));
        KVD_RETURN_IF_ERROR(KeyDiffScores(keys, keydiff, {.num_threads = 1}));
        const int64_t begin = std::min(options.sinks, n);
        const int64_t end = std::max(begin, n - window);
        const std::vector<float> expected_scores = *scores;
        KVD_RETURN_IF_ERROR(FuseKeyDiffRanks(expected_scores, keydiff,
                                             options.expected_attention.keydiff_share, begin, end,
                                             *scores));
      }
      break;
  }
  return Status::Ok();
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
