#include "kvd/llama/disagg.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "kvd/common/dtype.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/serving.h"

namespace kvd::llama {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status CheckLayout(const ModelLayout& layout, const LlamaConfig& cfg) {
  KVD_RETURN_IF_ERROR(layout.Validate());
  if (layout.num_layers != cfg.num_layers || layout.num_kv_heads != cfg.num_kv_heads ||
      layout.num_q_heads != cfg.num_q_heads || layout.head_dim != cfg.head_dim) {
    return Status::InvalidArgument("layout " + layout.ToString() +
                                   " does not describe the model (" + cfg.ToString() + ")");
  }
  return Status::Ok();
}

}  // namespace

Status ChunkedPrefillOptions::Validate() const {
  if (chunk_tokens < 1) {
    return Status::InvalidArgument("chunk_tokens must be >= 1, got " +
                                   std::to_string(chunk_tokens));
  }
  if (window < 1 || window > chunk_tokens) {
    return Status::InvalidArgument(
        "window must be in [1, chunk_tokens=" + std::to_string(chunk_tokens) + "], got " +
        std::to_string(window));
  }
  return Status::Ok();
}

StatusOr<ChunkedPrefill> PrefillChunks(LlamaSession& session, std::span<const int32_t> prompt,
                                       const ModelLayout& layout,
                                       const ChunkedPrefillOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  const LlamaConfig& cfg = session.model().config();
  KVD_RETURN_IF_ERROR(CheckLayout(layout, cfg));
  if (session.position() != 0) {
    return Status::InvalidArgument("PrefillChunks needs an empty session, position is " +
                                   std::to_string(session.position()));
  }
  if (prompt.empty()) return Status::InvalidArgument("PrefillChunks needs a non-empty prompt");
  const int C = options.chunk_tokens, W = options.window;
  const int L = cfg.num_layers, H = cfg.num_kv_heads, d = cfg.head_dim;
  const size_t q_layer = static_cast<size_t>(W) * cfg.num_q_heads * d;
  const size_t row = static_cast<size_t>(H) * d;  // floats of one token's K (or V) in a layer
  const size_t elem = DTypeSize(layout.dtype);

  ChunkedPrefill out;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t start = 0; start < prompt.size(); start += C) {
    const size_t n = std::min<size_t>(C, prompt.size() - start);
    const bool full = n == static_cast<size_t>(C);
    KVD_ASSIGN_OR_RETURN(out.last_logits, session.Forward(prompt.subspan(start, n),
                                                          {.capture_queries = full ? W : 0}));
    if (!full) break;
    PrefillChunk c;
    c.first_position = static_cast<int64_t>(start);
    c.tokens = C;
    c.window = W;
    c.raw.resize(layout.ChunkBytes(C));
    c.window_queries.resize(q_layer * L);
    for (int l = 0; l < L; ++l) {
      // The session's cache holds positions [0, start + C): this chunk's rows are the last C.
      const std::vector<float> k = session.LayerKeys(l);
      const std::vector<float> v = session.LayerValues(l);
      const size_t first = start * row;
      uint8_t* dst = c.raw.data() + layout.LayerOffset(l, C);
      ConvertFromFloat(layout.dtype, k.data() + first, dst, C * row);
      ConvertFromFloat(layout.dtype, v.data() + first, dst + C * row * elem, C * row);
      const std::vector<float>& q = session.captured_queries()[l];
      std::memcpy(c.window_queries.data() + l * q_layer, q.data(), q_layer * sizeof(float));
    }
    out.chunks.push_back(std::move(c));
  }
  out.seconds = Since(t0);
  return out;
}

