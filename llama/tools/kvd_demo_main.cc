// kvd-demo: the reference engine as a disaggregated prefill / decode pair through kvd.
//
//   kvd-demo prefill --addr ADDR --model-file GGUF [text options]
//       runs the prompt one chunk per forward pass and puts every full chunk's raw K/V to kvd;
//       when the model has a compression policy in kvd, with the post-RoPE queries of the
//       chunk's own last W tokens and its first position (kvd compresses it before the ack).
//   kvd-demo decode  --addr ADDR --model-file GGUF [text options] [--baseline]
//       looks the prompt up in kvd, gets its chunks (compact ones are expanded into the bias form
//       with kvd/client/expand.h; raw ones are the dense cache), continues: greedy continuation,
//       perplexity and top-1 of a held-out continuation. --baseline: also the full cache from a
//       local prefill (K/V rounded to the model's kvd dtype), the times to first token, and for
//       compact chunks the `kvd-demo:` line.
//   kvd-demo local   --model-file GGUF [text options] [--p-c X] [--score keydiff|snapkv]
//       the same in one process without kvd: the full cache against the cache compressed chunk
//       by chunk (kernels' plan, each chunk with only its own K/V and last-W queries; default
//       KeyDiff eviction, what the embedded default's smollm2-135m policy scores by until kvd
//       has seen 256 window queries per layer).
//   kvd-demo calibrate --addr ADDR --model-file GGUF --model M --from FILE [--token-ids]
//                      [--segment-tokens N] [--threads N] [--namespace NS]
//       feeds a corpus through the engine and puts its raw chunks (with window queries) to kvd
//       until kvd's online VECTOR calibration of model M completes (kvdctl calibrate runs this).
//       FILE is text (the GGUF's tokenizer), or with --token-ids whitespace-separated token ids
//       (models without a tokenizer). It is cut into prompts of --segment-tokens (default 4
//       chunks, at most the model's context), each prefilled from position 0. The chunks are put
//       in namespace NS (default "kvd-calibrate") under hashes salted per run, so none dedups
//       against an earlier put (every put feeds calibration), and evicted at the end (admin
//       role; else the command to evict them is printed). Already calibrated: prints the table,
//       exit 0. The corpus ends first: exit 1 naming the tokens seen and needed.
//
// Text options: --text FILE (default deploy/demo/text.txt), --prompt-tokens N (default 808),
// --heldout N (default 128), --generate N (default 24), --chunk-tokens N (default 256; prefill
// and decode take the daemon's), --window W (default 32), --threads N (default all cores),
// --model M (kvd model name, default smollm2-135m), --logits-out FILE (decode / local: the
// held-out logits of the kvd / compressed cache as raw float32, for tests), --full-logits-out
// FILE (local: those of the full cache). Prefill, decode and calibrate also take kvd-bench's
// connection options (--addr, --ucx-tls, --net-devices, --namespace, --hash-seed, --client-id,
// --timeout-ms). `kvd-demo MODE --help` lists a mode's options (CLI11, kvd/common/cli.h).
//
// Exit codes: 0 ok, 1 failure (the message says where), 2 usage, 3 kvd cannot be reached.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/client/expand.h"
#include "kvd/common/cli.h"
#include "kvd/common/dtype.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/stages.h"
#include "kvd/llama/disagg.h"
#include "kvd/llama/model.h"
#include "kvd/llama/tokenizer.h"
#include "util.h"

