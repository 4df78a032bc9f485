// Public entry of expected_attention.h: the query statistics, the expected query of a KV head,
// validation and the one backend switch of the scores.
#include "kvd/kernels/expected_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend_a.h"
#include "expected_attention_backend.h"

namespace kvd::kernels {

std::vector<int32_t> RopePartners(const RopeTable& rope) {
  const int d = rope.head_dim(), half = rope.rotary_dim() / 2;
  std::vector<int32_t> partner(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) partner[c] = c;
  for (int i = 0; i < half; ++i) {
    const int a = rope.pairing() == RopePairing::kInterleaved ? 2 * i : i;
    const int b = rope.pairing() == RopePairing::kInterleaved ? 2 * i + 1 : i + half;
    partner[a] = b;
    partner[b] = a;
  }
  return partner;
}

StatusOr<QueryStatistics> QueryStatistics::Create(int num_layers, int num_q_heads,
                                                  const RopeTable& rope) {
  KVD_RETURN_IF_ERROR(CheckHeadDim(rope.head_dim()).WithContext("query statistics"));
  if (num_layers < 1 || num_q_heads < 1) {
    return Status::InvalidArgument("query statistics: need num_layers >= 1 and num_q_heads >= 1");
  }
  QueryStatistics s;
  s.num_layers_ = num_layers;
  s.num_q_heads_ = num_q_heads;
  s.head_dim_ = rope.head_dim();
  s.rope_ = rope;
  const size_t total = static_cast<size_t>(num_layers) * num_q_heads * s.head_dim_;
  s.count_.assign(static_cast<size_t>(num_layers), 0);
  s.sum_.assign(total, 0.0);
  s.sum_sq_.assign(total, 0.0);
  s.sum_cross_.assign(total, 0.0);
  return s;
}

Status QueryStatistics::Add(int layer, std::span<const float> q,
                            std::span<const int64_t> positions) {
  const int64_t w = static_cast<int64_t>(positions.size());
  const int64_t row = static_cast<int64_t>(num_q_heads_) * head_dim_;
  if (layer < 0 || layer >= num_layers_) {
    return Status::InvalidArgument("query statistics: layer " + std::to_string(layer) +
                                   " out of range");
  }
  if (static_cast<int64_t>(q.size()) != w * row) {
    return Status::InvalidArgument("query statistics: " + std::to_string(q.size()) +
                                   " query elements for " + std::to_string(w) +
                                   " positions, need positions * num_q_heads * head_dim");
  }
  if (w == 0) return Status::Ok();
  KVD_RETURN_IF_ERROR(CheckFiniteSpan(q.data(), static_cast<int64_t>(q.size()),
                                      "query statistics: window queries"));
  const std::vector<int32_t> partner = RopePartners(rope_);
  Matrix pre(w, head_dim_);
  for (int h = 0; h < num_q_heads_; ++h) {
    const ConstMatrixView in{q.data() + static_cast<size_t>(h) * head_dim_, w, head_dim_, row};
    KVD_RETURN_IF_ERROR(
        ApplyRope(rope_, RopeDirection::kDerotate, positions, in, pre.View(), {.num_threads = 1}));
    const size_t base = (static_cast<size_t>(layer) * num_q_heads_ + h) * head_dim_;
    for (int64_t t = 0; t < w; ++t) {
      const float* x = pre.values.data() + t * head_dim_;
      for (int c = 0; c < head_dim_; ++c) {
        const double v = x[c];
        sum_[base + c] += v;
        sum_sq_[base + c] += v * v;
        sum_cross_[base + c] += v * static_cast<double>(x[partner[c]]);
      }
    }
  }
  count_[layer] += w;
  return Status::Ok();
}

Status QueryStatistics::Merge(const QueryStatistics& other) {
  if (other.num_layers_ != num_layers_ || other.num_q_heads_ != num_q_heads_ ||
      other.head_dim_ != head_dim_) {
    return Status::InvalidArgument("query statistics: merging statistics of another shape");
  }
  for (size_t i = 0; i < count_.size(); ++i) count_[i] += other.count_[i];
  for (size_t i = 0; i < sum_.size(); ++i) {
    sum_[i] += other.sum_[i];
    sum_sq_[i] += other.sum_sq_[i];
    sum_cross_[i] += other.sum_cross_[i];
  }
  return Status::Ok();
}

int64_t QueryStatistics::MinCount() const {
  int64_t m = count_.empty() ? 0 : count_[0];
  for (int64_t c : count_) m = std::min(m, c);
  return m;
}

Status QueryStatistics::Restore(std::span<const int64_t> counts, std::span<const double> sum,
                                std::span<const double> sum_sq, std::span<const double> sum_cross) {
  if (counts.size() != count_.size() || sum.size() != sum_.size() || sum_sq.size() != sum_.size() ||
      sum_cross.size() != sum_.size()) {
    return Status::InvalidArgument("query statistics: restored state has the wrong sizes");
  }
  for (int64_t c : counts) {
    if (c < 0) return Status::InvalidArgument("query statistics: negative count");
  }
  for (std::span<const double> s : {sum, sum_sq, sum_cross}) {
    for (double v : s) {
      if (!std::isfinite(v)) return Status::InvalidArgument("query statistics: non-finite sum");
    }
  }
  count_.assign(counts.begin(), counts.end());
  sum_.assign(sum.begin(), sum.end());
  sum_sq_.assign(sum_sq.begin(), sum_sq.end());
  sum_cross_.assign(sum_cross.begin(), sum_cross.end());
  return Status::Ok();
}

Status ExpectedAttentionOptions::Validate() const {
  if (future_positions < 1) {
    return Status::InvalidArgument("expected_attention: future_positions must be >= 1, got " +
                                   std::to_string(future_positions));
  }
  if (!(keydiff_share >= 0.0 && keydiff_share < 1.0)) {
    return Status::InvalidArgument("expected_attention: keydiff_share must be in [0, 1), got " +
                                   std::to_string(keydiff_share));
  }
  if (!(recent_share >= 0.0 && keydiff_share + recent_share < 1.0)) {
    return Status::InvalidArgument(
        "expected_attention: recent_share must be >= 0 with keydiff_share + recent_share < 1, "
        "got " +
        std::to_string(recent_share));
  }
  return Status::Ok();
}

namespace {

// rank[i - begin] = the rank of token i among [begin, end) by descending score, ties to the
// lower index (0 = best).
std::vector<int64_t> Ranks(std::span<const float> scores, int64_t begin, int64_t end) {
  std::vector<int64_t> order(static_cast<size_t>(end - begin));
  for (int64_t i = begin; i < end; ++i) order[i - begin] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  std::vector<int64_t> rank(order.size());
  for (size_t r = 0; r < order.size(); ++r) rank[order[r] - begin] = static_cast<int64_t>(r);
  return rank;
}

}  // namespace

Status FuseKeyDiffRanks(std::span<const float> expected, std::span<const float> keydiff,
                        double keydiff_share, double recent_share, int64_t begin, int64_t end,
                        std::span<float> fused) {
  const int64_t n = static_cast<int64_t>(expected.size());
  if (keydiff.size() != expected.size() || fused.size() != expected.size()) {
    return Status::InvalidArgument("fuse keydiff ranks: score spans of different sizes");
  }
  if (!(0 <= begin && begin <= end && end <= n)) {
    return Status::InvalidArgument("fuse keydiff ranks: range [" + std::to_string(begin) + ", " +
                                   std::to_string(end) + ") outside " + std::to_string(n) +
                                   " tokens");
  }
  if (!(keydiff_share >= 0.0 && recent_share >= 0.0 && keydiff_share + recent_share < 1.0)) {
    return Status::InvalidArgument(
        "fuse keydiff ranks: shares must be >= 0 with keydiff_share + recent_share < 1, got " +
        std::to_string(keydiff_share) + " and " + std::to_string(recent_share));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(expected[i]) || std::isnan(keydiff[i])) {
      return Status::InvalidArgument("fuse keydiff ranks: NaN score");
    }
  }
  const std::vector<int64_t> re = Ranks(expected, begin, end);
  const std::vector<int64_t> rk = Ranks(keydiff, begin, end);
  std::fill(fused.begin(), fused.end(), 0.0f);
  for (int64_t i = begin; i < end; ++i) {
    double depth = static_cast<double>(re[i - begin]) / (1.0 - keydiff_share - recent_share);
    if (keydiff_share > 0.0) {
      depth = std::min(depth, static_cast<double>(rk[i - begin]) / keydiff_share);
    }
    if (recent_share > 0.0) {
      depth = std::min(depth, static_cast<double>(end - 1 - i) / recent_share);
    }
    fused[i] = static_cast<float>(-depth);
  }
  return Status::Ok();
}

