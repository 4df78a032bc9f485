// kvd-quality: the compression quality harness (see harness.h).
//
//   kvd-quality --model PATH [--manifest FILE] [--out DIR] [--quick] [--methods a,b]
//               [--ratios 0.5,0.75,0.9] [--segments N] [--prefix N] [--continuation N]
//               [--window W] [--passkey N] [--threads N] [--text-file PATH]... [--modes a,b]
//               [--chunk N] [--chunk-window W] [--passkey-trials N] [--multikey-trials N]
//               [--calib-segments N] [--bootstrap N] [--passkey-methods a,b]
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "harness.h"
#include "kvd/llama/model.h"
#include "plot.h"
#include "report.h"

namespace {

constexpr const char* kUsage =
    "usage: kvd-quality --model PATH [--manifest FILE] [--out DIR] [--quick]\n"
    "                   [--methods full,sink_recent] [--ratios 0.5,0.75,0.9] [--segments 10]\n"
    "                   [--prefix 1024] [--continuation 128] [--window 64] [--passkey 1024]\n"
    "                   [--modes one-shot,chunk-wise] [--chunk 256] [--chunk-window 16]\n"
    "                   [--passkey-trials 20] [--multikey-trials 20] [--calib-segments 4]\n"
    "                   [--passkey-methods full,snapkv] (default: full,snapkv,keydiff;\n"
    "                   with --methods alone: every listed method)\n"
    "                   [--bootstrap 2000] [--text-file PATH]... [--threads N] [--list-methods]\n"
    "  --text-file PATH (repeatable) evaluates these UTF-8 files instead of the manifest's eval\n"
    "  texts (calibration still uses the manifest's calib texts).\n"
    "       kvd-quality --plot-from results.csv --out DIR   (re-draws DIR/perplexity-<mode>.png)\n";

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, out_dir = "quality-out", plot_from;
  kvd::quality::HarnessOptions o;
  o.manifest_path = KVD_QUALITY_DEFAULT_MANIFEST;
  std::string command = "kvd-quality";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  // --quick first, so that explicit flags override the preset.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") {
      const std::string manifest = o.manifest_path;
      o = kvd::quality::HarnessOptions::Quick();
      o.manifest_path = manifest;
    }
  }
  bool passkey_methods_given = false;
  for (int i = 1; i < argc; ++i)
    passkey_methods_given |= std::string(argv[i]) == "--passkey-methods";
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
      else if (a == "--quick")
        continue;
      else if (a == "--methods") {
        o.methods = SplitCommas(val());
        // Explicit methods without --passkey-methods: every listed method answers the passkey.
        if (!passkey_methods_given) o.passkey_methods.clear();
      } else if (a == "--passkey-methods") {
        o.passkey_methods = SplitCommas(val());
        passkey_methods_given = true;
      } else if (a == "--ratios") {
        o.ratios.clear();
        for (const auto& r : SplitCommas(val())) o.ratios.push_back(std::stod(r));
      } else if (a == "--segments")
        o.max_segments = std::stoi(val());
      else if (a == "--prefix")
        o.prefix_tokens = std::stoi(val());
      else if (a == "--continuation")
        o.continuation_tokens = std::stoi(val());
      else if (a == "--window")
        o.window = std::stoi(val());
      else if (a == "--passkey")
        o.passkey_filler_tokens = std::stoi(val());
      else if (a == "--text-file")
        o.text_files.push_back(val());
      else if (a == "--modes")
        o.modes = SplitCommas(val());
      else if (a == "--chunk")
        o.chunk_tokens = std::stoi(val());
      else if (a == "--chunk-window")
        o.chunk_window = std::stoi(val());
      else if (a == "--passkey-trials")
        o.passkey_trials = std::stoi(val());
      else if (a == "--multikey-trials")
        o.multikey_trials = std::stoi(val());
      else if (a == "--calib-segments")
        o.calibration_segments = std::stoi(val());
      else if (a == "--bootstrap")
        o.bootstrap_samples = std::stoi(val());
      else if (a == "--threads")
        o.threads = std::stoi(val());
      else if (a == "--plot-from")
        plot_from = val();
      else if (a == "--list-methods") {
        for (const auto& n : kvd::quality::MethodRegistry::Global().Names()) std::cout << n << "\n";
        return 0;
      } else if (a == "--help" || a == "-h") {
        std::cout << kUsage;
        return 0;
      } else {
        throw std::invalid_argument("unknown argument " + a);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << kUsage << "kvd-quality: " << e.what() << "\n";
    return 2;
  }
  if (!plot_from.empty()) {
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
  if (model_path.empty()) {
    std::cerr << kUsage << "kvd-quality: --model is required\n";
    return 2;
  }
  auto model = kvd::llama::LlamaModel::Load(model_path);
  if (!model.ok()) {
    std::cerr << "kvd-quality: " << model.status() << "\n";
    return 1;
  }
  auto rep = kvd::quality::RunHarness(**model, o);
  if (!rep.ok()) {
    std::cerr << "kvd-quality: " << rep.status() << "\n";
    return 1;
  }
  kvd::Status w = kvd::quality::WriteReport(*rep, out_dir, command);
  if (!w.ok()) {
    std::cerr << "kvd-quality: " << w << "\n";
    return 1;
  }
  std::cout << kvd::quality::ToMarkdown(*rep, command);
  std::cerr << "kvd-quality: wrote " << out_dir
            << "/results.csv, segments.csv, layers.csv, results.md, perplexity-<mode>.png\n";
  return 0;
}
