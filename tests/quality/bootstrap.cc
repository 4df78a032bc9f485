#include "bootstrap.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvd::quality {
namespace {

double Quantile(std::vector<double>& v, double q) {
  // Linear interpolation between order statistics (type 7).
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t i = static_cast<size_t>(std::floor(pos));
  const size_t j = std::min(i + 1, v.size() - 1);
  return v[i] + (pos - static_cast<double>(i)) * (v[j] - v[i]);
}

}  // namespace

BootstrapResult BootstrapSegments(const SegmentSums& s, int samples, double level, uint32_t seed) {
  BootstrapResult r;
  const size_t k = s.nll.size();
  if (k == 0 || s.engine_nll.size() != k || s.n.size() != k || s.agree.size() != k) return r;
  auto stat = [&](const std::vector<size_t>& idx, double* ratio, double* top1) {
    double d = 0, n = 0, a = 0;
    for (size_t i : idx) {
      d += s.nll[i] - s.engine_nll[i];
      n += static_cast<double>(s.n[i]);
      a += static_cast<double>(s.agree[i]);
    }
    *ratio = n > 0 ? std::exp(d / n) : 1.0;
    *top1 = n > 0 ? a / n : 0.0;
  };
  std::vector<size_t> idx(k);
  for (size_t i = 0; i < k; ++i) idx[i] = i;
  double point_ratio = 0, point_top1 = 0;
  stat(idx, &point_ratio, &point_top1);
  if (k == 1 || samples <= 0) {
    r.ppl_ratio = {point_ratio, point_ratio};
    r.top1 = {point_top1, point_top1};
    return r;
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, k - 1);
  std::vector<double> ratios(samples), top1s(samples);
  for (int b = 0; b < samples; ++b) {
    for (size_t i = 0; i < k; ++i) idx[i] = pick(rng);
    stat(idx, &ratios[b], &top1s[b]);
  }
  const double lo = (1.0 - level) / 2, hi = (1.0 + level) / 2;
  r.ppl_ratio = {Quantile(ratios, lo), Quantile(ratios, hi)};
  r.top1 = {Quantile(top1s, lo), Quantile(top1s, hi)};
  return r;
}

}  // namespace kvd::quality