Status ProtectKeyDiffOutliers(std::span<const float> keydiff, double z, int64_t cap, int64_t begin,
                              int64_t end, std::span<float> fused) {
  const int64_t n = static_cast<int64_t>(keydiff.size());
  if (fused.size() != keydiff.size()) {
    return Status::InvalidArgument("protect keydiff outliers: score spans of different sizes");
  }
  if (!(0 <= begin && begin <= end && end <= n)) {
    return Status::InvalidArgument("protect keydiff outliers: range [" + std::to_string(begin) +
                                   ", " + std::to_string(end) + ") outside " + std::to_string(n) +
                                   " tokens");
  }
  if (!(z >= 0.0 && std::isfinite(z)) || cap < 0) {
    return Status::InvalidArgument("protect keydiff outliers: need finite z >= 0 and cap >= 0");
  }
  for (int64_t i = begin; i < end; ++i) {
    if (std::isnan(keydiff[i])) return Status::InvalidArgument("protect keydiff outliers: NaN");
  }
  if (cap == 0 || begin == end) return Status::Ok();
  double sum = 0.0, sum_sq = 0.0;
  for (int64_t i = begin; i < end; ++i) sum += keydiff[i];
  const double mean = sum / static_cast<double>(end - begin);
  for (int64_t i = begin; i < end; ++i) sum_sq += (keydiff[i] - mean) * (keydiff[i] - mean);
  const double threshold = mean + z * std::sqrt(sum_sq / static_cast<double>(end - begin));
  std::vector<int64_t> out;
  for (int64_t i = begin; i < end; ++i) {
    if (keydiff[i] > threshold) out.push_back(i);
  }
  std::stable_sort(out.begin(), out.end(),
                   [&](int64_t a, int64_t b) { return keydiff[a] > keydiff[b]; });
  if (static_cast<int64_t>(out.size()) > cap) out.resize(static_cast<size_t>(cap));
  for (size_t r = 0; r < out.size(); ++r) {
    fused[out[r]] = static_cast<float>(1 + cap - static_cast<int64_t>(r));
  }
  return Status::Ok();
}

