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

// Evaluation modes: how the prefix is handed to a method.
//   "one-shot":   the whole prefix as one chunk, scored with its last `window` queries.
//   "chunk-wise": the serving path. The prefix is cut into `chunk_tokens` chunks (the last one may
//                 be shorter); each chunk is compressed on its own, with only its own K/V and the
//                 queries of its own last `chunk_window` tokens (prefix-consistent: nothing after
//                 the chunk is seen), and the compact chunks are concatenated.
inline constexpr const char* kModeOneShot = "one-shot";
inline constexpr const char* kModeChunkWise = "chunk-wise";

struct HarnessOptions {
  std::string manifest_path;  // required
  // Eval texts given by path (--text-file, repeatable): when non-empty they replace the
  // manifest's `eval` texts (their sha256 is computed and reported); calibration still comes from
  // the manifest's `calib` texts.
  std::vector<std::string> text_files;
  // Registry names, each optionally with its own p_c list, "name@0.5:0.75" (default: `ratios`).
  // The default is every scorer with uniform and AdaKV head budgets, SnapKV and
  // AdaKV + VECTOR, KVSlimmer, the hybrid and the error-aware hybrid; left out to fit the time
  // limit (docs/quality.md, "Running it"): keydiff+vector, pyramidkv+vector, kvslimmer_l1_code and
  // pyramidkv_ada (identical to adakv at these sizes). --list-methods shows every registered one.
  std::vector<std::string> methods = {
      "full",        "sink_recent",   "snapkv",       "keydiff",      "pyramidkv", "adakv",
      "keydiff_ada", "snapkv+vector", "adakv+vector", "kvslimmer_l2", "hybrid",    "hybrid_ea"};
  std::vector<double> ratios = {0.5, 0.75, 0.9};  // p_c values, each in [0, 1)
  std::vector<std::string> modes = {kModeOneShot, kModeChunkWise};
  // Sizes of the default run: docs/quality.md, "Running it" (estimated from a measured fraction to
  // fit 20 minutes of CPU on one engine thread).
  int prefix_tokens = 1024;          // compressed prefix length N
  int continuation_tokens = 128;     // scored continuation C (C - 1 predictions per segment)
  int max_segments = 10;             // eval segments (round-robin over the eval texts)
  int window = 64;                   // one-shot observation window W (post-RoPE queries)
  int chunk_tokens = 256;            // chunk-wise: chunk length (the daemon's chunk)
  int chunk_window = 16;             // chunk-wise: window queries per chunk (<= chunk_tokens)
  int calibration_segments = 4;      // prefixes from calib texts for Calibrate() (round-robin)
  int passkey_filler_tokens = 1024;  // passkey context length; 0 disables passkey
  std::vector<double> passkey_depths = {0.1, 0.5, 0.9};
  int passkey_trials = 20;   // random keys per depth (single-key variant; one-shot mode)
  int multikey_trials = 20;  // multi-key variant: prompts with `multikey_keys` labelled keys
  int multikey_keys = 4;     // keys per multi-key prompt (one asked for), >= 2
  // Methods whose one-shot rows answer the passkey prompts (each prompt costs one engine call per
  // row); empty = every method. Each must be in `methods`.
  std::vector<std::string> passkey_methods = {"full", "snapkv", "keydiff"};
  // Also ask the passkey prompts of every row on a front (fronts.h) of its mode, in that mode
  // (chunk-wise rows compress the prompt chunk by chunk). Costs one engine call per prompt and
  // front row, after the segments. Chunk-wise needs passkey_filler_tokens to be a multiple of
  // chunk_tokens. Default false.
  bool passkey_fronts = false;
  // Also ask the passkey prompts of the passkey methods' chunk-wise rows, compressed chunk by
  // chunk (the serving path); needs passkey_filler_tokens a multiple of chunk_tokens. Default
  // false.
  bool passkey_chunk_wise = false;
  // One line per passkey prompt on stderr: its key, depth, the context positions of the key's
  // tokens, and the uncompressed engine's and every asked row's answer (right, or wrong at which
  // answer token) with its margin (over the key's tokens, the least of the key token's logit
  // minus the best other). Default false.
  bool passkey_log = false;
  int bootstrap_samples = 2000;  // bootstrap resamples of the segments for the 95% intervals
  // Methods every other method is compared with, paired on the same segments, in results.md
  // (report.h PairedToMarkdown); default none. Each must be in `methods`.
  std::vector<std::string> paired_against;
  uint32_t seed = 1234;  // passkey digits and positions
  // Engine threads per session. Default 1: on a machine shared with other work OpenBLAS's second
  // thread spin-waits and costs more than it gives (docs/quality.md, "Running it"); 0 = all cores.
  int threads = 1;
  // Segments (and passkey prompts) evaluated at once, each worker with its own two engine
  // sessions of `threads` threads; results are summed in segment order, so the report is the
  // same for every value. 0 = cores / threads (at least 1), i.e. one worker per core with the
  // default threads = 1; never more than there are segments; 1 when a method is not
  // ParallelSafe() (online VECTOR calibration carries state from call to call).
  int jobs = 0;
  bool progress = true;  // progress lines on stderr

