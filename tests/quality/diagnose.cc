#include "diagnose.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "kvd/kernels/kvslimmer.h"
#include "kvd/kernels/observation.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/vector.h"
#include "kvd/llama/engine.h"
#include "kvd/llama/tokenizer.h"
#include "manifest.h"

namespace kvd::quality {
namespace {

using kernels::ConstMatrixView;
using kernels::Matrix;

std::vector<double> Ranks(std::span<const float> a) {
  std::vector<size_t> idx(a.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t x, size_t y) { return a[x] < a[y]; });
  std::vector<double> r(a.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && a[idx[j + 1]] == a[idx[i]]) ++j;
    const double avg = (static_cast<double>(i) + static_cast<double>(j)) / 2.0;
    for (size_t k = i; k <= j; ++k) r[idx[k]] = avg;
    i = j + 1;
  }
  return r;
}

double Cosine(const float* a, const float* b, int d, const double* ca = nullptr) {
  double ab = 0, aa = 0, bb = 0;
  for (int i = 0; i < d; ++i) {
    const double x = a[i] - (ca ? ca[i] : 0.0), y = b[i] - (ca ? ca[i] : 0.0);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

std::vector<double> RowMean(ConstMatrixView m) {
  std::vector<double> mu(m.cols, 0.0);
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t c = 0; c < m.cols; ++c) mu[c] += m.Row(i)[c];
  for (double& x : mu) x /= std::max<int64_t>(1, m.rows);
  return mu;
}

// Solves (A + ridge * trace(A)/n I) x = b for symmetric positive semi-definite A [n, n] (float64
// Cholesky), for each of the `m` right-hand sides (columns of B [n, m]); B is overwritten.
bool SolveSpd(std::vector<double> a, int n, double ridge, std::vector<double>* b, int m) {
  double tr = 0;
  for (int i = 0; i < n; ++i) tr += a[i * n + i];
  for (int i = 0; i < n; ++i) a[i * n + i] += ridge * tr / n;
  for (int j = 0; j < n; ++j) {
    double s = a[j * n + j];
    for (int k = 0; k < j; ++k) s -= a[j * n + k] * a[j * n + k];
    if (!(s > 0)) return false;
    a[j * n + j] = std::sqrt(s);
    for (int i = j + 1; i < n; ++i) {
      double t = a[i * n + j];
      for (int k = 0; k < j; ++k) t -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = t / a[j * n + j];
    }
  }
  for (int c = 0; c < m; ++c) {
    for (int i = 0; i < n; ++i) {
      double t = (*b)[i * m + c];
      for (int k = 0; k < i; ++k) t -= a[i * n + k] * (*b)[k * m + c];
      (*b)[i * m + c] = t / a[i * n + i];
    }
    for (int i = n - 1; i >= 0; --i) {
      double t = (*b)[i * m + c];
      for (int k = i + 1; k < n; ++k) t -= a[k * n + i] * (*b)[k * m + c];
      (*b)[i * m + c] = t / a[i * n + i];
    }
  }
  return true;
}

// Affine VECTOR fit accumulators of one head: augmented x = [kpre, 1].
struct AffineStats {
  std::vector<double> gram;   // [(d+1)^2]
  std::vector<double> cross;  // [(d+1) * d]
};

struct Capture {
  llama::DenseKvCache cache;
  std::vector<std::vector<float>> window_q;  // per layer [W, n_q, d]
  std::vector<std::vector<float>> cont_q;    // per layer [C, n_q, d]
  int w = 0, c = 0;
};

StatusOr<Capture> Prefill(llama::LlamaSession& s, const std::vector<int32_t>& prefix,
                          const std::vector<int32_t>& cont, int window) {
  s.Reset();
  Capture cap;
  KVD_RETURN_IF_ERROR(s.Forward(prefix, {.capture_queries = window}).status());
  cap.window_q = s.captured_queries();
  cap.w = s.captured_query_count();
  KVD_ASSIGN_OR_RETURN(cap.cache, s.ExportDense());
  if (!cont.empty()) {
    KVD_RETURN_IF_ERROR(
        s.Forward(cont, {.capture_queries = static_cast<int>(cont.size())}).status());
    cap.cont_q = s.captured_queries();
    cap.c = s.captured_query_count();
  }
  return cap;
}

std::vector<std::vector<int32_t>> Cuts(const std::vector<std::vector<int32_t>>& texts, size_t len,
                                       int count) {
  std::vector<std::vector<int32_t>> out;
  for (size_t round = 0; static_cast<int>(out.size()) < count; ++round) {
    bool any = false;
    for (const auto& ids : texts) {
      if ((round + 1) * len <= ids.size() && static_cast<int>(out.size()) < count) {
        out.emplace_back(ids.begin() + round * len, ids.begin() + (round + 1) * len);
        any = true;
      }
    }
    if (!any) break;
  }
  return out;
}

// Copies head h of a [N, H, d] layer tensor into [N, d].
Matrix HeadRows(const std::vector<float>& t, int n, int heads, int h, int d) {
  Matrix m(n, d);
  for (int i = 0; i < n; ++i) {
    std::copy_n(&t[(static_cast<size_t>(i) * heads + h) * d], d, m.Row(i));
  }
  return m;
}

// The slots a merge variant leaves, served as the kernels serve them (post-RoPE keys at the
// representative position, mean values, bias ln l).
struct Served {
  std::vector<float> k, v, bias;
};

StatusOr<Served> ServeSlots(const kernels::RopeTable& rope, const kernels::SlotSet& slots) {
  const int64_t s = slots.size(), d = slots.keys_pre.cols;
  Matrix post(s, d);
  KVD_RETURN_IF_ERROR(kernels::RotateSlotKeys(rope, slots, post.View()));
  Served out;
  out.k = std::move(post.values);
  out.v.resize(static_cast<size_t>(s * d));
  out.bias.resize(s);
  for (int64_t j = 0; j < s; ++j) {
    const double l = slots.cardinality[j];
    for (int64_t c = 0; c < d; ++c)
      out.v[j * d + c] = static_cast<float>(slots.value_sums.values[j * d + c] / l);
    out.bias[j] = static_cast<float>(std::log(l));
  }
  return out;
}

Served Without(const Matrix& keys_post, const Matrix& values, const std::vector<bool>& drop) {
  Served out;
  const int64_t d = keys_post.cols;
  for (int64_t j = 0; j < keys_post.rows; ++j) {
    if (drop[j]) continue;
    out.k.insert(out.k.end(), keys_post.values.begin() + j * d,
                 keys_post.values.begin() + (j + 1) * d);
    out.v.insert(out.v.end(), values.values.begin() + j * d, values.values.begin() + (j + 1) * d);
    out.bias.push_back(0.0f);
  }
  return out;
}

}  // namespace

