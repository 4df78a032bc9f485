// Writes a HarnessReport as CSV (one row per method x p_c), a per-layer CSV, and Markdown.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "harness.h"

namespace kvd::quality {

inline constexpr const char* kCsvHeader =
    "method,mode,p_c,achieved_p_c,scored_tokens,perplexity,ppl_ratio_vs_full,ppl_ratio_lo,"
    "ppl_ratio_hi,top1_agreement,top1_lo,top1_hi,mean_attn_rel_error,passkey_correct,"
    "passkey_total,multikey_correct,multikey_total,seconds,cpu_seconds,stored_raw,form";
inline constexpr size_t kCsvFields = 21;

// `v` formatted by printf format `f` (one double conversion), e.g. Fmt("%.3f", 1.25).
std::string Fmt(const char* f, double v);

// One row per (method, mode, p_c) with the 95% bootstrap intervals (kCsvHeader), the engine first;
// stored_raw is -1 where the method does not measure bytes, form "dense" or "compact" (fronts.h).
std::string ToCsv(const HarnessReport& r);
// method,mode,p_c,segment,nll_sum,scored_tokens,top1_agree,engine_nll_sum (for paired analyses)
std::string SegmentsToCsv(const HarnessReport& r);
// method,mode,p_c,layer,attn_rel_error
std::string LayersToCsv(const HarnessReport& r);
// "# kvd quality" with the options, texts, one table per mode, the fronts (fronts.h), and
// calibration R^2 if any.
std::string ToMarkdown(const HarnessReport& r, const std::string& command);

// Paired comparisons (docs/quality.md): for each baseline method and mode, every other method's
// perplexity ratio to the baseline on the same segments, exp((sum nll_m - sum nll_b) / sum n),
// with the 95% paired bootstrap interval (a resample draws the same segments for both) and the
// number of segments where the method's NLL is lower. Empty without baselines; "-" where a
// baseline row is missing. ToMarkdown appends it for HarnessOptions::paired_against.
std::string PairedToMarkdown(const HarnessReport& r, const std::vector<std::string>& baselines);

// Parses the CSV written by ToCsv (or the older 19-, 18- and 11-field layouts: no bytes measured;
// 11 fields are read as one-shot rows) back into
// rows (engine row into engine_perplexity); for re-plotting. INVALID_ARGUMENT naming the line on a
// malformed row.
StatusOr<HarnessReport> FromCsv(const std::string& csv);

// The modes present in the rows (in order of appearance; "full" excluded), and the rows of one
// mode plus the "full" row.
std::vector<std::string> ModesOf(const HarnessReport& r);
HarnessReport RowsOfMode(const HarnessReport& r, const std::string& mode);
// "perplexity-<mode>.png"
std::string PlotFileName(const std::string& mode);
// "fronts-<mode>.png"
std::string FrontPlotFileName(const std::string& mode);
// One perplexity plot and one front plot per mode under `dir`.
Status WritePlots(const HarnessReport& r, const std::string& dir);

// Writes results.csv, segments.csv, layers.csv, results.md and per mode perplexity-<mode>.png
// and fronts-<mode>.png under `dir` (created if missing).
Status WriteReport(const HarnessReport& r, const std::string& dir, const std::string& command);

}  // namespace kvd::quality
