// kvd-demo prefill and decode: the reference engine's prompt through kvd.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>

#include "demo.h"
#include "kvd/client/expand.h"
#include "kvd/common/dtype.h"

namespace kvd::demo {
namespace {

// Puts one prefilled chunk (with its window queries when kvd compresses) and prints what kvd
// stored.
Status PutPrefillChunk(client::Client& c, const llama::PrefillChunk& ch, const Hash128& hash,
                       size_t index, bool compressed) {
  client::PutItem item{.hash = hash,
                       .tokens = ch.tokens,
                       .data = ch.raw.data(),
                       .bytes = ch.raw.size(),
                       .first_position = static_cast<uint64_t>(ch.first_position)};
  if (compressed) {
    item.window = ch.window;
    item.window_queries = ch.window_queries;
  }
  const auto t0 = std::chrono::steady_clock::now();
  KVD_ASSIGN_OR_RETURN(auto put, c.PutChunks(std::span<const client::PutItem>(&item, 1)));
  const client::PutResult& r = put.front();
  std::printf("[prefill] chunk %zu: put %zu B raw%s in %.2f ms%s, kvd stored %llu B\n", index,
              ch.raw.size(),
              compressed ? (" + " + std::to_string(ch.window_queries.size() * 4) +
                            " B window queries (compressed by kvd before the ack)")
                               .c_str()
                         : "",
              Since(t0) * 1e3, r.already_stored ? " (already stored)" : "",
              static_cast<unsigned long long>(r.stored_bytes));
  return Status::Ok();
}

// The compact cache from compact chunks through the client's expansion library (expand.h):
// per layer and chunk, CompactLayer into per-head slot buffers, appended in chunk order.
StatusOr<llama::CompactKvCache> CacheFromCompact(client::Client& c, const ModelLayout& layout,
                                                 const std::vector<std::vector<uint8_t>>& bytes,
                                                 int next_position) {
  using client::CompactChunkReader;
  std::vector<std::unique_ptr<CompactChunkReader>> readers;
  for (const auto& b : bytes) {
    KVD_ASSIGN_OR_RETURN(auto r, CompactChunkReader::Open(b, layout));
    if (const uint64_t v = r->required_weights_version(); v != 0) {
      KVD_ASSIGN_OR_RETURN(auto w, c.GetVectorWeights(v));
      KVD_RETURN_IF_ERROR(r->SetWeights(*w));
    }
    readers.push_back(std::move(r));
  }
  const int L = layout.num_layers, H = layout.num_kv_heads, d = layout.head_dim;
  llama::CompactKvCache cache;
  cache.next_position = next_position;
  cache.layers.assign(L, std::vector<llama::CompactHeadKv>(H));
  for (int l = 0; l < L; ++l) {
    for (const auto& r : readers) {
      std::vector<client::CompactHeadOut> outs(H);
      for (int h = 0; h < H; ++h) {
        llama::CompactHeadKv& dst = cache.layers[l][h];
        const int64_t S = r->Slots(l, h);
        const size_t at = static_cast<size_t>(dst.num_slots);
        dst.num_slots += static_cast<int>(S);
        dst.k.resize((at + S) * d);
        dst.v.resize((at + S) * d);
        dst.bias.resize(at + S);
        outs[h] = {.keys = dst.k.data() + at * d,
                   .values = dst.v.data() + at * d,
                   .bias = dst.bias.data() + at,
                   .capacity_slots = S};
      }
      KVD_RETURN_IF_ERROR(r->CompactLayer(l, outs));
    }
  }
  return cache;
}

// The full cache: one forward pass over the prompt's cached part in this process, its K/V
// rounded to the layout's dtype (what kvd would hold raw). *prefill_s = that forward pass.
StatusOr<llama::ContinuationScore> FullBaseline(const Setup& s, const ModelLayout& layout,
                                                int chunks, double* prefill_s) {
  const size_t cached = static_cast<size_t>(chunks) * s.chunk_tokens;
  std::span<const int32_t> prompt(s.text.prompt);
  llama::LlamaSession prefill(*s.model, {.threads = s.threads});
  const auto t0 = std::chrono::steady_clock::now();
  if (cached > 0) KVD_RETURN_IF_ERROR(prefill.Forward(prompt.first(cached)).status());
  *prefill_s = Since(t0);
  KVD_ASSIGN_OR_RETURN(llama::DenseKvCache dense, prefill.ExportDense());
  const size_t elem = DTypeSize(layout.dtype);
  std::vector<uint8_t> tmp;
  for (llama::DenseLayerKv& l : dense.layers) {
    for (std::vector<float>* x : {&l.k, &l.v}) {
      tmp.resize(x->size() * elem);
      ConvertFromFloat(layout.dtype, x->data(), tmp.data(), x->size());
      ConvertToFloat(layout.dtype, tmp.data(), x->data(), x->size());
    }
  }
  return llama::ScoreContinuation(
      *s.model, {.threads = s.threads},
      [&](llama::LlamaSession& ses) { return ses.LoadDense(dense); }, prompt.subspan(cached),
      s.text.heldout, s.generate);
}

// p_c of a policy's canonical form ("v1 score=snapkv ... p_c=0.5 ..."); 0 when absent.
double PolicyRatio(const std::string& policy) {
  const size_t at = policy.find(" p_c=");
  return at == std::string::npos ? 0.0 : std::strtod(policy.c_str() + at + 5, nullptr);
}

// What a decode took from kvd: the prompt's leading chunks as stored, and the times it took.
struct FetchedPrompt {
  std::vector<std::vector<uint8_t>> bytes;  // one per chunk, raw or compact
  uint64_t total_bytes = 0;
  double lookup_s = 0, get_s = 0;
};

// Looks the prompt's full chunks up and gets the matched prefix (NOT_FOUND when kvd holds none).
StatusOr<FetchedPrompt> FetchPrompt(client::Client& c, const Setup& s) {
  const int want = CachedChunks(s);
  std::span<const int32_t> prompt(s.text.prompt);
  FetchedPrompt out;
  const auto t_lookup = std::chrono::steady_clock::now();
  const std::vector<Hash128> chain =
      c.hasher().ChunkChain(prompt.first(static_cast<size_t>(want) * s.chunk_tokens), false);
  KVD_ASSIGN_OR_RETURN(auto hit, c.Lookup(chain));
  out.lookup_s = Since(t_lookup);
  const int n = static_cast<int>(std::min<uint32_t>(hit.matched_chunks, want));
  std::printf("[decode] lookup: %u of %d chunks of the prompt in kvd (%.2f ms)\n",
              hit.matched_chunks, want, out.lookup_s * 1e3);
  if (n == 0) {
    return Status::NotFound(
        "the prompt's first chunk is not in kvd (run `kvd-demo prefill` with the same text "
        "first)");
  }
  const ModelLayout& layout = c.options().layout;
  const size_t capacity = c.session().codec_id != 0
                              ? client::MaxCompactChunkBytes(layout, s.chunk_tokens)
                              : layout.ChunkBytes(s.chunk_tokens);
  out.bytes.resize(n);
  for (int i = 0; i < n; ++i) {
    std::vector<uint8_t>& b = out.bytes[i];
    b.resize(capacity);
    const auto t0 = std::chrono::steady_clock::now();
    auto got = c.Get(hit.lease_id, static_cast<uint32_t>(i), b.data(), b.size());
    const double dt = Since(t0);
    if (!got.ok()) return got.status().WithContext("get chunk " + std::to_string(i));
    out.get_s += dt;
    out.total_bytes += got->bytes;
    b.resize(got->bytes);
    std::printf("[decode] chunk %d: get %llu B (%s) in %.2f ms\n", i,
                static_cast<unsigned long long>(got->bytes),
                got->form == client::ChunkForm::kCompact ? "compact" : "raw", dt * 1e3);
  }
  (void)c.ReleaseLease(hit.lease_id);
  return out;
}

// The engine's cache from the fetched chunks: compact chunks expanded into the bias form, raw
// ones as the dense cache.
struct ServedCache {
  std::optional<llama::DenseKvCache> dense;
  std::optional<llama::CompactKvCache> compact;
  Status Load(llama::LlamaSession& x) const {
    return compact ? x.LoadCompact(*compact) : x.LoadDense(*dense);
  }
};

StatusOr<ServedCache> BuildCache(client::Client& c, const Setup& s, const FetchedPrompt& got,
                                 size_t cached) {
  ServedCache cache;
  const ModelLayout& layout = c.options().layout;
  if (c.session().codec_id != 0) {
    KVD_ASSIGN_OR_RETURN(cache.compact,
                         CacheFromCompact(c, layout, got.bytes, static_cast<int>(cached)));
    return cache;
  }
  std::vector<llama::RawChunkView> views;
  for (const auto& b : got.bytes) views.push_back({s.chunk_tokens, b});
  KVD_ASSIGN_OR_RETURN(cache.dense, llama::DenseFromRawChunks(layout, views));
  return cache;
}

// --baseline: the full cache from a local prefill, the times to first token and top-1
// agreement; for compact chunks the `kvd-demo:` line.
int ReportBaseline(client::Client& c, const Setup& s, const FetchedPrompt& got,
                   const llama::ContinuationScore& served, double ttft) {
  const ModelLayout& layout = c.options().layout;
  const int n = static_cast<int>(got.bytes.size());
  double prefill_s = 0;
  auto full = FullBaseline(s, layout, n, &prefill_s);
  if (!full.ok()) return Fail("baseline", full.status());
  PrintScore("local prefill (full cache)", *full, s.model->tokenizer());
  std::printf("[decode] time to first token: %.3f s from kvd, %.3f s with a local prefill\n", ttft,
              prefill_s + full->first_token_seconds);
  std::printf("[decode] top-1 agreement kvd cache vs full cache: %.4f\n",
              llama::Agreement(full->heldout_top1, served.heldout_top1));
  if (c.session().codec_id != 0) {
    PrintLine(c.options().model, PolicyRatio(c.session().policy),
              static_cast<uint64_t>(n) * layout.ChunkBytes(s.chunk_tokens), got.total_bytes, *full,
              served);
  }
  return 0;
}

}  // namespace

int RunPrefill(const Flags& f) {
  Setup s;
  std::unique_ptr<client::Client> client;
  if (int rc = LoadAndConnect(f, &s, &client); rc != 0) return rc;
  client::Client& c = *client;
  const ModelLayout& layout = c.options().layout;
  std::span<const int32_t> prompt(s.text.prompt);
  std::printf("[prefill] kvd %s at %s, model %s (%s), chunks of %d tokens\n",
              c.session().daemon_version.c_str(), c.options().address.c_str(),
              c.options().model.c_str(), layout.ToString().c_str(), s.chunk_tokens);
  // Under a policy the daemon says how many window queries a put carries.
  if (c.session().codec_id != 0 && c.session().window_tokens > 0) {
    s.window = static_cast<int>(c.session().window_tokens);
  }
  llama::LlamaSession ses(*s.model, {.threads = s.threads});
  auto pre = llama::PrefillChunks(ses, prompt, layout,
                                  {.chunk_tokens = s.chunk_tokens, .window = s.window});
  if (!pre.ok()) return Fail("prefill", pre.status());
  std::printf("[prefill] %zu prompt tokens in %.3f s: %zu full chunks\n", prompt.size(),
              pre->seconds, pre->chunks.size());
  const std::vector<Hash128> chain = c.hasher().ChunkChain(prompt, false);
  const bool compressed = c.session().codec_id != 0;
  if (compressed) {
    std::printf("[prefill] kvd compresses this model's chunks at ingest (codec %08x: %s)\n",
                c.session().codec_id, c.session().policy.c_str());
  }
  for (size_t i = 0; i < pre->chunks.size(); ++i) {
    if (Status put = PutPrefillChunk(c, pre->chunks[i], chain[i], i, compressed); !put.ok()) {
      return Fail("put chunk " + std::to_string(i), put);
    }
  }
  return 0;
}

int RunDecode(const Flags& f) {
  Setup s;
  std::unique_ptr<client::Client> client;
  if (int rc = LoadAndConnect(f, &s, &client); rc != 0) return rc;
  client::Client& c = *client;
  auto got = FetchPrompt(c, s);
  if (!got.ok()) {
    return Fail(got.status().code() == StatusCode::kNotFound ? "lookup" : "fetch", got.status());
  }
  const int n = static_cast<int>(got->bytes.size());
  const size_t cached = static_cast<size_t>(n) * s.chunk_tokens;
  const auto t_build = std::chrono::steady_clock::now();
  auto cache = BuildCache(c, s, *got, cached);
  if (!cache.ok()) return Fail("cache from kvd chunks", cache.status());
  const double build_s = Since(t_build);
  const bool compressed = c.session().codec_id != 0;
  std::printf("[decode] cache of %zu tokens from kvd: get %.2f ms, %s %.2f ms per chunk\n", cached,
              got->get_s * 1e3 / n, compressed ? "expand" : "build", build_s * 1e3 / n);
  auto served = llama::ScoreContinuation(
      *s.model, {.threads = s.threads}, [&](llama::LlamaSession& x) { return cache->Load(x); },
      std::span<const int32_t>(s.text.prompt).subspan(cached), s.text.heldout, s.generate);
  if (!served.ok()) return Fail("decode from the kvd cache", served.status());
  if (Status w = WriteLogits(s.logits_out, served->heldout_logits); !w.ok()) {
    return Fail("--logits-out", w);
  }
  PrintScore("kvd cache", *served, s.model->tokenizer());
  const double ttft = got->lookup_s + got->get_s + build_s + served->first_token_seconds;
  return f.baseline ? ReportBaseline(c, s, *got, *served, ttft) : 0;
}

}  // namespace kvd::demo