Status DiagnoseOptions::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("diagnose options: " + m); };
  if (manifest_path.empty()) return bad("manifest_path is required");
  if (prefix_tokens < 64) return bad("prefix_tokens must be >= 64");
  if (continuation_tokens < 1) return bad("continuation_tokens must be >= 1");
  if (segments < 1) return bad("segments must be >= 1");
  if (window < 1 || sinks < 0 || sinks + window + 4 > prefix_tokens) {
    return bad("need window >= 1, sinks >= 0 and sinks + window + 4 <= prefix_tokens");
  }
  if (far_gap < 1 || far_gap >= prefix_tokens) return bad("far_gap must be in [1, prefix_tokens)");
  for (int c : calib_sizes) {
    if (c < 1) return bad("calibration sizes must be >= 1");
  }
  if (max_calib_prefixes < 1) return bad("max_calib_prefixes must be >= 1");
  return Status::Ok();
}

double Spearman(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size() || a.size() < 2) return 0.0;
  const std::vector<double> ra = Ranks(a), rb = Ranks(b);
  const double n = static_cast<double>(a.size()), mean = (n - 1) / 2;
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += (ra[i] - mean) * (rb[i] - mean);
    aa += (ra[i] - mean) * (ra[i] - mean);
    bb += (rb[i] - mean) * (rb[i] - mean);
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

double TopOverlap(std::span<const float> a, std::span<const float> b, double fraction) {
  const size_t n = a.size();
  if (n == 0 || b.size() != n) return 0.0;
  const size_t k = std::max<size_t>(1, static_cast<size_t>(std::ceil(fraction * n)));
  auto top = [&](std::span<const float> x) {
    std::vector<size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t p, size_t q) { return x[p] > x[q]; });
    std::vector<bool> in(n, false);
    for (size_t i = 0; i < k; ++i) in[idx[i]] = true;
    return in;
  };
  const std::vector<bool> ta = top(a), tb = top(b);
  size_t both = 0;
  for (size_t i = 0; i < n; ++i) both += ta[i] && tb[i];
  return static_cast<double>(both) / static_cast<double>(k);
}

std::vector<double> AttentionOutput(std::span<const float> q, int64_t rows,
                                    std::span<const float> keys, std::span<const float> values,
                                    std::span<const float> bias, int d) {
  const int64_t s = static_cast<int64_t>(keys.size()) / d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(static_cast<size_t>(rows) * d, 0.0), logit(s);
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < s; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[r * d + c]) * keys[j * d + c];
      logit[j] = dot * scale + (bias.empty() ? 0.0 : bias[j]);
      mx = std::max(mx, logit[j]);
    }
    double z = 0;
    for (int64_t j = 0; j < s; ++j) z += (logit[j] = std::exp(logit[j] - mx));
    for (int64_t j = 0; j < s; ++j) {
      const double p = logit[j] / z;
      for (int c = 0; c < d; ++c) out[r * d + c] += p * values[j * d + c];
    }
  }
  return out;
}

