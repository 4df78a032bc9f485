// KVSlimmer statistics, merge weights, pair ranking/selection and the CPU merge-apply step
// (kvslimmer.h; docs/algorithms.md 3.1-3.3). Statistics are accumulated in float64.
#include "kvd/kernels/kvslimmer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "backend_a.h"

namespace kvd::kernels {

Status ComputePairStatistics(std::span<const float> mass, int64_t begin, int64_t end,
                             MergeNorm norm, SlotSet* slots, PairStatistics* stats) {
  if (slots == nullptr || stats == nullptr) {
    return Status::InvalidArgument("kvslimmer: null output");
  }
  const int64_t s = slots->size(), d = slots->keys_pre.cols;
  if (mass.size() != static_cast<size_t>(s)) {
    return Status::InvalidArgument("kvslimmer: mass has " + std::to_string(mass.size()) +
                                   " entries for " + std::to_string(s) + " slots");
  }
  if (begin < 0 || begin > end || end > s) {
    return Status::InvalidArgument("kvslimmer: bad mergeable range [" + std::to_string(begin) +
                                   ", " + std::to_string(end) + ") of " + std::to_string(s) +
                                   " slots");
  }
  stats->alpha.assign(static_cast<size_t>(s), 0.0);
  stats->o.assign(static_cast<size_t>(d), 0.0);
  stats->l1_dev.assign(static_cast<size_t>(s), 0.0);
  stats->h.assign(static_cast<size_t>(s), 0.0);
  if (begin == end) return Status::Ok();
  double total = 0.0;
  for (int64_t j = begin; j < end; ++j) total += static_cast<double>(mass[static_cast<size_t>(j)]);
  for (int64_t j = begin; j < end; ++j) {
    stats->alpha[static_cast<size_t>(j)] =
        total > 0.0 ? mass[static_cast<size_t>(j)] / total : 1.0 / static_cast<double>(end - begin);
  }
  // o = sum_j alpha_j Vsum_j / l_j
  for (int64_t j = begin; j < end; ++j) {
    const double w =
        stats->alpha[static_cast<size_t>(j)] / slots->cardinality[static_cast<size_t>(j)];
    const float* v = slots->value_sums.Row(j);
    for (int64_t c = 0; c < d; ++c) stats->o[static_cast<size_t>(c)] += w * v[c];
  }
  if (norm != MergeNorm::kL1Code) return Status::Ok();
  if (slots->h.size() != static_cast<size_t>(s)) {
    slots->h.assign(static_cast<size_t>(s), 0.0f);
    slots->h_observations.assign(static_cast<size_t>(s), 0);
  }
  for (int64_t j = begin; j < end; ++j) {
    const size_t js = static_cast<size_t>(j);
    const double inv_l = 1.0 / slots->cardinality[js];
    const float* v = slots->value_sums.Row(j);
    double dev = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      dev += std::fabs(v[c] * inv_l - stats->o[static_cast<size_t>(c)]);
    }
    stats->l1_dev[js] = dev;
    const double a = stats->alpha[js];
    const double fresh = a * (1.0 - 2.0 * a) * dev;
    const int32_t count = slots->h_observations[js];
    const double smoothed = (static_cast<double>(slots->h[js]) * count + fresh) / (count + 1);
    slots->h[js] = static_cast<float>(smoothed);
    slots->h_observations[js] = count + 1;
    stats->h[js] = smoothed;
  }
  return Status::Ok();
}

MergeWeightResult ComputeMergeWeights(MergeNorm norm, const SlotSet& slots,
                                      const PairStatistics& stats, int64_t m, MergeGuard guard,
                                      double alpha_margin) {
  const int64_t d = slots.keys_pre.cols;
  const size_t a = static_cast<size_t>(m), b = a + 1;
  const double alpha_a = stats.alpha[a], alpha_b = stats.alpha[b];
  double wa_num = 0.0, wb_num = 0.0, h_a = 0.0, h_b = 0.0;
  if (norm == MergeNorm::kL2) {
    const float* va = slots.value_sums.Row(m);
    const float* vb = slots.value_sums.Row(m + 1);
    const double inv_la = 1.0 / slots.cardinality[a], inv_lb = 1.0 / slots.cardinality[b];
    double na = 0.0, nb = 0.0, nab = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      const double o = stats.o[static_cast<size_t>(c)];
      const double da = va[c] * inv_la - o, db = vb[c] * inv_lb - o;
      na += da * da;
      nb += db * db;
      nab += (da + db) * (da + db);
    }
    const double c11 = std::fabs(alpha_a * (1.0 - 2.0 * alpha_a)) * std::sqrt(na);
    const double c22 = std::fabs(alpha_b * (1.0 - 2.0 * alpha_b)) * std::sqrt(nb);
    const double c12 = alpha_a * alpha_b * std::sqrt(nab);
    wa_num = c11 - c12;
    wb_num = c22 - c12;
  } else {
    h_a = stats.h[a];
    h_b = stats.h[b];
    const double h12 = alpha_a * alpha_b * (stats.l1_dev[a] + stats.l1_dev[b]);
    wa_num = h_a - h12;
    wb_num = h_b - h12;
  }
  MergeWeightResult r;
  r.pair.first = m;
  const double den = wa_num + wb_num;
  const bool degenerate = !(den > 1e-30) || !std::isfinite(den);
  double wa = 0.5, wb = 0.5;
  bool outside = false;
  if (!degenerate) {
    wa = wa_num / den;
    wb = wb_num / den;
    outside = wa < 0.0 || wb < 0.0 || wa > 1.0 || wb > 1.0;
    if (outside) {
      const double clamped_a = std::clamp(wa, 0.0, 1.0);
      r.clamp_to_less =
          (clamped_a == 1.0 && alpha_a < alpha_b) || (clamped_a == 0.0 && alpha_b < alpha_a);
    }
  }
  switch (guard) {
    case MergeGuard::kClamp:
      if (degenerate) {
        r.guard_fallback = true;
      } else if (outside) {
        r.guard_clamped = true;
        wa = std::clamp(wa, 0.0, 1.0);
        wb = 1.0 - wa;
      }
      break;
    case MergeGuard::kAlphaFallback:
      if (degenerate || outside || std::fabs(alpha_a - 0.5) < alpha_margin ||
          std::fabs(alpha_b - 0.5) < alpha_margin) {
        r.alpha_fallback = true;
        const double sum = alpha_a + alpha_b;
        wa = sum > 0.0 ? alpha_a / sum : 0.5;
        wb = 1.0 - wa;
      }
      break;
    case MergeGuard::kMean:
      wa = wb = 0.5;
      break;
  }
  r.pair.w_first = static_cast<float>(wa);
  r.pair.w_second = static_cast<float>(wb);
  r.pair.h_merged = static_cast<float>(wa * wa * h_a + wb * wb * h_b);
  return r;
}

