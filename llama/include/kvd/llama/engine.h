// The reference Llama forward pass on the CPU: batched prefill through BLAS sgemm, single-token
// decode, GQA attention over a per-(layer, KV head) cache that may hold compacted slots with an
// additive log-cardinality bias.
//
// A LlamaSession is one sequence's state (its KV cache and position). Not thread-safe: one caller
// at a time; it parallelises internally (OpenBLAS threads + its own parallel-for over heads).
// Several sessions may share one LlamaModel concurrently.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/llama/kv_cache.h"
#include "kvd/llama/model.h"

namespace kvd::llama {

struct SessionOptions {
  // Worker threads for attention and element-wise work, and the OpenBLAS thread count
  // (process-wide). 0 = hardware concurrency. Default 0.
  int threads = 0;

  Status Validate() const;
};

struct ForwardOptions {
  // Return the logits of every token of the call ([T, vocab]) instead of only the last ([vocab]).
  // Default false. Costs T * vocab floats.
  bool all_logits = false;
  // Capture the post-RoPE queries of the last `capture_queries` tokens of this call per layer
  // (clamped to T); read them with captured_queries(). 0 (default) captures nothing.
  int capture_queries = 0;
  // Capture every layer's attention output (before W_o) for the tokens of this call: per layer
  // [T, num_q_heads * head_dim]; read with captured_attention(). Default false.
  bool capture_attention = false;
};

class LlamaSession {
 public:
  // REQUIRES: `model` outlives the session.
  LlamaSession(const LlamaModel& model, SessionOptions options = {});

  // Runs `tokens` through the model at positions position() .. position()+T-1, appending their
  // keys and values to the cache, and returns logits (see ForwardOptions): [vocab] for the last
  // token or [T, vocab]. Errors: INVALID_ARGUMENT (empty input, token id outside the vocabulary),
  // OUT_OF_RANGE (position() + T exceeds the model's context length). On error the session is
  // unchanged.
  StatusOr<std::vector<float>> Forward(std::span<const int32_t> tokens, ForwardOptions opts = {});

  const LlamaModel& model() const { return model_; }
  // Position of the next token (not the number of cached entries once a cache was compacted).
  int position() const { return position_; }
  // Entries (slots) cached for (layer, kv_head).
  int num_slots(int layer, int kv_head) const;
  // True while every (layer, head) holds the same entries with no bias (a dense cache).
  bool is_dense() const { return dense_; }

  // Exports the cache in the dense layout (K[N, n_kv, d], V[N, n_kv, d] per layer).
  // FAILED_PRECONDITION when the session holds a compact cache.
  StatusOr<DenseKvCache> ExportDense() const;
  // Layer `layer`'s keys or values as [N, n_kv, d]; empty when !is_dense().
  std::vector<float> LayerKeys(int layer) const;
  std::vector<float> LayerValues(int layer) const;
  // Original positions of the dense entries [N].
  const std::vector<int32_t>& positions() const { return positions_; }

  // Replaces the session's state with `cache`; the next token is at cache.next_position.
  // INVALID_ARGUMENT on shapes that do not match the model; OUT_OF_RANGE past the context.
  Status LoadDense(const DenseKvCache& cache);
  Status LoadCompact(const CompactKvCache& cache);

  // Post-RoPE queries captured by the last Forward with capture_queries = W:
  // per layer [W', num_q_heads, head_dim] with W' = min(W, T) (empty if none were captured).
  const std::vector<std::vector<float>>& captured_queries() const { return captured_q_; }
  int captured_query_count() const { return captured_count_; }
  // Attention outputs captured by the last Forward with capture_attention (else empty).
  const std::vector<std::vector<float>>& captured_attention() const { return captured_att_; }

  // Drops the cache; position() becomes 0.
  void Reset();

 private:
  struct HeadCache {
    std::vector<float> k;     // [S, d]
    std::vector<float> v;     // [S, d]
    std::vector<float> bias;  // [S] or empty when every bias is 0
  };
  // Interleaves one layer's per-head rows (`rows` of each HeadCache, [N, d]) into the export
  // layout [N, num_kv_heads, d].
  static std::vector<float> InterleaveHeads(const std::vector<HeadCache>& heads, int num_tokens,
                                            int d, std::vector<float> HeadCache::*rows);
  Status CheckTokens(std::span<const int32_t> tokens) const;
  void ApplyRope(float* x, int num_heads, int pos) const;
  // Causal attention of T new queries (q [T, n_q*d]) over head caches that already include the
  // T new entries; writes out [T, n_q*d].
  void Attention(int layer, const float* q, int T, float* out);

  const LlamaModel& model_;
  const LlamaConfig& cfg_;
  SessionOptions options_;
  int threads_;
  int position_ = 0;
  bool dense_ = true;
  std::vector<int32_t> positions_;             // dense entries' positions
  std::vector<std::vector<HeadCache>> cache_;  // [layer][kv_head]
  std::vector<double> inv_freq_;               // [rotary_dim / 2]
  std::vector<std::vector<float>> captured_q_;
  std::vector<std::vector<float>> captured_att_;
  int captured_count_ = 0;
};

// Index of the largest logit (ties: the lowest index).
int32_t Argmax(std::span<const float> logits);
// -log softmax(logits)[target], computed stably in double.
double NegLogLikelihood(std::span<const float> logits, int32_t target);

}  // namespace kvd::llama