double RelativeError(std::span<const double> a, std::span<const double> b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

namespace {

using DiagClock = std::chrono::steady_clock;

// State passed between the steps of RunDiagnosis.
struct Diagnosis {
  Diagnosis(const llama::LlamaModel& m, const DiagnoseOptions& opts, DiagClock::time_point start)
      : model(m),
        o(opts),
        cfg(m.config()),
        L(cfg.num_layers),
        H(cfg.num_kv_heads),
        d(cfg.head_dim),
        G(cfg.num_q_heads / cfg.num_kv_heads),
        layout(cfg.ToModelLayout()),
        t0(start) {}
  const llama::LlamaModel& model;
  const DiagnoseOptions& o;
  const llama::LlamaConfig& cfg;
  const int L, H, d, G;
  const ModelLayout layout;
  const DiagClock::time_point t0;
  DiagnoseReport rep;
  std::vector<std::vector<int32_t>> segs, calib_prefixes;
  std::vector<int> sizes;                     // calibration sizes fitted (the last: all)
  std::vector<kernels::VectorWeights> fits;   // [sizes], ridge 1e-4
  kernels::VectorWeights fit_ridge;           // all prefixes, ridge 1e-2
  std::vector<std::vector<double>> affine_w;  // [L * H][(d+1) * d]
};

// Prints one progress line on stderr, stamped with the seconds since the start.
void Log(const Diagnosis& r, const std::string& m) {
  std::fprintf(stderr, "[diag %6.1fs] %s\n",
               std::chrono::duration<double>(DiagClock::now() - r.t0).count(), m.c_str());
}

// Reads the eval and calib texts and cuts them into r.segs and r.calib_prefixes.
Status LoadTexts(Diagnosis& r) {
  const DiagnoseOptions& o = r.o;
  const llama::Tokenizer* tok = r.model.tokenizer();
  KVD_ASSIGN_OR_RETURN(auto manifest, LoadManifest(o.manifest_path));
  r.rep.options = o;
  r.rep.layers = r.L;
  r.rep.kv_heads = r.H;
  std::vector<std::string> warnings;
  std::vector<ManifestText> eval;
  if (o.text_files.empty()) {
    KVD_ASSIGN_OR_RETURN(eval, ReadVerified(manifest, "eval", &warnings));
  } else {
    KVD_ASSIGN_OR_RETURN(eval, ReadTextFiles(o.text_files));
  }
  KVD_ASSIGN_OR_RETURN(auto calib, ReadVerified(manifest, "calib", &warnings));
  std::vector<std::vector<int32_t>> eval_ids, calib_ids;
  for (const auto& t : eval) {
    eval_ids.push_back(tok->Encode(t.text));
    r.rep.texts.push_back(t.entry.path + " " + t.entry.sha256);
  }
  for (const auto& t : calib) calib_ids.push_back(tok->Encode(t.text));
  r.segs = Cuts(eval_ids, o.prefix_tokens + o.continuation_tokens, o.segments);
  r.calib_prefixes = Cuts(calib_ids, o.prefix_tokens, o.max_calib_prefixes);
  if (r.segs.empty() || r.calib_prefixes.empty()) {
    return Status::FailedPrecondition("not enough eval or calibration text for " +
                                      std::to_string(o.prefix_tokens) + "-token prefixes");
  }
  r.rep.segments = static_cast<int>(r.segs.size());
  r.rep.calib_prefixes = static_cast<int>(r.calib_prefixes.size());
  return Status::Ok();
}

// Adds the rows of one head (pre-RoPE keys x, values y) to its affine fit's sums.
void AddAffineRows(const kernels::SlotSet& sl, const Matrix& v, int d, AffineStats& a) {
  for (int64_t i = 0; i < sl.size(); ++i) {
    const float* x = sl.keys_pre.Row(i);
    const float* y = v.Row(i);
    for (int r = 0; r <= d; ++r) {
      const double xr = r < d ? x[r] : 1.0;
      for (int c = 0; c <= d; ++c) a.gram[r * (d + 1) + c] += xr * (c < d ? x[c] : 1.0);
      for (int c = 0; c < d; ++c) a.cross[r * d + c] += xr * y[c];
    }
  }
}

// Adds every head of one calibration capture to the VECTOR calibrator and the affine sums.
Status AddCalibCapture(const Diagnosis& r, const kernels::RopeTable& rope, const Capture& cap,
                       kernels::VectorCalibrator& cal, std::vector<AffineStats>& affine) {
  const int H = r.H, d = r.d;
  std::vector<int64_t> pos(cap.cache.positions.begin(), cap.cache.positions.end());
  for (int l = 0; l < r.L; ++l) {
    for (int h = 0; h < H; ++h) {
      Matrix k = HeadRows(cap.cache.layers[l].k, cap.cache.num_tokens, H, h, d);
      Matrix v = HeadRows(cap.cache.layers[l].v, cap.cache.num_tokens, H, h, d);
      KVD_ASSIGN_OR_RETURN(kernels::SlotSet sl,
                           kernels::SlotsFromTokens(rope, k.View(), v.View(), pos));
      KVD_RETURN_IF_ERROR(cal.Add(l, h, sl.keys_pre.View(), v.View()));
      AddAffineRows(sl, v, d, affine[l * H + h]);
    }
  }
  return Status::Ok();
}

// Solves each head's affine fit from its sums into r.affine_w.
Status SolveAffine(Diagnosis& r, const std::vector<AffineStats>& affine) {
  r.affine_w.assign(affine.size(), {});
  for (size_t i = 0; i < affine.size(); ++i) {
    r.affine_w[i] = affine[i].cross;
    if (!SolveSpd(affine[i].gram, r.d + 1, 1e-4, &r.affine_w[i], r.d)) {
      return Status::Internal("affine VECTOR fit is singular for head " + std::to_string(i));
    }
  }
  return Status::Ok();
}

// VECTOR calibrations: snapshots after 1, 4, 16, ... prefixes and after all (r.fits, r.fit_ridge);
// affine fits on all (r.affine_w).
Status Calibrate(Diagnosis& r, const kernels::RopeTable& rope, llama::LlamaSession& session) {
  const int L = r.L, H = r.H, d = r.d;
  for (int c : r.o.calib_sizes) {
    if (c < r.rep.calib_prefixes) r.sizes.push_back(c);
  }
  r.sizes.push_back(r.rep.calib_prefixes);
  r.rep.calib_sizes_used = r.sizes;
  KVD_ASSIGN_OR_RETURN(kernels::VectorCalibrator cal, kernels::VectorCalibrator::Create(L, H, d));
  std::vector<AffineStats> affine(static_cast<size_t>(L) * H);
  for (auto& a : affine) {
    a.gram.assign(static_cast<size_t>(d + 1) * (d + 1), 0.0);
    a.cross.assign(static_cast<size_t>(d + 1) * d, 0.0);
  }
  for (size_t p = 0; p < r.calib_prefixes.size(); ++p) {
    KVD_ASSIGN_OR_RETURN(Capture cap, Prefill(session, r.calib_prefixes[p], {}, r.o.window));
    KVD_RETURN_IF_ERROR(AddCalibCapture(r, rope, cap, cal, affine));
    const int done = static_cast<int>(p + 1);
    if (std::find(r.sizes.begin(), r.sizes.end(), done) != r.sizes.end()) {
      KVD_ASSIGN_OR_RETURN(kernels::VectorWeights w, cal.Solve({.ridge = 1e-4}));
      r.fits.push_back(std::move(w));
      if (done == r.rep.calib_prefixes) {
        KVD_ASSIGN_OR_RETURN(r.fit_ridge, cal.Solve({.ridge = 1e-2}));
      }
    }
  }
  KVD_RETURN_IF_ERROR(SolveAffine(r, affine));
  Log(r, "calibrated on " + std::to_string(r.rep.calib_prefixes) + " prefixes");
  return Status::Ok();
}

// One KV head of one layer on one segment: what the per-head steps read.
struct HeadInput {
  int l = 0, h = 0, N = 0;
  int64_t begin = 0, end = 0;  // mergeable / scored range
  double inv_segs = 0;
  Matrix kpost, v;
  kernels::SlotSet slots;
  std::vector<double> mu_k, mu_v;
  std::vector<float> mw, mc;  // window and continuation attention mass per token
};

// Adjacent, far and value cosine similarities of the head's keys.
void AddSimilarity(const Diagnosis& r, const HeadInput& x, HeadDiagnosis& hd) {
  const int N = x.N, d = r.d;
  const ConstMatrixView kpre = x.slots.keys_pre.View();
  double ar = 0, ac = 0, vc = 0, fr = 0;
  for (int t = 0; t + 1 < N; ++t) {
    ar += Cosine(kpre.Row(t), kpre.Row(t + 1), d);
    ac += Cosine(kpre.Row(t), kpre.Row(t + 1), d, x.mu_k.data());
    vc += Cosine(x.v.Row(t), x.v.Row(t + 1), d, x.mu_v.data());
  }
  for (int t = 0; t + r.o.far_gap < N; ++t) fr += Cosine(kpre.Row(t), kpre.Row(t + r.o.far_gap), d);
  hd.cos_adj_raw += ar / (N - 1) * x.inv_segs;
  hd.cos_adj_centred += ac / (N - 1) * x.inv_segs;
  hd.value_cos_adj_centred += vc / (N - 1) * x.inv_segs;
  hd.cos_far_raw += fr / (N - r.o.far_gap) * x.inv_segs;
}

// Window vs continuation attention mass (x.mw, x.mc) and how well the first ranks the second.
Status AddMassAgreement(const Diagnosis& r, const Matrix& wq, const Matrix& cq, HeadInput& x,
                        HeadDiagnosis& hd) {
  x.mw.assign(x.N, 0.0f);
  x.mc.assign(x.N, 0.0f);
  kernels::ObservationHead ow;
  ow.queries = wq.View();
  ow.keys = x.kpost.View();
  KVD_RETURN_IF_ERROR(kernels::ComputeAttentionMass(
      ow, {.mask = kernels::MaskKind::kCausalWindow, .group_size = r.G}, x.mw));
  kernels::ObservationHead oc;
  oc.queries = cq.View();
  oc.keys = x.kpost.View();
  KVD_RETURN_IF_ERROR(kernels::ComputeAttentionMass(
      oc, {.mask = kernels::MaskKind::kNone, .group_size = r.G}, x.mc));
  std::span<const float> sw(x.mw.data() + x.begin, x.end - x.begin),
      sc(x.mc.data() + x.begin, x.end - x.begin);
  hd.spearman += Spearman(sw, sc) * x.inv_segs;
  hd.top25_overlap += TopOverlap(sw, sc, 0.25) * x.inv_segs;
  return Status::Ok();
}

// One KVSlimmer round's pairs merged four ways, and the tokens two evictions of as many drop.
struct MergeRound {
  std::vector<kernels::MergePair> hess, mean, alpha, keep;
  std::vector<bool> drop_same, drop_low;
};

// Plans one KVSlimmer round (every disjoint pair of the mergeable range) and adds its pair
// statistics to hd.
StatusOr<MergeRound> PlanMergeRound(const Diagnosis& r, HeadInput& x, HeadDiagnosis& hd) {
  const int d = r.d;
  const int64_t begin = x.begin, end = x.end;
  const ConstMatrixView kpre = x.slots.keys_pre.View();
  kernels::PairStatistics ps;
  KVD_RETURN_IF_ERROR(
      kernels::ComputePairStatistics(x.mw, begin, end, kernels::MergeNorm::kL2, &x.slots, &ps));
  const std::vector<double> rank = kernels::RankPairs(
      x.mw, x.slots, begin, end, kernels::PairLambda::kAsymKv, kernels::kKvSlimmerDefaultGamma);
  const std::vector<int64_t> chosen = kernels::SelectDisjointPairs(rank, (end - begin) / 2);
  MergeRound mr;
  mr.drop_same.assign(x.N, false);
  mr.drop_low.assign(x.N, false);
  int64_t flaw = 0, favours_less = 0, compared = 0;
  double pr = 0, pc = 0;
  for (int64_t m : chosen) {
    const kernels::MergeWeightResult w =
        kernels::ComputeMergeWeights(kernels::MergeNorm::kL2, x.slots, ps, m);
    mr.hess.push_back(w.pair);
    const double a1 = ps.alpha[m], a2 = ps.alpha[m + 1];
    mr.mean.push_back({m, 0.5f, 0.5f, 0.0f});
    const float wa = a1 + a2 > 0 ? static_cast<float>(a1 / (a1 + a2)) : 0.5f;
    mr.alpha.push_back({m, wa, 1.0f - wa, 0.0f});
    mr.keep.push_back({m, a1 >= a2 ? 1.0f : 0.0f, a1 >= a2 ? 0.0f : 1.0f, 0.0f});
    mr.drop_same[a1 >= a2 ? m + 1 : m] = true;
    if (a1 != a2) {
      ++compared;
      const bool first_more = a1 > a2;
      if (w.pair.w_first != w.pair.w_second && (w.pair.w_first > w.pair.w_second) != first_more) {
        ++favours_less;
        if (w.guard_clamped && std::max(w.pair.w_first, w.pair.w_second) == 1.0f) ++flaw;
      }
    }
    pr += Cosine(kpre.Row(m), kpre.Row(m + 1), d);
    pc += Cosine(kpre.Row(m), kpre.Row(m + 1), d, x.mu_k.data());
  }
  const int64_t R = static_cast<int64_t>(chosen.size());
  hd.pairs += R;
  if (R > 0) {
    hd.cos_pair_raw += pr / R * x.inv_segs;
    hd.cos_pair_centred += pc / R * x.inv_segs;
  }
  if (compared > 0) {
    hd.clamp_flaw_fraction += static_cast<double>(flaw) / compared * x.inv_segs;
    hd.hessian_favours_less += static_cast<double>(favours_less) / compared * x.inv_segs;
  }
  {  // the R lowest window-mass tokens of the range
    std::vector<int64_t> idx(end - begin);
    std::iota(idx.begin(), idx.end(), begin);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return x.mw[a] < x.mw[b]; });
    for (int64_t i = 0; i < R; ++i) mr.drop_low[idx[i]] = true;
  }
  return mr;
}

