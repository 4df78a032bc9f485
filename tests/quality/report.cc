#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bootstrap.h"
#include "fronts.h"
#include "plot.h"

namespace kvd::quality {
std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

std::vector<std::string> ModesOf(const HarnessReport& r) {
  std::vector<std::string> modes;
  for (const MethodResult& m : r.rows) {
    if (m.method == "full") continue;
    if (std::find(modes.begin(), modes.end(), m.mode) == modes.end()) modes.push_back(m.mode);
  }
  if (modes.empty()) modes.push_back(kModeOneShot);
  return modes;
}

HarnessReport RowsOfMode(const HarnessReport& r, const std::string& mode) {
  HarnessReport out = r;
  out.rows.clear();
  for (const MethodResult& m : r.rows) {
    if (m.mode == mode || m.method == "full") out.rows.push_back(m);
  }
  return out;
}

std::string ToCsv(const HarnessReport& r) {
  std::ostringstream os;
  os << kCsvHeader << "\n";
  os << "engine,one-shot,0,0," << r.engine_scored_tokens << "," << Fmt("%.6f", r.engine_perplexity)
     << ",1,1,1,1,1,1,0," << r.engine_passkey_correct << "," << r.engine_passkey_total << ","
     << r.engine_multikey_correct << "," << r.engine_multikey_total << ",0,0,1,dense\n";
  for (const MethodResult& m : r.rows) {
    os << m.method << "," << m.mode << "," << Fmt("%.4f", m.p_c) << ","
       << Fmt("%.4f", m.achieved_p_c) << "," << m.scored_tokens << "," << Fmt("%.6f", m.perplexity)
       << "," << Fmt("%.6f", m.perplexity / r.engine_perplexity) << ","
       << Fmt("%.6f", m.ppl_ratio_lo) << "," << Fmt("%.6f", m.ppl_ratio_hi) << ","
       << Fmt("%.6f", m.top1_agreement) << "," << Fmt("%.6f", m.top1_lo) << ","
       << Fmt("%.6f", m.top1_hi) << "," << Fmt("%.6f", m.mean_rel_error) << "," << m.passkey_correct
       << "," << m.passkey_total << "," << m.multikey_correct << "," << m.multikey_total << ","
       << Fmt("%.2f", m.seconds) << "," << Fmt("%.2f", m.cpu_seconds) << ","
       << Fmt("%.4f", m.stored_raw) << ","
       << ServingFormName(m.keeps_positions ? ServingForm::kDense : ServingForm::kCompact) << "\n";
  }
  return os.str();
}

std::string SegmentsToCsv(const HarnessReport& r) {
  std::ostringstream os;
  os << "method,mode,p_c,segment,nll_sum,scored_tokens,top1_agree,engine_nll_sum\n";
  for (const MethodResult& m : r.rows) {
    for (size_t i = 0; i < m.seg_nll.size() && i < r.engine_seg_nll.size(); ++i) {
      os << m.method << "," << m.mode << "," << Fmt("%.4f", m.p_c) << "," << i << ","
         << Fmt("%.6f", m.seg_nll[i]) << "," << m.seg_n[i] << "," << m.seg_agree[i] << ","
         << Fmt("%.6f", r.engine_seg_nll[i]) << "\n";
    }
  }
  return os.str();
}

std::string LayersToCsv(const HarnessReport& r) {
  std::ostringstream os;
  os << "method,mode,p_c,layer,attn_rel_error\n";
  for (const MethodResult& m : r.rows) {
    for (size_t l = 0; l < m.layer_rel_error.size(); ++l) {
      os << m.method << "," << m.mode << "," << Fmt("%.4f", m.p_c) << "," << l << ","
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
     << o.continuation_tokens - 1 << " scored per segment); one-shot window " << o.window
     << "; chunk-wise: chunks of " << o.chunk_tokens << " with " << o.chunk_window
     << " window queries each; passkey context " << o.passkey_filler_tokens << " tokens ("
     << o.passkey_trials << " keys per depth, " << o.multikey_trials << " multi-key prompts of "
     << o.multikey_keys << " keys); 95% bootstrap intervals over segments (" << o.bootstrap_samples
     << " resamples); " << Fmt("%.1f", r.seconds)
     << " s.\n\nEval texts (segments drawn round-robin, in this order):\n\n";
  for (const std::string& t : r.texts) os << "- `" << t << "`\n";
  if (!r.calib_texts.empty()) {
    os << "\nCalibration texts:\n\n";
    for (const std::string& t : r.calib_texts) os << "- `" << t << "`\n";
  }
  for (const std::string& w : r.warnings) os << "- warning: " << w << "\n";
  std::string depths;
  for (double d : o.passkey_depths) depths += (depths.empty() ? "" : " / ") + Fmt("%.2f", d);
  for (const std::string& mode : ModesOf(r)) {
    os << "\n## " << mode << "\n\n| method | p_c | achieved p_c | stored/raw | form | perplexity "
       << "| vs full [95% CI] | top-1 agreement [95% CI] | attn rel. error | passkey " << depths
       << " | multi-key |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    os << "| engine (uncompressed) | 0 | 0 | 1.000 | dense | " << Fmt("%.3f", r.engine_perplexity)
       << " | 1.000 | 1.000 | 0 | " << r.engine_passkey_correct << "/" << r.engine_passkey_total
       << " | " << r.engine_multikey_correct << "/" << r.engine_multikey_total << " |\n";
    for (const MethodResult& m : RowsOfMode(r, mode).rows) {
      std::string pk;
      for (size_t d = 0; d < m.passkey_depth_total.size(); ++d) {
        pk += (d ? " / " : "") + std::to_string(m.passkey_depth_correct[d]) + "/" +
              std::to_string(m.passkey_depth_total[d]);
      }
      if (pk.empty())
        pk = std::to_string(m.passkey_correct) + "/" + std::to_string(m.passkey_total);
      const bool asked = m.passkey_total + m.multikey_total > 0;
      if (!asked) pk = "-";
      os << "| " << m.method << " | " << Fmt("%.2f", m.p_c) << " | " << Fmt("%.3f", m.achieved_p_c)
         << " | " << (m.stored_raw < 0 ? std::string("-") : Fmt("%.3f", m.stored_raw)) << " | "
         << ServingFormName(m.keeps_positions ? ServingForm::kDense : ServingForm::kCompact)
         << " | " << Fmt("%.3f", m.perplexity) << " | "
         << Fmt("%.3f", m.perplexity / r.engine_perplexity) << " [" << Fmt("%.3f", m.ppl_ratio_lo)
         << ", " << Fmt("%.3f", m.ppl_ratio_hi) << "] | " << Fmt("%.3f", m.top1_agreement) << " ["
         << Fmt("%.3f", m.top1_lo) << ", " << Fmt("%.3f", m.top1_hi) << "] | "
         << Fmt("%.4f", m.mean_rel_error) << " | " << pk << " | "
         << (!asked ? std::string("-")
                    : std::to_string(m.multikey_correct) + "/" + std::to_string(m.multikey_total))
         << " |\n";
    }
    os << "\nPlot (`" << PlotFileName(mode) << "`, perplexity against p_c; full = dashed level):";
    for (const std::string& l : PlotLegend(RowsOfMode(r, mode))) os << " " << l << ";";
    os << "\n";
  }
  os << FrontsToMarkdown(r);
  os << "\nFront plots: `" << FrontPlotFileName("<mode>")
     << "` (stored/raw against perplexity / full; dense front blue, compact front red, every "
        "other row grey).\n";
  os << PairedToMarkdown(r, o.paired_against);
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

std::string PairedToMarkdown(const HarnessReport& r, const std::vector<std::string>& baselines) {
  std::ostringstream os;
  for (const std::string& base : baselines) {
    for (const std::string& mode : ModesOf(r)) {
      const HarnessReport rows = RowsOfMode(r, mode);
      std::vector<std::string> methods;
      for (const MethodResult& m : rows.rows) {
        if (m.method == "full" || m.method == base) continue;
        if (std::find(methods.begin(), methods.end(), m.method) == methods.end())
          methods.push_back(m.method);
      }
      auto find = [&](const std::string& name, double p_c) -> const MethodResult* {
        for (const MethodResult& m : rows.rows) {
          if (m.method == name && std::abs(m.p_c - p_c) < 1e-9) return &m;
        }
        return nullptr;
      };
      os << "\n### Paired against " << base << ", " << mode << " (perplexity ratio method / "
         << base << " [95% CI], segments where the method is lower)\n\n| method |";
      for (double p : r.options.ratios) os << " p_c " << Fmt("%.2f", p) << " |";
      os << "\n|---|";
      for (size_t i = 0; i < r.options.ratios.size(); ++i) os << "---|";
      os << "\n";
      for (const std::string& name : methods) {
        os << "| " << name << " |";
        for (double p : r.options.ratios) {
          const MethodResult* m = find(name, p);
          const MethodResult* b = find(base, p);
          if (m == nullptr || b == nullptr || m->seg_nll.size() != b->seg_nll.size() ||
              m->seg_n != b->seg_n) {
            os << " - |";
            continue;
          }
          double dn = 0, n = 0;
          int lower = 0;
          for (size_t i = 0; i < m->seg_nll.size(); ++i) {
            dn += m->seg_nll[i] - b->seg_nll[i];
            n += static_cast<double>(m->seg_n[i]);
            lower += m->seg_nll[i] < b->seg_nll[i];
          }
          const BootstrapResult br = BootstrapSegments(
              {m->seg_nll, b->seg_nll, m->seg_n, m->seg_agree}, r.options.bootstrap_samples);
          const std::string cell = Fmt("%.3f", std::exp(dn / n)) + " [" +
                                   Fmt("%.3f", br.ppl_ratio.lo) + ", " +
                                   Fmt("%.3f", br.ppl_ratio.hi) + "]";
          const char* mark = br.ppl_ratio.hi < 1.0 ? "**" : br.ppl_ratio.lo > 1.0 ? "*" : "";
          os << " " << mark << cell << mark << " (" << lower << "/" << m->seg_nll.size() << ") |";
        }
        os << "\n";
      }
    }
  }
  if (!baselines.empty()) {
    os << "\n(bold: paired interval below 1, the method is better; italic: above 1, worse.)\n";
  }
  return os.str();
}

std::string PlotFileName(const std::string& mode) { return "perplexity-" + mode + ".png"; }
std::string FrontPlotFileName(const std::string& mode) { return "fronts-" + mode + ".png"; }

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
    // The layout before modes and intervals (11 fields) is read as one-shot rows.
    if (f.size() == 11) {
      f.insert(f.begin() + 1, kModeOneShot);
      f.insert(f.begin() + 7, {"0", "0"});
      f.insert(f.begin() + 10, {"0", "0"});
      f.insert(f.begin() + 15, {"0", "0"});
    }
    // The layout before cpu_seconds (18 fields) reads with cpu_seconds 0, the one before
    // stored_raw and form (19 fields) with no bytes measured.
    if (f.size() == kCsvFields - 3) f.push_back("0");
    if (f.size() == kCsvFields - 2) f.insert(f.end(), {"-1", "compact"});
    if (f.size() != kCsvFields) {
      return Status::InvalidArgument(
          "results CSV line " + std::to_string(no) + " has " + std::to_string(f.size()) +
          " fields, expected " + std::to_string(kCsvFields) + " (or 19, 18 or 11, older layouts)");
    }
    try {
      if (f[0] == "engine") {
        r.engine_scored_tokens = std::stoll(f[4]);
        r.engine_perplexity = std::stod(f[5]);
        r.engine_passkey_correct = std::stoi(f[13]);
        r.engine_passkey_total = std::stoi(f[14]);
        r.engine_multikey_correct = std::stoi(f[15]);
        r.engine_multikey_total = std::stoi(f[16]);
        continue;
      }
      MethodResult m;
      m.method = f[0];
      m.mode = f[1];
      m.p_c = std::stod(f[2]);
      m.achieved_p_c = std::stod(f[3]);
      m.scored_tokens = std::stoll(f[4]);
      m.perplexity = std::stod(f[5]);
      m.ppl_ratio_lo = std::stod(f[7]);
      m.ppl_ratio_hi = std::stod(f[8]);
      m.top1_agreement = std::stod(f[9]);
      m.top1_lo = std::stod(f[10]);
      m.top1_hi = std::stod(f[11]);
      m.mean_rel_error = std::stod(f[12]);
      m.passkey_correct = std::stoi(f[13]);
      m.passkey_total = std::stoi(f[14]);
      m.multikey_correct = std::stoi(f[15]);
      m.multikey_total = std::stoi(f[16]);
      m.seconds = std::stod(f[17]);
      m.cpu_seconds = std::stod(f[18]);
      m.stored_raw = std::stod(f[19]);
      if (f[20] != "dense" && f[20] != "compact") {
        return Status::InvalidArgument("results CSV line " + std::to_string(no) + ": form '" +
                                       f[20] + "' is not dense or compact");
      }
      m.keeps_positions = f[20] == "dense";
      r.rows.push_back(m);
    } catch (const std::exception&) {
      return Status::InvalidArgument("results CSV line " + std::to_string(no) +
                                     " has a bad number");
    }
  }
  return r;
}

Status WritePlots(const HarnessReport& r, const std::string& dir) {
  for (const std::string& mode : ModesOf(r)) {
    KVD_RETURN_IF_ERROR(WritePerplexityPlot(RowsOfMode(r, mode), dir + "/" + PlotFileName(mode)));
    KVD_RETURN_IF_ERROR(WriteFrontPlot(r, mode, dir + "/" + FrontPlotFileName(mode)));
  }
  return Status::Ok();
}

Status WriteReport(const HarnessReport& r, const std::string& dir, const std::string& command) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Internal("cannot create " + dir + ": " + ec.message());
  const std::pair<std::string, std::string> files[] = {{"results.csv", ToCsv(r)},
                                                       {"segments.csv", SegmentsToCsv(r)},
                                                       {"layers.csv", LayersToCsv(r)},
                                                       {"results.md", ToMarkdown(r, command)}};
  for (const auto& [name, body] : files) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out << body;
    if (!out) return Status::Internal("cannot write " + dir + "/" + name);
  }
  return WritePlots(r, dir);
}

}  // namespace kvd::quality
