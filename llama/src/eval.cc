#include "kvd/llama/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace kvd::llama {
namespace {
double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

StatusOr<GenerateResult> GenerateGreedy(LlamaSession& session, std::span<const int32_t> prompt,
                                        int n, int32_t stop_token) {
  if (n < 0) return Status::InvalidArgument("n must be >= 0");
  GenerateResult r;
  auto t0 = std::chrono::steady_clock::now();
  KVD_ASSIGN_OR_RETURN(std::vector<float> logits, session.Forward(prompt));
  r.prefill_seconds = Since(t0);
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    const int32_t next = Argmax(logits);
    r.tokens.push_back(next);
    if (next == stop_token || i + 1 == n) break;
    KVD_ASSIGN_OR_RETURN(logits, session.Forward(std::span<const int32_t>(&next, 1)));
  }
  r.decode_seconds = Since(t0);
  return r;
}

StatusOr<PerplexityResult> Perplexity(const LlamaModel& model, std::span<const int32_t> tokens,
                                      PerplexityOptions options) {
  const int ctx = model.config().context_length;
  const int window = options.window > 0 ? std::min(options.window, ctx) : ctx;
  if (window < 2 || options.batch < 1) {
    return Status::InvalidArgument("perplexity needs window >= 2 and batch >= 1");
  }
  if (tokens.size() < 2) return Status::InvalidArgument("perplexity needs at least 2 tokens");
  PerplexityResult r;
  const auto t0 = std::chrono::steady_clock::now();
  LlamaSession session(model, SessionOptions{.threads = options.threads});
  const int V = model.config().vocab_size;
  for (size_t start = 0; start + 1 < tokens.size(); start += window) {
    const size_t len = std::min<size_t>(window, tokens.size() - start);
    if (len < 2) break;
    session.Reset();
    for (size_t b = 0; b < len; b += options.batch) {
      const size_t blen = std::min<size_t>(options.batch, len - b);
      KVD_ASSIGN_OR_RETURN(std::vector<float> logits,
                           session.Forward(tokens.subspan(start + b, blen), {.all_logits = true}));
      for (size_t t = 0; t < blen; ++t) {
        const size_t pos = b + t;  // within the window
        if (pos + 1 >= len) break;
        r.total_nll += NegLogLikelihood(std::span<const float>(logits.data() + t * V, V),
                                        tokens[start + pos + 1]);
        ++r.scored_tokens;
      }
    }
  }
  r.seconds = Since(t0);
  r.perplexity = std::exp(r.total_nll / static_cast<double>(r.scored_tokens));
  return r;
}

}  // namespace kvd::llama
