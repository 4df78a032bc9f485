// Per-head pipeline of a compression plan (plan.h). Internal to kvd_kernels.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/stages.h"

namespace kvd::kernels::internal {

// One (layer, KV head) of the plan. `head` is the head as its merge stage sees it (stages.h):
// the plan fills the options, RoPE table, tensors, window and layer gate; the pipeline adds the
// fields of each merge call (slots, pool, selected, cache, state). The score and route stages'
// inputs are built from it.
struct HeadInput {
  MergeHeadInput head;
  int64_t kept_pairs = 0;              // M of this head
  const VectorHeadFit* fit = nullptr;  // the head's VECTOR weights (a needs_calibration route)
  DType dtype = DType::kBFloat16;
  const ExpectedQueries* expected = nullptr;  // score kExpectedAttention: this head's queries
  // The head's scores [N] when the plan already has them (HeadBudget::kAdaptive scores every
  // head to share out the layer's budget), else null: the pipeline scores the head.
  const std::vector<float>* scores = nullptr;
};

// merge_gate's layer statistic: the mean over heads of MeanCentredAdjacentCosine of the
// de-rotated keys (keys[h] post-RoPE [N, d]). Errors of ApplyRope.
StatusOr<double> LayerCentredAdjacentCosine(const RopeTable& rope, std::span<const Matrix> keys,
                                            std::span<const int64_t> positions);

// The score stage of one head (its registration's ScoreFn, stages.h) into *scores [N].
// Single-threaded. `expected` is passed to needs_query_stats stages only (non-null there).
Status HeadScores(const CompressionPlanOptions& options, ConstMatrixView keys,
                  ConstMatrixView values, ConstMatrixView queries, int64_t window, int group_size,
                  int64_t kept, const ExpectedQueries* expected, std::vector<float>* scores);

// PyramidKV layer budgets of a chunk of n tokens adjusted so that they sum to exactly layers * m,
// each within [forced, n] (plan.h). OUT_OF_RANGE when that is impossible.
StatusOr<std::vector<int64_t>> ExactPyramidBudgets(int64_t n, int layers, int64_t m, int64_t forced,
                                                   const CompressionPlanOptions& o);

// The built-in merge and route steps (stages.h MergeFn, RouteFn): kvslimmer (merge_kvslimmer.cc:
// the hybrid with a score stage, KVSlimmer's pairwise rounds without) and vector
// (route_vector.cc: VECTOR residuals, or route_adaptive's relative ones).
Status KvSlimmerMergeHead(const MergeHeadInput& in, HeadSlots* out);
Status VectorRouteErrors(const RouteHeadInput& in, const HeadSlots& slots, std::vector<float>* err);
// VECTOR's RebuildFn: W RoPE^-1(k_j, pos_j) for the dropped slots (route_vector.cc).
Status VectorRebuild(const RebuildHeadInput& in, MatrixView values);

// Compresses one head into *out; adds its counters to *stats. Single-threaded.
Status CompressHead(const HeadInput& in, CompactHead* out, CompressionStats* stats);

// The built-in stages' policy keys (stage_keys.cc): the quantize stage's quant_* keys and the
// expected_attention stage's ea_* keys, how they fill the plan's typed options and their part of
// the canonical form.
inline constexpr char kEaOutlierZ[] = "ea_keydiff_outlier_z";
inline constexpr char kEaOutlierShare[] = "ea_keydiff_outlier_share";
inline constexpr char kEaKeyDiffPool[] = "ea_keydiff_pool";
inline constexpr char kQuantSinks[] = "quant_sinks";  // quant.sinks
// The quantize stage a chunk of tokens at `positions` records (compact_chunk.h
// QuantDescription::sinks): `q` with `sinks` the number of its first tokens that are among the
// sequence's first q.sinks.
QuantDescription ChunkQuant(const QuantDescription& q, std::span<const int64_t> positions);

std::vector<StagePolicyKey> QuantizeKeys();
void ApplyQuantizeKeys(const StageKeyValues& keys, CompressionPlanOptions* o);
std::string QuantizeCanonicalForm(const StageKeyValues& keys);
std::vector<StagePolicyKey> ExpectedAttentionKeys();
void ApplyExpectedAttentionKeys(const StageKeyValues& keys, CompressionPlanOptions* o);
std::string ExpectedAttentionCanonicalForm(const StageKeyValues& keys);

}  // namespace kvd::kernels::internal
