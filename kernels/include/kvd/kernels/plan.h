// Compression plans (docs/algorithms.md 5): score -> select -> merge -> route, each stage optional,
// turning one raw chunk (engine layout of common/layout.h) into a CompactChunk.
//
// Stages and what each combination does, per (layer, KV head) of N tokens (the stages a plan can
// run, their codes and capabilities are the stage registry's, stages.h):
//   score  kNone (recency: the latest tokens win) | kSnapKv | kKeyDiff | kPyramidKv
//          | kExpectedAttention (expected_attention.h: the keys' expected attention under the
//          model's query statistics, CompressionInput::query_stats, averaged over the
//          `expected_attention.future_positions` positions after the chunk's last token; the
//          chunk's own window queries are not used. Fallback: while query_stats is null or
//          MinCount() < expected_attention_min_queries the plan scores with one-shot KeyDiff
//          and the chunk records kKeyDiff, the stage that scored it)
//          | any other registered score stage (its ScoreFn scores each head; higher = keep)
//   merge  kNone | kKvSlimmer | any other registered merge stage (its MergeFn writes each head's
//          slots from the score stage's pool)
//   route  kNone | kVector | any other registered route stage (its RouteFn prices dropping each
//          slot's value; the budget below is kept the same way)
//   - merge kNone:        keep the top `pool` tokens by score (eviction; section 5.1/5.2).
//   - score kNone + merge: KVSlimmer merges all N tokens down to `pool` slots (section 5.3).
//   - score + merge:      the hybrid of section 5.4: the score picks the pool; every token outside
//                         the pool is merged into its nearest pool neighbour that is not a sink or
//                         window token (ties go left). A merged slot's pre-RoPE key is the
//                         attention-mass-weighted mean of its tokens (uniform when the plan has no
//                         queries or the masses are all 0), its value sum the sum, its position
//                         per `position`. (The pairwise closed form of 3.1 is defined for pairs;
//                         the weighted mean is its first-order form for groups.) Tokens with no
//                         eligible neighbour (the pool is only sinks/window) are evicted. Each
//                         slot holds at most `hybrid_max_group` tokens: the absorber plus its
//                         (hybrid_max_group - 1) assigned tokens nearest in token distance (ties
//                         left); the other assigned tokens are evicted, as are tokens failing
//                         the `hybrid_min_cos` gate. The slot count (budget) does not change.
//                         With `hybrid_error_aware` a token is merged only where that is
//                         estimated to hurt less than evicting it (below).
//   - error-aware hybrid (`hybrid_error_aware`, default off): after the gate, each absorber's
//                         assigned tokens are visited nearest first (token distance, ties left);
//                         token i joins the slot's current group G only if the window queries'
//                         attention-output error of serving G + i as one merged slot is below that
//                         of serving G merged and evicting i, both measured against the
//                         uncompressed head (sum over the W*G window query rows of the squared
//                         change of the output, exact for this one slot's change with every other
//                         token kept; window_error.h); otherwise i is evicted. At most
//                         `hybrid_max_group` tokens join a slot (absorber included); candidates
//                         left after the slot is full are evicted. Needs window queries.
//   - merge_guard:        how a merged key weighs its tokens (field comment; kvslimmer.h).
//   - merge_gate:         merges allowed only between keys alike after centring, and only in
//                         layers where adjacent keys are alike after centring (field comment).
//   - route kVector:      among the slots of cardinality 1 that are not sinks/window, the ones
//                         with the smallest |v - W kpre - b|^2 drop their value (section 4.2;
//                         b = the fit's intercept, 0 for a linear map).
//   - adaptive routing (`route_adaptive`, default off): a slot may drop its value only when its
//                         attention-weighted relative residual
//                           e_j = (m_j / mean_i m_i) * |v_j - W kpre_j - b|^2 / s_v
//                         is <= `route_max_error` (m = the window queries' attention mass of the
//                         slot's token, ComputeAttentionMass causal window, uniform without queries
//                         or for KVSlimmer-only plans; s_v = mean_i |v_i - mean v|^2 over the
//                         head's N tokens, the head's value scale); the 2a slots with the smallest
//                         e_j are routed. A head whose calibration R^2 (VectorHeadFit::r2) is
//                         below `route_min_r2` routes nothing. Too few passing slots lower a
//                         exactly as below: a token that is not routed keeps its value and the
//                         half-pair it would have freed is not spent on an extra key, so the
//                         plan falls back towards plain eviction head by head.
//   - quantize:           after the other stages, every head's keys and values are quantized
//                         (quantize.h; `quant`, format kNone = off): keys per channel over
//                         quant.key_group slots, values per slot over quant.value_group
//                         channels, the last quant.recent rows of each and the rows of the
//                         sequence's first quant.sinks tokens (at most `sinks`: tokens the plan
//                         always keeps, its first rows in a chunk holding them) kept as they are.
//                         It changes the bytes of a slot, not which slots are kept: the half-pair
//                         budget below is that of the other stages.
//
// Budget, in half-pairs, exact for every head: M = llround((1 - p_c) N) (PyramidKV: the layer
// budget, see below); without routing pool = M slots with values (2M half-pairs); with routing
// a = ComputeRouteBudget(...) and pool = M + a slots of which 2a drop their value: keys + values
// == 2M. When merging leaves fewer than 2a eligible single slots, a is lowered (pool shrinks,
// more tokens merge) until they suffice, so the total stays exactly 2M.
// PyramidKV: per-layer budgets from PyramidKvLayerBudgets, then the rounding residue is spread
// one token at a time (largest layers first when over, smallest first when under, within
// [forced, N]) so that the sum over layers is exactly L * M: the chunk total is exact.
//
// Head budgets (`head_budget`): kUniform gives every head of a layer the same M. kAdaptive (AdaKV
// style, for every scorer) shares the layer's H * M slots across its H heads by score: each head
// keeps its sinks + window and floor(adaptive_floor * (M - forced)) of its best tokens; the rest of
// the layer's non-forced budget goes to the highest scores over all heads of the layer (ties:
// lower index, then lower head, so identical heads split evenly). Scores compare across heads
// because SnapKV/PyramidKV scores are pooled attention probabilities and KeyDiff scores negative
// cosines. Per-layer total exact (sum_h M_h == H * M); the compact chunk already stores a slot
// count per head. See AdaptiveHeadBudgets. Each head is scored once (its score stage sees the
// layer's M as ScoreHeadInput::kept); its pool is selected with the scores that shared out M.
//
// Window and sinks: the first `sinks` tokens and, when window queries are given, the last
// `window` tokens (the tokens whose queries they are) are never evicted, merged or routed.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/expected_attention.h"
#include "kvd/kernels/kvslimmer.h"
#include "kvd/kernels/snapkv.h"
#include "kvd/kernels/types.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {

