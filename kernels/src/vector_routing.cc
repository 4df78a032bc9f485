// VECTOR three-way routing (docs/algorithms.md 4.2) with the exact half-pair budget of vector.h.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kvd/kernels/vector.h"

namespace kvd::kernels {

Status RouteOptions::Validate() const {
  if (!(p_c >= 0.0 && p_c < 1.0)) {
    return Status::OutOfRange("RouteOptions.p_c must be in [0, 1), got " + std::to_string(p_c));
  }
  if (!(eps >= 0.0 && eps < 1.0)) {
    return Status::InvalidArgument("RouteOptions.eps must be in [0, 1), got " +
                                   std::to_string(eps));
  }
  if (kept_pairs < -1) return Status::InvalidArgument("RouteOptions.kept_pairs must be >= -1");
  return Status::Ok();
}

StatusOr<RouteBudget> ComputeRouteBudget(int64_t n, int64_t forced, const RouteOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (n < 0 || forced < 0 || forced > n) {
    return Status::InvalidArgument("ComputeRouteBudget: need 0 <= forced <= n, got n=" +
                                   std::to_string(n) + " forced=" + std::to_string(forced));
  }
  RouteBudget b;
  b.tokens = n;
  double p_c = options.p_c;
  if (options.kept_pairs >= 0) {
    if (options.kept_pairs > n) {
      return Status::InvalidArgument("RouteOptions.kept_pairs " +
                                     std::to_string(options.kept_pairs) + " exceeds n " +
                                     std::to_string(n));
    }
    b.kept_pairs = options.kept_pairs;
    p_c = n > 0 ? 1.0 - static_cast<double>(b.kept_pairs) / static_cast<double>(n) : 0.0;
  } else {
    b.kept_pairs = std::llround((1.0 - p_c) * static_cast<double>(n));
  }
  if (b.kept_pairs < forced) {
    return Status::OutOfRange("VECTOR budget of " + std::to_string(b.kept_pairs) +
                              " pairs cannot keep the " + std::to_string(forced) +
                              " forced (sink/window) tokens at p_c=" + std::to_string(p_c));
  }
  const double p_a = std::max(0.0, std::min(p_c / 2.0, (1.0 - p_c - options.eps) / 2.0));
  int64_t a = std::llround(p_a * static_cast<double>(n));
  a = std::min({a, n - b.kept_pairs, b.kept_pairs - forced});
  a = std::max<int64_t>(a, 0);
  b.pool = b.kept_pairs + a;
  b.key_only = 2 * a;
  b.key_value = b.kept_pairs - a;
  return b;
}

StatusOr<RouteBudget> RouteValues(std::span<const float> base_score,
                                  std::span<const float> residuals, std::span<const uint8_t> forced,
                                  const RouteOptions& options, std::span<RouteDecision> decisions) {
  const int64_t n = static_cast<int64_t>(base_score.size());
  if (static_cast<int64_t>(residuals.size()) != n || static_cast<int64_t>(decisions.size()) != n ||
      (!forced.empty() && static_cast<int64_t>(forced.size()) != n)) {
    return Status::InvalidArgument(
        "RouteValues: base_score, residuals, decisions (and forced "
        "when given) must all have n entries");
  }
  int64_t num_forced = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(base_score[i])) {
      return Status::InvalidArgument("RouteValues: NaN base score at token " + std::to_string(i));
    }
    if (!std::isfinite(residuals[i])) {
      return Status::InvalidArgument("RouteValues: non-finite residual at token " +
                                     std::to_string(i));
    }
    if (!forced.empty() && forced[i] != 0) ++num_forced;
  }
  KVD_ASSIGN_OR_RETURN(RouteBudget budget, ComputeRouteBudget(n, num_forced, options));
  auto is_forced = [&](int64_t i) { return !forced.empty() && forced[i] != 0; };

  // Pool: forced first, then by descending score, ties to the lower index.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto by_score = [&](int64_t x, int64_t y) {
    const bool fx = is_forced(x), fy = is_forced(y);
    if (fx != fy) return fx;
    if (base_score[x] != base_score[y]) return base_score[x] > base_score[y];
    return x < y;
  };
  if (budget.pool < n) {
    std::nth_element(order.begin(), order.begin() + budget.pool, order.end(), by_score);
  }
  std::fill(decisions.begin(), decisions.end(), RouteDecision::kEvict);
  std::vector<int64_t> candidates;  // non-forced pool members
  candidates.reserve(static_cast<size_t>(budget.pool));
  for (int64_t k = 0; k < budget.pool; ++k) {
    const int64_t i = order[k];
    decisions[i] = RouteDecision::kKeyValue;
    if (!is_forced(i)) candidates.push_back(i);
  }
  // The key_only smallest residuals among the non-forced pool drop their value. The budget
  // guarantees candidates.size() = pool - forced >= 2a.
  auto by_residual = [&](int64_t x, int64_t y) {
    if (residuals[x] != residuals[y]) return residuals[x] < residuals[y];
    return x < y;
  };
  if (budget.key_only > static_cast<int64_t>(candidates.size())) {
    return Status::Internal("RouteValues: pool smaller than the key-only count");
  }
  if (budget.key_only < static_cast<int64_t>(candidates.size())) {
    std::nth_element(candidates.begin(), candidates.begin() + budget.key_only, candidates.end(),
                     by_residual);
  }
  for (int64_t k = 0; k < budget.key_only; ++k) decisions[candidates[k]] = RouteDecision::kKeyOnly;
  return budget;
}

}  // namespace kvd::kernels
