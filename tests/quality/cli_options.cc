#include "cli_options.h"

namespace kvd::quality {

CLI::Option* AddEvalOptions(CLI::App& app, const EvalOptionTargets& t) {
  CLI::Option* model = app.add_option("--model", *t.model_path, "llama2.c checkpoint or GGUF file");
  app.add_option("--manifest", *t.manifest_path, "text manifest (eval and calib texts)")
      ->capture_default_str();
  app.add_option("--out", *t.out_dir, "output folder")->capture_default_str();
  app.add_option("--text-file", *t.text_files,
                 "evaluate this UTF-8 file instead of the manifest's eval texts (repeatable; "
                 "calibration still uses the manifest's calib texts)");
  app.add_option("--segments", *t.segments, "eval segments (round-robin over the eval texts)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--prefix", *t.prefix_tokens, "compressed prefix length in tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--continuation", *t.continuation_tokens, "scored continuation in tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--window", *t.window, "observation window W (post-RoPE queries)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--threads", *t.threads,
                 "engine threads per session (0 = all cores; one thread avoids OpenBLAS's "
                 "spin-wait on a shared machine)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 16));
  return model;
}

std::string CommandLine(const std::string& program, int argc, char** argv) {
  std::string command = program;
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return command;
}

}  // namespace kvd::quality
