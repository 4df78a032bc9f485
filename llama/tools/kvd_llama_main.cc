// kvd-llama: greedy generation and perplexity with the reference Llama engine.
//
//   kvd-llama --model PATH [--prompt TEXT | --tokens 1,2,3] [--n 48] [--threads N]
//             [--ppl FILE [--window 1024]] [--chat]
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "kvd/common/cli.h"
#include "kvd/llama/eval.h"
#include "kvd/llama/model.h"
#include "kvd/llama/tokenizer.h"

namespace {

int Fail(const std::string& msg) {
  std::cerr << "kvd-llama: " << msg << "\n";
  return 1;
}

bool ParseInt(const std::string& s, int* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

struct Flags {
  std::string model_path, prompt, tokens_arg, ppl_file;
  bool have_prompt = false, chat = false, special = false, tokenize = false;
  int n = 48, threads = 0, window = 1024;
};

// Teacher-forced perplexity of --ppl's file (or its token ids with --tokenize).
int RunPerplexity(const kvd::llama::LlamaModel& model, const Flags& f) {
  const kvd::llama::Tokenizer* tok = model.tokenizer();
  if (tok == nullptr) return Fail("--ppl needs a model with a tokenizer (GGUF)");
  std::ifstream in(f.ppl_file, std::ios::binary);
  if (!in) return Fail("cannot read " + f.ppl_file);
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<int32_t> ids = tok->Encode(ss.str());
  if (f.tokenize) {
    for (int32_t id : ids) std::cout << id << "\n";
    return 0;
  }
  auto r = kvd::llama::Perplexity(model, ids, {.window = f.window, .threads = f.threads});
  if (!r.ok()) return Fail(r.status().ToString());
  std::printf(
      "file=%s tokens=%zu scored=%lld window=%d nll=%.4f ppl=%.3f seconds=%.2f tok/s=%.1f\n",
      f.ppl_file.c_str(), ids.size(), static_cast<long long>(r->scored_tokens), f.window,
      r->total_nll / r->scored_tokens, r->perplexity, r->seconds,
      static_cast<double>(ids.size()) / r->seconds);
  return 0;
}

// The prompt's token ids: --tokens, else --prompt (tokenized, ChatML-wrapped with --chat), else
// BOS alone.
kvd::StatusOr<std::vector<int32_t>> PromptIds(const kvd::llama::LlamaModel& model, Flags f) {
  std::vector<int32_t> ids;
  const kvd::llama::Tokenizer* tok = model.tokenizer();
  if (!f.tokens_arg.empty()) {
    for (char& c : f.tokens_arg)
      if (c == ',') c = ' ';
    std::istringstream is(f.tokens_arg);
    std::string t;
    while (is >> t) {
      int id;
      if (!ParseInt(t, &id)) return kvd::Status::InvalidArgument("bad token id '" + t + "'");
      ids.push_back(id);
    }
  } else if (f.have_prompt) {
    if (tok == nullptr) {
      return kvd::Status::InvalidArgument("--prompt needs a model with a tokenizer; use --tokens");
    }
    std::string text = f.prompt;
    if (f.chat) text = "<|im_start|>user\n" + f.prompt + "<|im_end|>\n<|im_start|>assistant\n";
    ids = tok->Encode(text, f.special || f.chat);
  } else {
    ids.push_back(model.config().bos_token);
  }
  if (ids.empty()) return kvd::Status::InvalidArgument("empty prompt");
  return ids;
}

// Greedy generation from the prompt: the ids, the text and the speeds.
int RunGenerate(const kvd::llama::LlamaModel& model, const Flags& f) {
  const kvd::llama::Tokenizer* tok = model.tokenizer();
  auto prompt_ids = PromptIds(model, f);
  if (!prompt_ids.ok()) return Fail(prompt_ids.status().message());
  const std::vector<int32_t>& ids = *prompt_ids;
  if (f.tokenize) {
    for (int32_t id : ids) std::cout << id << "\n";
    return 0;
  }
  kvd::llama::LlamaSession session(model, {.threads = f.threads});
  auto r =
      kvd::llama::GenerateGreedy(session, ids, f.n, f.chat && tok != nullptr ? tok->eos() : -1);
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd-llama: greedy generation and perplexity with the reference Llama engine",
               "kvd-llama"};
  app.footer("exit codes: 0 ok, 1 failure, 2 usage");
  Flags f;
  app.add_option("--model", f.model_path, "llama2.c checkpoint or GGUF file")->required();
  auto* prompt_opt = app.add_option(
      "--prompt", f.prompt, "text to continue (needs a GGUF with a tokenizer); default: BOS only");
  app.add_option("--tokens", f.tokens_arg,
                 "prompt as token ids (comma or space separated); wins over --prompt");
  app.add_option("--n", f.n, "tokens to generate greedily (default 48)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", f.threads, "worker and OpenBLAS threads (default 0: all cores)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ppl", f.ppl_file,
                 "teacher-forced perplexity of a UTF-8 text file instead of generating");
  app.add_option("--window", f.window,
                 "perplexity window in tokens (default 1024, capped at the context)")
      ->check(CLI::Range(2, 1 << 30));
  app.add_flag("--chat", f.chat, "wrap --prompt in the model's ChatML user turn");
  app.add_flag("--special", f.special, "recognise special-token texts inside --prompt");
  app.add_flag("--tokenize", f.tokenize,
               "print the token ids of --prompt (or of the --ppl file) and exit");
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  f.have_prompt = prompt_opt->count() > 0;
  auto model_or = kvd::llama::LlamaModel::Load(f.model_path);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  const kvd::llama::LlamaModel& model = **model_or;
  std::cerr << "model: " << model.config().ToString() << " tensors: " << model.tensor_types()
            << "\n";
  return f.ppl_file.empty() ? RunGenerate(model, f) : RunPerplexity(model, f);
}
