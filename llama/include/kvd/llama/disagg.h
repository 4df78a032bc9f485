// The reference engine as a disaggregated prefill / decode pair (library kvd_llama_disagg).
//
// Prefill side: PrefillChunks runs a prompt one kvd chunk per Forward call, so that each full
// chunk comes with the post-RoPE queries of ITS OWN last W tokens (what a prefix-consistent
// compression of that chunk may use, and what a put sends with the chunk), and returns the
// chunks in the raw chunk layout of common/layout.h (converted to the layout's dtype).
//
// Decode side: DenseFromRawChunks / CompactFromChunks turn what kvd serves (raw chunks, or compact
// chunks of kvd/kernels/compact_chunk.h) back into a cache a LlamaSession loads; ScoreContinuation
// continues from such a cache and measures it (greedy continuation, perplexity and top-1 of a
// held-out continuation).
//
// CompressPrefillChunk runs the kernels' compression plan on exactly the inputs a put carries
// (raw bytes in the layout dtype, positions, window queries): the in-process reference for a
// chunk that kvd compressed at ingest.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/vector.h"
#include "kvd/llama/engine.h"
#include "kvd/llama/kv_cache.h"

namespace kvd::llama {

struct ChunkedPrefillOptions {
  // Tokens per chunk: must equal the daemon's chunk_tokens. Default 256. >= 1.
  int chunk_tokens = 256;
  // W: window queries captured per full chunk (its last W tokens). Default 32. 1..chunk_tokens.
  int window = 32;

  Status Validate() const;
};

// One full chunk of a prompt as a prefill engine hands it to kvd.
struct PrefillChunk {
  int64_t first_position = 0;  // position of the chunk's first token
  int tokens = 0;              // chunk_tokens
  std::vector<uint8_t> raw;    // layout.ChunkBytes(tokens): per layer K[N, H, d], V[N, H, d]
  int window = 0;              // W
  // Post-RoPE queries of the chunk's last W tokens, float32, layer-major: per layer
  // [W, num_q_heads, head_dim] (the engine's captured_queries() of that chunk's Forward).
  std::vector<float> window_queries;
};

struct ChunkedPrefill {
  std::vector<PrefillChunk> chunks;  // the prompt's FULL chunks, in order
  std::vector<float> last_logits;    // logits after the prompt's last token [vocab]
  double seconds = 0;                // wall time of the forward passes
};

// Runs `prompt` through `session` (REQUIRES: position() == 0) one chunk per Forward; the tokens
// after the last full chunk are run too (the session ends holding the whole prompt) but make no
// chunk. `layout` must describe the model (layers, heads, head dim); its dtype is the chunks'.
// Errors: INVALID_ARGUMENT (options, layout mismatch, non-empty session), Forward's errors.
StatusOr<ChunkedPrefill> PrefillChunks(LlamaSession& session, std::span<const int32_t> prompt,
                                       const ModelLayout& layout,
                                       const ChunkedPrefillOptions& options = {});

// One raw chunk as kvd serves it: layout.ChunkBytes(tokens) bytes in layout.dtype.
struct RawChunkView {
  int tokens = 0;
  std::span<const uint8_t> bytes;
};

// The dense cache of consecutive raw chunks starting at position 0; next_position = their token
// count. INVALID_ARGUMENT when a chunk's size disagrees with the layout.
StatusOr<DenseKvCache> DenseFromRawChunks(const ModelLayout& layout,
                                          std::span<const RawChunkView> chunks);

// kernels::Compress of one prefill chunk (positions first_position.., the chunk's own window
// queries). `weights` only for plans that route values. Errors: those of Compress and of
// GatherWindowQueries; INVALID_ARGUMENT when the chunk has no queries and the plan needs them is
// Compress's FAILED_PRECONDITION.
StatusOr<kernels::CompactChunk> CompressPrefillChunk(const kernels::CompressionPlanOptions& plan,
                                                     const ModelLayout& layout,
                                                     const PrefillChunk& chunk,
                                                     const kernels::VectorWeights* weights,
                                                     kernels::CompressionStats* stats = nullptr);

// The compact cache of consecutive compact chunks (prefix order): per (layer, KV head) the slots
// of every chunk in order, with ln(l) bias and mean values (VECTOR values rebuilt with
// `weights`, which may be null when no slot needs it). next_position as given.
// Errors: INVALID_ARGUMENT (chunks of different shapes, next_position not after the last slot),
// BuildServingHead's errors.
StatusOr<CompactKvCache> CompactFromChunks(std::span<const kernels::CompactChunk> chunks,
                                           const RopeConfig& rope, int next_position,
                                           const kernels::VectorWeights* weights);

// What a continuation from a cache looks like.
struct ContinuationScore {
  std::vector<int32_t> generated;     // greedy continuation after the prompt
  std::vector<int32_t> heldout_top1;  // argmax of the logits predicting each held-out token
  std::vector<float> heldout_logits;  // [heldout.size(), vocab], teacher-forced
  double nll = 0;                     // total over the held-out tokens, nats
  double perplexity = 0;              // exp(nll / heldout.size())
  double first_token_seconds = 0;     // load + tail forward + first argmax
  double decode_tokens_per_s = 0;     // greedy decode rate after the first token
};

// Continues from a cache twice: `load` puts the session in the cache's state (e.g. LoadDense /
// LoadCompact); then (a) `tail` (the prompt's tokens the cache does not hold, may be empty) plus
// `heldout` teacher-forced: perplexity and top-1 of every held-out token; (b) again from `load`:
// `tail` then `generate` greedy tokens. INVALID_ARGUMENT when heldout is empty, or when tail is
// empty and the cache gives no logits (then the first held-out token has nothing predicting it:
// pass the prompt's last token in tail by holding it out of the cache).
StatusOr<ContinuationScore> ScoreContinuation(const LlamaModel& model, SessionOptions session,
                                              const std::function<Status(LlamaSession&)>& load,
                                              std::span<const int32_t> tail,
                                              std::span<const int32_t> heldout, int generate);

// Fraction of positions where a and b agree (equal sizes; 0 for empty).
double Agreement(std::span<const int32_t> a, std::span<const int32_t> b);

}  // namespace kvd::llama