namespace {

// The averaged rotation of one pair of frequency f over p = p0 .. p0 + F - 1:
// mean e^{i p f} = e^{i (p0 + (F-1)/2) f} sin(F f/2) / (F sin(f/2)) = alpha + i beta.
void AveragedRotation(double f, int64_t p0, int64_t future, double* alpha, double* beta) {
  const double half = std::sin(0.5 * f);
  const double shrink = std::abs(half) < 1e-15 ? 1.0
                                               : std::sin(0.5 * f * static_cast<double>(future)) /
                                                     (static_cast<double>(future) * half);
  const double centre =
      std::fmod((static_cast<double>(p0) + 0.5 * static_cast<double>(future - 1)) * f, 2 * M_PI);
  *alpha = shrink * std::cos(centre);
  *beta = shrink * std::sin(centre);
}

}  // namespace

StatusOr<ExpectedQueries> ExpectedQueriesFor(const QueryStatistics& stats, int layer, int kv_head,
                                             int group_size, int64_t last_position,
                                             const ExpectedAttentionOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (layer < 0 || layer >= stats.num_layers() || group_size < 1 || kv_head < 0 ||
      (kv_head + 1) * group_size > stats.num_q_heads() || last_position < 0) {
    return Status::InvalidArgument("expected_attention: layer " + std::to_string(layer) +
                                   ", KV head " + std::to_string(kv_head) + ", group " +
                                   std::to_string(group_size) + " or last position " +
                                   std::to_string(last_position) + " out of range");
  }
  const int64_t n = stats.count(layer);
  if (n < 1) {
    return Status::FailedPrecondition("expected_attention: layer " + std::to_string(layer) +
                                      " has seen no window query");
  }
  const RopeTable& rope = stats.rope();
  const int d = stats.head_dim(), half = rope.rotary_dim() / 2;
  ExpectedQueries out;
  out.group_size = group_size;
  out.head_dim = d;
  out.partner = RopePartners(rope);
  out.mean.assign(static_cast<size_t>(group_size) * d, 0.0f);
  out.diag.assign(out.mean.size(), 0.0f);
  out.cross.assign(out.mean.size(), 0.0f);
  std::vector<double> alpha(static_cast<size_t>(half)), beta(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    AveragedRotation(rope.inv_freq()[i], last_position + 1, options.future_positions, &alpha[i],
                     &beta[i]);
  }
  const double inv_n = 1.0 / static_cast<double>(n);
  for (int g = 0; g < group_size; ++g) {
    const int qh = kv_head * group_size + g;
    std::span<const double> s = stats.sum(layer, qh), s2 = stats.sum_sq(layer, qh),
                            sx = stats.sum_cross(layer, qh);
    float* m = out.mean.data() + static_cast<size_t>(g) * d;
    float* diag = out.diag.data() + static_cast<size_t>(g) * d;
    float* cross = out.cross.data() + static_cast<size_t>(g) * d;
    for (int c = 0; c < d; ++c) {  // dims past rotary_dim: no rotation
      const double mu = s[c] * inv_n;
      m[c] = static_cast<float>(mu);
      diag[c] = options.use_covariance ? static_cast<float>(std::max(0.0, s2[c] * inv_n - mu * mu))
                                       : 0.0f;
    }
    for (int i = 0; i < half; ++i) {
      const int a = rope.pairing() == RopePairing::kInterleaved ? 2 * i : i;
      const int b = out.partner[a];
      const double mua = s[a] * inv_n, mub = s[b] * inv_n, al = alpha[i], be = beta[i];
      m[a] = static_cast<float>(al * mua - be * mub);
      m[b] = static_cast<float>(be * mua + al * mub);
      if (!options.use_covariance) continue;
      // C = Rbar Sigma Rbar^T with Rbar = [[al, -be], [be, al]].
      const double saa = std::max(0.0, s2[a] * inv_n - mua * mua);
      const double sbb = std::max(0.0, s2[b] * inv_n - mub * mub);
      const double sab = sx[a] * inv_n - mua * mub;
      diag[a] = static_cast<float>(al * al * saa - 2 * al * be * sab + be * be * sbb);
      diag[b] = static_cast<float>(be * be * saa + 2 * al * be * sab + al * al * sbb);
      const double cab = al * be * saa + (al * al - be * be) * sab - al * be * sbb;
      cross[a] = static_cast<float>(cab);
      cross[b] = static_cast<float>(cab);
    }
  }
  return out;
}

