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
#include <CLI/CLI.hpp>

#include "demo.h"
#include "kvd/common/cli.h"

namespace {

using kvd::demo::Flags;

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

// local's own options: the plan it compresses with and the full cache's logits.
void AddLocalOptions(CLI::App* local, Flags* f) {
  local->add_option("--p-c", f->p_c, "compression ratio of the plan")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  local
      ->add_option("--score", f->score,
                   "eviction scorer: keydiff (what the embedded default's expected-attention "
                   "policy scores by until kvd has query statistics) or snapkv")
      ->capture_default_str()
      ->check(CLI::IsMember({"keydiff", "snapkv"}));
  local
      ->add_option("--quant", f->quant,
                   "the quantize stage after eviction: int8 (the embedded default's policy), "
                   "int4 or none")
      ->capture_default_str()
      ->check(CLI::IsMember({"int8", "int4", "none"}));
  local->add_option("--full-logits-out", f->full_logits_out,
                    "write the held-out logits of the full cache (raw float32)");
}

CLI::App* AddCalibrate(CLI::App& app, Flags* f) {
  CLI::App* calibrate = app.add_subcommand(
      "calibrate",
      "feed a corpus through the engine until kvd's VECTOR calibration of --model completes");
  calibrate->add_option("--model-file", f->model_file, "GGUF or llama2.c model file")->required();
  calibrate->add_option("--from", f->from, "the corpus: UTF-8 text, or token ids with --token-ids")
      ->required();
  calibrate->add_option("--model", f->model, "the model's name in kvd")->capture_default_str();
  calibrate->add_flag("--token-ids", f->token_ids,
                      "the corpus is whitespace-separated token ids (models without a tokenizer)");
  calibrate
      ->add_option("--segment-tokens", f->segment_tokens,
                   "prompt length (default 0: 4 chunks, at most the model's context)")
      ->check(CLI::Range(0, 1 << 30));
  calibrate->add_option("--threads", f->threads, "engine threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 16));
  return calibrate;
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
  AddLocalOptions(local, &f);
  CLI::App* calibrate = AddCalibrate(app, &f);
  for (CLI::App* mode : {prefill, decode, calibrate}) {
    kvd::tools::AddConnectionOptions(*mode, &f.connection);
  }
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (prefill->parsed()) return kvd::demo::RunPrefill(f);
  if (decode->parsed()) return kvd::demo::RunDecode(f);
  if (local->parsed()) return kvd::demo::RunLocal(f);
  return kvd::demo::RunCalibrate(f);
}
