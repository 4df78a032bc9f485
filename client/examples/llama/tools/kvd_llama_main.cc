// kvd-llama: greedy generation and perplexity with the reference Llama engine.
//
//   kvd-llama --model PATH [--prompt TEXT | --tokens 1,2,3] [--n 48] [--threads N]
//             [--ppl FILE [--window 1024]] [--chat]
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "kvd/llama/eval.h"
#include "kvd/llama/model.h"
#include "kvd/llama/tokenizer.h"

namespace {

constexpr const char* kUsage =
    "usage: kvd-llama --model PATH [--prompt TEXT | --tokens ID,ID,...] [--n 48] [--threads N]\n"
    "                 [--ppl FILE [--window 1024]] [--chat] [--special]\n"
    "  --prompt   text to continue (needs a GGUF with a tokenizer); default: BOS only\n"
    "  --tokens   prompt as token ids (comma or space separated)\n"
    "  --n        tokens to generate greedily (default 48)\n"
    "  --threads  worker and OpenBLAS threads (default: all cores)\n"
    "  --ppl      teacher-forced perplexity of a UTF-8 text file instead of generating\n"
    "  --window   perplexity window in tokens (default 1024, capped at the context)\n"
    "  --chat     wrap --prompt in the model's ChatML user turn (<|im_start|>user ...)\n"
    "  --special  recognise special-token texts inside --prompt\n"
    "  --tokenize print the token ids of --prompt (or of the --ppl file) and exit\n";

int Fail(const std::string& msg) {
  std::cerr << "kvd-llama: " << msg << "\n";
  return 1;
}

bool ParseInt(const std::string& s, int* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, prompt, tokens_arg, ppl_file;
  bool have_prompt = false, chat = false, special = false, tokenize = false;
  int n = 48, threads = 0, window = 1024;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (a == "--model" && next(&model_path)) {
    } else if (a == "--prompt" && next(&prompt)) {
      have_prompt = true;
    } else if (a == "--tokens" && next(&tokens_arg)) {
    } else if (a == "--ppl" && next(&ppl_file)) {
    } else if (a == "--n" && next(&v) && ParseInt(v, &n) && n >= 0) {
    } else if (a == "--threads" && next(&v) && ParseInt(v, &threads) && threads >= 0) {
    } else if (a == "--window" && next(&v) && ParseInt(v, &window) && window >= 2) {
    } else if (a == "--chat") {
      chat = true;
    } else if (a == "--special") {
      special = true;
    } else if (a == "--tokenize") {
      tokenize = true;
    } else {
      std::cerr << kUsage;
      return Fail("bad or incomplete argument '" + a + "'");
    }
  }
  if (model_path.empty()) {
    std::cerr << kUsage;
    return Fail("--model is required");
  }
  auto model_or = kvd::llama::LlamaModel::Load(model_path);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  const kvd::llama::LlamaModel& model = **model_or;
  const kvd::llama::Tokenizer* tok = model.tokenizer();
  std::cerr << "model: " << model.config().ToString() << " tensors: " << model.tensor_types()
            << "\n";

  if (!ppl_file.empty()) {
    if (tok == nullptr) return Fail("--ppl needs a model with a tokenizer (GGUF)");
    std::ifstream in(ppl_file, std::ios::binary);
    if (!in) return Fail("cannot read " + ppl_file);
    std::stringstream ss;
    ss << in.rdbuf();
    std::vector<int32_t> ids = tok->Encode(ss.str());
    if (tokenize) {
      for (int32_t id : ids) std::cout << id << "\n";
      return 0;
    }
    auto r = kvd::llama::Perplexity(model, ids, {.window = window, .threads = threads});
    if (!r.ok()) return Fail(r.status().ToString());
    std::printf(
        "file=%s tokens=%zu scored=%lld window=%d nll=%.4f ppl=%.3f seconds=%.2f tok/s=%.1f\n",
        ppl_file.c_str(), ids.size(), static_cast<long long>(r->scored_tokens), window,
        r->total_nll / r->scored_tokens, r->perplexity, r->seconds,
        static_cast<double>(ids.size()) / r->seconds);
    return 0;
  }

  std::vector<int32_t> ids;
  if (!tokens_arg.empty()) {
    for (char& c : tokens_arg)
      if (c == ',') c = ' ';
    std::istringstream is(tokens_arg);
    std::string t;
    while (is >> t) {
      int id;
      if (!ParseInt(t, &id)) return Fail("bad token id '" + t + "'");
      ids.push_back(id);
    }
  } else if (have_prompt) {
    if (tok == nullptr) return Fail("--prompt needs a model with a tokenizer; use --tokens");
    std::string text = prompt;
    if (chat) text = "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n";
    ids = tok->Encode(text, special || chat);
  } else {
    ids.push_back(model.config().bos_token);
  }
  if (ids.empty()) return Fail("empty prompt");
  if (tokenize) {
    for (int32_t id : ids) std::cout << id << "\n";
    return 0;
  }
  kvd::llama::LlamaSession session(model, {.threads = threads});
  auto r = kvd::llama::GenerateGreedy(session, ids, n, chat && tok != nullptr ? tok->eos() : -1);
  if (!r.ok()) return Fail(r.status().ToString());
  std::cout << "prompt_ids:";
  for (int32_t id : ids) std::cout << " " << id;
  std::cout << "\ngenerated_ids:";
  for (int32_t id : r->tokens) std::cout << " " << id;
  std::cout << "\n";
  if (tok != nullptr) {
    auto p = tok->Decode(ids);
    auto g = tok->Decode(r->tokens);
    if (p.ok() && g.ok()) std::cout << "text: " << *p << *g << "\n";
  }
  const int steps = static_cast<int>(r->tokens.size()) - 1;
  std::fprintf(
      stderr,
      "prefill: %zu tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s (%.1f tok/s)\n",
      ids.size(), r->prefill_seconds, ids.size() / r->prefill_seconds, steps, r->decode_seconds,
      steps > 0 ? steps / r->decode_seconds : 0.0);
  return 0;
}
