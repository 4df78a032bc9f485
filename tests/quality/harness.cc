#include "harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>

#include "kvd/llama/engine.h"
#include "kvd/llama/tokenizer.h"
#include "manifest.h"

namespace kvd::quality {
namespace {

using llama::LlamaSession;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Segment {
  std::vector<int32_t> prefix;
  std::vector<int32_t> continuation;
};

// What a method is scored against on one segment (the uncompressed engine).
struct Reference {
  std::vector<int32_t> argmax;                // [C-1]
  std::vector<std::vector<float>> attention;  // [layer][(C-1) * n_q * d]
};

struct Scores {
  double nll = 0;
  int64_t n = 0;
  int64_t agree = 0;
  std::vector<double> rel_err;  // [layer]
};

// Prefills `prefix` and captures the dense cache and the last W queries.
StatusOr<PrefixCapture> Capture(LlamaSession& s, const llama::LlamaModel& model,
                                const std::vector<int32_t>& prefix, int window) {
  s.Reset();
  KVD_RETURN_IF_ERROR(s.Forward(prefix, {.capture_queries = window}).status());
  PrefixCapture p;
  p.config = &model.config();
  KVD_ASSIGN_OR_RETURN(p.cache, s.ExportDense());
  p.window_queries = s.captured_queries();
  p.window = s.captured_query_count();
  return p;
}

// Teacher-forces `cont` on the session's current cache; scores cont[1..] and, when `ref` is
// given, compares argmax and attention outputs with it.
StatusOr<Scores> ScoreContinuation(LlamaSession& s, const llama::LlamaConfig& cfg,
                                   const std::vector<int32_t>& cont, const Reference* ref,
                                   Reference* capture) {
  const int C = static_cast<int>(cont.size());
  std::span<const int32_t> feed(cont.data(), C - 1);
  KVD_ASSIGN_OR_RETURN(std::vector<float> logits,
                       s.Forward(feed, {.all_logits = true, .capture_attention = true}));
  Scores sc;
  const int V = cfg.vocab_size;
  std::vector<int32_t> argmax(C - 1);
  for (int t = 0; t + 1 < C; ++t) {
    std::span<const float> row(logits.data() + static_cast<size_t>(t) * V, V);
    sc.nll += llama::NegLogLikelihood(row, cont[t + 1]);
    argmax[t] = llama::Argmax(row);
    ++sc.n;
    if (ref != nullptr) sc.agree += argmax[t] == ref->argmax[t];
  }
  const auto& att = s.captured_attention();
  sc.rel_err.assign(cfg.num_layers, 0.0);
  if (ref != nullptr) {
    for (int l = 0; l < cfg.num_layers; ++l) {
      double num = 0, den = 0;
      for (size_t i = 0; i < att[l].size(); ++i) {
        const double diff = static_cast<double>(att[l][i]) - ref->attention[l][i];
        num += diff * diff;
        den += static_cast<double>(ref->attention[l][i]) * ref->attention[l][i];
      }
      sc.rel_err[l] = den > 0 ? std::sqrt(num / den) : 0.0;
    }
  }
  if (capture != nullptr) {
    capture->argmax = std::move(argmax);
    capture->attention = att;
  }
  return sc;
}

struct PasskeyPrompt {
  std::vector<int32_t> context;   // filler with the key inside (compressed)
  std::vector<int32_t> question;  // fed after the (compressed) context
  std::string key;
};

std::vector<PasskeyPrompt> BuildPasskeyPrompts(const llama::Tokenizer& tok,
                                               const HarnessOptions& o) {
  std::vector<PasskeyPrompt> out;
  if (o.passkey_filler_tokens <= 0) return out;
  const std::vector<int32_t> intro = tok.Encode(
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
      "it. I will quiz you about the important information there.");
  const std::vector<int32_t> unit = tok.Encode(
      " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.");
  std::mt19937 rng(o.seed);
  std::uniform_int_distribution<int> digits(10000, 99999);
  for (double depth : o.passkey_depths) {
    for (int trial = 0; trial < o.passkey_trials; ++trial) {
      PasskeyPrompt p;
      p.key = std::to_string(digits(rng));
      const std::vector<int32_t> needle =
          tok.Encode(" The pass key is " + p.key + ". Remember it. " + p.key + " is the pass key.");
      const int units = std::max(
          1,
          static_cast<int>((o.passkey_filler_tokens - intro.size() - needle.size()) / unit.size()));
      const int at = static_cast<int>(std::lround(depth * units));
      p.context = intro;
      for (int u = 0; u <= units; ++u) {
        if (u == at) p.context.insert(p.context.end(), needle.begin(), needle.end());
        if (u < units) p.context.insert(p.context.end(), unit.begin(), unit.end());
      }
      p.question = tok.Encode(" What is the pass key? The pass key is");
      out.push_back(std::move(p));
    }
  }
  return out;
}

// Feeds the question on the session's cache, then greedily generates 8 tokens.
StatusOr<bool> AnswerPasskey(LlamaSession& s, const llama::Tokenizer& tok, const PasskeyPrompt& p) {
  KVD_ASSIGN_OR_RETURN(std::vector<float> logits, s.Forward(p.question));
  std::vector<int32_t> gen;
  for (int i = 0; i < 8; ++i) {
    const int32_t next = llama::Argmax(logits);
    gen.push_back(next);
    if (i + 1 < 8) {
      KVD_ASSIGN_OR_RETURN(logits, s.Forward(std::span<const int32_t>(&next, 1)));
    }
  }
  KVD_ASSIGN_OR_RETURN(std::string text, tok.Decode(gen, /*render_special=*/false));
  return text.find(p.key) != std::string::npos;
}

void Progress(const HarnessOptions& o, Clock::time_point t0, const std::string& msg) {
  if (o.progress) std::fprintf(stderr, "[quality %6.1fs] %s\n", Since(t0), msg.c_str());
}

}  // namespace

HarnessOptions HarnessOptions::Quick() {
  HarnessOptions o;
  o.prefix_tokens = 512;
  o.continuation_tokens = 64;
  o.max_segments = 2;
  o.window = 32;
  o.calibration_segments = 1;
  o.passkey_filler_tokens = 384;
  o.passkey_depths = {0.1, 0.9};
  o.ratios = {0.5, 0.9};
  return o;
}

Status HarnessOptions::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("harness options: " + m); };
  if (manifest_path.empty()) return bad("manifest_path is required");
  if (methods.empty()) return bad("no methods");
  if (ratios.empty()) return bad("no ratios");
  for (double r : ratios) {
    if (!(r >= 0 && r < 1)) return bad("ratio " + std::to_string(r) + " outside [0, 1)");
  }
  if (prefix_tokens < 8) return bad("prefix_tokens must be >= 8");
  if (continuation_tokens < 2) return bad("continuation_tokens must be >= 2");
  if (max_segments < 1) return bad("max_segments must be >= 1");
  if (window < 1 || window > prefix_tokens) return bad("window must be in [1, prefix_tokens]");
  if (calibration_segments < 0 || passkey_filler_tokens < 0 || passkey_trials < 0 || threads < 0) {
    return bad("counts must be >= 0");
  }
  for (double d : passkey_depths) {
    if (!(d >= 0 && d <= 1)) return bad("passkey depth outside [0, 1]");
  }
  return Status::Ok();
}

