// kvd-quality-diag: measurements that explain why key merging and VECTOR routing win or lose on a
// real model (docs/quality.md, "What the results say"). Per (layer, KV head), averaged over eval segments:
//
//  - keys: cosine of adjacent pre-RoPE keys (raw, and centred on the head's mean key over the
//    segment), of keys `far_gap` tokens apart, of adjacent centred values; and of the pairs
//    KVSlimmer's first round actually selects (raw and centred);
//  - window premise: Spearman rank correlation between the observation window's attention mass
//    and the continuation queries' mass over the prefix keys (sinks and window excluded), and the
//    overlap of their top-25% sets (0.25 by chance);
//  - merge vs evict: one full KVSlimmer round (every disjoint adjacent pair of the mergeable range,
//    ranked and selected by the kernels) merged with four key weights (the kernel's Hessian weight
//    kL2, the plain mean, the alpha-weighted mean, keeping the more attended key; values are the
//    mean, bias ln 2, as the kernels serve them), against evicting the same number of tokens: the
//    less attended member of each selected pair, or the lowest window-mass tokens. Error: relative
//    Frobenius error of the continuation queries' attention output over the prefix slots. Also how
//    often the clamp guard put all weight on the LESS attended key, and how often the Hessian
//    weight favours the less attended key at all;
//  - VECTOR: out-of-sample R^2 of v ~ W kpre on the eval prefixes for W fitted on 1, 4, 16 and all
//    calibration prefixes (relative ridge 1e-4), on all with ridge 1e-2, the affine fit
//    v ~ W kpre + b on all, and the in-sample R^2 (fitted on the evaluated prefix itself); and the
//    continuation-attention-weighted relative error of the rebuilt values.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/llama/model.h"

namespace kvd::quality {

struct DiagnoseOptions {
  std::string manifest_path;            // required (eval and calib texts)
  std::vector<std::string> text_files;  // replace the manifest's eval texts when non-empty
  int prefix_tokens = 1024;             // N
  int continuation_tokens = 64;         // continuation queries scored against the prefix
  int segments = 3;                     // eval segments (round-robin over the texts)
  int window = 64;                      // observation window W
  int sinks = 4;
  int far_gap = 64;                           // "far" key pairs are this many tokens apart
  std::vector<int> calib_sizes = {1, 4, 16};  // calibration prefixes per VECTOR fit (+ all)
  int max_calib_prefixes = 32;                // "all" = up to this many calibration prefixes
  // Engine threads of the one session (0 = all cores). Default 1, as kvd-quality's --threads: on
  // a machine shared with other work OpenBLAS's second thread spin-waits and costs more than it
  // gives (docs/quality.md, "Running it"); pass --threads 2 (or 0) on free cores.
  int threads = 1;

  Status Validate() const;
};

// Every metric of one (layer, KV head), averaged over segments.
struct HeadDiagnosis {
  int layer = 0, head = 0;
  double cos_adj_raw = 0, cos_far_raw = 0, cos_adj_centred = 0, value_cos_adj_centred = 0;
  double cos_pair_raw = 0, cos_pair_centred = 0;  // pairs KVSlimmer's round selects
  double spearman = 0, top25_overlap = 0;
  int64_t pairs = 0;  // pairs merged per segment (summed)
  double err_merge_hessian = 0, err_merge_mean = 0, err_merge_alpha = 0, err_merge_keep_one = 0;
  double err_evict_same = 0, err_evict_lowest = 0;
  double clamp_flaw_fraction = 0;   // pairs whose clamp put weight 1 on the less attended key
  double hessian_favours_less = 0;  // pairs whose Hessian weight favours the less attended key
  std::vector<double> r2_calib;     // per calib size (calib_sizes, then all)
  double r2_ridge_1e2 = 0, r2_affine = 0, r2_in_sample = 0;
  double vector_weighted_error = 0;  // sum m_c |v - W k|^2 / sum m_c |v - mean v|^2 (all calib)
};

struct DiagnoseReport {
  DiagnoseOptions options;
  int layers = 0, kv_heads = 0, segments = 0, calib_prefixes = 0;
  std::vector<int> calib_sizes_used;  // the sizes actually fitted (the last one is "all")
  std::vector<HeadDiagnosis> heads;   // [layers * kv_heads], index layer * kv_heads + head
  std::vector<std::string> texts;     // "path sha256" of the eval texts used
  double seconds = 0;
};

StatusOr<DiagnoseReport> RunDiagnosis(const llama::LlamaModel& model, const DiagnoseOptions& o);

// heads.csv: one row per (layer, head); layers.md: per-layer means as a Markdown table.
std::string DiagnosisCsv(const DiagnoseReport& r);
std::string DiagnosisMarkdown(const DiagnoseReport& r, const std::string& command);

// Helpers (exposed for tests).
// Spearman rank correlation (average ranks for ties); 0 when either side is constant or n < 2.
double Spearman(std::span<const float> a, std::span<const float> b);
// |top-k(a) & top-k(b)| / k with k = ceil(fraction * n).
double TopOverlap(std::span<const float> a, std::span<const float> b, double fraction);
// Attention output of queries q [R, d] over slots (keys [S, d], values [S, d], bias [S] or empty)
// with scale 1/sqrt(d), float64: out [R, d].
std::vector<double> AttentionOutput(std::span<const float> q, int64_t rows,
                                    std::span<const float> keys, std::span<const float> values,
                                    std::span<const float> bias, int d);
// |a - b|_F / |b|_F (0 when |b| is 0).
double RelativeError(std::span<const double> a, std::span<const double> b);

}  // namespace kvd::quality