enum class HeadBudget : uint8_t { kUniform = 0, kAdaptive = 1 };

struct CompressionPlanOptions {
  ScoreStage score = ScoreStage::kSnapKv;  // which tokens matter (see file comment)
  MergeStage merge = MergeStage::kNone;    // kKvSlimmer: merge instead of evicting
  RouteStage route = RouteStage::kNone;    // kVector: drop predictable values (needs weights)
  double p_c = 0.5;                        // compression ratio in [0, 1)
  int64_t window = 32;     // W: window queries per chunk = the last W tokens; kept. >= 1
  int64_t sinks = 4;       // first tokens never evicted/merged/routed, >= 0 (AsymKV: 32)
  int pooling_kernel = 5;  // SnapKV/PyramidKV pooling kernel, odd >= 1
  PoolingKind pooling = PoolingKind::kAvg;
  int64_t keydiff_block = 0;  // KeyDiff: 0 = one-shot, else the block-wise block size (128)
  // kExpectedAttention: future positions, covariance and value-norm terms (expected_attention.h).
  ExpectedAttentionOptions expected_attention;
  // kExpectedAttention: the fewest window queries per layer the statistics must hold before they
  // score (file comment: KeyDiff until then), >= 1. Default 256 (8 puts of 32 window queries).
  int64_t expected_attention_min_queries = 256;
  double pyramid_beta = 20.0;                                       // PyramidKV beta, >= 1
  MergeNorm merge_norm = MergeNorm::kL2;                            // KVSlimmer weight variant
  PairLambda pair_lambda = PairLambda::kAsymKv;                     // KVSlimmer pair ranking
  RepresentativePosition position = RepresentativePosition::kLast;  // merged slot position
  double route_eps = 0.0;  // p_a margin (vector.h RouteOptions::eps), in [0, 1)
  // Hybrid only: the most tokens one merged slot may hold, absorber included (>= 1; 1 = no
  // merging, i.e. plain eviction of the pool). Uncapped groups reach hundreds of tokens at high
  // p_c and their mean key and ln(l) bias pull attention onto them (KVSlimmer's code caps at 5).
  int64_t hybrid_max_group = 4;
  // Hybrid only: a token joins its absorber only if cos(kpre_i, kpre_absorber) >= this; 0 = off
  // (any value <= 0 disables the gate). In [-1, 1].
  double hybrid_min_cos = 0.0;
  // Hybrid only: merge a token only when the estimated attention-output error of merging it is
  // below that of evicting it (file comment); default off = merge every assigned token. Needs
  // window queries (FAILED_PRECONDITION without). Not recorded in CodecDescription: serving
  // reads merged slots the same way whichever tokens were merged.
  bool hybrid_error_aware = false;
  // Per-head budgets within a layer (file comment). kAdaptive needs a score stage (not kNone) and
  // one-shot KeyDiff (keydiff_block 0). Not recorded in CodecDescription: the chunk's per-head
  // slot counts are all serving needs.
  HeadBudget head_budget = HeadBudget::kUniform;
  // kAdaptive: the fraction of its uniform non-forced share every head keeps (AdaKV's safeguard),
  // in [0, 1]; 1 = uniform budgets. Default 0.2.
  double adaptive_floor = 0.2;
  // Merge key weight guard (kvslimmer.h MergeGuard; default kClamp = the original weights).
  // KVSlimmer pairs: the guard of ComputeMergeWeights. Hybrid (its groups have no pairwise
  // closed form): kMean merges a group's pre-RoPE keys as the plain mean instead of the
  // mass-weighted one; kClamp and kAlphaFallback keep the mass-weighted (alpha-weighted) mean.
  // Not recorded in CodecDescription: serving reads a merged key the same way whatever its
  // weights.
  MergeGuard merge_guard = MergeGuard::kClamp;
  // kAlphaFallback: KvSlimmerOptions::guard_alpha_margin, in [0, 0.5]. Default 0.1.
  double merge_guard_alpha_margin = 0.1;
  // Merges gated by centred key similarity (default off; needs merge kKvSlimmer). The centre of
  // a head is its mean pre-RoPE key over the chunk; CentredCosine / MeanCentredAdjacentCosine
  // are in kvslimmer.h. Layer gate, derived from the chunk: a layer merges at all only when the
  // mean over its KV heads of MeanCentredAdjacentCosine (adjacent tokens of the chunk) is
  // >= merge_gate_layer_min; in a closed layer every token a merge would take is evicted instead
  // (the hybrid becomes eviction of its pool; KVSlimmer drops the less attended slot of every
  // pair it selects). Pair gate in open layers: hybrid: a token joins its absorber only if the
  // centred cosine of their pre-RoPE keys is >= merge_gate_min_cos, else it is evicted (before
  // the cap and the error-aware choice); KVSlimmer: the KvSlimmerOptions gate (a pair failing it
  // drops its less attended slot). The budget is unchanged. Counters: CompressionStats
  // gate_closed_layers, gate_evicted_tokens. Not recorded in CodecDescription.
  bool merge_gate = false;
  double merge_gate_min_cos = 0.5;    // pair gate, in [-1, 1]
  double merge_gate_layer_min = 0.3;  // layer gate, in [-1, 1]; -1 opens every layer
  // kVector only: adaptive routing (file comment); default off = route the 2a smallest residuals
  // of the pool. Not recorded in CodecDescription: serving rebuilds every flagged slot alike.
  bool route_adaptive = false;
  // route_adaptive: the largest attention-weighted relative residual e_j a routed slot may have,
  // finite and >= 0. Default 0.05 (a token of average window mass whose rebuilt value is off by
  // 5% of the head's value variance).
  double route_max_error = 0.05;
  // route_adaptive: heads whose calibration R^2 is below this route nothing; finite, <= 1.
  // Default 0.3.
  double route_min_r2 = 0.3;
  // The quantize stage (file comment; quantize.h). Default format kNone = off. When on:
  // key_group, value_group in [1, 65536] (KIVI and the quality runs use 64 and 64; a value group
  // beyond head_dim is one group per slot), recent >= 0 rows, sinks in [0, sinks] tokens (the
  // chunk records its own rows of them: compact_chunk.h). Recorded in CodecDescription.
  QuantDescription quant;
  // Policy keys of registered stages (stages.h StagePolicyKey) set for this plan, by key name;
  // a key not here has its default. Each must be a key of the plan's score, merge or route stage,
  // or of the quantize stage when quant is on, and fit it (INVALID_ARGUMENT naming it). The stages
  // whose options are typed fields (quant, expected_attention) read those, which the daemon fills
  // from these keys (StageRegistration::apply_keys). Not recorded in CodecDescription (the
  // daemon's codec id records them).
  std::map<std::string, double, std::less<>> stage_keys;

