// KVSlimmer key merging (docs/algorithms.md 3): merge ADJACENT slots of one KV head, keys by a
// closed-form weighted average in the pre-RoPE space, values by addition with a cardinality, in
// rounds of disjoint pairs until an exact slot budget is met. Sinks and the window are never
// merged. One SlotSet holds one KV head; the *Heads forms run heads in parallel.
//
// One round (KvSlimmerCompress):
//  1. post-RoPE slot keys = RoPE(keys_pre, representative position)
//  2. mass m_j = sum_{w,g} softmax_j(q.k_j/sqrt(d) + ln l_j)         (observation.h)
//  3. over the mergeable slots M = [sinks, S - window):  a_j = m_j / G,  alpha_j = a_j / sum_M a,
//     o = sum_M alpha_j Vsum_j / l_j                                   (ComputePairStatistics)
//  4. pair rank w_j = (m_j + m_{j+1}) exp(-(j+1)/gamma) lambda_j, lambda_j = l_j + l_{j+1}
//     (kAsymKv) or 1 (kConstant); j is the slot index in the current round
//  5. the K smallest disjoint pairs (greedy ascending w, ties to the lower j), K = min(S - budget,
//     as many as fit): SelectDisjointPairs
//  6. weights per pair (ComputeMergeWeights), then ApplyMerges.
// Rounds repeat (statistics recomputed) until S == budget.
//
// Merge weights (per pair (m, m+1), v_j = Vsum_j / l_j):
//  kL2 (paper):  c11 = alpha_m (1-2 alpha_m)(v_m - o), c22 likewise, c12 = -alpha_m alpha_{m+1}
//                (v_m + v_{m+1} - 2o); A = |c11| - |c12|, B = |c22| - |c12| (Euclidean norms).
//  kL1Code (released code): d_j = |v_j - o|_1, h_j = alpha_j (1-2 alpha_j) d_j, smoothed as a
//                running mean over the rounds/chunks that observed the slot (SlotSet::h and
//                h_observations), H12 = alpha_m alpha_{m+1} (d_m + d_{m+1}), A = h_m - H12,
//                B = h_{m+1} - H12; merged h = (A/D)^2 h_m + (B/D)^2 h_{m+1}.
//  k* = (A k_m + B k_{m+1}) / D, D = A + B. Guard (kvd's, not in either source; MergeGuard):
//  kClamp (default): if D <= 1e-30 or not finite, both weights are 1/2 (guard_fallbacks += 1);
//                else each weight is clamped to [0, 1] (they sum to 1, so one clamp fixes both;
//                guard_clamps += 1 when it changed anything). Flaw: when a member's alpha nears
//                1/2 its coefficient alpha (1 - 2 alpha) vanishes, and the clamp can put ALL the
//                weight on the less attended key (alpha 0.05 / 0.40 can give (1, 0)); such pairs
//                are counted in guard_clamp_to_less whichever guard is used.
//  kAlphaFallback: where kClamp would fall back or clamp, or where either member's alpha is
//                within alpha_margin of 1/2, the weights are the alpha-weighted mean
//                (alpha_m, alpha_{m+1}) / (alpha_m + alpha_{m+1}) (1/2 each when both are 0;
//                guard_alpha_fallbacks += 1); elsewhere the closed form, unclamped (it is in
//                [0, 1] there).
//  kMean:        every pair is the plain mean (1/2, 1/2); no statistics are used for the key.
//
// Centred-similarity gate (optional; plan.h merge_gate): with a centre c (the head's mean
// pre-RoPE key over the chunk), a selected pair (m, m+1) merges only if CentredCosine(k_m, k_{m+1},
// c) >= gate_min_cos; otherwise the member with the lower mass m_j (ties: the first) is dropped,
// its tokens evicted (gate_evicted_slots / gate_evicted_tokens). gate_evict_all drops for every
// pair (the layer's gate is closed). Either way a selected pair removes one slot: the rounds and
// the exact budget are unchanged.
//
// Representative position of a merged slot: kLast = position of the later slot (original
// positions are kept: the decode engine continues at N); kWeighted = llround(w_m p_m + w_{m+1}
// p_{m+1}) with the merge weights (where the merged key "lives" between the two).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/observation.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

enum class MergeNorm : uint8_t { kL2 = 0, kL1Code = 1 };
enum class PairLambda : uint8_t { kAsymKv = 0, kConstant = 1 };
enum class RepresentativePosition : uint8_t { kLast = 0, kWeighted = 1 };
// The guard of the pairwise merge weight (file comment). kClamp is the original behaviour.
enum class MergeGuard : uint8_t { kClamp = 0, kAlphaFallback = 1, kMean = 2 };

