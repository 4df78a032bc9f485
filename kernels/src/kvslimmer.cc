// Public entry of kvslimmer.h: options, slot construction, the merge-apply backend switch and
// the multi-round compression driver.
#include "kvd/kernels/kvslimmer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "backend_a.h"

namespace kvd::kernels {

Status KvSlimmerOptions::Validate() const {
  if (norm != MergeNorm::kL2 && norm != MergeNorm::kL1Code) {
    return Status::InvalidArgument("kvslimmer: unknown norm");
  }
  if (lambda != PairLambda::kAsymKv && lambda != PairLambda::kConstant) {
    return Status::InvalidArgument("kvslimmer: unknown lambda");
  }
  if (position != RepresentativePosition::kLast && position != RepresentativePosition::kWeighted) {
    return Status::InvalidArgument("kvslimmer: unknown representative position");
  }
  if (sinks < 0) {
    return Status::InvalidArgument("kvslimmer: sinks must be >= 0, got " + std::to_string(sinks));
  }
  if (window < 0) {
    return Status::InvalidArgument("kvslimmer: window must be >= 0, got " + std::to_string(window));
  }
  if (group_size < 1) {
    return Status::InvalidArgument("kvslimmer: group_size must be >= 1, got " +
                                   std::to_string(group_size));
  }
  if (!(gamma > 0.0) || !std::isfinite(gamma)) {
    return Status::InvalidArgument("kvslimmer: gamma must be finite and > 0, got " +
                                   std::to_string(gamma));
  }
  if (mask != MaskKind::kNone && mask != MaskKind::kByPosition) {
    return Status::InvalidArgument(
        "kvslimmer: mask must be kNone or kByPosition (slots are not tokens)");
  }
  if (max_rounds < 1) return Status::InvalidArgument("kvslimmer: max_rounds must be >= 1");
  if (guard != MergeGuard::kClamp && guard != MergeGuard::kAlphaFallback &&
      guard != MergeGuard::kMean) {
    return Status::InvalidArgument("kvslimmer: unknown merge guard");
  }
  if (!(guard_alpha_margin >= 0.0 && guard_alpha_margin <= 0.5)) {
    return Status::InvalidArgument("kvslimmer: guard_alpha_margin must be in [0, 0.5], got " +
                                   std::to_string(guard_alpha_margin));
  }
  if (!(gate_min_cos >= -1.0 && gate_min_cos <= 1.0)) {
    return Status::InvalidArgument("kvslimmer: gate_min_cos must be in [-1, 1], got " +
                                   std::to_string(gate_min_cos));
  }
  return Status::Ok();
}

Status SlotSet::Validate(int64_t head_dim) const {
  const int64_t s = size();
  if (keys_pre.cols != head_dim || value_sums.cols != head_dim) {
    return Status::InvalidArgument("slots: keys/values have d=" + std::to_string(keys_pre.cols) +
                                   "/" + std::to_string(value_sums.cols) + ", expected " +
                                   std::to_string(head_dim));
  }
  if (value_sums.rows != s || cardinality.size() != static_cast<size_t>(s) ||
      positions.size() != static_cast<size_t>(s) ||
      keys_pre.values.size() != static_cast<size_t>(s * head_dim) ||
      value_sums.values.size() != static_cast<size_t>(s * head_dim)) {
    return Status::InvalidArgument("slots: inconsistent sizes (keys " + std::to_string(s) +
                                   ", values " + std::to_string(value_sums.rows) +
                                   ", cardinality " + std::to_string(cardinality.size()) +
                                   ", positions " + std::to_string(positions.size()) + ")");
  }
  if (!h.empty() && (h.size() != static_cast<size_t>(s) || h_observations.size() != h.size())) {
    return Status::InvalidArgument("slots: h state has " + std::to_string(h.size()) +
                                   " entries for " + std::to_string(s) + " slots");
  }
  for (int64_t j = 0; j < s; ++j) {
    if (cardinality[static_cast<size_t>(j)] < 1) {
      return Status::InvalidArgument("slots: cardinality " +
                                     std::to_string(cardinality[static_cast<size_t>(j)]) +
                                     " < 1 at slot " + std::to_string(j));
    }
    if (positions[static_cast<size_t>(j)] < 0) {
      return Status::InvalidArgument("slots: negative position at slot " + std::to_string(j));
    }
  }
  KVD_RETURN_IF_ERROR(CheckFinite(keys_pre.View(), "slots: keys"));
  return CheckFinite(value_sums.View(), "slots: values");
}

StatusOr<SlotSet> SlotsFromTokens(const RopeTable& rope, ConstMatrixView keys_post,
                                  ConstMatrixView values, std::span<const int64_t> positions,
                                  const ExecOptions& exec) {
  const int64_t n = keys_post.rows, d = rope.head_dim();
  if (keys_post.cols != d || values.cols != d || values.rows != n ||
      positions.size() != static_cast<size_t>(n)) {
    return Status::InvalidArgument(
        "kvslimmer: tokens need keys [N, d], values [N, d] and N positions (d=" +
        std::to_string(d) + "), got keys [" + std::to_string(n) + ", " +
        std::to_string(keys_post.cols) + "], values [" + std::to_string(values.rows) + ", " +
        std::to_string(values.cols) + "], " + std::to_string(positions.size()) + " positions");
  }
  KVD_RETURN_IF_ERROR(CheckFinite(keys_post, "kvslimmer: keys"));
  KVD_RETURN_IF_ERROR(CheckFinite(values, "kvslimmer: values"));
  SlotSet slots;
  slots.keys_pre = Matrix(n, d);
  slots.value_sums = Matrix(n, d);
  for (int64_t i = 0; i < n; ++i) {
    std::copy(keys_post.Row(i), keys_post.Row(i) + d, slots.keys_pre.Row(i));
    std::copy(values.Row(i), values.Row(i) + d, slots.value_sums.Row(i));
  }
  slots.cardinality.assign(static_cast<size_t>(n), 1);
  slots.positions.assign(positions.begin(), positions.end());
  MatrixView view = slots.keys_pre.View();
  KVD_RETURN_IF_ERROR(ApplyRope(rope, RopeDirection::kDerotate, positions,
                                std::span<const MatrixView>(&view, 1), exec, false));
  return slots;
}

Status RotateSlotKeys(const RopeTable& rope, const SlotSet& slots, MatrixView out,
                      const ExecOptions& exec) {
  if (out.rows != slots.size() || out.cols != slots.keys_pre.cols) {
    return Status::InvalidArgument("kvslimmer: output is [" + std::to_string(out.rows) + ", " +
                                   std::to_string(out.cols) + "] for " +
                                   std::to_string(slots.size()) + " slots");
  }
  return ApplyRope(rope, RopeDirection::kRotate, slots.positions, slots.keys_pre.View(), out, exec);
}

Status ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position,
                   SlotSet* slots, const ExecOptions& exec) {
  if (slots == nullptr) return Status::InvalidArgument("kvslimmer: null slots");
  const int64_t s = slots->size();
  int64_t next_free = 0;
  for (size_t p = 0; p < pairs.size(); ++p) {
    const MergePair& mp = pairs[p];
    if (mp.first < next_free || mp.first + 1 >= s) {
      return Status::InvalidArgument(
          "kvslimmer: merge pair " + std::to_string(p) + " (slot " + std::to_string(mp.first) +
          ") overlaps the previous pair, is unsorted or is out of range");
    }
    if (!std::isfinite(mp.w_first) || !std::isfinite(mp.w_second)) {
      return Status::InvalidArgument("kvslimmer: non-finite merge weight in pair " +
                                     std::to_string(p));
    }
    next_free = mp.first + 2;
  }
  if (pairs.empty()) return Status::Ok();
  switch (exec.backend) {
    case Backend::kCpu:
      cpu::ApplyMerges(pairs, position, slots);
      return Status::Ok();
    case Backend::kCuda: {
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("ApplyMerges"));
      return cuda::ApplyMerges(pairs, position, slots, exec.cuda_stream);
#else
      return CheckCudaBackend("ApplyMerges");
#endif
    }
    default:
      return Status::InvalidArgument("ApplyMerges: unknown backend");
  }
}

