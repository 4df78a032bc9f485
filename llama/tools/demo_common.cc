#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>

#include "demo.h"

namespace kvd::demo {
namespace {

std::string Quote(const llama::Tokenizer* tok, const std::vector<int32_t>& ids) {
  if (tok == nullptr) return "(no tokenizer)";
  auto s = tok->Decode(ids);
  if (!s.ok()) return "(" + s.status().ToString() + ")";
  std::string out;
  for (char c : *s) out += c == '\n' ? ' ' : c;
  return "\"" + out + "\"";
}

}  // namespace

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Fail(const std::string& where, const Status& s) {
  std::cerr << "kvd-demo: " << where << ": " << s << "\n";
  return s.code() == StatusCode::kUnavailable ? 3 : 1;
}

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

StatusOr<std::unique_ptr<client::Client>> ConnectEngine(const Flags& f, Setup* s,
                                                        const std::string& default_namespace) {
  client::ClientOptions o;
  o.name_space = default_namespace;
  tools::ApplyConnectionFlags(f.connection, &o);
  o.model = f.model;
  uint32_t chunk_tokens = 0;
  KVD_ASSIGN_OR_RETURN(client::ModelInfo info, tools::FindModel(o, o.model, &chunk_tokens));
  o.layout = info.layout;
  o.chunk_tokens = static_cast<int>(chunk_tokens);
  o.block_tokens = std::gcd(16, o.chunk_tokens);
  s->chunk_tokens = o.chunk_tokens;
  return client::Client::Connect(o);
}

int LoadAndConnect(const Flags& f, Setup* s, std::unique_ptr<client::Client>* client) {
  auto setup = Load(f);
  if (!setup.ok()) return Fail("setup", setup.status());
  *s = std::move(*setup);
  auto connected = ConnectEngine(f, s);
  if (!connected.ok()) return Fail("connect", connected.status());
  *client = std::move(*connected);
  return 0;
}

}  // namespace kvd::demo