  // INVALID_ARGUMENT (OUT_OF_RANGE for p_c) naming the field.
  Status Validate() const;
  // The codec description recorded in a chunk this plan compresses with VectorWeights of
  // `calibration_version` (0: no weights, values stored).
  CodecDescription Codec(uint64_t calibration_version = 0) const;
};

// Time per stage of one Compress call, in nanoseconds of std::chrono::steady_clock, measured
// around the stage calls (two clock reads per stage and head; no behaviour change). Exclusive:
// a stage that runs inside another (de-rotation inside the hybrid's merge) counts only in its own.
// `convert` is time of the calling thread (the conversion itself may use exec.num_threads); the
// other stages are summed over (layer, KV head) pipelines, i.e. thread time: with
// exec.num_threads == 1 the stages sum to at most CompressionStats::total_ns, with more threads
// the heads run in parallel and the sum may exceed the wall time.
struct CompressionStageTimes {
  int64_t convert_ns = 0;   // raw engine bytes -> per-head float32 (GatherHeads, K and V)
  int64_t derotate_ns = 0;  // RoPE^-1 of the keys (hybrid merge, VECTOR routing)
  int64_t score_ns = 0;     // SnapKV / KeyDiff / PyramidKV scores (recency included)
  int64_t select_ns = 0;    // top-k pool (or block-wise KeyDiff) + the eviction slot table
  int64_t merge_ns = 0;     // hybrid grouping + merged slots (+ attention mass), or KVSlimmer
  int64_t route_ns = 0;     // VECTOR residuals + the slots that drop their value
  int64_t encode_ns = 0;    // slot table -> compact head (float32 -> dtype, value means)
  int64_t Sum() const {
    return convert_ns + derotate_ns + score_ns + select_ns + merge_ns + route_ns + encode_ns;
  }
  CompressionStageTimes& operator+=(const CompressionStageTimes& o);
};

