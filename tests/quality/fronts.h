// Quality per stored byte: the Pareto fronts of a harness report (docs/quality.md, "Fronts").
//
// Every row measured in bytes (MethodResult::stored_raw >= 0: the encoded compact chunks over the
// raw bfloat16 chunks) is a point (stored/raw, perplexity). Rows are classed by serving form:
//   dense    the cache expands to one KV slot per token position of the raw chunk (every token
//            kept, quantized or not; merges expanded, slot j repeated l_j times), the form an
//            unmodified paged engine (vLLM) takes; kvd's CompressionPolicy::KeepsPositions;
//   compact  every row (an engine that takes kvd's compact form serves the dense ones too).
// The front of a form is the rows of that form no other row of that form dominates (stored/raw
// and perplexity both <=, one of them <), in increasing stored/raw.
#pragma once

#include <string>
#include <vector>

#include "harness.h"

namespace kvd::quality {

enum class ServingForm { kDense, kCompact };
const char* ServingFormName(ServingForm form);  // "dense", "compact"

// True when every (layer, KV head) of `cache` expands to exactly `num_tokens` slots: the sum over
// its slots of l_j = round(exp(bias_j)) (the compact form's bias is ln l_j) is `num_tokens`.
bool KeepsPositions(const llama::CompactKvCache& cache, int num_tokens);

// Indices into r.rows of the front of `form` among the rows of `mode` (plus "full", which is
// reported once), in increasing stored/raw; equal points keep the first row.
std::vector<size_t> ParetoFront(const HarnessReport& r, const std::string& mode, ServingForm form);

// Whether row `k` of r is on the front of either form of its mode.
std::vector<bool> OnAnyFront(const HarnessReport& r);

// Byte budgets (stored/raw) the budget table of FrontsToMarkdown reads the fronts at.
inline constexpr double kFrontBudgets[] = {1.0, 0.55, 0.30, 0.20, 0.15, 0.10, 0.05};

// "## Fronts" with, per mode and form, the front's rows (stored/raw, perplexity ratio to the
// engine with its paired 95% interval, top-1 agreement, passkey and multi-key where asked), and
// the best row of each form within each of kFrontBudgets.
std::string FrontsToMarkdown(const HarnessReport& r);

}  // namespace kvd::quality