StatusOr<DenseKvCache> DenseFromRawChunks(const ModelLayout& layout,
                                          std::span<const RawChunkView> chunks) {
  KVD_RETURN_IF_ERROR(layout.Validate());
  const int L = layout.num_layers;
  const size_t row = static_cast<size_t>(layout.num_kv_heads) * layout.head_dim;
  const size_t elem = DTypeSize(layout.dtype);
  DenseKvCache cache;
  cache.layers.resize(L);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const RawChunkView& c = chunks[i];
    if (c.tokens < 1 || c.bytes.size() != layout.ChunkBytes(c.tokens)) {
      return Status::InvalidArgument("chunk " + std::to_string(i) + " has " +
                                     std::to_string(c.bytes.size()) + " bytes for " +
                                     std::to_string(c.tokens) + " tokens; the layout needs " +
                                     std::to_string(layout.ChunkBytes(std::max(c.tokens, 0))));
    }
    const size_t n = static_cast<size_t>(c.tokens) * row;
    for (int l = 0; l < L; ++l) {
      const uint8_t* src = c.bytes.data() + layout.LayerOffset(l, c.tokens);
      DenseLayerKv& dl = cache.layers[l];
      const size_t at = dl.k.size();
      dl.k.resize(at + n);
      dl.v.resize(at + n);
      ConvertToFloat(layout.dtype, src, dl.k.data() + at, n);
      ConvertToFloat(layout.dtype, src + n * elem, dl.v.data() + at, n);
    }
    for (int t = 0; t < c.tokens; ++t) cache.positions.push_back(cache.num_tokens + t);
    cache.num_tokens += c.tokens;
  }
  cache.next_position = cache.num_tokens;
  return cache;
}

StatusOr<kernels::CompactChunk> CompressPrefillChunk(const kernels::CompressionPlanOptions& plan,
                                                     const ModelLayout& layout,
                                                     const PrefillChunk& chunk,
                                                     const kernels::VectorWeights* weights,
                                                     kernels::CompressionStats* stats) {
  const int L = layout.num_layers;
  std::vector<int64_t> positions(chunk.tokens);
  for (int t = 0; t < chunk.tokens; ++t) positions[t] = chunk.first_position + t;
  std::vector<kernels::Matrix> q_store;
  std::vector<kernels::ConstMatrixView> q_views;
  if (!chunk.window_queries.empty()) {
    const size_t q_layer = static_cast<size_t>(chunk.window) * layout.num_q_heads * layout.head_dim;
    if (chunk.window_queries.size() != q_layer * L) {
      return Status::InvalidArgument(
          "window queries hold " + std::to_string(chunk.window_queries.size()) +
          " floats; W=" + std::to_string(chunk.window) + " needs " + std::to_string(q_layer * L));
    }
    // The queries travel as float32 (the engine's capture): gather them with a float32 view of
    // the layout so that no rounding to the KV dtype happens on the way.
    ModelLayout q_layout = layout;
    q_layout.dtype = DType::kFloat32;
    for (int l = 0; l < L; ++l) {
      KVD_ASSIGN_OR_RETURN(std::vector<kernels::Matrix> per_head,
                           kernels::GatherWindowQueries(
                               q_layout, chunk.window_queries.data() + l * q_layer, chunk.window));
      for (auto& m : per_head) q_store.push_back(std::move(m));
    }
    for (const auto& m : q_store) q_views.push_back(m.View());
  }
  kernels::CompressionInput in;
  in.raw = chunk.raw;
  in.positions = positions;
  in.window_queries = q_views;
  in.weights = weights;
  return kernels::Compress(plan, layout, in, stats);
}