// gamma = 4096 / ln 512 (AsymKV), as a literal so it can be constexpr.
inline constexpr double kKvSlimmerDefaultGamma = 656.586543053466;

struct KvSlimmerOptions {
  MergeNorm norm = MergeNorm::kL2;                                  // weight variant
  PairLambda lambda = PairLambda::kAsymKv;                          // lambda_j of the ranking
  RepresentativePosition position = RepresentativePosition::kLast;  // merged slot position
  int64_t sinks = 4;   // first slots never merged, >= 0
  int64_t window = 0;  // last slots never merged (one-shot: the observation window), >= 0
  int group_size = 1;  // G query heads per KV head, >= 1
  double gamma = kKvSlimmerDefaultGamma;  // recency discount of the ranking, > 0
  // Observation visibility: kByPosition (query w sees slots at positions <= query_positions[w])
  // or kNone (queries of the next chunk see all). kCausalWindow is rejected (slots != tokens).
  MaskKind mask = MaskKind::kByPosition;
  int max_rounds = 64;  // safety bound on rounds, >= 1 (each round at least halves slack)
  MergeGuard guard = MergeGuard::kClamp;  // merge weight guard (file comment)
  // kAlphaFallback: a pair falls back to the alpha-weighted mean when a member's alpha is within
  // this distance of 1/2. In [0, 0.5]; default 0.1.
  double guard_alpha_margin = 0.1;
  // Centred-similarity gate (file comment): off when empty, else the centre [d].
  std::span<const float> gate_center;
  double gate_min_cos = 0.5;    // in [-1, 1]
  bool gate_evict_all = false;  // with a centre: drop instead of merging for every pair

  Status Validate() const;
};

// cos(a - c, b - c) in float64 over d entries (c may be empty = 0); 0 when either centred vector
// is 0.
double CentredCosine(const float* a, const float* b, std::span<const float> center, int64_t d);
// The mean of `keys` ([N, d]) into *center (float64 sums) and the mean over adjacent rows of
// CentredCosine(k_i, k_{i+1}, center); 0 when N < 2.
double MeanCentredAdjacentCosine(ConstMatrixView keys, std::vector<float>* center);

// The slots of one KV head.
struct SlotSet {
  Matrix keys_pre;                      // [S, d] pre-RoPE keys
  Matrix value_sums;                    // [S, d] Vsum_j (sum of the original values)
  std::vector<int32_t> cardinality;     // [S] l_j >= 1 (original tokens in slot j)
  std::vector<int64_t> positions;       // [S] representative positions, >= 0
  std::vector<float> h;                 // [S] kL1Code smoothed h_j; empty = never observed
  std::vector<int32_t> h_observations;  // [S] observations averaged into h (same size as h)

  int64_t size() const { return keys_pre.rows; }
  // Checks consistent sizes, d == head_dim, l >= 1, positions >= 0, finite keys and values.
  Status Validate(int64_t head_dim) const;
};

// Builds slots from raw tokens: keys_pre = RoPE^-1(keys_post, positions), Vsum = values, l = 1.
// Errors: shape mismatch / NaN / Inf (INVALID_ARGUMENT), those of ApplyRope.
StatusOr<SlotSet> SlotsFromTokens(const RopeTable& rope, ConstMatrixView keys_post,
                                  ConstMatrixView values, std::span<const int64_t> positions,
                                  const ExecOptions& exec = {});

// out = RoPE(keys_pre, positions): the slot keys as a post-RoPE engine serves them.  // [S, d]
Status RotateSlotKeys(const RopeTable& rope, const SlotSet& slots, MatrixView out,
                      const ExecOptions& exec = {});

// Step 3 for the mergeable range [begin, end) of `slots`.
struct PairStatistics {
  std::vector<double> alpha;   // [S] alpha_j inside [begin, end), 0 outside
  std::vector<double> o;       // [d] mean attended value
  std::vector<double> l1_dev;  // [S] d_j = |v_j - o|_1 inside the range (kL1Code), 0 outside
  std::vector<double> h;       // [S] smoothed h_j (kL1Code; before this round's merges)
};
// `mass` [S] from ComputeAttentionMass (with the ln l bias). When sum_M mass == 0 every alpha is
// 1/|M|. Updates slots->h / h_observations (running mean) when norm == kL1Code.
// Errors: INVALID_ARGUMENT on size mismatch or a bad range.
Status ComputePairStatistics(std::span<const float> mass, int64_t begin, int64_t end,
                             MergeNorm norm, SlotSet* slots, PairStatistics* stats);

