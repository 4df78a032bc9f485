// Expected-attention scores (docs/algorithms.md 2.4; Expected Attention, arXiv 2510.00636):
// query-agnostic at serving time. Per model, per (layer, query head), the daemon accumulates the
// window queries engines send with their puts (QueryStatistics: count, mean, per-channel second
// moment and the cross moment of every RoPE pair, of the DE-ROTATED queries). A key is scored by
// the attention a future query drawn from that distribution is expected to pay it:
//
//   q ~ N(m, C) post-RoPE, m = Rbar mu, C = Rbar Sigma Rbar^T,
//   Rbar = mean of R(p) over the F positions p = last + 1 .. last + F after the chunk,
//   z_g(i) = m . k_i / sqrt(d) + k_i^T C k_i / (2 d)      (= log E[exp(q . k_i / sqrt d)])
//   score(i) = mean_g softmax_i(z_g) * |v_i|               (G query heads of the KV head)
//
// mu and Sigma are the pre-RoPE mean and covariance; Sigma is kept block-diagonal over the RoPE
// pairs (2x2 per pair, diagonal for dims past rotary_dim): RoPE mixes only within a pair, so these
// are exactly the blocks Rbar can move, and k^T C k costs O(d) per key (a full d x d covariance
// would cost O(d^2) per key and query head, 64x more at d = 64). The averaged rotation Rbar (the
// paper's choice) shrinks each pair's mean by |mean_p e^{i p f}|: high-frequency pairs, whose
// phase the future position does not fix, stop voting for a direction.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/rope.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// Running statistics of the de-rotated window queries of one model. Not thread-safe; a copy is
// an independent snapshot.
class QueryStatistics {
 public:
  // INVALID_ARGUMENT for non-positive sizes, a head_dim the kernels refuse, or a rope table of
  // another head_dim.
  static StatusOr<QueryStatistics> Create(int num_layers, int num_q_heads, const RopeTable& rope);

  // Adds the window queries of one layer: q [W, num_q_heads, d] float32 post-RoPE (row-major,
  // token-major, as engines send them), token w at positions[w]. The queries are de-rotated
  // here. INVALID_ARGUMENT on a bad layer, sizes, negative positions or non-finite queries
  // (nothing is added then).
  Status Add(int layer, std::span<const float> q, std::span<const int64_t> positions);
  // Adds every count and sum of `other` (same shape; INVALID_ARGUMENT otherwise).
  Status Merge(const QueryStatistics& other);

  int num_layers() const { return num_layers_; }
  int num_q_heads() const { return num_q_heads_; }
  int head_dim() const { return head_dim_; }
  const RopeTable& rope() const { return rope_; }
  // Queries added to (layer, query head); the same for every head of a layer.
  int64_t count(int layer) const { return count_[layer]; }
  // The smallest count over layers (0 until every layer has seen a query).
  int64_t MinCount() const;

  // Sums of one (layer, query head), REQUIRES valid indices: sum [d] of q, sum_sq [d] of q_c^2,
  // sum_cross [d] with sum_cross[c] = sum of q_c q_partner(c) (c's RoPE pair partner; q_c^2 for
  // dims past rotary_dim), float64.
  std::span<const double> sum(int layer, int q_head) const { return Slice(sum_, layer, q_head); }
  std::span<const double> sum_sq(int layer, int q_head) const {
    return Slice(sum_sq_, layer, q_head);
  }
  std::span<const double> sum_cross(int layer, int q_head) const {
    return Slice(sum_cross_, layer, q_head);
  }
  // Restores the state (the daemon's persisted copy): counts [L], sums [L * n_q * d] each.
  // INVALID_ARGUMENT on sizes or negative/non-finite entries.
  Status Restore(std::span<const int64_t> counts, std::span<const double> sum,
                 std::span<const double> sum_sq, std::span<const double> sum_cross);
  std::span<const int64_t> counts() const { return count_; }
  std::span<const double> all_sum() const { return sum_; }
  std::span<const double> all_sum_sq() const { return sum_sq_; }
  std::span<const double> all_sum_cross() const { return sum_cross_; }

 private:
  std::span<const double> Slice(const std::vector<double>& v, int layer, int q_head) const {
    return {v.data() + (static_cast<size_t>(layer) * num_q_heads_ + q_head) * head_dim_,
            static_cast<size_t>(head_dim_)};
  }
  int num_layers_ = 0, num_q_heads_ = 0, head_dim_ = 0;
  RopeTable rope_;
  std::vector<int64_t> count_;     // [L]
  std::vector<double> sum_;        // [L, n_q, d]
  std::vector<double> sum_sq_;     // [L, n_q, d]
  std::vector<double> sum_cross_;  // [L, n_q, d]
};