KvSlimmerStats& KvSlimmerStats::operator+=(const KvSlimmerStats& o) {
  rounds += o.rounds;
  pairs_merged += o.pairs_merged;
  guard_fallbacks += o.guard_fallbacks;
  guard_clamps += o.guard_clamps;
  guard_clamp_to_less += o.guard_clamp_to_less;
  guard_alpha_fallbacks += o.guard_alpha_fallbacks;
  gate_evicted_slots += o.gate_evicted_slots;
  gate_evicted_tokens += o.gate_evicted_tokens;
  return *this;
}

double CentredCosine(const float* a, const float* b, std::span<const float> center, int64_t d) {
  double dot = 0.0, na = 0.0, nb = 0.0;
  for (int64_t c = 0; c < d; ++c) {
    const double m = center.empty() ? 0.0 : center[static_cast<size_t>(c)];
    const double x = a[c] - m, y = b[c] - m;
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  return na > 0.0 && nb > 0.0 ? dot / std::sqrt(na * nb) : 0.0;
}

double MeanCentredAdjacentCosine(ConstMatrixView keys, std::vector<float>* center) {
  const int64_t n = keys.rows, d = keys.cols;
  std::vector<double> sum(static_cast<size_t>(d), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < d; ++c) sum[static_cast<size_t>(c)] += keys.Row(i)[c];
  }
  center->assign(static_cast<size_t>(d), 0.0f);
  if (n == 0) return 0.0;
  for (int64_t c = 0; c < d; ++c) {
    (*center)[static_cast<size_t>(c)] = static_cast<float>(sum[static_cast<size_t>(c)] / n);
  }
  if (n < 2) return 0.0;
  double total = 0.0;
  for (int64_t i = 0; i + 1 < n; ++i)
    total += CentredCosine(keys.Row(i), keys.Row(i + 1), *center, d);
  return total / static_cast<double>(n - 1);
}

