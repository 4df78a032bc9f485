// The kvslimmer merge stage's step (stages.h MergeFn): with a score stage the hybrid (every token
// outside the pool merged into its nearest pool neighbour), without one KVSlimmer's pairwise
// rounds. The contract is the file comment of plan.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "kvd/kernels/kvslimmer.h"
#include "kvd/kernels/stages.h"
#include "plan_internal.h"
#include "window_error.h"

namespace kvd::kernels::internal {
namespace {

void CopyRow(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }

// One head's kvslimmer state across its calls (route budget retries).
struct KvSlimmerState final : MergeState {
  SlotSet slots;  // merge-only: merged further on each call
  bool started = false;
  KvSlimmerStats stats;
  std::optional<WindowErrorModel> window_error;  // hybrid_error_aware (lazy)
  int64_t error_aware_evicted = 0;               // of the latest hybrid call
  int64_t gate_evicted = 0;  // merge_gate: hybrid tokens evicted by the gate (latest call)
  void AddStats(CompressionStats* s) const override {
    s->error_aware_evicted += error_aware_evicted;
    s->gate_evicted_tokens += gate_evicted + stats.gate_evicted_tokens;
    s->kvslimmer += stats;
  }
};

KvSlimmerState& StateOf(const MergeHeadInput& in) {
  if (*in.state == nullptr) *in.state = std::make_unique<KvSlimmerState>();
  return static_cast<KvSlimmerState&>(**in.state);
}

// The hybrid's view of one head: its inputs and the lazily computed keys and mass.
struct Hybrid {
  const MergeHeadInput& in;
  const CompressionPlanOptions& o;
  ConstMatrixView kpre;
  std::span<const float> mass;
  int64_t n, d;
  bool IsForced(int64_t i) const { return i < o.sinks || i >= n - in.window; }
};

// The merged slot of tokens `g` (token order, >= 2): mass-weighted mean pre-RoPE key rotated to
// the slot's position, value sum, position (plan.h).
Status MergeGroup(const Hybrid& h, std::span<const int64_t> g, float* key_pre, float* key_post,
                  double* value_sum, int64_t* position) {
  const int64_t d = h.d;
  // merge_guard kMean: the plain mean key (total 0 selects the uniform weights below).
  double total = 0.0;
  if (h.o.merge_guard != MergeGuard::kMean) {
    for (int64_t i : g) total += h.mass.empty() ? 0.0 : std::max(0.0f, h.mass[i]);
  }
  std::vector<double> key(static_cast<size_t>(d), 0.0);
  std::fill(value_sum, value_sum + d, 0.0);
  double pos_weighted = 0.0;
  int64_t pos_last = 0;
  for (int64_t i : g) {
    const double w = total > 0.0 ? std::max(0.0f, h.mass[i]) / total : 1.0 / g.size();
    for (int64_t c = 0; c < d; ++c) {
      key[c] += w * h.kpre.Row(i)[c];
      value_sum[c] += h.in.values.Row(i)[c];
    }
    pos_weighted += w * static_cast<double>(h.in.positions[i]);
    pos_last = std::max(pos_last, h.in.positions[i]);
  }
  for (int64_t c = 0; c < d; ++c) key_pre[c] = static_cast<float>(key[c]);
  *position = h.o.position == RepresentativePosition::kLast ? pos_last : std::llround(pos_weighted);
  return ApplyRope(*h.in.rope, RopeDirection::kRotate, std::span(position, 1),
                   ConstMatrixView{key_pre, 1, d, d}, MatrixView{key_post, 1, d, d},
                   {.num_threads = 1});
}

// hybrid_error_aware: keeps, of each slot's candidates (absorber first, the rest nearest
// first), those whose merge is estimated to cost less than their eviction (plan.h).
Status ErrorAwareGroups(const Hybrid& h, KvSlimmerState* st,
                        std::vector<std::vector<int64_t>>* members) {
  const MergeHeadInput& in = h.in;
  if (in.queries.rows == 0) {
    return Status::FailedPrecondition("plan: hybrid_error_aware needs window queries");
  }
  if (!st->window_error.has_value()) {
    KVD_ASSIGN_OR_RETURN(st->window_error,
                         WindowErrorModel::Create(in.queries, in.keys, in.values, in.group_size));
  }
  const WindowErrorModel& model = *st->window_error;
  st->error_aware_evicted = 0;  // the hybrid may run again (route budget retries)
  std::vector<float> kpre(static_cast<size_t>(h.d)), try_post(static_cast<size_t>(h.d));
  std::vector<double> try_sum(static_cast<size_t>(h.d));
  std::vector<int64_t> accepted, trial;
  WindowErrorModel::Group group;
  for (std::vector<int64_t>& g : *members) {
    if (g.size() < 2) continue;
    accepted.assign(1, g[0]);
    model.Start(g[0], &group);
    for (size_t k = 1; k < g.size(); ++k) {
      const int64_t i = g[k];
      if (static_cast<int64_t>(accepted.size()) >= h.o.hybrid_max_group) break;  // full: evicted
      trial = accepted;
      trial.insert(std::upper_bound(trial.begin(), trial.end(), i), i);
      int64_t pos = 0;
      KVD_RETURN_IF_ERROR(MergeGroup(h, trial, kpre.data(), try_post.data(), try_sum.data(), &pos));
      const ReplacementSlot merged{try_post.data(), try_sum.data(),
                                   static_cast<int64_t>(trial.size())};
      double evict_err = 0.0, merge_err = 0.0;
      model.Compare(group, i, merged, &evict_err, &merge_err);
      if (merge_err < evict_err) {
        accepted = trial;
        model.Accept(i, merged, &group);
      } else {
        ++st->error_aware_evicted;
      }
    }
    g = accepted;
  }
  return Status::Ok();
}

// owner[i] = the pool slot whose token is i's nearest non-forced pool token (ties to the left),
// i's own slot for pool tokens, -1 when the pool has no such token.
std::vector<int64_t> NearestAbsorbers(const Hybrid& h) {
  const std::span<const int32_t> pool = h.in.pool;
  const int64_t s = static_cast<int64_t>(pool.size());
  std::vector<int64_t> owner(static_cast<size_t>(h.n), -1);
  std::vector<int64_t> absorber_slots;  // slot indices of non-forced pool tokens, ascending
  for (int64_t j = 0; j < s; ++j) {
    owner[pool[j]] = j;
    if (!h.IsForced(pool[j])) absorber_slots.push_back(j);
  }
  for (int64_t i = 0; i < h.n; ++i) {
    if (owner[i] >= 0 || absorber_slots.empty()) continue;
    auto right = std::lower_bound(absorber_slots.begin(), absorber_slots.end(), i,
                                  [&](int64_t slot, int64_t tok) { return pool[slot] < tok; });
    int64_t best = -1;
    if (right != absorber_slots.begin()) best = *(right - 1);
    if (right != absorber_slots.end() && (best < 0 || pool[*right] - i < i - pool[best])) {
      best = *right;
    }
    owner[i] = best;
  }
  return owner;
}

// The gates: hybrid_min_cos (cos(kpre_i, kpre_absorber)), then merge_gate (plan.h: a closed
// layer merges nothing; else the centred cosine must reach merge_gate_min_cos). A token failing
// one is evicted (owner -1).
Status GateOwners(const Hybrid& h, KvSlimmerState* st, std::vector<int64_t>* owner) {
  const std::span<const int32_t> pool = h.in.pool;
  const ConstMatrixView& kpre = h.kpre;
  if (h.o.hybrid_min_cos > 0.0) {
    auto norm = [&](int64_t i) {
      double q = 0.0;
      for (int64_t c = 0; c < h.d; ++c) q += double(kpre.Row(i)[c]) * kpre.Row(i)[c];
      return std::sqrt(q);
    };
    for (int64_t i = 0; i < h.n; ++i) {
      if ((*owner)[i] < 0 || pool[(*owner)[i]] == i) continue;
      const int64_t a = pool[(*owner)[i]];
      double dot = 0.0;
      for (int64_t c = 0; c < h.d; ++c) dot += double(kpre.Row(i)[c]) * kpre.Row(a)[c];
      const double den = norm(i) * norm(a);
      if (!(den > 0.0 && dot / den >= h.o.hybrid_min_cos)) (*owner)[i] = -1;
    }
  }
  st->gate_evicted = 0;
  if (!h.o.merge_gate) return Status::Ok();
  KVD_ASSIGN_OR_RETURN(const std::span<const float> center, h.in.cache->Center());
  for (int64_t i = 0; i < h.n; ++i) {
    if ((*owner)[i] < 0 || pool[(*owner)[i]] == i) continue;
    if (!h.in.layer_open || CentredCosine(kpre.Row(i), kpre.Row(pool[(*owner)[i]]), center, h.d) <
                                h.o.merge_gate_min_cos) {
      (*owner)[i] = -1;
      ++st->gate_evicted;
    }
  }
  return Status::Ok();
}

// Group members per slot (absorber first, then the others by token distance, ties left); the
// cap keeps the absorber and its (hybrid_max_group - 1) nearest members, evicting the rest
// (error-aware: the members whose merge beats their eviction, up to the cap). Token order.
Status GroupMembers(const Hybrid& h, const std::vector<int64_t>& owner, KvSlimmerState* st,
                    std::vector<std::vector<int64_t>>* members) {
  const std::span<const int32_t> pool = h.in.pool;
  const int64_t s = static_cast<int64_t>(pool.size());
  members->assign(static_cast<size_t>(s), {});
  for (int64_t j = 0; j < s; ++j) (*members)[j].push_back(pool[j]);
  for (int64_t i = 0; i < h.n; ++i) {
    if (owner[i] >= 0 && pool[owner[i]] != i) (*members)[owner[i]].push_back(i);
  }
  for (int64_t j = 0; j < s; ++j) {
    std::vector<int64_t>& g = (*members)[j];
    const int64_t a = pool[j];
    const auto dist_less = [a](int64_t x, int64_t y) {
      const int64_t dx = x < a ? a - x : x - a, dy = y < a ? a - y : y - a;
      return dx != dy ? dx < dy : x < y;
    };
    if (h.o.hybrid_error_aware) {
      std::sort(g.begin() + 1, g.end(), dist_less);
    } else if (static_cast<int64_t>(g.size()) > h.o.hybrid_max_group) {
      std::sort(g.begin() + 1, g.end(), dist_less);
      g.resize(static_cast<size_t>(h.o.hybrid_max_group));
    }
  }
  if (h.o.hybrid_error_aware) KVD_RETURN_IF_ERROR(ErrorAwareGroups(h, st, members));
  for (auto& g : *members) std::sort(g.begin(), g.end());  // token order
  return Status::Ok();
}

// The hybrid (plan.h): the score stage's pool absorbs the other tokens.
Status HybridMerge(const MergeHeadInput& in, HeadSlots* t) {
  KvSlimmerState& st = StateOf(in);
  KVD_ASSIGN_OR_RETURN(const ConstMatrixView kpre, in.cache->KeysPre());
  KVD_ASSIGN_OR_RETURN(const std::span<const float> mass, in.cache->Mass());
  const Hybrid h{in, *in.options, kpre, mass, in.keys.rows, in.keys.cols};
  std::vector<int64_t> owner = NearestAbsorbers(h);
  KVD_RETURN_IF_ERROR(GateOwners(h, &st, &owner));
  std::vector<std::vector<int64_t>> members;
  KVD_RETURN_IF_ERROR(GroupMembers(h, owner, &st, &members));
  const int64_t s = static_cast<int64_t>(in.pool.size()), d = h.d;
  t->Resize(s, d);
  std::vector<double> vsum(static_cast<size_t>(d));
  for (int64_t j = 0; j < s; ++j) {
    const std::vector<int64_t>& g = members[j];
    const int64_t head_token = in.pool[j];
    t->forced[j] = h.IsForced(head_token);
    t->cardinality[j] = static_cast<int32_t>(g.size());
    if (g.size() == 1) {
      CopyRow(in.keys.Row(head_token), t->keys_post.Row(j), d);
      CopyRow(kpre.Row(head_token), t->keys_pre.Row(j), d);
      CopyRow(in.values.Row(head_token), t->value_sums.Row(j), d);
      t->positions[j] = in.positions[head_token];
      t->token[j] = head_token;
      continue;
    }
    KVD_RETURN_IF_ERROR(
        MergeGroup(h, g, t->keys_pre.Row(j), t->keys_post.Row(j), vsum.data(), &t->positions[j]));
    for (int64_t c = 0; c < d; ++c) t->value_sums.Row(j)[c] = static_cast<float>(vsum[c]);
  }
  return Status::Ok();
}

// KVSlimmer's pairwise rounds over the whole head, down to in.slots slots.
Status PairwiseMerge(const MergeHeadInput& in, HeadSlots* t) {
  KvSlimmerState& st = StateOf(in);
  const CompressionPlanOptions& o = *in.options;
  const int64_t n = in.keys.rows, d = in.keys.cols;
  if (!st.started) {
    KVD_ASSIGN_OR_RETURN(
        st.slots, SlotsFromTokens(*in.rope, in.keys, in.values, in.positions, {.num_threads = 1}));
    st.started = true;
  }
  KvSlimmerOptions ko{.norm = o.merge_norm,
                      .lambda = o.pair_lambda,
                      .position = o.position,
                      .sinks = o.sinks,
                      .window = in.window,
                      .group_size = in.group_size,
                      .mask = MaskKind::kByPosition,
                      .guard = o.merge_guard,
                      .guard_alpha_margin = o.merge_guard_alpha_margin};
  if (o.merge_gate) {
    KVD_ASSIGN_OR_RETURN(ko.gate_center, in.cache->Center());
    ko.gate_min_cos = o.merge_gate_min_cos;
    ko.gate_evict_all = !in.layer_open;
  }
  std::span<const int64_t> qpos = in.positions.subspan(static_cast<size_t>(n - in.window));
  KVD_RETURN_IF_ERROR(KvSlimmerCompress(*in.rope, in.queries, qpos, in.slots, ko, &st.slots,
                                        &st.stats, {.num_threads = 1}));
  const int64_t s = st.slots.size();
  t->Resize(s, d);
  KVD_RETURN_IF_ERROR(RotateSlotKeys(*in.rope, st.slots, t->keys_post.View(), {.num_threads = 1}));
  t->keys_pre = st.slots.keys_pre;
  t->value_sums = st.slots.value_sums;
  t->cardinality = st.slots.cardinality;
  t->positions = st.slots.positions;
  for (int64_t j = 0; j < s; ++j) t->forced[j] = j < o.sinks || j >= s - in.window;
  return Status::Ok();
}

}  // namespace

Status KvSlimmerMergeHead(const MergeHeadInput& in, HeadSlots* out) {
  return in.selected ? HybridMerge(in, out) : PairwiseMerge(in, out);
}

}  // namespace kvd::kernels::internal