  // The --quick preset (< 2 minutes on 2 cores): 2 segments of 512 + 64, passkey 384 tokens.
  static HarnessOptions Quick();
  Status Validate() const;
  // The number of workers for `items` segments or prompts (see jobs).
  int EffectiveJobs(size_t items) const;
};

// One (method, p_c, mode) row, aggregated over segments.
struct MethodResult {
  std::string method;
  std::string mode = kModeOneShot;
  double p_c = 0;           // requested ("full" is reported at 0)
  double achieved_p_c = 0;  // measured from the slots kept, averaged over segments
  // Stored bytes over raw bfloat16 bytes (CompressedPrefix::stored_bytes_fraction), averaged over
  // segments; -1 when the method does not measure bytes.
  double stored_raw = -1;
  // Dense serving form on every segment: one slot per token position (fronts.h KeepsPositions).
  bool keeps_positions = false;
  int64_t scored_tokens = 0;
  double nll_sum = 0;
  double perplexity = 0;
  double top1_agreement = 0;  // fraction of positions whose argmax equals the full cache's
  std::vector<double> layer_rel_error;  // [layers] mean over segments of |A_m - A_full| / |A_full|
  double mean_rel_error = 0;
  // Per segment (for the bootstrap): NLL sums, scored tokens, top-1 agreements.
  std::vector<double> seg_nll;
  std::vector<int64_t> seg_n;
  std::vector<int64_t> seg_agree;
  // 95% bootstrap intervals over segments (paired with the engine on the same segments).
  double ppl_ratio_lo = 0, ppl_ratio_hi = 0;
  double top1_lo = 0, top1_hi = 0;
  // Passkey (one-shot rows only): single key per depth (depth index as in passkey_depths), and
  // the multi-key variant.
  int passkey_correct = 0;
  int passkey_total = 0;
  std::vector<int> passkey_depth_correct;
  std::vector<int> passkey_depth_total;
  int multikey_correct = 0;
  int multikey_total = 0;
  double seconds = 0;      // wall time of this row's compressions and scoring, summed
  double cpu_seconds = 0;  // CPU time of the same work (the worker's thread; exact when threads
                           // == 1, the engine's other threads are not counted otherwise)
};

struct HarnessReport {
  HarnessOptions options;
  std::vector<MethodResult> rows;
  double engine_perplexity = 0;  // the uncompressed engine on the same predictions
  int64_t engine_scored_tokens = 0;
  double engine_nll_sum = 0;
  std::vector<double> engine_seg_nll;  // per segment
  int engine_passkey_correct = 0;
  int engine_passkey_total = 0;
  int engine_multikey_correct = 0;
  int engine_multikey_total = 0;
  int segments = 0;
  std::vector<std::string> texts;        // "path sha256" of the eval texts used
  std::vector<std::string> calib_texts;  // "path sha256" of the calibration texts used
  std::vector<std::string> warnings;     // skipped manifest entries
  std::map<std::string, std::vector<double>> calibration_r2;  // method -> per layer
  double seconds = 0;
};

// A --methods entry "name" or "name@0.5:0.75": the registry name and its p_c list (`ratios`
// without "@"). INVALID_ARGUMENT for an empty name or a p_c outside [0, 1).
struct MethodRatios {
  std::string name;
  std::vector<double> ratios;
};
StatusOr<MethodRatios> ParseMethodSpec(const std::string& entry, const std::vector<double>& ratios);

// Runs every method x ratio. Errors: INVALID_ARGUMENT (options), NOT_FOUND (manifest, methods),
// FAILED_PRECONDITION (model without tokenizer, too little text), and any method's error with
// the method's name as context.
StatusOr<HarnessReport> RunHarness(const llama::LlamaModel& model, const HarnessOptions& options,
                                   const MethodRegistry& registry = MethodRegistry::Global());

}  // namespace kvd::quality