// Counters of one Compress call.
struct CompressionStats {
  int64_t heads = 0;
  int64_t input_tokens = 0;       // N summed over heads
  int64_t slots = 0;              // keys kept, summed over heads
  int64_t rebuild_slots = 0;      // slots whose value was dropped (VECTOR)
  int64_t merged_tokens = 0;      // tokens that ended in a slot of cardinality > 1
  int64_t evicted_tokens = 0;     // tokens in no slot
  int64_t budget_half_pairs = 0;  // sum of 2M
  int64_t half_pairs = 0;         // keys + stored values (== budget_half_pairs)
  int64_t route_reductions = 0;   // heads whose a was lowered for lack of single slots
  int64_t route_floor_heads = 0;  // route_adaptive: heads that routed nothing (R^2 below floor)
  KvSlimmerStats kvslimmer;       // guard counters of the merge stage
  // hybrid_error_aware: tokens evicted because merging them was estimated to cost more (the
  // candidates left once a slot is full are not counted).
  int64_t error_aware_evicted = 0;
  // merge_gate: layers whose gate was closed (counted once per layer), and tokens evicted by
  // either gate instead of being merged (hybrid: tokens; KVSlimmer: tokens of dropped slots).
  int64_t gate_closed_layers = 0;
  int64_t gate_evicted_tokens = 0;
  CompressionStageTimes stage;  // time per stage (see CompressionStageTimes)
  int64_t total_ns = 0;         // wall time of the whole Compress call (steady_clock)
};