// RoPE pair partner of every dim: partner[c] = the other dim of c's pair, c itself for dims past
// rotary_dim. [head_dim]
std::vector<int32_t> RopePartners(const RopeTable& rope);

struct ExpectedAttentionOptions {
  // F: the future positions the rotation is averaged over (kvpress uses 512), >= 1.
  int64_t future_positions = 512;
  bool use_covariance = true;  // false: z = m . k / sqrt d only
  bool value_norm = true;      // multiply by |v_i| (the paper's rescaling)
  // s: the share of the evictable tokens kept by KeyDiff's rank instead (FuseKeyDiffRanks), in
  // [0, 1); 0 = expected attention alone. KeyDiff keeps the distinctive keys a later question
  // asks for (a passkey), which expected attention under the average query ranks low.
  double keydiff_share = 0.0;
  // r: the share of the evictable tokens kept by recency instead (the most recent ones before the
  // window, as sink_recent keeps them), in [0, 1) with s + r < 1; 0 = none.
  double recent_share = 0.0;

  Status Validate() const;
};

// The query distribution of the G query heads of one KV head as the scorer uses it, post-RoPE:
// z_g(i) = sum_c k_c (mean[g][c] + (diag[g][c] k_c + cross[g][c] k_partner[c]) / 2 sqrt d) /
// sqrt d, with C's diagonal in diag and C[c][partner(c)] in cross (0 past rotary_dim).
struct ExpectedQueries {
  int group_size = 0;
  int head_dim = 0;
  std::vector<float> mean;       // [G, d] m
  std::vector<float> diag;       // [G, d]
  std::vector<float> cross;      // [G, d]
  std::vector<int32_t> partner;  // [d]
};

// The distribution of query heads kv_head * G .. kv_head * G + G - 1 of `layer` for the F
// positions after `last_position` (the chunk's last token). INVALID_ARGUMENT for bad indices or
// G, FAILED_PRECONDITION when the layer has seen no query.
StatusOr<ExpectedQueries> ExpectedQueriesFor(const QueryStatistics& stats, int layer, int kv_head,
                                             int group_size, int64_t last_position,
                                             const ExpectedAttentionOptions& options);

// scores[i] for the N keys of one KV head: keys [N, d] post-RoPE; values [N, d] (rows 0 = no
// value-norm rescaling). INVALID_ARGUMENT for shape mismatches, a head_dim other than q's, NaN/Inf
// keys or values. kCuda: UNIMPLEMENTED without CUDA, UNAVAILABLE without a device.
Status ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys,
                               ConstMatrixView values, std::span<float> scores,
                               const ExecOptions& exec = {});

// Fuses the expected-attention and KeyDiff scores of N tokens, and their recency, by rank. r_e(i),
// r_k(i) and r_r(i) are token i's ranks (0 = first, ties to the lower index) among the tokens
// [begin, end) by descending expected attention, descending KeyDiff score and descending position
// (r_r(i) = end - 1 - i); fused[i] = -min(r_e(i) / (1 - s - r), r_k(i) / s, r_r(i) / r) there (a
// term with share 0 left out), 0 outside (the forced sinks and window). The top B tokens of
// [begin, end) by fused are the union of the (1 - s - r) x best by expected attention, the s x
// best by KeyDiff and the r x most recent, x chosen to make B. INVALID_ARGUMENT for spans of
// different sizes, 0 <= begin <= end <= N violated, s or r negative, s + r >= 1 or a NaN score.
Status FuseKeyDiffRanks(std::span<const float> expected, std::span<const float> keydiff,
                        double keydiff_share, double recent_share, int64_t begin, int64_t end,
                        std::span<float> fused);

// Puts KeyDiff's outliers first: among the tokens [begin, end), those whose KeyDiff score is
// above mean + z * std of the range's scores (float64, population std) are the outliers; the
// `cap` highest of them (ties to the lower index) get fused[i] = 1 + cap - r, r their rank among
// them (0 = highest), above every other token's fused score (<= 0 as FuseKeyDiffRanks writes
// them); the rest of fused is unchanged. A distinctive key (a passkey) stands far out of its
// chunk's key distribution, and a small budget keeps it only when it goes first. cap 0 or an
// empty range: no change. INVALID_ARGUMENT for spans of different sizes, 0 <= begin <= end <= N
// violated, z negative or not finite, cap negative or a NaN score.
Status ProtectKeyDiffOutliers(std::span<const float> keydiff, double z, int64_t cap, int64_t begin,
                              int64_t end, std::span<float> fused);

}  // namespace kvd::kernels