// The continuation's attention-output error of each merge variant and eviction of the round.
Status AddMergeErrors(const Diagnosis& r, const kernels::RopeTable& rope, const Matrix& cq,
                      const HeadInput& x, const MergeRound& mr, HeadDiagnosis& hd) {
  const int d = r.d;
  const std::vector<double> ref =
      AttentionOutput(cq.values, cq.rows, x.kpost.values, x.v.values, {}, d);
  auto err_of = [&](const Served& s) {
    return RelativeError(AttentionOutput(cq.values, cq.rows, s.k, s.v, s.bias, d), ref);
  };
  auto merged = [&](const std::vector<kernels::MergePair>& pairs) -> StatusOr<double> {
    kernels::SlotSet copy = x.slots;
    KVD_RETURN_IF_ERROR(kernels::ApplyMerges(pairs, kernels::RepresentativePosition::kLast, &copy));
    KVD_ASSIGN_OR_RETURN(Served s, ServeSlots(rope, copy));
    return err_of(s);
  };
  KVD_ASSIGN_OR_RETURN(double eh, merged(mr.hess));
  KVD_ASSIGN_OR_RETURN(double em, merged(mr.mean));
  KVD_ASSIGN_OR_RETURN(double ea, merged(mr.alpha));
  KVD_ASSIGN_OR_RETURN(double ek, merged(mr.keep));
  hd.err_merge_hessian += eh * x.inv_segs;
  hd.err_merge_mean += em * x.inv_segs;
  hd.err_merge_alpha += ea * x.inv_segs;
  hd.err_merge_keep_one += ek * x.inv_segs;
  hd.err_evict_same += err_of(Without(x.kpost, x.v, mr.drop_same)) * x.inv_segs;
  hd.err_evict_lowest += err_of(Without(x.kpost, x.v, mr.drop_low)) * x.inv_segs;
  return Status::Ok();
}

