// The error-aware hybrid's estimate (plan.h, `hybrid_error_aware`): how much the window queries'
// attention output of one head changes when some tokens are replaced by slots. Internal to
// kvd_kernels.
//
// For window query rows r (R = W*G, row w*G + g = query head g of the w-th of the last W tokens,
// post-RoPE) over the head's N tokens (post-RoPE keys k_t, values v_t), with the causal window
// mask (query w sees tokens 0..N-W+w) and s_rt = q_r . k_t / sqrt(d):
//   E_rt = exp(s_rt - m_r) (m_r = the row's largest visible logit), Z_r = sum_t E_rt,
//   o_r = sum_t E_rt v_t / Z_r   (the exact attention output of the uncompressed head).
// Replacing the tokens of `removed` (each visible to every window query, i.e. not a window
// token) by slots (post-RoPE key k_s, value sum V_s, cardinality l_s; served as exp(s) V_s over
// l_s exp(s), docs/algorithms.md 1) with everything else kept changes the numerator by
//   dN_r = sum_s exp(s_rs - m_r) V_s - sum_{t in removed} E_rt v_t
// and the denominator by dZ_r = sum_s l_s exp(s_rs - m_r) - sum_{t in removed} E_rt, so the new
// output is o'_r = o_r + (dN_r - o_r dZ_r) / (Z_r + dZ_r), exactly. Compare() returns
// sum_r |o'_r - o_r|^2 in float64 for the two choices of one candidate token, from the group's
// running sums (O(R d) per candidate). Evicting token i alone gives |E_ri (o_r - v_i)| / (Z_r -
// E_ri) per row; merging it into a neighbour's slot is scored the same way, so the two compare on
// one scale.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/types.h"

namespace kvd::kernels::internal {

struct ReplacementSlot {
  const float* key_post = nullptr;    // [d]
  const double* value_sum = nullptr;  // [d]
  int64_t cardinality = 1;
};

class WindowErrorModel {
 public:
  // One slot's group G (tokens below N - W, each visible to every window query) and the slot it
  // is served as; per row r the sums over G of E_rt v_t and E_rt, and exp(s_r(slot) - m_r).
  struct Group {
    std::vector<double> removed_v;  // [R, d]
    std::vector<double> removed_z;  // [R]
    std::vector<double> slot_e;     // [R]
    std::vector<double> slot_v;     // [d] value sum of G
    int64_t cardinality = 0;
  };

  // queries [W*G, d], keys and values [N, d]; W = queries.rows / group_size <= N. INVALID_ARGUMENT
  // on shape mismatches.
  static StatusOr<WindowErrorModel> Create(ConstMatrixView queries, ConstMatrixView keys,
                                           ConstMatrixView values, int group_size);

  // G = {a}, served as token a itself (no change to the output).
  void Start(int64_t a, Group* g) const;
  // The errors sum_r |o'_r - o_r|^2 of (evict) serving G as now and evicting token i, and (merge)
  // serving G + i as `merged`. O(R d).
  void Compare(const Group& g, int64_t i, const ReplacementSlot& merged, double* evict,
               double* merge) const;
  // G += {i}, now served as `merged`.
  void Accept(int64_t i, const ReplacementSlot& merged, Group* g) const;

 private:
  double SlotWeight(int64_t r, const float* key_post) const;
  ConstMatrixView queries_, values_;
  int64_t rows_ = 0, n_ = 0, d_ = 0;
  double scale_ = 0;
  std::vector<double> max_;  // [R] m_r
  std::vector<double> z_;    // [R] Z_r
  std::vector<double> e_;    // [R, N] E_rt (0 where not visible)
  std::vector<double> out_;  // [R, d] o_r
};

}  // namespace kvd::kernels::internal