std::vector<double> RankPairs(std::span<const float> mass, const SlotSet& slots, int64_t begin,
                              int64_t end, PairLambda lambda, double gamma) {
  const int64_t s = slots.size();
  std::vector<double> rank(static_cast<size_t>(std::max<int64_t>(s - 1, 0)),
                           std::numeric_limits<double>::infinity());
  for (int64_t j = std::max<int64_t>(begin, 0); j + 1 < std::min(end, s); ++j) {
    const size_t js = static_cast<size_t>(j);
    const double lam = lambda == PairLambda::kAsymKv
                           ? static_cast<double>(slots.cardinality[js]) + slots.cardinality[js + 1]
                           : 1.0;
    rank[js] = (static_cast<double>(mass[js]) + mass[js + 1]) * std::exp(-(j + 1) / gamma) * lam;
  }
  return rank;
}

std::vector<int64_t> SelectDisjointPairs(std::span<const double> rank, int64_t max_pairs) {
  std::vector<int64_t> order;
  order.reserve(rank.size());
  for (size_t j = 0; j < rank.size(); ++j) {
    if (rank[j] < std::numeric_limits<double>::infinity()) order.push_back(static_cast<int64_t>(j));
  }
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const double ra = rank[static_cast<size_t>(a)], rb = rank[static_cast<size_t>(b)];
    return ra < rb || (ra == rb && a < b);
  });
  std::vector<char> used(rank.size() + 1, 0);
  std::vector<int64_t> chosen;
  for (int64_t j : order) {
    if (static_cast<int64_t>(chosen.size()) >= max_pairs) break;
    if (used[static_cast<size_t>(j)] || used[static_cast<size_t>(j) + 1]) continue;
    used[static_cast<size_t>(j)] = used[static_cast<size_t>(j) + 1] = 1;
    chosen.push_back(j);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

namespace cpu {

void ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position,
                 SlotSet* slots) {
  const int64_t s = slots->size(), d = slots->keys_pre.cols;
  const bool has_h = slots->h.size() == static_cast<size_t>(s);
  size_t p = 0;
  int64_t out = 0;
  for (int64_t i = 0; i < s; ++out) {
    const size_t is = static_cast<size_t>(i), os = static_cast<size_t>(out);
    float* ko = slots->keys_pre.Row(out);
    float* vo = slots->value_sums.Row(out);
    if (p < pairs.size() && pairs[p].first == i) {
      const MergePair& mp = pairs[p++];
      const float* ka = slots->keys_pre.Row(i);
      const float* kb = slots->keys_pre.Row(i + 1);
      const float* va = slots->value_sums.Row(i);
      const float* vb = slots->value_sums.Row(i + 1);
      for (int64_t c = 0; c < d; ++c) {  // out <= i: rows are read before being overwritten
        ko[c] = mp.w_first * ka[c] + mp.w_second * kb[c];
        vo[c] = va[c] + vb[c];
      }
      const int64_t pa = slots->positions[is], pb = slots->positions[is + 1];
      slots->positions[os] = position == RepresentativePosition::kLast
                                 ? std::max(pa, pb)
                                 : std::llround(static_cast<double>(mp.w_first) * pa +
                                                static_cast<double>(mp.w_second) * pb);
      slots->cardinality[os] = slots->cardinality[is] + slots->cardinality[is + 1];
      if (has_h) {
        slots->h[os] = mp.h_merged;
        slots->h_observations[os] =
            std::max(slots->h_observations[is], slots->h_observations[is + 1]);
      }
      i += 2;
    } else {
      if (out != i) {
        std::copy(slots->keys_pre.Row(i), slots->keys_pre.Row(i) + d, ko);
        std::copy(slots->value_sums.Row(i), slots->value_sums.Row(i) + d, vo);
        slots->positions[os] = slots->positions[is];
        slots->cardinality[os] = slots->cardinality[is];
        if (has_h) {
          slots->h[os] = slots->h[is];
          slots->h_observations[os] = slots->h_observations[is];
        }
      }
      ++i;
    }
  }
  slots->keys_pre.values.resize(static_cast<size_t>(out * d));
  slots->keys_pre.rows = out;
  slots->value_sums.values.resize(static_cast<size_t>(out * d));
  slots->value_sums.rows = out;
  slots->positions.resize(static_cast<size_t>(out));
  slots->cardinality.resize(static_cast<size_t>(out));
  if (has_h) {
    slots->h.resize(static_cast<size_t>(out));
    slots->h_observations.resize(static_cast<size_t>(out));
  }
}

}  // namespace cpu
}  // namespace kvd::kernels