StatusOr<CompactKvCache> CompactFromChunks(std::span<const kernels::CompactChunk> chunks,
                                           const RopeConfig& rope, int next_position,
                                           const kernels::VectorWeights* weights) {
  if (chunks.empty()) return Status::InvalidArgument("CompactFromChunks needs at least one chunk");
  const kernels::CompactChunk& first = chunks.front();
  const int L = first.num_layers, H = first.num_kv_heads, d = first.head_dim;
  KVD_ASSIGN_OR_RETURN(kernels::RopeTable table, kernels::RopeTable::Create(rope, d));
  CompactKvCache cache;
  cache.next_position = next_position;
  cache.layers.assign(L, std::vector<CompactHeadKv>(H));
  int64_t last_position = -1;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const kernels::CompactChunk& c = chunks[i];
    if (c.num_layers != L || c.num_kv_heads != H || c.head_dim != d) {
      return Status::InvalidArgument("compact chunk " + std::to_string(i) +
                                     " has another shape than chunk 0");
    }
    for (int l = 0; l < L; ++l) {
      for (int h = 0; h < H; ++h) {
        KVD_ASSIGN_OR_RETURN(kernels::ServingHead sh,
                             kernels::BuildServingHead(c, l, h, &table, weights));
        CompactHeadKv& dst = cache.layers[l][h];
        dst.num_slots += static_cast<int>(sh.keys.rows);
        dst.k.insert(dst.k.end(), sh.keys.values.begin(), sh.keys.values.end());
        dst.v.insert(dst.v.end(), sh.values.values.begin(), sh.values.values.end());
        dst.bias.insert(dst.bias.end(), sh.bias.begin(), sh.bias.end());
        for (int64_t p : sh.positions) last_position = std::max(last_position, p);
      }
    }
  }
  if (next_position <= last_position) {
    return Status::InvalidArgument("next_position " + std::to_string(next_position) +
                                   " is not after the chunks' last slot position " +
                                   std::to_string(last_position));
  }
  return cache;
}

StatusOr<ContinuationScore> ScoreContinuation(const LlamaModel& model, SessionOptions options,
                                              const std::function<Status(LlamaSession&)>& load,
                                              std::span<const int32_t> tail,
                                              std::span<const int32_t> heldout, int generate) {
  if (heldout.empty()) return Status::InvalidArgument("ScoreContinuation needs held-out tokens");
  if (tail.empty()) {
    return Status::InvalidArgument(
        "ScoreContinuation needs at least one prompt token after the cache (the logits that "
        "predict the first held-out token)");
  }
  if (generate < 1) return Status::InvalidArgument("generate must be >= 1");
  const int V = model.config().vocab_size;
  ContinuationScore r;
  LlamaSession s(model, options);

  // (a) teacher-forced: tail + heldout[0 .. n-2]; row tail.size()-1+i predicts heldout[i].
  KVD_RETURN_IF_ERROR(load(s));
  std::vector<int32_t> forced(tail.begin(), tail.end());
  forced.insert(forced.end(), heldout.begin(), heldout.end() - 1);
  KVD_ASSIGN_OR_RETURN(std::vector<float> all, s.Forward(forced, {.all_logits = true}));
  const size_t first_row = tail.size() - 1;
  r.heldout_logits.assign(all.begin() + static_cast<ptrdiff_t>(first_row * V), all.end());
  for (size_t i = 0; i < heldout.size(); ++i) {
    std::span<const float> row(r.heldout_logits.data() + i * V, V);
    r.nll += NegLogLikelihood(row, heldout[i]);
    r.heldout_top1.push_back(Argmax(row));
  }
  r.perplexity = std::exp(r.nll / static_cast<double>(heldout.size()));

  // (b) greedy from the cache.
  const auto t0 = std::chrono::steady_clock::now();
  KVD_RETURN_IF_ERROR(load(s));
  KVD_ASSIGN_OR_RETURN(std::vector<float> logits, s.Forward(tail));
  r.generated.push_back(Argmax(logits));
  r.first_token_seconds = Since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 1; i < generate; ++i) {
    const int32_t next = r.generated.back();
    KVD_ASSIGN_OR_RETURN(logits, s.Forward(std::span<const int32_t>(&next, 1)));
    r.generated.push_back(Argmax(logits));
  }
  const double dt = Since(t1);
  r.decode_tokens_per_s = generate > 1 && dt > 0 ? (generate - 1) / dt : 0.0;
  return r;
}

double Agreement(std::span<const int32_t> a, std::span<const int32_t> b) {
  if (a.empty() || a.size() != b.size()) return 0.0;
  size_t same = 0;
  for (size_t i = 0; i < a.size(); ++i) same += a[i] == b[i] ? 1 : 0;
  return static_cast<double>(same) / static_cast<double>(a.size());
}

}  // namespace kvd::llama
