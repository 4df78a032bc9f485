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

#include "diagnose.h"
#include "kvd/llama/model.h"

int main(int argc, char** argv) {
  constexpr const char* kUsage =
      "usage: kvd-quality-diag --model PATH [--manifest FILE] [--out DIR] [--segments 3]\n"
      "                        [--prefix 1024] [--continuation 64] [--window 64]\n"
      "                        [--calib-max 32] [--text-file PATH]... [--threads N]\n";
  std::string model_path, out_dir = "quality-diag";
  kvd::quality::DiagnoseOptions o;
  o.manifest_path = KVD_QUALITY_DEFAULT_MANIFEST;
  std::string command = "kvd-quality-diag";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto val = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("missing value for " + a);
        return argv[++i];
      };
      if (a == "--model")
        model_path = val();
      else if (a == "--manifest")
        o.manifest_path = val();
      else if (a == "--out")
        out_dir = val();
      else if (a == "--segments")
        o.segments = std::stoi(val());
      else if (a == "--prefix")
        o.prefix_tokens = std::stoi(val());
      else if (a == "--continuation")
        o.continuation_tokens = std::stoi(val());
      else if (a == "--window")
        o.window = std::stoi(val());
      else if (a == "--calib-max")
        o.max_calib_prefixes = std::stoi(val());
      else if (a == "--text-file")
        o.text_files.push_back(val());
      else if (a == "--threads")
        o.threads = std::stoi(val());
      else if (a == "--help" || a == "-h") {
        std::cout << kUsage;
        return 0;
      } else {
        throw std::invalid_argument("unknown argument " + a);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << kUsage << "kvd-quality-diag: " << e.what() << "\n";
    return 2;
  }
  if (model_path.empty()) {
    std::cerr << kUsage << "kvd-quality-diag: --model is required\n";
    return 2;
  }
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