// R^2 of predicting the head's values from its pre-RoPE keys (VECTOR), on this prefix.
class ValueFit {
 public:
  ValueFit(const HeadInput& x, int d) : x_(x), d_(d) {
    for (int t = 0; t < x.N; ++t)
      for (int c = 0; c < d; ++c) {
        const double dv = x.v.Row(t)[c] - x.mu_v[c];
        sst_ += dv * dv;
        wsst_ += x.mc[t] * dv * dv;
      }
  }
  // R^2 of predict(key, out); *weighted (if set): the continuation-mass-weighted error.
  template <typename Predict>
  double R2(Predict predict, double* weighted) const {
    const int d = d_;
    const ConstMatrixView kpre = x_.slots.keys_pre.View();
    double sse = 0, wsse = 0;
    std::vector<double> pred(d);
    for (int t = 0; t < x_.N; ++t) {
      predict(kpre.Row(t), pred.data());
      double e = 0;
      for (int c = 0; c < d; ++c) e += (x_.v.Row(t)[c] - pred[c]) * (x_.v.Row(t)[c] - pred[c]);
      sse += e;
      wsse += x_.mc[t] * e;
    }
    if (weighted) *weighted = wsst_ > 0 ? wsse / wsst_ : 0.0;
    return sst_ > 0 ? 1.0 - sse / sst_ : 0.0;
  }