Status ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys,
                               ConstMatrixView values, std::span<float> scores,
                               const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(CheckHeadDim(keys.cols).WithContext("expected_attention"));
  const size_t gd = static_cast<size_t>(q.group_size) * q.head_dim;
  if (q.group_size < 1 || q.head_dim != keys.cols || q.mean.size() != gd || q.diag.size() != gd ||
      q.cross.size() != gd || q.partner.size() != static_cast<size_t>(q.head_dim)) {
    return Status::InvalidArgument(
        "expected_attention: the expected queries do not match keys of "
        "head_dim " +
        std::to_string(keys.cols));
  }
  for (int32_t p : q.partner) {
    if (p < 0 || p >= q.head_dim) {
      return Status::InvalidArgument("expected_attention: partner index out of range");
    }
  }
  if (scores.size() != static_cast<size_t>(keys.rows)) {
    return Status::InvalidArgument("expected_attention: scores has " +
                                   std::to_string(scores.size()) +
                                   " entries for N=" + std::to_string(keys.rows));
  }
  if (values.rows != 0 && (values.rows != keys.rows || values.cols != keys.cols)) {
    return Status::InvalidArgument("expected_attention: values must be [N, d] like the keys");
  }
  if (keys.rows == 0) return Status::Ok();
  if (keys.data == nullptr || keys.ld < keys.cols ||
      (values.rows != 0 && (values.data == nullptr || values.ld < values.cols))) {
    return Status::InvalidArgument("expected_attention: bad keys or values view");
  }
  KVD_RETURN_IF_ERROR(CheckFinite(keys, "expected_attention: keys"));
  if (values.rows != 0) KVD_RETURN_IF_ERROR(CheckFinite(values, "expected_attention: values"));
  for (const std::vector<float>* v : {&q.mean, &q.diag, &q.cross}) {
    KVD_RETURN_IF_ERROR(CheckFiniteSpan(v->data(), static_cast<int64_t>(v->size()),
                                        "expected_attention: expected queries"));
  }
  switch (exec.backend) {
    case Backend::kCpu:
      cpu::ExpectedAttentionScores(q, keys, values, scores.data());
      return Status::Ok();
    case Backend::kCuda:
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("ExpectedAttentionScores"));
      return cuda::ExpectedAttentionScores(q, keys, values, scores.data(), exec.cuda_stream);
#else
      return CheckCudaBackend("ExpectedAttentionScores");
#endif
    default:
      return Status::InvalidArgument("ExpectedAttentionScores: unknown backend");
  }
}

}  // namespace kvd::kernels