namespace {

using kvd::Status;
using kvd::StatusOr;
namespace llama = kvd::llama;

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

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Text {
  std::vector<int32_t> prompt;
  std::vector<int32_t> heldout;
};

struct Setup {
  std::unique_ptr<llama::LlamaModel> model;
  Text text;
  int generate = 24;
  int threads = 0;
  int window = 32;
  int chunk_tokens = 256;
  std::string logits_out;
};

int Fail(const std::string& where, const Status& s) {
  std::cerr << "kvd-demo: " << where << ": " << s << "\n";
  return s.code() == kvd::StatusCode::kUnavailable ? 3 : 1;
}

std::string Quote(const llama::Tokenizer* tok, const std::vector<int32_t>& ids) {
  if (tok == nullptr) return "(no tokenizer)";
  auto s = tok->Decode(ids);
  if (!s.ok()) return "(" + s.status().ToString() + ")";
  std::string out;
  for (char c : *s) out += c == '\n' ? ' ' : c;
  return "\"" + out + "\"";
}

// The model and the tokenised text: prompt = the first --prompt-tokens ids, held-out = the next
// --heldout.
StatusOr<Setup> Load(const Flags& f) {
  Setup s;
  const std::string& path = f.model_file;
  KVD_ASSIGN_OR_RETURN(s.model, llama::LlamaModel::Load(path));
  const llama::Tokenizer* tok = s.model->tokenizer();
  if (tok == nullptr) return Status::InvalidArgument(path + " has no tokenizer (needs a GGUF)");
  const std::string& text_path = f.text;
  std::ifstream in(text_path, std::ios::binary);
  if (!in) return Status::NotFound("cannot read the text file " + text_path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::vector<int32_t> ids = tok->Encode(ss.str());
  const int64_t p = f.prompt_tokens, h = f.heldout;  // ranges checked by the command line
  s.generate = f.generate;
  s.threads = f.threads;
  s.window = f.window;
  s.chunk_tokens = f.chunk_tokens;
  s.logits_out = f.logits_out;
  if (p + h > static_cast<int64_t>(ids.size())) {
    return Status::InvalidArgument(text_path + " has " + std::to_string(ids.size()) +
                                   " tokens; --prompt-tokens " + std::to_string(p) +
                                   " + --heldout " + std::to_string(h) + " need more");
  }
  s.text.prompt.assign(ids.begin(), ids.begin() + p);
  s.text.heldout.assign(ids.begin() + p, ids.begin() + p + h);
  return s;
}

// Chunks a decode takes from the cache: the prompt's full chunks, leaving at least one prompt
// token to run (its logits predict the first held-out token).
int CachedChunks(const Setup& s) {
  return static_cast<int>((s.text.prompt.size() - 1) / s.chunk_tokens);
}

Status WriteLogits(const std::string& path, const std::vector<float>& logits) {
  if (path.empty()) return Status::Ok();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(logits.data()),
            static_cast<std::streamsize>(logits.size() * sizeof(float)));
  if (!out) return Status::Internal("cannot write " + path);
  return Status::Ok();
}

void PrintScore(const char* name, const llama::ContinuationScore& r, const llama::Tokenizer* tok) {
  std::printf("[demo] %s: ppl=%.4f first_token=%.3f s decode=%.1f tok/s\n", name, r.perplexity,
              r.first_token_seconds, r.decode_tokens_per_s);
  std::printf("[demo] %s continuation: %s\n", name, Quote(tok, r.generated).c_str());
}

void PrintLine(const std::string& model, double p_c, uint64_t raw, uint64_t stored,
               const llama::ContinuationScore& full, const llama::ContinuationScore& comp) {
  std::printf(
      "kvd-demo: model=%s p_c=%.2f raw_bytes=%llu stored_bytes=%llu ppl_full=%.4f "
      "ppl_compressed=%.4f top1_agree=%.4f\n",
      model.c_str(), p_c, static_cast<unsigned long long>(raw),
      static_cast<unsigned long long>(stored), full.perplexity, comp.perplexity,
      llama::Agreement(full.heldout_top1, comp.heldout_top1));
}

// The full cache: one forward pass over the prompt's cached part in this process, its K/V
// rounded to the layout's dtype (what kvd would hold raw). *prefill_s = that forward pass.
StatusOr<llama::ContinuationScore> FullBaseline(const Setup& s, const kvd::ModelLayout& layout,
                                                int chunks, double* prefill_s) {
  const size_t cached = static_cast<size_t>(chunks) * s.chunk_tokens;
  std::span<const int32_t> prompt(s.text.prompt);
  llama::LlamaSession prefill(*s.model, {.threads = s.threads});
  const auto t0 = std::chrono::steady_clock::now();
  if (cached > 0) KVD_RETURN_IF_ERROR(prefill.Forward(prompt.first(cached)).status());
  *prefill_s = Since(t0);
  KVD_ASSIGN_OR_RETURN(llama::DenseKvCache dense, prefill.ExportDense());
  const size_t elem = kvd::DTypeSize(layout.dtype);
  std::vector<uint8_t> tmp;
  for (llama::DenseLayerKv& l : dense.layers) {
    for (std::vector<float>* x : {&l.k, &l.v}) {
      tmp.resize(x->size() * elem);
      kvd::ConvertFromFloat(layout.dtype, x->data(), tmp.data(), x->size());
      kvd::ConvertToFloat(layout.dtype, tmp.data(), x->data(), x->size());
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

// ---- local: in-process compression ----
int RunLocal(const Flags& f) {
  auto setup = Load(f);
  if (!setup.ok()) return Fail("setup", setup.status());
  Setup& s = *setup;
  const double p_c = f.p_c;
  const std::string& model_name = f.model;
  kvd::ModelLayout layout = s.model->config().ToModelLayout();
  layout.dtype = kvd::DType::kBFloat16;  // as kvd's topology registers the model
  // The daemon's {stages: [SCORE, quantize], quant_format: QUANT} (or {stages: [SCORE]} for
  // --quant none), with its default groups: keys per channel over 64 slots, values per slot over
  // 64 channels.
  kvd::kernels::CompressionPlanOptions plan;
  plan.score = static_cast<kvd::kernels::ScoreStage>(
      kvd::kernels::StageRegistry::Global().Find(f.score)->code);  // a --score choice
  plan.p_c = p_c;
  plan.window = s.window;
  if (f.quant != "none") {
    plan.quant = {.format = f.quant == "int4" ? kvd::kernels::QuantFormat::kInt4
                                              : kvd::kernels::QuantFormat::kInt8,
                  .key_group = 64,
                  .value_group = 64};
  }
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

  std::vector<kvd::kernels::CompactChunk> compact;
  std::vector<llama::RawChunkView> raw_views;
  uint64_t raw_bytes = 0, stored_bytes = 0;
  for (size_t i = 0; i < pre->chunks.size(); ++i) {
    const llama::PrefillChunk& c = pre->chunks[i];
    const auto t0 = std::chrono::steady_clock::now();
    auto cc = llama::CompressPrefillChunk(plan, layout, c, nullptr);
    const double dt = Since(t0);
    if (!cc.ok()) return Fail("compress chunk " + std::to_string(i), cc.status());
    auto bytes = kvd::kernels::EncodeCompactChunk(*cc);
    if (!bytes.ok()) return Fail("encode chunk " + std::to_string(i), bytes.status());
    std::printf("[demo] chunk %zu: raw %zu B -> compact %zu B (%.4f), compress %.1f ms\n", i,
                c.raw.size(), bytes->size(),
                static_cast<double>(bytes->size()) / static_cast<double>(c.raw.size()), dt * 1e3);
    raw_bytes += c.raw.size();
    stored_bytes += bytes->size();
    compact.push_back(std::move(*cc));
    raw_views.push_back({c.tokens, c.raw});
  }
  // Full: the same raw chunks (layout dtype) the compressed path started from.
  auto dense = llama::DenseFromRawChunks(layout, raw_views);
  if (!dense.ok()) return Fail("dense cache", dense.status());
  auto comp_cache =
      llama::CompactFromChunks(compact, layout.rope, static_cast<int>(cached), nullptr);
  if (!comp_cache.ok()) return Fail("compact cache", comp_cache.status());
  const std::span<const int32_t> tail = prompt.subspan(cached);
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
  PrintLine(model_name, p_c, raw_bytes, stored_bytes, *full, *comp);
  return 0;
}

// ---- prefill / decode through kvd ----

// Connects as an engine for --model with the daemon's layout and chunk size, in namespace
// --namespace (else `default_namespace`; "" = the daemon's default).
StatusOr<std::unique_ptr<kvd::client::Client>> ConnectEngine(
    const Flags& f, Setup* s, const std::string& default_namespace = "") {
  kvd::client::ClientOptions o;
  o.name_space = default_namespace;
  kvd::tools::ApplyConnectionFlags(f.connection, &o);
  o.model = f.model;
  uint32_t chunk_tokens = 0;
  KVD_ASSIGN_OR_RETURN(kvd::client::ModelInfo info,
                       kvd::tools::FindModel(o, o.model, &chunk_tokens));
  o.layout = info.layout;
  o.chunk_tokens = static_cast<int>(chunk_tokens);
  o.block_tokens = std::gcd(16, o.chunk_tokens);
  s->chunk_tokens = o.chunk_tokens;
  return kvd::client::Client::Connect(o);
}

int RunPrefill(const Flags& f) {
  auto setup = Load(f);
  if (!setup.ok()) return Fail("setup", setup.status());
  Setup& s = *setup;
  auto client = ConnectEngine(f, &s);
  if (!client.ok()) return Fail("connect", client.status());
  kvd::client::Client& c = **client;
  const kvd::ModelLayout& layout = c.options().layout;
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
  const std::vector<kvd::Hash128> chain = c.hasher().ChunkChain(prompt, false);
  const bool compressed = c.session().codec_id != 0;
  if (compressed) {
    std::printf("[prefill] kvd compresses this model's chunks at ingest (codec %08x: %s)\n",
                c.session().codec_id, c.session().policy.c_str());
  }
  for (size_t i = 0; i < pre->chunks.size(); ++i) {
    const llama::PrefillChunk& ch = pre->chunks[i];
    kvd::client::PutItem item{.hash = chain[i],
                              .tokens = ch.tokens,
                              .data = ch.raw.data(),
                              .bytes = ch.raw.size(),
                              .first_position = static_cast<uint64_t>(ch.first_position)};
    if (compressed) {
      item.window = ch.window;
      item.window_queries = ch.window_queries;
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto put = c.PutChunks(std::span<const kvd::client::PutItem>(&item, 1));
    if (!put.ok()) return Fail("put chunk " + std::to_string(i), put.status());
    const kvd::client::PutResult& r = put->front();
    std::printf("[prefill] chunk %zu: put %zu B raw%s in %.2f ms%s, kvd stored %llu B\n", i,
                ch.raw.size(),
                compressed ? (" + " + std::to_string(ch.window_queries.size() * 4) +
                              " B window queries (compressed by kvd before the ack)")
                                 .c_str()
                           : "",
                Since(t0) * 1e3, r.already_stored ? " (already stored)" : "",
                static_cast<unsigned long long>(r.stored_bytes));
  }
  return 0;
}

// The compact cache from compact chunks through the client's expansion library (expand.h):
// per layer and chunk, CompactLayer into per-head slot buffers, appended in chunk order.
StatusOr<llama::CompactKvCache> CacheFromCompact(kvd::client::Client& c,
                                                 const kvd::ModelLayout& layout,
                                                 const std::vector<std::vector<uint8_t>>& bytes,
                                                 int next_position) {
  using kvd::client::CompactChunkReader;
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
      std::vector<kvd::client::CompactHeadOut> outs(H);
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

int RunDecode(const Flags& f) {
  auto setup = Load(f);
  if (!setup.ok()) return Fail("setup", setup.status());
  Setup& s = *setup;
  auto client = ConnectEngine(f, &s);
  if (!client.ok()) return Fail("connect", client.status());
  kvd::client::Client& c = **client;
  const kvd::ModelLayout& layout = c.options().layout;
  const int want = CachedChunks(s);
  std::span<const int32_t> prompt(s.text.prompt);
  const auto t_lookup = std::chrono::steady_clock::now();
  const std::vector<kvd::Hash128> chain =
      c.hasher().ChunkChain(prompt.first(static_cast<size_t>(want) * s.chunk_tokens), false);
  auto hit = c.Lookup(chain);
  if (!hit.ok()) return Fail("lookup", hit.status());
  const double lookup_s = Since(t_lookup);
  const int n = static_cast<int>(std::min<uint32_t>(hit->matched_chunks, want));
  std::printf("[decode] lookup: %u of %d chunks of the prompt in kvd (%.2f ms)\n",
              hit->matched_chunks, want, lookup_s * 1e3);
  if (n == 0) {
    return Fail("lookup", Status::NotFound("the prompt's first chunk is not in kvd (run "
                                           "`kvd-demo prefill` with the same text first)"));
  }
  const bool compressed = c.session().codec_id != 0;
  const size_t capacity = compressed ? kvd::client::MaxCompactChunkBytes(layout, s.chunk_tokens)
                                     : layout.ChunkBytes(s.chunk_tokens);
  std::vector<std::vector<uint8_t>> bytes(n);
  std::vector<llama::RawChunkView> views;
  uint64_t got_bytes = 0;
  double get_s = 0;
  for (int i = 0; i < n; ++i) {
    bytes[i].resize(capacity);
    const auto t0 = std::chrono::steady_clock::now();
    auto got = c.Get(hit->lease_id, static_cast<uint32_t>(i), bytes[i].data(), bytes[i].size());
    const double dt = Since(t0);
    if (!got.ok()) return Fail("get chunk " + std::to_string(i), got.status());
    get_s += dt;
    got_bytes += got->bytes;
    bytes[i].resize(got->bytes);
    std::printf("[decode] chunk %d: get %llu B (%s) in %.2f ms\n", i,
                static_cast<unsigned long long>(got->bytes),
                got->form == kvd::client::ChunkForm::kCompact ? "compact" : "raw", dt * 1e3);
    views.push_back({s.chunk_tokens, bytes[i]});
  }
  (void)c.ReleaseLease(hit->lease_id);
  const size_t cached = static_cast<size_t>(n) * s.chunk_tokens;
  const auto t_build = std::chrono::steady_clock::now();
  std::optional<llama::DenseKvCache> dense;
  std::optional<llama::CompactKvCache> compact;
  if (compressed) {
    auto cc = CacheFromCompact(c, layout, bytes, static_cast<int>(cached));
    if (!cc.ok()) return Fail("expand the compact chunks", cc.status());
    compact = std::move(*cc);
  } else {
    auto dc = llama::DenseFromRawChunks(layout, views);
    if (!dc.ok()) return Fail("cache from kvd chunks", dc.status());
    dense = std::move(*dc);
  }
  const double build_s = Since(t_build);
  std::printf("[decode] cache of %zu tokens from kvd: get %.2f ms, %s %.2f ms per chunk\n", cached,
              get_s * 1e3 / n, compressed ? "expand" : "build", build_s * 1e3 / n);
  auto served = llama::ScoreContinuation(
      *s.model, {.threads = s.threads},
      [&](llama::LlamaSession& x) {
        return compressed ? x.LoadCompact(*compact) : x.LoadDense(*dense);
      },
      prompt.subspan(cached), s.text.heldout, s.generate);
  if (!served.ok()) return Fail("decode from the kvd cache", served.status());
  if (Status w = WriteLogits(s.logits_out, served->heldout_logits); !w.ok()) {
    return Fail("--logits-out", w);
  }
  const llama::Tokenizer* tok = s.model->tokenizer();
  PrintScore("kvd cache", *served, tok);
  const double ttft = lookup_s + get_s + build_s + served->first_token_seconds;
  if (f.baseline) {
    double prefill_s = 0;
    auto full = FullBaseline(s, layout, n, &prefill_s);
    if (!full.ok()) return Fail("baseline", full.status());
    PrintScore("local prefill (full cache)", *full, tok);
    std::printf("[decode] time to first token: %.3f s from kvd, %.3f s with a local prefill\n",
                ttft, prefill_s + full->first_token_seconds);
    std::printf("[decode] top-1 agreement kvd cache vs full cache: %.4f\n",
                llama::Agreement(full->heldout_top1, served->heldout_top1));
    if (compressed) {
      PrintLine(c.options().model, PolicyRatio(c.session().policy),
                static_cast<uint64_t>(n) * layout.ChunkBytes(s.chunk_tokens), got_bytes, *full,
                *served);
    }
  }
  return 0;
}

// ---- calibrate: a corpus through the engine until kvd's VECTOR calibration completes ----

// The corpus as token ids: text through the model's tokenizer, or (--token-ids) ids as written.
StatusOr<std::vector<int32_t>> CorpusTokens(const llama::LlamaModel& model, const std::string& path,
                                            bool token_ids) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot read the corpus " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!token_ids) {
    const llama::Tokenizer* tok = model.tokenizer();
    if (tok == nullptr) {
      return Status::InvalidArgument(
          "the model file has no tokenizer: give the corpus as token ids with --token-ids");
    }
    return tok->Encode(ss.str());
  }
  std::vector<int32_t> ids;
  std::string word;
  const int vocab = model.config().vocab_size;
  while (ss >> word) {
    char* end = nullptr;
    const long id = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || id < 0 || id >= vocab) {
      return Status::InvalidArgument(path + ": '" + word + "' (token " +
                                     std::to_string(ids.size()) + ") is not a token id in [0, " +
                                     std::to_string(vocab) + ")");
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// The model's calibration row (exactly one, since the model is named).
StatusOr<kvd::client::CalibrationInfo> CalibrationOf(kvd::client::Client& c,
                                                     const std::string& model) {
  KVD_ASSIGN_OR_RETURN(auto all, c.GetCalibration(model));
  if (all.size() != 1) {
    return Status::Internal("kvd answered " + std::to_string(all.size()) +
                            " calibration rows for model " + model);
  }
  return all[0];
}

struct CalibrationPut {
  int threads = 1;
  int chunk_tokens = 0;
  int window = 0;                  // the session's window tokens (0: none sent, 32 prefilled)
  uint64_t salt = 0;               // xor-ed into every chunk hash's high word
  uint64_t* chunks_put = nullptr;  // counts the chunks put
};

// Prefills one calibration prompt and puts its chunks (salted, with window queries when the
// session takes them), retrying a full ingest queue after a pause.
Status PutCalibrationPrompt(kvd::client::Client& c, const llama::LlamaModel& model,
                            std::span<const int32_t> prompt, const CalibrationPut& p) {
  llama::LlamaSession ses(model, {.threads = p.threads});
  KVD_ASSIGN_OR_RETURN(
      auto pre,
      llama::PrefillChunks(ses, prompt, c.options().layout,
                           {.chunk_tokens = p.chunk_tokens,
                            .window = p.window > 0 ? p.window : std::min(32, p.chunk_tokens)}));
  std::vector<kvd::Hash128> chain = c.hasher().ChunkChain(prompt, false);
  for (size_t i = 0; i < pre.chunks.size(); ++i) {
    const llama::PrefillChunk& ch = pre.chunks[i];
    kvd::client::PutItem item{.hash = {chain[i].hi ^ p.salt, chain[i].lo},
                              .tokens = ch.tokens,
                              .data = ch.raw.data(),
                              .bytes = ch.raw.size(),
                              .first_position = static_cast<uint64_t>(ch.first_position)};
    if (p.window > 0) {
      item.window = ch.window;
      item.window_queries = ch.window_queries;
    }
    for (;;) {  // the ingest queue may be full: retry after the hinted pause
      auto put = c.PutChunks(std::span<const kvd::client::PutItem>(&item, 1));
      if (put.ok()) break;
      if (put.status().code() != kvd::StatusCode::kResourceExhausted) {
        return put.status().WithContext("put chunk " + std::to_string(*p.chunks_put));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ++*p.chunks_put;
  }
  return Status::Ok();
}

// The calibration chunks are no prompt anyone will look up: evicts them when allowed (an admin
// session; KVD_ADMIN_TOKEN when the daemon takes tokens), else says how to.
void EvictCalibrationChunks(kvd::client::Client& c) {
  kvd::client::ClientOptions admin_options = c.options();
  admin_options.role = kvd::client::Role::kAdmin;
  if (const char* token = std::getenv("KVD_ADMIN_TOKEN")) admin_options.auth_token = token;
  auto admin = kvd::client::Client::Connect(admin_options);
  auto evicted = admin.ok() ? (*admin)->Evict({.kind = kvd::client::EvictFilter::Kind::kNamespace,
                                               .name = c.options().name_space})
                            : StatusOr<kvd::client::EvictResult>(admin.status());
  if (evicted.ok()) {
    std::printf("[calibrate] evicted the %llu calibration chunks of namespace %s\n",
                static_cast<unsigned long long>(evicted->chunks), c.options().name_space.c_str());
  } else {
    std::printf(
        "[calibrate] calibration chunks left in namespace %s (%s); evict them with: "
        "kvdctl evict --namespace %s\n",
        c.options().name_space.c_str(), evicted.status().ToString().c_str(),
        c.options().name_space.c_str());
  }
}

int RunCalibrate(const Flags& f) {
  const std::string& model_path = f.model_file;
  const std::string& corpus_path = f.from;
  const int threads = f.threads;
  int64_t segment = f.segment_tokens;
  auto model = llama::LlamaModel::Load(model_path);
  if (!model.ok()) return Fail("model", model.status());
  auto ids = CorpusTokens(**model, corpus_path, f.token_ids);
  if (!ids.ok()) return Fail("corpus", ids.status());

  Setup s;
  auto client = ConnectEngine(f, &s, "kvd-calibrate");
  if (!client.ok()) return Fail("connect", client.status());
  kvd::client::Client& c = **client;
  const kvd::ModelLayout& layout = c.options().layout;
  const std::string name = c.options().model;
  auto cal = CalibrationOf(c, name);
  if (!cal.ok()) return Fail("calibration of " + name, cal.status());
  if (cal->state == "not-routing") {
    return Fail("calibrate", Status::FailedPrecondition(
                                 "model " + name + "'s compression policy (" + c.session().policy +
                                 ") does not route values (no vector " +
                                 "stage): there is nothing to calibrate"));
  }
  if (cal->state == "calibrated") {
    std::printf("[calibrate] model %s is already calibrated\n", name.c_str());
    kvd::tools::PrintCalibration(std::cout, {*cal});
    return 0;
  }
  const int64_t context = (*model)->config().context_length;
  const int64_t max_segment =
      (context > 0 ? context : 4 * s.chunk_tokens) / s.chunk_tokens * s.chunk_tokens;
  if (segment == 0) segment = std::min<int64_t>(4 * s.chunk_tokens, max_segment);
  if (segment < s.chunk_tokens || segment > max_segment) {
    std::cerr << "kvd-demo calibrate: --segment-tokens must be in [" << s.chunk_tokens << ", "
              << max_segment << "] (one chunk .. the model's context)\n";
    return 2;
  }
  const int window = static_cast<int>(c.session().window_tokens);
  std::printf(
      "[calibrate] model %s (%s): %llu of %llu tokens per head seen; corpus %s: %zu tokens, "
      "prompts of %lld tokens, namespace %s\n",
      name.c_str(), layout.ToString().c_str(), static_cast<unsigned long long>(cal->tokens_seen),
      static_cast<unsigned long long>(cal->tokens_needed), corpus_path.c_str(), ids->size(),
      static_cast<long long>(segment), c.options().name_space.c_str());

  // Salt: this run's chunk hashes differ from every earlier run's, so no put dedups.
  const uint64_t salt =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count() ^
                            (static_cast<uint64_t>(::getpid()) << 32));
  uint64_t chunks_put = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t off = 0; off + s.chunk_tokens <= ids->size() && cal->state == "collecting";
       off += static_cast<size_t>(segment)) {
    const std::span<const int32_t> prompt =
        std::span<const int32_t>(*ids).subspan(off, std::min<size_t>(segment, ids->size() - off));
    auto put = PutCalibrationPrompt(c, **model, prompt,
                                    {.threads = threads,
                                     .chunk_tokens = s.chunk_tokens,
                                     .window = window,
                                     .salt = salt,
                                     .chunks_put = &chunks_put});
    if (!put.ok()) return Fail("calibration put", put);
    cal = CalibrationOf(c, name);
    if (!cal.ok()) return Fail("calibration of " + name, cal.status());
    std::printf(
        "[calibrate] %zu corpus tokens: %llu chunks put, %llu of %llu tokens per head, %s\n",
        off + prompt.size(), static_cast<unsigned long long>(chunks_put),
        static_cast<unsigned long long>(cal->tokens_seen),
        static_cast<unsigned long long>(cal->tokens_needed), cal->state.c_str());
  }
  const double seconds = Since(t0);

  EvictCalibrationChunks(c);
  if (cal->state != "calibrated") {
    return Fail("calibrate", Status::FailedPrecondition(
                                 "the corpus " + corpus_path + " (" + std::to_string(ids->size()) +
                                 " tokens) gave " + std::to_string(cal->tokens_seen) + " of the " +
                                 std::to_string(cal->tokens_needed) +
                                 " tokens per head calibration needs: give a longer corpus"));
  }
  std::printf("[calibrate] calibrated in %.1f s: %llu chunks put\n", seconds,
              static_cast<unsigned long long>(chunks_put));
  kvd::tools::PrintCalibration(std::cout, {*cal});
  return 0;
}

// Declares the options of prefill, decode and local (the text and engine options).
void AddTextOptions(CLI::App* mode, Flags* f) {
  mode->add_option("--model-file", f->model_file, "GGUF model file (with its tokenizer)")
      ->required();
  mode->add_option("--text", f->text, "UTF-8 text: prompt, then held-out continuation")
      ->capture_default_str();
  mode->add_option("--prompt-tokens", f->prompt_tokens, "prompt length in tokens (>= 2)")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 30));
  mode->add_option("--heldout", f->heldout, "held-out tokens scored after the prompt")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  mode->add_option("--generate", f->generate, "greedy continuation tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  mode->add_option("--chunk-tokens", f->chunk_tokens,
                   "tokens per chunk (local; prefill and decode take the daemon's)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  mode->add_option("--window", f->window,
                   "window queries per chunk (prefill under a policy takes the daemon's)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  mode->add_option("--threads", f->threads, "engine threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 16));
  mode->add_option("--model", f->model, "the model's name in kvd")->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvd-demo: the reference engine as a disaggregated prefill / decode pair through kvd",
      "kvd-demo"};
  app.require_subcommand(1);
  app.footer(
      "exit codes: 0 ok, 1 failure (the message says where), 2 usage, 3 kvd cannot be "
      "reached\n`kvd-demo MODE --help` lists the options of a mode");
  Flags f;
  CLI::App* prefill = app.add_subcommand(
      "prefill", "run the prompt one chunk per forward pass and put every full chunk to kvd");
  CLI::App* decode = app.add_subcommand(
      "decode", "look the prompt up in kvd, get its chunks and continue from them");
  CLI::App* local = app.add_subcommand(
      "local", "in one process without kvd: the full cache against the chunk-wise compressed one");
  for (CLI::App* mode : {prefill, decode, local}) AddTextOptions(mode, &f);
  for (CLI::App* mode : {decode, local}) {
    mode->add_option("--logits-out", f.logits_out,
                     "write the held-out logits of the kvd / compressed cache (raw float32)");
  }
  decode->add_flag("--baseline", f.baseline,
                   "also a local prefill's full cache: times to first token, top-1 agreement, "
                   "and for compact chunks the `kvd-demo:` line");
  local->add_option("--p-c", f.p_c, "compression ratio of the plan")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  local
      ->add_option("--score", f.score,
                   "eviction scorer: keydiff (what the embedded default's expected-attention "
                   "policy scores by until kvd has query statistics) or snapkv")
      ->capture_default_str()
      ->check(CLI::IsMember({"keydiff", "snapkv"}));
  local
      ->add_option("--quant", f.quant,
                   "the quantize stage after eviction: int8 (the embedded default's policy), "
                   "int4 or none")
      ->capture_default_str()
      ->check(CLI::IsMember({"int8", "int4", "none"}));
  local->add_option("--full-logits-out", f.full_logits_out,
                    "write the held-out logits of the full cache (raw float32)");

  CLI::App* calibrate = app.add_subcommand(
      "calibrate",
      "feed a corpus through the engine until kvd's VECTOR calibration of --model completes");
  calibrate->add_option("--model-file", f.model_file, "GGUF or llama2.c model file")->required();
  calibrate->add_option("--from", f.from, "the corpus: UTF-8 text, or token ids with --token-ids")
      ->required();
  calibrate->add_option("--model", f.model, "the model's name in kvd")->capture_default_str();
  calibrate->add_flag("--token-ids", f.token_ids,
                      "the corpus is whitespace-separated token ids (models without a tokenizer)");
  calibrate
      ->add_option("--segment-tokens", f.segment_tokens,
                   "prompt length (default 0: 4 chunks, at most the model's context)")
      ->check(CLI::Range(0, 1 << 30));
  calibrate->add_option("--threads", f.threads, "engine threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 16));
  for (CLI::App* mode : {prefill, decode, calibrate}) {
    kvd::tools::AddConnectionOptions(*mode, &f.connection);
  }
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (prefill->parsed()) return RunPrefill(f);
  if (decode->parsed()) return RunDecode(f);
  if (local->parsed()) return RunLocal(f);
  return RunCalibrate(f);
}
