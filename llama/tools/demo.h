// kvd-demo's modes and what they share (the tool's own header; kvd_demo_main.cc says what each
// mode does).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/common/status.h"
#include "kvd/llama/disagg.h"
#include "kvd/llama/model.h"
#include "kvd/llama/tokenizer.h"
#include "util.h"

namespace kvd::demo {

// The command line of every mode (each mode reads the options it declares).
struct Flags {
  std::string model_file, text = "deploy/demo/text.txt", model = "smollm2-135m";
  std::string logits_out, full_logits_out, from;
  int prompt_tokens = 808, heldout = 128, generate = 24, threads = 0, window = 32;
  int chunk_tokens = 256, segment_tokens = 0;
  double p_c = 0.5;
  std::string score = "keydiff";
  std::string quant = "int8";
  bool baseline = false, token_ids = false;
  kvd::tools::ConnectionFlags connection;
};

struct Text {
  std::vector<int32_t> prompt;
  std::vector<int32_t> heldout;
};

// The model, the tokenised text and the engine settings of one run.
struct Setup {
  std::unique_ptr<llama::LlamaModel> model;
  Text text;
  int generate = 24;
  int threads = 0;
  int window = 32;
  int chunk_tokens = 256;
  std::string logits_out;
};

// The modes; each returns the tool's exit code (0 ok, 1 failure, 2 usage, 3 kvd unreachable).
int RunLocal(const Flags& f);
int RunPrefill(const Flags& f);
int RunDecode(const Flags& f);
int RunCalibrate(const Flags& f);

// ---- shared by the modes (demo_common.cc) ----

double Since(std::chrono::steady_clock::time_point t0);

// Prints "kvd-demo: WHERE: STATUS" to stderr; the exit code: 3 when kvd is unavailable, else 1.
int Fail(const std::string& where, const Status& s);

// The model and the tokenised text: prompt = the first --prompt-tokens ids, held-out = the next
// --heldout.
StatusOr<Setup> Load(const Flags& f);

// Chunks a decode takes from the cache: the prompt's full chunks, leaving at least one prompt
// token to run (its logits predict the first held-out token).
int CachedChunks(const Setup& s);

// Writes the logits as raw float32 to `path`; nothing when `path` is empty.
Status WriteLogits(const std::string& path, const std::vector<float>& logits);

void PrintScore(const char* name, const llama::ContinuationScore& r, const llama::Tokenizer* tok);

// The `kvd-demo:` summary line the tests and the quickstart read.
void PrintLine(const std::string& model, double p_c, uint64_t raw, uint64_t stored,
               const llama::ContinuationScore& full, const llama::ContinuationScore& comp);

// Connects as an engine for --model with the daemon's layout and chunk size, in namespace
// --namespace (else `default_namespace`; "" = the daemon's default).
StatusOr<std::unique_ptr<client::Client>> ConnectEngine(const Flags& f, Setup* s,
                                                        const std::string& default_namespace = "");

// Load, then ConnectEngine: 0, or the exit code after printing where it failed.
int LoadAndConnect(const Flags& f, Setup* s, std::unique_ptr<client::Client>* client);

}  // namespace kvd::demo
