#include "fronts.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "report.h"

namespace kvd::quality {
namespace {

bool InForm(const MethodResult& m, ServingForm form) {
  return m.stored_raw >= 0 && (form == ServingForm::kCompact || m.keeps_positions);
}

// a dominates b: no more bytes and no higher perplexity, and less of one.
bool Dominates(const MethodResult& a, const MethodResult& b) {
  return a.stored_raw <= b.stored_raw && a.perplexity <= b.perplexity &&
         (a.stored_raw < b.stored_raw || a.perplexity < b.perplexity);
}

std::string Retrieval(int correct, int total) {
  return total > 0 ? std::to_string(correct) + "/" + std::to_string(total) : "-";
}

}  // namespace

const char* ServingFormName(ServingForm form) {
  return form == ServingForm::kDense ? "dense" : "compact";
}

bool KeepsPositions(const llama::CompactKvCache& cache, int num_tokens) {
  for (const auto& layer : cache.layers) {
    for (const llama::CompactHeadKv& h : layer) {
      int64_t tokens = 0;
      for (float b : h.bias) tokens += std::lround(std::exp(static_cast<double>(b)));
      if (tokens != num_tokens) return false;
    }
  }
  return !cache.layers.empty();
}

std::vector<size_t> ParetoFront(const HarnessReport& r, const std::string& mode, ServingForm form) {
  std::vector<size_t> cand;
  for (size_t k = 0; k < r.rows.size(); ++k) {
    const MethodResult& m = r.rows[k];
    if ((m.mode == mode || m.method == "full") && InForm(m, form) && std::isfinite(m.perplexity))
      cand.push_back(k);
  }
  std::vector<size_t> front;
  for (size_t i : cand) {
    bool dominated = false;
    for (size_t j : cand) {
      const MethodResult &a = r.rows[j], &b = r.rows[i];
      const bool equal = a.stored_raw == b.stored_raw && a.perplexity == b.perplexity;
      if (Dominates(a, b) || (equal && j < i)) {
        dominated = true;
        break;
      }
    }
    if (!dominated) front.push_back(i);
  }
  std::sort(front.begin(), front.end(),
            [&](size_t a, size_t b) { return r.rows[a].stored_raw < r.rows[b].stored_raw; });
  return front;
}

std::vector<bool> OnAnyFront(const HarnessReport& r) {
  std::vector<bool> on(r.rows.size(), false);
  std::vector<std::string> modes;
  for (const MethodResult& m : r.rows) {
    if (std::find(modes.begin(), modes.end(), m.mode) == modes.end()) modes.push_back(m.mode);
  }
  for (const std::string& mode : modes) {
    for (ServingForm f : {ServingForm::kDense, ServingForm::kCompact}) {
      for (size_t k : ParetoFront(r, mode, f)) on[k] = true;
    }
  }
  return on;
}

std::string FrontsToMarkdown(const HarnessReport& r) {
  std::vector<std::string> modes;
  for (const MethodResult& m : r.rows) {
    if (m.method != "full" && std::find(modes.begin(), modes.end(), m.mode) == modes.end())
      modes.push_back(m.mode);
  }
  std::ostringstream os;
  os << "\n## Fronts: quality per stored byte\n\nstored/raw: the encoded compact chunks (header, "
        "slot metadata, scales, padding, checksum) over the raw bfloat16 chunks. dense: one KV "
        "slot per token position (what an unmodified engine takes); compact: every method. "
        "Perplexity ratio to the uncompressed engine with its paired 95% interval over "
        "segments.\n";
  for (const std::string& mode : modes) {
    std::vector<size_t> fronts[2] = {ParetoFront(r, mode, ServingForm::kDense),
                                     ParetoFront(r, mode, ServingForm::kCompact)};
    for (int f = 0; f < 2; ++f) {
      os << "\n### " << mode << ", " << ServingFormName(static_cast<ServingForm>(f))
         << " front\n\n| method | p_c | stored/raw | perplexity / full [95% CI] | top-1 | passkey "
            "| multi-key |\n|---|---|---|---|---|---|---|\n";
      for (size_t k : fronts[f]) {
        const MethodResult& m = r.rows[k];
        os << "| " << m.method << " | " << Fmt("%.2f", m.p_c) << " | " << Fmt("%.3f", m.stored_raw)
           << " | " << Fmt("%.3f", m.perplexity / r.engine_perplexity) << " ["
           << Fmt("%.3f", m.ppl_ratio_lo) << ", " << Fmt("%.3f", m.ppl_ratio_hi) << "] | "
           << Fmt("%.3f", m.top1_agreement) << " | "
           << Retrieval(m.passkey_correct, m.passkey_total) << " | "
           << Retrieval(m.multikey_correct, m.multikey_total) << " |\n";
      }
    }
    os << "\n### " << mode << ": the best row within each byte budget\n\n| stored/raw <= | "
       << "dense | compact |\n|---|---|---|\n";
    for (double budget : kFrontBudgets) {
      os << "| " << Fmt("%.2f", budget) << " |";
      for (int f = 0; f < 2; ++f) {
        const MethodResult* best = nullptr;
        for (size_t k : fronts[f]) {
          const MethodResult& m = r.rows[k];
          if (m.stored_raw <= budget && (best == nullptr || m.perplexity < best->perplexity))
            best = &m;
        }
        if (best == nullptr) {
          os << " - |";
        } else {
          os << " " << best->method << " @" << Fmt("%.2f", best->p_c) << ": "
             << Fmt("%.3f", best->stored_raw) << ", "
             << Fmt("%.3f", best->perplexity / r.engine_perplexity) << " |";
        }
      }
      os << "\n";
    }
  }
  return os.str();
}

}  // namespace kvd::quality