 private:
  const HeadInput& x_;
  const int d_;
  double sst_ = 0, wsst_ = 0;
};

// The calibrated linear fits', the ridge fit's, the affine fit's and the in-sample fit's R^2.
Status AddVectorFits(const Diagnosis& r, const HeadInput& x, HeadDiagnosis& hd) {
  const int d = r.d, l = x.l, h = x.h;
  const ValueFit fit(x, d);
  auto linear = [&](const kernels::VectorWeights& w) {
    const Matrix& W = w.Head(l, h).w;
    return [&W, d](const float* k, double* out) {
      for (int row = 0; row < d; ++row) {
        double s = 0;
        for (int c = 0; c < d; ++c) s += static_cast<double>(W.values[row * d + c]) * k[c];
        out[row] = s;
      }
    };
  };
  for (size_t f = 0; f < r.fits.size(); ++f) {
    double wt = 0;
    hd.r2_calib[f] += fit.R2(linear(r.fits[f]), &wt) * x.inv_segs;
    if (f + 1 == r.fits.size()) hd.vector_weighted_error += wt * x.inv_segs;
  }
  hd.r2_ridge_1e2 += fit.R2(linear(r.fit_ridge), nullptr) * x.inv_segs;
  const std::vector<double>& aw = r.affine_w[l * r.H + h];
  auto affine = [&aw, d](const float* k, double* out) {
    for (int c = 0; c < d; ++c) {
      double s = aw[d * d + c];  // intercept row
      for (int row = 0; row < d; ++row) s += aw[row * d + c] * k[row];
      out[c] = s;
    }
  };
  hd.r2_affine += fit.R2(affine, nullptr) * x.inv_segs;
  KVD_ASSIGN_OR_RETURN(kernels::VectorCalibrator own, kernels::VectorCalibrator::Create(1, 1, d));
  KVD_RETURN_IF_ERROR(own.Add(0, 0, x.slots.keys_pre.View(), x.v.View()));
  KVD_ASSIGN_OR_RETURN(kernels::VectorWeights ow2, own.Solve({.ridge = 1e-4}));
  hd.r2_in_sample += ow2.Head(0, 0).r2 * x.inv_segs;
  return Status::Ok();
}