StatusOr<HarnessReport> RunHarness(const llama::LlamaModel& model, const HarnessOptions& o,
                                   const MethodRegistry& registry) {
  KVD_RETURN_IF_ERROR(o.Validate());
  const auto t0 = Clock::now();
  const llama::Tokenizer* tok = model.tokenizer();
  if (tok == nullptr)
    return Status::FailedPrecondition("the harness needs a model with a tokenizer");
  const llama::LlamaConfig& cfg = model.config();
  if (o.prefix_tokens + o.continuation_tokens > cfg.context_length ||
      o.passkey_filler_tokens + 64 > cfg.context_length) {
    return Status::InvalidArgument("segments or passkey prompts exceed the model's context " +
                                   std::to_string(cfg.context_length));
  }
  HarnessReport rep;
  rep.options = o;
  KVD_ASSIGN_OR_RETURN(auto manifest, LoadManifest(o.manifest_path));
  KVD_ASSIGN_OR_RETURN(auto eval_texts, ReadVerified(manifest, "eval", &rep.warnings));

  // Segments: consecutive non-overlapping (prefix, continuation) cuts, round-robin over texts.
  const int seg_len = o.prefix_tokens + o.continuation_tokens;
  std::vector<std::vector<Segment>> per_text;
  for (const ManifestText& t : eval_texts) {
    const std::vector<int32_t> ids = tok->Encode(t.text);
    std::vector<Segment> segs;
    for (size_t s = 0; s + seg_len <= ids.size(); s += seg_len) {
      segs.push_back(
          {std::vector<int32_t>(ids.begin() + s, ids.begin() + s + o.prefix_tokens),
           std::vector<int32_t>(ids.begin() + s + o.prefix_tokens, ids.begin() + s + seg_len)});
    }
    if (!segs.empty()) rep.texts.push_back(t.entry.path + " " + t.entry.sha256);
    per_text.push_back(std::move(segs));
  }
  std::vector<Segment> segments;
  for (size_t round = 0; static_cast<int>(segments.size()) < o.max_segments; ++round) {
    bool any = false;
    for (auto& segs : per_text) {
      if (round < segs.size() && static_cast<int>(segments.size()) < o.max_segments) {
        segments.push_back(segs[round]);
        any = true;
      }
    }
    if (!any) break;
  }
  if (segments.empty()) {
    return Status::FailedPrecondition("no eval text is long enough for a segment of " +
                                      std::to_string(seg_len) + " tokens");
  }
  rep.segments = static_cast<int>(segments.size());
  Progress(o, t0,
           std::to_string(segments.size()) + " segments of " + std::to_string(o.prefix_tokens) +
               " + " + std::to_string(o.continuation_tokens) + " tokens from " +
               std::to_string(rep.texts.size()) + " texts");

  // Methods (+ calibration on disjoint texts).
  std::vector<std::unique_ptr<CompressionMethod>> methods;
  for (const std::string& name : o.methods) {
    KVD_ASSIGN_OR_RETURN(auto m, registry.Create(name));
    methods.push_back(std::move(m));
  }
  LlamaSession session(model, {.threads = o.threads});
  const bool need_calibration = std::any_of(methods.begin(), methods.end(),
                                            [](const auto& m) { return m->NeedsCalibration(); });
  if (o.calibration_segments > 0 && need_calibration) {
    std::vector<std::string> calib_warnings;
    auto calib = ReadVerified(manifest, "calib", &calib_warnings);
    rep.warnings.insert(rep.warnings.end(), calib_warnings.begin(), calib_warnings.end());
    std::vector<PrefixCapture> captures;
    if (calib.ok()) {
      // The calib texts are short: cut prefixes from their concatenation.
      std::vector<int32_t> ids;
      for (const ManifestText& t : *calib) {
        const std::vector<int32_t> part = tok->Encode(t.text);
        ids.insert(ids.end(), part.begin(), part.end());
      }
      for (size_t s = 0; s + o.prefix_tokens <= ids.size() &&
                         static_cast<int>(captures.size()) < o.calibration_segments;
           s += o.prefix_tokens) {
        std::vector<int32_t> prefix(ids.begin() + s, ids.begin() + s + o.prefix_tokens);
        KVD_ASSIGN_OR_RETURN(PrefixCapture p, Capture(session, model, prefix, o.window));
        captures.push_back(std::move(p));
      }
    }
    Progress(o, t0, "calibration prefixes: " + std::to_string(captures.size()));
    for (auto& m : methods) {
      if (!m->NeedsCalibration()) continue;
      Status s = m->Calibrate(captures);
      if (!s.ok()) return s.WithContext("calibrating " + m->name());
      if (auto r2 = m->CalibrationR2(); !r2.empty()) rep.calibration_r2[m->name()] = r2;
    }
  }

  // Rows: "full" once at p_c 0, every other method at every ratio.
  struct RowKey {
    size_t method;
    double p_c;
  };
  std::vector<RowKey> keys;
  for (size_t m = 0; m < methods.size(); ++m) {
    if (methods[m]->name() == "full") {
      keys.push_back({m, 0.0});
    } else {
      for (double r : o.ratios) keys.push_back({m, r});
    }
  }
  rep.rows.resize(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    rep.rows[k].method = methods[keys[k].method]->name();
    rep.rows[k].p_c = keys[k].p_c;
    rep.rows[k].layer_rel_error.assign(cfg.num_layers, 0.0);
  }

  LlamaSession other(model, {.threads = o.threads});
  for (size_t si = 0; si < segments.size(); ++si) {
    const Segment& seg = segments[si];
    KVD_ASSIGN_OR_RETURN(PrefixCapture prefix, Capture(session, model, seg.prefix, o.window));
    Reference ref;
    KVD_ASSIGN_OR_RETURN(Scores eng,
                         ScoreContinuation(session, cfg, seg.continuation, nullptr, &ref));
    rep.engine_nll_sum += eng.nll;
    rep.engine_scored_tokens += eng.n;
    for (size_t k = 0; k < keys.size(); ++k) {
      const auto tr = Clock::now();
      MethodResult& row = rep.rows[k];
      CompressionMethod& m = *methods[keys[k].method];
      auto cache = m.Compress(prefix, row.p_c);
      if (!cache.ok())
        return cache.status().WithContext(m.name() + " p_c=" + std::to_string(row.p_c));
      const double stored = cache->stored_fraction >= 0
                                ? cache->stored_fraction
                                : 1.0 - AchievedCompression(cache->cache, o.prefix_tokens);
      row.achieved_p_c += (1.0 - stored) / segments.size();
      if (cache->cache.next_position != o.prefix_tokens) {
        return Status::Internal(m.name() + " returned next_position " +
                                std::to_string(cache->cache.next_position) + ", expected " +
                                std::to_string(o.prefix_tokens));
      }
      Status ls = other.LoadCompact(cache->cache);
      if (!ls.ok()) return ls.WithContext(m.name() + " returned an unusable cache");
      KVD_ASSIGN_OR_RETURN(Scores sc,
                           ScoreContinuation(other, cfg, seg.continuation, &ref, nullptr));
      row.nll_sum += sc.nll;
      row.scored_tokens += sc.n;
      row.top1_agreement += static_cast<double>(sc.agree);
      for (int l = 0; l < cfg.num_layers; ++l)
        row.layer_rel_error[l] += sc.rel_err[l] / segments.size();
      row.seconds += Since(tr);
    }
    Progress(o, t0,
             "segment " + std::to_string(si + 1) + "/" + std::to_string(segments.size()) +
                 ": engine ppl " + std::to_string(std::exp(eng.nll / eng.n)));
  }

  // Passkey retrieval.
  const std::vector<PasskeyPrompt> prompts = BuildPasskeyPrompts(*tok, o);
  for (size_t pi = 0; pi < prompts.size(); ++pi) {
    const PasskeyPrompt& p = prompts[pi];
    KVD_ASSIGN_OR_RETURN(PrefixCapture prefix, Capture(session, model, p.context, o.window));
    KVD_ASSIGN_OR_RETURN(bool engine_ok, AnswerPasskey(session, *tok, p));
    rep.engine_passkey_correct += engine_ok;
    ++rep.engine_passkey_total;
    for (size_t k = 0; k < keys.size(); ++k) {
      MethodResult& row = rep.rows[k];
      CompressionMethod& m = *methods[keys[k].method];
      auto cache = m.Compress(prefix, row.p_c);
      if (!cache.ok()) return cache.status().WithContext(m.name() + " (passkey)");
      KVD_RETURN_IF_ERROR(other.LoadCompact(cache->cache));
      KVD_ASSIGN_OR_RETURN(bool ok, AnswerPasskey(other, *tok, p));
      row.passkey_correct += ok;
      ++row.passkey_total;
    }
    Progress(o, t0,
             "passkey " + std::to_string(pi + 1) + "/" + std::to_string(prompts.size()) + " (" +
                 std::to_string(p.context.size()) + " tokens): engine " +
                 (engine_ok ? "correct" : "wrong"));
  }

  for (MethodResult& row : rep.rows) {
    row.perplexity = std::exp(row.nll_sum / static_cast<double>(row.scored_tokens));
    row.top1_agreement /= static_cast<double>(row.scored_tokens);
    double s = 0;
    for (double e : row.layer_rel_error) s += e;
    row.mean_rel_error = s / cfg.num_layers;
  }
  rep.engine_perplexity =
      std::exp(rep.engine_nll_sum / static_cast<double>(rep.engine_scored_tokens));
  rep.seconds = Since(t0);
  return rep;
}

}  // namespace kvd::quality