namespace {

// Removes the slots `drop` (ascending) from *slots.
void EraseSlots(std::span<const int64_t> drop, SlotSet* slots) {
  const int64_t s = slots->size(), d = slots->keys_pre.cols;
  const bool has_h = slots->h.size() == static_cast<size_t>(s);
  size_t next = 0;
  int64_t out = 0;
  for (int64_t i = 0; i < s; ++i) {
    if (next < drop.size() && drop[next] == i) {
      ++next;
      continue;
    }
    if (out != i) {
      std::copy(slots->keys_pre.Row(i), slots->keys_pre.Row(i) + d, slots->keys_pre.Row(out));
      std::copy(slots->value_sums.Row(i), slots->value_sums.Row(i) + d, slots->value_sums.Row(out));
      slots->cardinality[static_cast<size_t>(out)] = slots->cardinality[static_cast<size_t>(i)];
      slots->positions[static_cast<size_t>(out)] = slots->positions[static_cast<size_t>(i)];
      if (has_h) {
        slots->h[static_cast<size_t>(out)] = slots->h[static_cast<size_t>(i)];
        slots->h_observations[static_cast<size_t>(out)] =
            slots->h_observations[static_cast<size_t>(i)];
      }
    }
    ++out;
  }
  slots->keys_pre.rows = out;
  slots->keys_pre.values.resize(static_cast<size_t>(out * d));
  slots->value_sums.rows = out;
  slots->value_sums.values.resize(static_cast<size_t>(out * d));
  slots->cardinality.resize(static_cast<size_t>(out));
  slots->positions.resize(static_cast<size_t>(out));
  if (has_h) {
    slots->h.resize(static_cast<size_t>(out));
    slots->h_observations.resize(static_cast<size_t>(out));
  }
}

}  // namespace

int64_t KvSlimmerMinBudget(int64_t slots, const KvSlimmerOptions& options) {
  const int64_t protected_slots = std::min(slots, options.sinks + options.window);
  return protected_slots + (slots > protected_slots ? 1 : 0);
}

