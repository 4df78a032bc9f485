// Writes a HarnessReport as CSV (one row per method x p_c), a per-layer CSV, and Markdown.
#pragma once

#include <string>

#include "harness.h"

namespace kvd::quality {

// method,p_c,achieved_p_c,scored_tokens,perplexity,ppl_ratio_vs_full,top1_agreement,
// mean_attn_rel_error,passkey_correct,passkey_total,seconds
std::string ToCsv(const HarnessReport& r);
// method,p_c,layer,attn_rel_error
std::string LayersToCsv(const HarnessReport& r);
// "# kvd quality" with the options, texts, the table, and calibration R^2 if any.
std::string ToMarkdown(const HarnessReport& r, const std::string& command);

// Parses the CSV written by ToCsv back into rows (engine row into engine_perplexity); for
// re-plotting. INVALID_ARGUMENT naming the line on a malformed row.
StatusOr<HarnessReport> FromCsv(const std::string& csv);

// Writes results.csv, layers.csv, results.md and perplexity.png under `dir` (created if missing).
Status WriteReport(const HarnessReport& r, const std::string& dir, const std::string& command);

}  // namespace kvd::quality