// Inputs of one chunk. Views are host memory.
struct CompressionInput {
  std::span<const uint8_t> raw;        // layout.ChunkBytes(N): per layer K[N,H,d] then V[N,H,d]
  std::span<const int64_t> positions;  // [N] original positions, >= 0
  // Optional observation queries, post-RoPE, one view per (layer, KV head) at index layer*H+h:
  // [W*G, d] with row w*G+g = query head h*G+g of the w-th of the last W tokens (W = window).
  // Empty = none (then scorers/mergers that need queries fail with FAILED_PRECONDITION).
  std::span<const ConstMatrixView> window_queries;
  const VectorWeights* weights = nullptr;  // required when route == kVector
  // kExpectedAttention: the model's query statistics (same layers, query heads and head_dim as
  // the layout; FAILED_PRECONDITION otherwise). Null or too few queries: KeyDiff (file comment).
  const QueryStatistics* query_stats = nullptr;
};

// Compresses one chunk. Errors: INVALID_ARGUMENT for a bad layout, raw size, positions count or
// option, non-finite K/V/queries, N smaller than sinks + window; FAILED_PRECONDITION when a stage
// lacks its input (queries for SnapKV/PyramidKV/KVSlimmer, weights for VECTOR, weights of another
// shape); OUT_OF_RANGE when the budget cannot hold the sinks and window; the errors of the
// stages. Parallel over KV heads (exec.num_threads).
StatusOr<CompactChunk> Compress(const CompressionPlanOptions& options, const ModelLayout& layout,
                                const CompressionInput& input, CompressionStats* stats = nullptr,
                                const ExecOptions& exec = {});

// The kAdaptive split of one layer: scores[h] [N] per head (higher = keep), M per head, `sinks`
// and `window` forced. Returns M_h per head, sum == H * M, each M_h >= forced + floor(floor *
// (M - forced)) and <= N. When M <= forced every M_h is M (the stages then report the budget
// error). INVALID_ARGUMENT on empty or unequal score lengths, NaN scores, floor outside [0, 1].
StatusOr<std::vector<int64_t>> AdaptiveHeadBudgets(std::span<const std::vector<float>> scores,
                                                   int64_t kept, int64_t sinks, int64_t window,
                                                   double floor);

// Rearranges engine queries of one layer, Q[W, num_q_heads, d] of `dtype`, into the per-KV-head
// [W*G, d] float32 matrices CompressionInput expects (H of them). INVALID_ARGUMENT on bad sizes.
StatusOr<std::vector<Matrix>> GatherWindowQueries(const ModelLayout& layout, const void* q,
                                                  int64_t window);

// Streams one raw chunk into a VECTOR calibration: de-rotates K and adds (Kpre, V) of every
// (layer, head). Errors of Compress's input checks and of VectorCalibrator::Add.
Status CalibrateFromChunk(const ModelLayout& layout, std::span<const uint8_t> raw,
                          std::span<const int64_t> positions, VectorCalibrator* calibrator,
                          const ExecOptions& exec = {});

}  // namespace kvd::kernels
