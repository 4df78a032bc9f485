// kvd-quality: the compression quality harness (see harness.h).
//
//   kvd-quality --model PATH [--manifest FILE] [--out DIR] [--quick] [--methods a,b]
//               [--ratios 0.5,0.75,0.9] [--segments N] [--prefix N] [--continuation N]
//               [--window W] [--passkey N] [--threads N] [--jobs N] [--text-file PATH]...
//               [--modes a,b]
//               [--chunk N] [--chunk-window W] [--passkey-trials N] [--multikey-trials N]
//               [--calib-segments N] [--bootstrap N] [--passkey-methods a,b]
//               [--paired-against a,b] [--passkey-fronts]
// A --methods entry may carry its own p_c list: keydiff+int4@0.5:0.65.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cli_options.h"
#include "harness.h"
#include "kvd/common/cli.h"
#include "kvd/llama/model.h"
#include "plot.h"
#include "report.h"

namespace {

// What the command line sets, and the options main needs to ask whether they were given.
struct Cli {
  std::string model_path, out_dir = "quality-out", plot_from;
  kvd::quality::HarnessOptions o;
  bool list_methods = false;
  CLI::Option* model_opt = nullptr;
  CLI::Option* methods_opt = nullptr;
  CLI::Option* passkey_methods_opt = nullptr;
};

// Adds --quick, the evaluation options shared with kvd-quality-diag, and the method options.
void AddMethodOptions(CLI::App& app, Cli& c) {
  kvd::quality::HarnessOptions& o = c.o;
  // --quick first: its preset is applied before the options given with it (CLI11 stores the
  // options in the order they are declared), so explicit options override the preset.
  app.add_flag_callback(
      "--quick",
      [&o] {
        const std::string manifest = o.manifest_path;
        o = kvd::quality::HarnessOptions::Quick();
        o.manifest_path = manifest;
      },
      "the quick preset (fewer methods, segments and trials; the options given override it)");
  c.model_opt = kvd::quality::AddEvalOptions(app, {.model_path = &c.model_path,
                                                   .manifest_path = &o.manifest_path,
                                                   .out_dir = &c.out_dir,
                                                   .text_files = &o.text_files,
                                                   .segments = &o.max_segments,
                                                   .prefix_tokens = &o.prefix_tokens,
                                                   .continuation_tokens = &o.continuation_tokens,
                                                   .window = &o.window,
                                                   .threads = &o.threads});
  c.methods_opt =
      app.add_option("--methods", o.methods, "methods, comma separated (--list-methods)")
          ->delimiter(',')
          ->capture_default_str();
  c.passkey_methods_opt =
      app.add_option("--passkey-methods", o.passkey_methods,
                     "methods answering the passkey (default full,snapkv,keydiff; with --methods "
                     "alone: every listed method)")
          ->delimiter(',');
  app.add_option("--paired-against", o.paired_against,
                 "methods every other method is compared with, paired on the same segments "
                 "(tables in results.md)")
      ->delimiter(',');
  app.add_option("--ratios", o.ratios, "compression ratios p_c, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--modes", o.modes, "one-shot, chunk-wise (comma separated)")
      ->delimiter(',')
      ->capture_default_str();
}

// Adds the passkey, chunk, calibration, bootstrap and jobs options.
void AddRunOptions(CLI::App& app, kvd::quality::HarnessOptions& o) {
  app.add_option("--passkey", o.passkey_filler_tokens, "passkey context in tokens (0: no passkey)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--chunk", o.chunk_tokens, "chunk-wise: chunk length in tokens")
      ->capture_default_str();
  app.add_option("--chunk-window", o.chunk_window, "chunk-wise: window queries per chunk")
      ->capture_default_str();
  app.add_option("--passkey-trials", o.passkey_trials, "random keys per depth")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--multikey-trials", o.multikey_trials,
                 "multi-key prompts (several keys at random depths, one asked for)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--calib-segments", o.calibration_segments, "calibration prefixes")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bootstrap", o.bootstrap_samples, "bootstrap resamples for the intervals")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--jobs", o.jobs,
                 "segments and passkey prompts evaluated at once, each worker with its own engine "
                 "sessions of --threads threads (0 = cores / threads; 1 with --threads 0)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 10));
}

