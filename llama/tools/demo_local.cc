// kvd-demo local: the full cache against the chunk-wise compressed one, in one process.
#include <cstdio>
#include <span>

#include "demo.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/stages.h"

namespace kvd::demo {
namespace {

// The daemon's {stages: [SCORE, quantize], quant_format: QUANT} (or {stages: [SCORE]} for
// --quant none), with its default groups: keys per channel over 64 slots, values per slot over
// 64 channels.
kernels::CompressionPlanOptions LocalPlan(const Flags& f, int window) {
  kernels::CompressionPlanOptions plan;
  plan.score = static_cast<kernels::ScoreStage>(
      kernels::StageRegistry::Global().Find(f.score)->code);  // a --score choice
  plan.p_c = f.p_c;
  plan.window = window;
  if (f.quant != "none") {
    plan.quant = {
        .format = f.quant == "int4" ? kernels::QuantFormat::kInt4 : kernels::QuantFormat::kInt8,
        .key_group = 64,
        .value_group = 64};
  }
  return plan;
}

// The prefilled chunks, each compressed and encoded as kvd stores it.
struct CompressedChunks {
  std::vector<kernels::CompactChunk> compact;
  std::vector<llama::RawChunkView> raw_views;  // into the prefill's chunks
  uint64_t raw_bytes = 0, stored_bytes = 0;
};

StatusOr<CompressedChunks> CompressChunks(const kernels::CompressionPlanOptions& plan,
                                          const ModelLayout& layout,
                                          const std::vector<llama::PrefillChunk>& chunks) {
  CompressedChunks out;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const llama::PrefillChunk& c = chunks[i];
    const std::string at = "chunk " + std::to_string(i);
    const auto t0 = std::chrono::steady_clock::now();
    auto cc = llama::CompressPrefillChunk(plan, layout, c, nullptr);
    const double dt = Since(t0);
    if (!cc.ok()) return cc.status().WithContext("compress " + at);
    auto bytes = kernels::EncodeCompactChunk(*cc);
    if (!bytes.ok()) return bytes.status().WithContext("encode " + at);
    std::printf("[demo] chunk %zu: raw %zu B -> compact %zu B (%.4f), compress %.1f ms\n", i,
                c.raw.size(), bytes->size(),
                static_cast<double>(bytes->size()) / static_cast<double>(c.raw.size()), dt * 1e3);
    out.raw_bytes += c.raw.size();
    out.stored_bytes += bytes->size();
    out.compact.push_back(std::move(*cc));
    out.raw_views.push_back({c.tokens, c.raw});
  }
  return out;
}

// Scores the continuation from the full cache (the raw chunks the compressed path started from)
// and from the compressed one, writes the logits files, prints both and the `kvd-demo:` line.
int ScoreBoth(const Flags& f, const Setup& s, const ModelLayout& layout,
              const CompressedChunks& chunks, size_t cached) {
  auto dense = llama::DenseFromRawChunks(layout, chunks.raw_views);
  if (!dense.ok()) return Fail("dense cache", dense.status());
  auto comp_cache =
      llama::CompactFromChunks(chunks.compact, layout.rope, static_cast<int>(cached), nullptr);
  if (!comp_cache.ok()) return Fail("compact cache", comp_cache.status());
  const std::span<const int32_t> tail = std::span<const int32_t>(s.text.prompt).subspan(cached);
  auto full = llama::ScoreContinuation(
      *s.model, {.threads = s.threads}, [&](llama::LlamaSession& x) { return x.LoadDense(*dense); },
      tail, s.text.heldout, s.generate);
  if (!full.ok()) return Fail("full cache", full.status());
  auto comp = llama::ScoreContinuation(
      *s.model, {.threads = s.threads},
      [&](llama::LlamaSession& x) { return x.LoadCompact(*comp_cache); }, tail, s.text.heldout,
      s.generate);
  if (!comp.ok()) return Fail("compressed cache", comp.status());
  if (Status w = WriteLogits(s.logits_out, comp->heldout_logits); !w.ok()) {
    return Fail("--logits-out", w);
  }
  if (Status w = WriteLogits(f.full_logits_out, full->heldout_logits); !w.ok()) {
    return Fail("--full-logits-out", w);
  }
  const llama::Tokenizer* tok = s.model->tokenizer();
  PrintScore("full cache", *full, tok);
  PrintScore("compressed cache", *comp, tok);
  PrintLine(f.model, f.p_c, chunks.raw_bytes, chunks.stored_bytes, *full, *comp);
  return 0;
}

}  // namespace

int RunLocal(const Flags& f) {
  auto setup = Load(f);
  if (!setup.ok()) return Fail("setup", setup.status());
  Setup& s = *setup;
  ModelLayout layout = s.model->config().ToModelLayout();
  layout.dtype = DType::kBFloat16;  // as kvd's topology registers the model
  const kernels::CompressionPlanOptions plan = LocalPlan(f, s.window);
  if (Status v = plan.Validate(); !v.ok()) return Fail("--p-c / --window", v);

  const int chunks = CachedChunks(s);
  std::span<const int32_t> prompt(s.text.prompt);
  const size_t cached = static_cast<size_t>(chunks) * s.chunk_tokens;
  std::printf(
      "[demo] local: prompt %zu tokens (%d chunks of %d in the cache, %zu after), held-out %zu\n",
      prompt.size(), chunks, s.chunk_tokens, prompt.size() - cached, s.text.heldout.size());
  llama::LlamaSession ses(*s.model, {.threads = s.threads});
  auto pre = llama::PrefillChunks(ses, prompt.first(cached), layout,
                                  {.chunk_tokens = s.chunk_tokens, .window = s.window});
  if (!pre.ok()) return Fail("prefill", pre.status());
  std::printf("[demo] prefill: %zu tokens in %.3f s\n", cached, pre->seconds);
  auto compressed = CompressChunks(plan, layout, pre->chunks);
  if (!compressed.ok()) return Fail("local", compressed.status());
  return ScoreBoth(f, s, layout, *compressed, cached);
}

}  // namespace kvd::demo