namespace {

// Scratch of one KvSlimmerCompress, reused across its rounds.
struct RoundScratch {
  Matrix post;              // [S, d] the slots' keys rotated to their positions
  std::vector<float> bias;  // [S] log cardinality
  std::vector<float> mass;  // [S] attention mass from the observation queries
  PairStatistics pair_stats;
  std::vector<MergePair> pairs;  // the round's merges
  std::vector<int64_t> drops;    // the round's gate evictions, ascending
};

// The arguments of KvSlimmerCompress against each other: query shape and positions, finite
// queries, the gate center, and a budget between KvSlimmerMinBudget and the slot count.
Status CheckCompressInput(int64_t d, ConstMatrixView queries,
                          std::span<const int64_t> query_positions, int64_t slot_budget,
                          const KvSlimmerOptions& options, const SlotSet& slots) {
  if (queries.cols != d || queries.rows < 1 || queries.rows % options.group_size != 0) {
    return Status::InvalidArgument(
        "kvslimmer: observation queries must be [W*G, d] with W >= 1, G=" +
        std::to_string(options.group_size) + ", d=" + std::to_string(d) + "; got [" +
        std::to_string(queries.rows) + ", " + std::to_string(queries.cols) + "]");
  }
  const int64_t w = queries.rows / options.group_size;
  if (options.mask == MaskKind::kByPosition && query_positions.size() != static_cast<size_t>(w)) {
    return Status::InvalidArgument("kvslimmer: " + std::to_string(query_positions.size()) +
                                   " query positions for W=" + std::to_string(w) + " queries");
  }
  KVD_RETURN_IF_ERROR(CheckFinite(queries, "kvslimmer: queries"));
  if (!options.gate_center.empty() && options.gate_center.size() != static_cast<size_t>(d)) {
    return Status::InvalidArgument("kvslimmer: gate_center has " +
                                   std::to_string(options.gate_center.size()) +
                                   " entries, head_dim is " + std::to_string(d));
  }
  const int64_t s = slots.size();
  if (s < options.sinks) {
    return Status::InvalidArgument("kvslimmer: " + std::to_string(s) +
                                   " slots is smaller than the sinks (" +
                                   std::to_string(options.sinks) + ")");
  }
  if (s < options.sinks + options.window) {
    return Status::InvalidArgument(
        "kvslimmer: " + std::to_string(s) + " slots is smaller than the window (" +
        std::to_string(options.window) + ") + sinks (" + std::to_string(options.sinks) + ")");
  }
  const int64_t min_budget = KvSlimmerMinBudget(s, options);
  if (slot_budget > s || slot_budget < min_budget) {
    return Status::OutOfRange("kvslimmer: slot budget " + std::to_string(slot_budget) +
                              " is unreachable: must be in [" + std::to_string(min_budget) + ", " +
                              std::to_string(s) + "] (sinks " + std::to_string(options.sinks) +
                              " and window " + std::to_string(options.window) +
                              " are never merged)");
  }
  return Status::Ok();
}

// scratch->mass: the attention mass each slot gets from the observation queries, its keys
// rotated to its position and its logit biased by log cardinality.
Status SlotAttentionMass(const RopeTable& rope, ConstMatrixView queries,
                         std::span<const int64_t> query_positions, const KvSlimmerOptions& options,
                         const SlotSet& slots, RoundScratch* scratch, const ExecOptions& exec) {
  const int64_t s = slots.size();
  scratch->post = Matrix(s, rope.head_dim());
  KVD_RETURN_IF_ERROR(RotateSlotKeys(rope, slots, scratch->post.View(), exec));
  scratch->bias.resize(static_cast<size_t>(s));
  for (int64_t j = 0; j < s; ++j) {
    scratch->bias[static_cast<size_t>(j)] =
        std::log(static_cast<float>(slots.cardinality[static_cast<size_t>(j)]));
  }
  scratch->mass.assign(static_cast<size_t>(s), 0.0f);
  ObservationOptions obs;
  obs.mask = options.mask;
  obs.group_size = options.group_size;
  ObservationHead head{queries, scratch->post.View(), scratch->bias, query_positions,
                       slots.positions};
  return ComputeAttentionMass(head, obs, scratch->mass, exec);
}

// Splits the chosen pairs (j, j + 1) into gate evictions (with a gate, the less attended slot
// of a pair whose centred cosine is below gate_min_cos, or of every pair with gate_evict_all)
// and merges with their weights, counting both in *local.
void SplitChosenPairs(std::span<const int64_t> chosen, const KvSlimmerOptions& options,
                      const SlotSet& slots, RoundScratch* scratch, KvSlimmerStats* local) {
  const bool gated = !options.gate_center.empty();
  const int64_t d = slots.keys_pre.cols;
  const std::vector<float>& mass = scratch->mass;
  scratch->pairs.clear();
  scratch->drops.clear();
  for (int64_t j : chosen) {
    if (gated &&
        (options.gate_evict_all || CentredCosine(slots.keys_pre.Row(j), slots.keys_pre.Row(j + 1),
                                                 options.gate_center, d) < options.gate_min_cos)) {
      const int64_t drop =
          mass[static_cast<size_t>(j + 1)] < mass[static_cast<size_t>(j)] ? j + 1 : j;
      scratch->drops.push_back(drop);
      local->gate_evicted_slots += 1;
      local->gate_evicted_tokens += slots.cardinality[static_cast<size_t>(drop)];
      continue;
    }
    const MergeWeightResult r = ComputeMergeWeights(options.norm, slots, scratch->pair_stats, j,
                                                    options.guard, options.guard_alpha_margin);
    local->guard_fallbacks += r.guard_fallback ? 1 : 0;
    local->guard_clamps += r.guard_clamped ? 1 : 0;
    local->guard_clamp_to_less += r.clamp_to_less ? 1 : 0;
    local->guard_alpha_fallbacks += r.alpha_fallback ? 1 : 0;
    scratch->pairs.push_back(r.pair);
  }
}

// One round: ranks the mergeable pairs between the sinks and the window by the slots' attention
// mass, takes up to (slots - slot_budget) disjoint ones, evicts or merges each.
Status MergeRound(const RopeTable& rope, ConstMatrixView queries,
                  std::span<const int64_t> query_positions, int64_t slot_budget,
                  const KvSlimmerOptions& options, SlotSet* slots, RoundScratch* scratch,
                  KvSlimmerStats* local, const ExecOptions& exec) {
  const int64_t s = slots->size();
  KVD_RETURN_IF_ERROR(
      SlotAttentionMass(rope, queries, query_positions, options, *slots, scratch, exec));
  const int64_t begin = options.sinks, end = s - options.window;
  KVD_RETURN_IF_ERROR(
      ComputePairStatistics(scratch->mass, begin, end, options.norm, slots, &scratch->pair_stats));
  const std::vector<double> rank =
      RankPairs(scratch->mass, *slots, begin, end, options.lambda, options.gamma);
  const std::vector<int64_t> chosen = SelectDisjointPairs(rank, s - slot_budget);
  if (chosen.empty()) {
    return Status::Internal("kvslimmer: no mergeable pair among " + std::to_string(s) + " slots");
  }
  SplitChosenPairs(chosen, options, *slots, scratch, local);
  if (!scratch->drops.empty()) {  // drop first, then merge the remaining pairs at their new indices
    size_t k = 0;
    for (MergePair& p : scratch->pairs) {
      while (k < scratch->drops.size() && scratch->drops[k] < p.first) ++k;
      p.first -= static_cast<int64_t>(k);
    }
    EraseSlots(scratch->drops, slots);
  }
  KVD_RETURN_IF_ERROR(ApplyMerges(scratch->pairs, options.position, slots, exec));
  local->pairs_merged += static_cast<int64_t>(scratch->pairs.size());
  local->rounds += 1;
  return Status::Ok();
}

}  // namespace