// Diagnoses head h of layer l on one segment's capture (wq, cq: its window and continuation
// queries) and adds the results to hd.
Status DiagnoseHead(const Diagnosis& r, const kernels::RopeTable& rope, const Capture& cap,
                    const std::vector<int64_t>& pos, int l, int h, const Matrix& wq,
                    const Matrix& cq, HeadDiagnosis& hd) {
  HeadInput x;
  x.l = l;
  x.h = h;
  x.N = cap.cache.num_tokens;
  x.begin = r.o.sinks;
  x.end = x.N - cap.w;
  x.inv_segs = 1.0 / static_cast<double>(r.segs.size());
  x.kpost = HeadRows(cap.cache.layers[l].k, x.N, r.H, h, r.d);
  x.v = HeadRows(cap.cache.layers[l].v, x.N, r.H, h, r.d);
  KVD_ASSIGN_OR_RETURN(x.slots, kernels::SlotsFromTokens(rope, x.kpost.View(), x.v.View(), pos));
  x.mu_k = RowMean(x.slots.keys_pre.View());
  x.mu_v = RowMean(x.v.View());
  AddSimilarity(r, x, hd);
  KVD_RETURN_IF_ERROR(AddMassAgreement(r, wq, cq, x, hd));
  KVD_ASSIGN_OR_RETURN(const MergeRound mr, PlanMergeRound(r, x, hd));
  KVD_RETURN_IF_ERROR(AddMergeErrors(r, rope, cq, x, mr, hd));
  return AddVectorFits(r, x, hd);
}

// Diagnoses every head on segment si and adds the results to r.rep.heads.
Status DiagnoseSegment(Diagnosis& r, const kernels::RopeTable& rope, llama::LlamaSession& session,
                       size_t si) {
  const DiagnoseOptions& o = r.o;
  const std::vector<int32_t> prefix(r.segs[si].begin(), r.segs[si].begin() + o.prefix_tokens);
  const std::vector<int32_t> cont(r.segs[si].begin() + o.prefix_tokens, r.segs[si].end());
  KVD_ASSIGN_OR_RETURN(Capture cap, Prefill(session, prefix, cont, o.window));
  std::vector<int64_t> pos(cap.cache.positions.begin(), cap.cache.positions.end());
  for (int l = 0; l < r.L; ++l) {
    KVD_ASSIGN_OR_RETURN(std::vector<Matrix> wq,
                         kernels::GatherWindowQueries(r.layout, cap.window_q[l].data(), cap.w));
    KVD_ASSIGN_OR_RETURN(std::vector<Matrix> cq,
                         kernels::GatherWindowQueries(r.layout, cap.cont_q[l].data(), cap.c));
    for (int h = 0; h < r.H; ++h) {
      KVD_RETURN_IF_ERROR(
          DiagnoseHead(r, rope, cap, pos, l, h, wq[h], cq[h], r.rep.heads[l * r.H + h]));
    }
  }
  Log(r, "segment " + std::to_string(si + 1) + "/" + std::to_string(r.segs.size()));
  return Status::Ok();
}

}  // namespace

StatusOr<DiagnoseReport> RunDiagnosis(const llama::LlamaModel& model, const DiagnoseOptions& o) {
  KVD_RETURN_IF_ERROR(o.Validate());
  Diagnosis r(model, o, DiagClock::now());
  if (model.tokenizer() == nullptr)
    return Status::FailedPrecondition("the diagnosis needs a tokenizer");
  KVD_ASSIGN_OR_RETURN(kernels::RopeTable rope, kernels::RopeTable::Create(r.cfg.rope, r.d));
  KVD_RETURN_IF_ERROR(LoadTexts(r));
  llama::LlamaSession session(model, {.threads = o.threads});
  KVD_RETURN_IF_ERROR(Calibrate(r, rope, session));
  r.rep.heads.resize(static_cast<size_t>(r.L) * r.H);
  for (int l = 0; l < r.L; ++l)
    for (int h = 0; h < r.H; ++h) {
      r.rep.heads[l * r.H + h].layer = l;
      r.rep.heads[l * r.H + h].head = h;
      r.rep.heads[l * r.H + h].r2_calib.assign(r.sizes.size(), 0.0);
    }
  for (size_t si = 0; si < r.segs.size(); ++si) {
    KVD_RETURN_IF_ERROR(DiagnoseSegment(r, rope, session, si));
  }
  r.rep.seconds = std::chrono::duration<double>(DiagClock::now() - r.t0).count();
  return std::move(r.rep);
}

namespace {
std::string F(double v, const char* f = "%.3f") {
  char b[48];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}
}  // namespace