struct MergePair {
  int64_t first = 0;      // merges slots first and first + 1
  float w_first = 0.5f;   // weight of keys_pre[first]
  float w_second = 0.5f;  // weight of keys_pre[first + 1]
  float h_merged = 0.0f;  // kL1Code: h of the merged slot
};

struct MergeWeightResult {
  MergePair pair;
  bool guard_fallback = false;  // kClamp: D <= 0 or non-finite, weights 1/2
  bool guard_clamped = false;   // kClamp: a weight was clamped into [0, 1]
  // The unguarded weights lie outside [0, 1] and clamping them gives weight 1 to the member
  // with the strictly smaller alpha (set for every guard: what kClamp does / would do).
  bool clamp_to_less = false;
  bool alpha_fallback = false;  // kAlphaFallback: merged as the alpha-weighted mean
};
// Step 6 for the pair (m, m+1) of `slots` with `stats` from ComputePairStatistics, guarded by
// `guard` (alpha_margin: KvSlimmerOptions::guard_alpha_margin, used by kAlphaFallback).
MergeWeightResult ComputeMergeWeights(MergeNorm norm, const SlotSet& slots,
                                      const PairStatistics& stats, int64_t m,
                                      MergeGuard guard = MergeGuard::kClamp,
                                      double alpha_margin = 0.1);

// Step 4: rank[j] for pairs (j, j+1), j in [begin, end-1); +Inf outside.  // [S-1] (or empty)
std::vector<double> RankPairs(std::span<const float> mass, const SlotSet& slots, int64_t begin,
                              int64_t end, PairLambda lambda, double gamma);

// Step 5: up to max_pairs disjoint pairs by ascending rank (+Inf never chosen), ties to the lower
// index; returned sorted ascending by first index.
std::vector<int64_t> SelectDisjointPairs(std::span<const double> rank, int64_t max_pairs);

// Merges each pair (keys weighted, value sums and cardinalities added, position per
// RepresentativePosition, h for kL1Code when slots->h is non-empty). The SlotSet shrinks by
// pairs.size(). REQUIRES pairs sorted ascending and disjoint (INVALID_ARGUMENT otherwise).
// kCuda: UNIMPLEMENTED without CUDA, UNAVAILABLE without a device.
Status ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position,
                   SlotSet* slots, const ExecOptions& exec = {});

struct KvSlimmerStats {
  int64_t rounds = 0;
  int64_t pairs_merged = 0;
  int64_t guard_fallbacks = 0;        // pairs merged as the mean because D <= 0
  int64_t guard_clamps = 0;           // pairs whose weights were clamped into [0, 1]
  int64_t guard_clamp_to_less = 0;    // pairs where the clamp gives weight 1 to the less attended
  int64_t guard_alpha_fallbacks = 0;  // kAlphaFallback: pairs merged as the alpha-weighted mean
  int64_t gate_evicted_slots = 0;     // gate: pairs that dropped a slot instead of merging
  int64_t gate_evicted_tokens = 0;    // gate: tokens in those dropped slots
  KvSlimmerStats& operator+=(const KvSlimmerStats& o);
};

// Smallest budget reachable for `slots` slots: sinks + window + (1 if any slot is mergeable).
int64_t KvSlimmerMinBudget(int64_t slots, const KvSlimmerOptions& options);

// Merges `slots` (one KV head) down to exactly `slot_budget` slots.
// queries: [W*G, d] post-RoPE observation queries (row w*G+g); query_positions: [W] (kByPosition).
// Errors: INVALID_ARGUMENT (bad option, shape, NaN/Inf in queries or slots, empty queries,
// unsupported d); OUT_OF_RANGE "budget" when slot_budget > S or < KvSlimmerMinBudget;
// INTERNAL if max_rounds pass without reaching the budget. budget == S is a no-op.
Status KvSlimmerCompress(const RopeTable& rope, ConstMatrixView queries,
                         std::span<const int64_t> query_positions, int64_t slot_budget,
                         const KvSlimmerOptions& options, SlotSet* slots, KvSlimmerStats* stats,
                         const ExecOptions& exec = {});

// Per-head inputs for the batched form.
struct KvSlimmerHead {
  ConstMatrixView queries;                   // [W*G, d]
  std::span<const int64_t> query_positions;  // [W]
  SlotSet* slots = nullptr;
};
// Runs KvSlimmerCompress on each head in parallel (ExecOptions::num_threads); stats summed.
// Returns the first error by head order (prefixed "head h: ").
Status KvSlimmerCompressHeads(const RopeTable& rope, std::span<const KvSlimmerHead> heads,
                              int64_t slot_budget, const KvSlimmerOptions& options,
                              KvSlimmerStats* stats, const ExecOptions& exec = {});

}  // namespace kvd::kernels