Status KvSlimmerCompress(const RopeTable& rope, ConstMatrixView queries,
                         std::span<const int64_t> query_positions, int64_t slot_budget,
                         const KvSlimmerOptions& options, SlotSet* slots, KvSlimmerStats* stats,
                         const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (slots == nullptr || stats == nullptr) {
    return Status::InvalidArgument("kvslimmer: null slots or stats");
  }
  const int64_t d = rope.head_dim();
  KVD_RETURN_IF_ERROR(CheckHeadDim(d).WithContext("kvslimmer"));
  KVD_RETURN_IF_ERROR(slots->Validate(d));
  KVD_RETURN_IF_ERROR(
      CheckCompressInput(d, queries, query_positions, slot_budget, options, *slots));
  RoundScratch scratch;
  KvSlimmerStats local;
  for (int64_t s = slots->size(); s > slot_budget; s = slots->size()) {
    if (local.rounds >= options.max_rounds) {
      return Status::Internal("kvslimmer: budget " + std::to_string(slot_budget) +
                              " not reached after " + std::to_string(local.rounds) + " rounds (" +
                              std::to_string(s) + " slots)");
    }
    KVD_RETURN_IF_ERROR(MergeRound(rope, queries, query_positions, slot_budget, options, slots,
                                   &scratch, &local, exec));
  }
  *stats += local;
  return Status::Ok();
}

Status KvSlimmerCompressHeads(const RopeTable& rope, std::span<const KvSlimmerHead> heads,
                              int64_t slot_budget, const KvSlimmerOptions& options,
                              KvSlimmerStats* stats, const ExecOptions& exec) {
  if (stats == nullptr) return Status::InvalidArgument("kvslimmer: null stats");
  std::vector<Status> status(heads.size());
  std::vector<KvSlimmerStats> per_head(heads.size());
  ExecOptions inner = exec;
  inner.num_threads = 1;
  const int threads = exec.backend == Backend::kCuda ? 1 : exec.num_threads;
  ParallelFor(static_cast<int64_t>(heads.size()), threads, [&](int64_t h) {
    const KvSlimmerHead& head = heads[static_cast<size_t>(h)];
    status[static_cast<size_t>(h)] =
        KvSlimmerCompress(rope, head.queries, head.query_positions, slot_budget, options,
                          head.slots, &per_head[static_cast<size_t>(h)], inner);
  });
  for (size_t h = 0; h < heads.size(); ++h) {
    if (!status[h].ok()) return status[h].WithContext("head " + std::to_string(h));
    *stats += per_head[h];
  }
  return Status::Ok();
}

}  // namespace kvd::kernels
