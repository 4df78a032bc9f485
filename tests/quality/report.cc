#include "report.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "plot.h"

namespace kvd::quality {
namespace {

std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

}  // namespace

std::string ToCsv(const HarnessReport& r) {
  std::ostringstream os;
  os << "method,p_c,achieved_p_c,scored_tokens,perplexity,ppl_ratio_vs_full,top1_agreement,"
        "mean_attn_rel_error,passkey_correct,passkey_total,seconds\n";
  os << "engine," << 0 << "," << 0 << "," << r.engine_scored_tokens << ","
     << Fmt("%.6f", r.engine_perplexity) << ",1,1,0," << r.engine_passkey_correct << ","
     << r.engine_passkey_total << ",0\n";
  for (const MethodResult& m : r.rows) {
    os << m.method << "," << Fmt("%.4f", m.p_c) << "," << Fmt("%.4f", m.achieved_p_c) << ","
       << m.scored_tokens << "," << Fmt("%.6f", m.perplexity) << ","
       << Fmt("%.6f", m.perplexity / r.engine_perplexity) << "," << Fmt("%.6f", m.top1_agreement)
       << "," << Fmt("%.6f", m.mean_rel_error) << "," << m.passkey_correct << "," << m.passkey_total
       << "," << Fmt("%.2f", m.seconds) << "\n";
  }
  return os.str();
}

std::string LayersToCsv(const HarnessReport& r) {
  std::ostringstream os;
  os << "method,p_c,layer,attn_rel_error\n";
  for (const MethodResult& m : r.rows) {
    for (size_t l = 0; l < m.layer_rel_error.size(); ++l) {
      os << m.method << "," << Fmt("%.4f", m.p_c) << "," << l << ","
         << Fmt("%.6f", m.layer_rel_error[l]) << "\n";
    }
  }
  return os.str();
}

std::string ToMarkdown(const HarnessReport& r, const std::string& command) {
  const HarnessOptions& o = r.options;
  std::ostringstream os;
  os << "# kvd quality results\n\n";
  os << "Command: `" << command << "`\n\n";
  os << r.segments << " segments: prefix " << o.prefix_tokens << " tokens (compressed), "
     << "continuation " << o.continuation_tokens << " tokens (teacher-forced, "
     << o.continuation_tokens - 1 << " scored per segment); observation window " << o.window
     << "; passkey context " << o.passkey_filler_tokens << " tokens; " << Fmt("%.1f", r.seconds)
     << " s.\n\nEval texts (segments drawn round-robin, in this order):\n\n";
  for (const std::string& t : r.texts) os << "- `" << t << "`\n";
  for (const std::string& w : r.warnings) os << "- warning: " << w << "\n";
  os << "\n| method | p_c | achieved p_c | perplexity | vs full | top-1 agreement | attn rel. "
        "error "
        "| passkey |\n|---|---|---|---|---|---|---|---|\n";
  os << "| engine (uncompressed) | 0 | 0 | " << Fmt("%.3f", r.engine_perplexity)
     << " | 1.000 | 1.000 | 0 | " << r.engine_passkey_correct << "/" << r.engine_passkey_total
     << " |\n";
  for (const MethodResult& m : r.rows) {
    os << "| " << m.method << " | " << Fmt("%.2f", m.p_c) << " | " << Fmt("%.3f", m.achieved_p_c)
       << " | " << Fmt("%.3f", m.perplexity) << " | "
       << Fmt("%.3f", m.perplexity / r.engine_perplexity) << " | " << Fmt("%.3f", m.top1_agreement)
       << " | " << Fmt("%.4f", m.mean_rel_error) << " | " << m.passkey_correct << "/"
       << m.passkey_total << " |\n";
  }
  os << "\nPlot (`perplexity.png`, perplexity against p_c; full = dashed level):";
  for (const std::string& l : PlotLegend(r)) os << " " << l << ";";
  os << "\n";
  if (!r.calibration_r2.empty()) {
    os << "\nCalibration R^2 per layer (calib texts, disjoint from eval):\n\n";
    for (const auto& [name, r2] : r.calibration_r2) {
      os << "- " << name << ":";
      for (double v : r2) os << " " << Fmt("%.3f", v);
      os << "\n";
    }
  }
  return os.str();
}

StatusOr<HarnessReport> FromCsv(const std::string& csv) {
  HarnessReport r;
  std::istringstream in(csv);
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    if (no == 1 || line.empty()) continue;  // header
    std::vector<std::string> f;
    std::stringstream ls(line);
    std::string cell;
    while (std::getline(ls, cell, ',')) f.push_back(cell);
    if (f.size() != 11) {
      return Status::InvalidArgument("results CSV line " + std::to_string(no) + " has " +
                                     std::to_string(f.size()) + " fields, expected 11");
    }
    try {
      if (f[0] == "engine") {
        r.engine_scored_tokens = std::stoll(f[3]);
        r.engine_perplexity = std::stod(f[4]);
        r.engine_passkey_correct = std::stoi(f[8]);
        r.engine_passkey_total = std::stoi(f[9]);
        continue;
      }
      MethodResult m;
      m.method = f[0];
      m.p_c = std::stod(f[1]);
      m.achieved_p_c = std::stod(f[2]);
      m.scored_tokens = std::stoll(f[3]);
      m.perplexity = std::stod(f[4]);
      m.top1_agreement = std::stod(f[6]);
      m.mean_rel_error = std::stod(f[7]);
      m.passkey_correct = std::stoi(f[8]);
      m.passkey_total = std::stoi(f[9]);
      m.seconds = std::stod(f[10]);
      r.rows.push_back(m);
    } catch (const std::exception&) {
      return Status::InvalidArgument("results CSV line " + std::to_string(no) +
                                     " has a bad number");
    }
  }
  return r;
}

Status WriteReport(const HarnessReport& r, const std::string& dir, const std::string& command) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Internal("cannot create " + dir + ": " + ec.message());
  const std::pair<std::string, std::string> files[] = {{"results.csv", ToCsv(r)},
                                                       {"layers.csv", LayersToCsv(r)},
                                                       {"results.md", ToMarkdown(r, command)}};
  for (const auto& [name, body] : files) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out << body;
    if (!out) return Status::Internal("cannot write " + dir + "/" + name);
  }
  return WritePerplexityPlot(r, dir + "/perplexity.png");
}

}  // namespace kvd::quality
