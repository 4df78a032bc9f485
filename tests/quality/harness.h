// The compression quality harness: for each method x p_c, on segments of Debian-shipped English
// texts (manifest.txt), (1) teacher-forced perplexity of a continuation given the compressed
// prefix, (2) top-1 agreement with the full cache, (3) per-layer relative error of the attention
// output, (4) passkey retrieval at several depths, (5) the methods' calibration R^2.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/llama/model.h"
#include "methods.h"

namespace kvd::quality {

struct HarnessOptions {
  std::string manifest_path;  // required
  // Registry names; the default is every method of issue 4 (kernel_methods.h registers all but
  // the built-in full and sink_recent).
  std::vector<std::string> methods = {
      "full",         "sink_recent",       "snapkv",         "keydiff",
      "pyramidkv",    "snapkv+vector",     "keydiff+vector", "pyramidkv+vector",
      "kvslimmer_l2", "kvslimmer_l1_code", "hybrid"};
  std::vector<double> ratios = {0.5, 0.75, 0.9};  // p_c values, each in [0, 1)
  // Sizes of the default run (11 methods x 3 ratios): 872 s measured on 2 shared cores, within
  // the 20-minute goal (docs/quality.md, "Sizes"); --prefix 1024 --continuation 128 halves it.
  int prefix_tokens = 2048;          // compressed prefix length N
  int continuation_tokens = 256;     // scored continuation C (C - 1 predictions per segment)
  int max_segments = 8;              // eval segments (round-robin over the eval texts)
  int window = 64;                   // observation window W handed to methods (post-RoPE queries)
  int calibration_segments = 2;      // prefixes from calib texts for Calibrate()
  int passkey_filler_tokens = 1536;  // passkey context length; 0 disables passkey
  std::vector<double> passkey_depths = {0.1, 0.5, 0.9};
  int passkey_trials = 1;  // random keys per depth
  uint32_t seed = 1234;    // passkey digits
  int threads = 0;         // engine threads; 0 = all cores
  bool progress = true;    // progress lines on stderr

  // The --quick preset (< 3 minutes on 2 cores): 2 segments of 512 + 64, passkey 384 tokens.
  static HarnessOptions Quick();
  Status Validate() const;
};

// One (method, p_c) row, aggregated over segments.
struct MethodResult {
  std::string method;
  double p_c = 0;           // requested ("full" is reported at 0)
  double achieved_p_c = 0;  // measured from the slots kept, averaged over segments
  int64_t scored_tokens = 0;
  double nll_sum = 0;
  double perplexity = 0;
  double top1_agreement = 0;  // fraction of positions whose argmax equals the full cache's
  std::vector<double> layer_rel_error;  // [layers] mean over segments of |A_m - A_full| / |A_full|
  double mean_rel_error = 0;
  int passkey_correct = 0;
  int passkey_total = 0;
  double seconds = 0;
};

struct HarnessReport {
  HarnessOptions options;
  std::vector<MethodResult> rows;
  double engine_perplexity = 0;  // the uncompressed engine on the same predictions
  int64_t engine_scored_tokens = 0;
  double engine_nll_sum = 0;
  int engine_passkey_correct = 0;
  int engine_passkey_total = 0;
  int segments = 0;
  std::vector<std::string> texts;     // "path sha256" of the eval texts used
  std::vector<std::string> warnings;  // skipped manifest entries
  std::map<std::string, std::vector<double>> calibration_r2;  // method -> per layer
  double seconds = 0;
};

// Runs every method x ratio. Errors: INVALID_ARGUMENT (options), NOT_FOUND (manifest, methods),
// FAILED_PRECONDITION (model without tokenizer, too little text), and any method's error with
// the method's name as context.
StatusOr<HarnessReport> RunHarness(const llama::LlamaModel& model, const HarnessOptions& options,
                                   const MethodRegistry& registry = MethodRegistry::Global());

}  // namespace kvd::quality