std::string DiagnosisCsv(const DiagnoseReport& r) {
  std::ostringstream os;
  os << "layer,head,cos_adj_raw,cos_far_raw,cos_adj_centred,value_cos_adj_centred,cos_pair_raw,"
        "cos_pair_centred,spearman,top25_overlap,pairs,err_merge_hessian,err_merge_mean,"
        "err_merge_alpha,err_merge_keep_one,err_evict_same,err_evict_lowest,clamp_flaw_fraction,"
        "hessian_favours_less";
  for (int s : r.calib_sizes_used) os << ",r2_calib_" << s;
  os << ",r2_ridge_1e-2,r2_affine,r2_in_sample,vector_weighted_error\n";
  for (const HeadDiagnosis& h : r.heads) {
    os << h.layer << "," << h.head;
    for (double x : {h.cos_adj_raw, h.cos_far_raw, h.cos_adj_centred, h.value_cos_adj_centred,
                     h.cos_pair_raw, h.cos_pair_centred, h.spearman, h.top25_overlap}) {
      os << "," << F(x, "%.4f");
    }
    os << "," << h.pairs;
    for (double x :
         {h.err_merge_hessian, h.err_merge_mean, h.err_merge_alpha, h.err_merge_keep_one,
          h.err_evict_same, h.err_evict_lowest, h.clamp_flaw_fraction, h.hessian_favours_less}) {
      os << "," << F(x, "%.4f");
    }
    for (double x : h.r2_calib) os << "," << F(x, "%.4f");
    for (double x : {h.r2_ridge_1e2, h.r2_affine, h.r2_in_sample, h.vector_weighted_error}) {
      os << "," << F(x, "%.4f");
    }
    os << "\n";
  }
  return os.str();
}

std::string DiagnosisMarkdown(const DiagnoseReport& r, const std::string& command) {
  std::ostringstream os;
  os << "Command: `" << command << "` (" << r.segments << " segments of " << r.options.prefix_tokens
     << " + " << r.options.continuation_tokens << " tokens, window " << r.options.window << ", "
     << r.calib_prefixes << " calibration prefixes, " << F(r.seconds, "%.0f")
     << " s). Per layer, mean over the " << r.kv_heads << " KV heads (per head: heads.csv).\n\n";
  os << "| layer | cos adj | cos far | cos adj centred | value cos adj centred | pair cos centred "
        "| Spearman | top-25% overlap | err merge Hessian | mean | alpha | keep one | evict same "
        "| evict lowest | merge < evict heads | clamp flaw | Hessian favours less |";
  for (int s : r.calib_sizes_used) os << " R^2 calib " << s << " |";
  os << " R^2 ridge 1e-2 | R^2 affine | R^2 in-sample | weighted err |\n|";
  const int cols = 18 + static_cast<int>(r.calib_sizes_used.size()) + 4;
  for (int i = 0; i < cols; ++i) os << "---|";
  os << "\n";
  for (int l = 0; l < r.layers; ++l) {
    HeadDiagnosis m;
    m.r2_calib.assign(r.calib_sizes_used.size(), 0.0);
    int wins = 0;
    for (int h = 0; h < r.kv_heads; ++h) {
      const HeadDiagnosis& x = r.heads[l * r.kv_heads + h];
      const double k = 1.0 / r.kv_heads;
      m.cos_adj_raw += x.cos_adj_raw * k;
      m.cos_far_raw += x.cos_far_raw * k;
      m.cos_adj_centred += x.cos_adj_centred * k;
      m.value_cos_adj_centred += x.value_cos_adj_centred * k;
      m.cos_pair_centred += x.cos_pair_centred * k;
      m.spearman += x.spearman * k;
      m.top25_overlap += x.top25_overlap * k;
      m.err_merge_hessian += x.err_merge_hessian * k;
      m.err_merge_mean += x.err_merge_mean * k;
      m.err_merge_alpha += x.err_merge_alpha * k;
      m.err_merge_keep_one += x.err_merge_keep_one * k;
      m.err_evict_same += x.err_evict_same * k;
      m.err_evict_lowest += x.err_evict_lowest * k;
      m.clamp_flaw_fraction += x.clamp_flaw_fraction * k;
      m.hessian_favours_less += x.hessian_favours_less * k;
      for (size_t i = 0; i < m.r2_calib.size(); ++i) m.r2_calib[i] += x.r2_calib[i] * k;
      m.r2_ridge_1e2 += x.r2_ridge_1e2 * k;
      m.r2_affine += x.r2_affine * k;
      m.r2_in_sample += x.r2_in_sample * k;
      m.vector_weighted_error += x.vector_weighted_error * k;
      const double best_merge = std::min(
          {x.err_merge_hessian, x.err_merge_mean, x.err_merge_alpha, x.err_merge_keep_one});
      wins += best_merge < std::min(x.err_evict_same, x.err_evict_lowest);
    }
    os << "| " << l;
    for (double x :
         {m.cos_adj_raw, m.cos_far_raw, m.cos_adj_centred, m.value_cos_adj_centred,
          m.cos_pair_centred, m.spearman, m.top25_overlap, m.err_merge_hessian, m.err_merge_mean,
          m.err_merge_alpha, m.err_merge_keep_one, m.err_evict_same, m.err_evict_lowest}) {
      os << " | " << F(x);
    }
    os << " | " << wins << "/" << r.kv_heads;
    for (double x : {m.clamp_flaw_fraction, m.hessian_favours_less}) os << " | " << F(x);
    for (double x : m.r2_calib) os << " | " << F(x);
    for (double x : {m.r2_ridge_1e2, m.r2_affine, m.r2_in_sample, m.vector_weighted_error}) {
      os << " | " << F(x);
    }
    os << " |\n";
  }
  return os.str();
}

}  // namespace kvd::quality
