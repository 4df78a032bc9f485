// kvd-quality-diag: per-layer and per-head measurements of why merging and VECTOR win or lose
// (diagnose.h). Writes DIR/heads.csv and DIR/layers.md and prints the Markdown.
//
//   kvd-quality-diag --model PATH [--manifest FILE] [--out DIR] [--segments 3] [--prefix 1024]
//                    [--continuation 64] [--window 64] [--calib-max 32] [--text-file PATH]...
//                    [--threads N]
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "cli_options.h"
#include "diagnose.h"
#include "kvd/common/cli.h"
#include "kvd/llama/model.h"

int main(int argc, char** argv) {
  std::string model_path, out_dir = "quality-diag";
  kvd::quality::DiagnoseOptions o;
  o.manifest_path = KVD_QUALITY_DEFAULT_MANIFEST;
  const std::string command = kvd::quality::CommandLine("kvd-quality-diag", argc, argv);
  CLI::App app{
      "kvd-quality-diag: per layer and KV head, why merging and VECTOR win or lose "
      "(writes DIR/heads.csv and DIR/layers.md)",
      "kvd-quality-diag"};
  app.footer("exit codes: 0 ok, 1 failure, 2 usage");
  kvd::quality::AddEvalOptions(app, {.model_path = &model_path,
                                     .manifest_path = &o.manifest_path,
                                     .out_dir = &out_dir,
                                     .text_files = &o.text_files,
                                     .segments = &o.segments,
                                     .prefix_tokens = &o.prefix_tokens,
                                     .continuation_tokens = &o.continuation_tokens,
                                     .window = &o.window,
                                     .threads = &o.threads})
      ->required();
  app.add_option("--calib-max", o.max_calib_prefixes, "calibration prefixes of the \"all\" fit")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (kvd::Status v = o.Validate(); !v.ok()) return kvd::cli::UsageError(app, v.message());
  auto model = kvd::llama::LlamaModel::Load(model_path);
  if (!model.ok()) {
    std::cerr << "kvd-quality-diag: " << model.status() << "\n";
    return 1;
  }
  auto rep = kvd::quality::RunDiagnosis(**model, o);
  if (!rep.ok()) {
    std::cerr << "kvd-quality-diag: " << rep.status() << "\n";
    return 1;
  }
  std::filesystem::create_directories(out_dir);
  const std::string md = kvd::quality::DiagnosisMarkdown(*rep, command);
  std::ofstream(out_dir + "/heads.csv") << kvd::quality::DiagnosisCsv(*rep);
  std::ofstream(out_dir + "/layers.md") << md;
  std::cout << md;
  return 0;
}