// Adds the passkey flags and depths, --plot-from and --list-methods.
void AddPasskeyAndToolOptions(CLI::App& app, Cli& c) {
  kvd::quality::HarnessOptions& o = c.o;
  app.add_flag("--passkey-fronts", o.passkey_fronts,
               "also ask the passkey prompts of every row on a dense or compact front, in its "
               "mode (one engine call per prompt and front row)");
  app.add_flag("--passkey-chunk-wise", o.passkey_chunk_wise,
               "also ask the passkey prompts of the passkey methods' chunk-wise rows, chunk by "
               "chunk (the serving path)");
  app.add_option("--passkey-depths", o.passkey_depths,
                 "depths of the single-key passkey, each in [0, 1] (keys are drawn in this order)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_flag("--passkey-log", o.passkey_log,
               "one line per passkey prompt on stderr: key, depth, its token positions, and the "
               "engine's and every asked row's answer with its logit margin");
  app.add_option("--plot-from", c.plot_from, "re-draw the plots of this results.csv into --out");
  app.add_flag("--list-methods", c.list_methods, "print the registered methods and exit");
}

// Re-draws the plots of the results.csv at plot_from into out_dir; the exit code.
int RePlot(const std::string& plot_from, const std::string& out_dir) {
  std::ifstream in(plot_from, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  auto rep = kvd::quality::FromCsv(ss.str());
  if (!in || !rep.ok()) {
    std::cerr << "kvd-quality: cannot re-plot " << plot_from << ": "
              << (rep.ok() ? std::string("unreadable") : rep.status().ToString()) << "\n";
    return 1;
  }
  std::filesystem::create_directories(out_dir);
  kvd::Status s = kvd::quality::WritePlots(*rep, out_dir);
  if (!s.ok()) {
    std::cerr << "kvd-quality: " << s << "\n";
    return 1;
  }
  for (const auto& l : kvd::quality::PlotLegend(*rep)) std::cout << l << "\n";
  return 0;
}

// Loads the model, runs the harness and writes the report into c.out_dir; the exit code.
int RunAndReport(const Cli& c, const std::string& command) {
  auto model = kvd::llama::LlamaModel::Load(c.model_path);
  if (!model.ok()) {
    std::cerr << "kvd-quality: " << model.status() << "\n";
    return 1;
  }
  auto rep = kvd::quality::RunHarness(**model, c.o);
  if (!rep.ok()) {
    std::cerr << "kvd-quality: " << rep.status() << "\n";
    return 1;
  }
  kvd::Status w = kvd::quality::WriteReport(*rep, c.out_dir, command);
  if (!w.ok()) {
    std::cerr << "kvd-quality: " << w << "\n";
    return 1;
  }
  std::cout << kvd::quality::ToMarkdown(*rep, command);
  std::cerr << "kvd-quality: wrote " << c.out_dir
            << "/results.csv, segments.csv, layers.csv, results.md, perplexity-<mode>.png\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Cli c;
  c.o.manifest_path = KVD_QUALITY_DEFAULT_MANIFEST;
  const std::string command = kvd::quality::CommandLine("kvd-quality", argc, argv);
  CLI::App app{
      "kvd-quality: the compression quality harness (perplexity, top-1 agreement, "
      "attention error and passkey retrieval of each method against the full cache)",
      "kvd-quality"};
  app.footer(
      "kvd-quality --plot-from results.csv --out DIR re-draws DIR/perplexity-<mode>.png and "
      "fronts-<mode>.png\n"
      "a --methods entry may carry its own p_c list: keydiff+int4@0.5:0.65\n"
      "exit codes: 0 ok, 1 failure, 2 usage");
  AddMethodOptions(app, c);
  AddRunOptions(app, c.o);
  AddPasskeyAndToolOptions(app, c);
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  // Explicit methods without --passkey-methods: every listed method answers the passkey.
  if (c.methods_opt->count() > 0 && c.passkey_methods_opt->count() == 0)
    c.o.passkey_methods.clear();
  if (c.list_methods) {
    for (const auto& n : kvd::quality::MethodRegistry::Global().Names()) std::cout << n << "\n";
    return 0;
  }
  if (!c.plot_from.empty()) return RePlot(c.plot_from, c.out_dir);
  if (c.model_opt->count() == 0) return kvd::cli::UsageError(app, "--model is required");
  if (kvd::Status v = c.o.Validate(); !v.ok()) return kvd::cli::UsageError(app, v.message());
  return RunAndReport(c, command);
}
