// Evaluation helpers on top of LlamaSession: greedy generation and teacher-forced perplexity.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/llama/engine.h"

namespace kvd::llama {

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (prompt excluded)
  double prefill_seconds = 0;
  double decode_seconds = 0;  // for tokens.size() - 1 decode steps (the first comes from prefill)
};

// Prefills `prompt` then greedily generates `n` tokens (stops early at `stop_token` if >= 0,
// which is included). The session keeps the resulting state.
StatusOr<GenerateResult> GenerateGreedy(LlamaSession& session, std::span<const int32_t> prompt,
                                        int n, int32_t stop_token = -1);

struct PerplexityOptions {
  // Tokens per independent window (each starts from an empty cache); 0 = the model's context.
  int window = 1024;
  // Tokens fed per Forward call inside a window (bounds the [batch, vocab] logits). Default 256.
  int batch = 256;
  // Worker threads (SessionOptions::threads). 0 = all.
  int threads = 0;
};

struct PerplexityResult {
  int64_t scored_tokens = 0;  // tokens whose NLL was counted (window length - 1 per window)
  double total_nll = 0;       // nats
  double perplexity = 0;      // exp(total_nll / scored_tokens)
  double seconds = 0;
};

// Teacher-forced perplexity of `tokens`, split into consecutive windows. INVALID_ARGUMENT when
// fewer than 2 tokens or bad options.
StatusOr<PerplexityResult> Perplexity(const LlamaModel& model, std::span<const int32_t> tokens,
                                      PerplexityOptions options = {});

}  // namespace kvd::llama
