#include "harness.h"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "bootstrap.h"
#include "fronts.h"
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

// CPU time of the calling thread (the engine runs in it when threads == 1).
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Runs work(worker, item) for item in [0, items) on `jobs` threads (jobs <= 1: inline), each
// worker taking the next unclaimed item; stops handing out items after the first error.
// Returns the error of the lowest failing item.
Status ParallelItems(int jobs, size_t items, const std::function<Status(int, size_t)>& work) {
  std::vector<Status> status(items);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto loop = [&](int worker) {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= items || failed.load()) return;
      status[i] = work(worker, i);
      if (!status[i].ok()) failed.store(true);
    }
  };
  if (jobs <= 1) {
    loop(0);
  } else {
    std::vector<std::thread> threads;
    for (int w = 0; w < jobs; ++w) threads.emplace_back(loop, w);
    for (auto& t : threads) t.join();
  }
  for (const Status& st : status) {
    if (!st.ok()) return st;
  }
  return Status::Ok();
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
  std::vector<int32_t> context;   // filler with the key(s) inside (compressed)
  std::vector<int32_t> question;  // fed after the (compressed) context
  std::string key;                // the key asked for
  std::vector<int32_t> answer;    // tokens of " <key>" (what greedy decoding must produce)
  int depth_index = -1;           // single-key prompts: index into passkey_depths; -1 multi-key
};

// Filler of about `tokens` tokens with each needle inserted before filler unit
// lround(depth * units) (needles in the order given; equal slots keep that order).
std::vector<int32_t> BuildContext(
    const llama::Tokenizer& tok, int tokens,
    const std::vector<std::pair<double, std::vector<int32_t>>>& needles) {
  const std::vector<int32_t> intro = tok.Encode(
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
      "it. I will quiz you about the important information there.");
  const std::vector<int32_t> unit = tok.Encode(
      " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.");
  size_t needle_tokens = 0;
  for (const auto& [d, n] : needles) needle_tokens += n.size();
  const int room = tokens - static_cast<int>(intro.size() + needle_tokens);
  const int units = std::max(1, room / static_cast<int>(unit.size()));
  std::vector<int32_t> ctx = intro;
  for (int u = 0; u <= units; ++u) {
    for (const auto& [depth, n] : needles) {
      if (static_cast<int>(std::lround(depth * units)) == u)
        ctx.insert(ctx.end(), n.begin(), n.end());
    }
    if (u < units) ctx.insert(ctx.end(), unit.begin(), unit.end());
  }
  // Filler up to exactly `tokens` (a multiple of the chunk size stays one, for chunk-wise rows).
  for (size_t i = 0; static_cast<int>(ctx.size()) < tokens; ++i)
    ctx.push_back(unit[i % unit.size()]);
  return ctx;
}

std::vector<PasskeyPrompt> BuildPasskeyPrompts(const llama::Tokenizer& tok,
                                               const HarnessOptions& o) {
  std::vector<PasskeyPrompt> out;
  if (o.passkey_filler_tokens <= 0) return out;
  std::mt19937 rng(o.seed);
  std::uniform_int_distribution<int> digits(10000, 99999);
  for (size_t di = 0; di < o.passkey_depths.size(); ++di) {
    for (int trial = 0; trial < o.passkey_trials; ++trial) {
      PasskeyPrompt p;
      p.key = std::to_string(digits(rng));
      p.depth_index = static_cast<int>(di);
      p.context = BuildContext(
          tok, o.passkey_filler_tokens,
          {{o.passkey_depths[di], tok.Encode(" The pass key is " + p.key + ". Remember it. " +
                                             p.key + " is the pass key.")}});
      p.question = tok.Encode(" What is the pass key? The pass key is");
      p.answer = tok.Encode(" " + p.key);
      out.push_back(std::move(p));
    }
  }
  // Multi-key: `multikey_keys` keys behind labelled doors at uniform random depths; one asked.
  static const char* kLabels[] = {"red",   "blue",  "green",  "yellow",
                                  "white", "black", "orange", "grey"};
  std::uniform_real_distribution<double> depth(0.0, 1.0);
  for (int trial = 0; trial < o.multikey_trials; ++trial) {
    std::vector<std::pair<double, std::vector<int32_t>>> needles;
    std::vector<std::string> keys;
    for (int k = 0; k < o.multikey_keys; ++k) {
      keys.push_back(std::to_string(digits(rng)));
      needles.push_back({depth(rng), tok.Encode(" The pass key for the " + std::string(kLabels[k]) +
                                                " door is " + keys.back() + ". Remember it.")});
    }
    const int asked = std::uniform_int_distribution<int>(0, o.multikey_keys - 1)(rng);
    PasskeyPrompt p;
    p.key = keys[asked];
    p.context = BuildContext(tok, o.passkey_filler_tokens, needles);
    p.question = tok.Encode(" What is the pass key for the " + std::string(kLabels[asked]) +
                            " door? The pass key for the " + kLabels[asked] + " door is");
    p.answer = tok.Encode(" " + p.key);
    out.push_back(std::move(p));
  }
  return out;
}

// The tokens [begin, end) of a prefix capture as a capture of their own (positions kept), with
// `queries` (per layer [w, n_q, d]) as its window.
PrefixCapture SliceCapture(const PrefixCapture& p, int begin, int end,
                           std::vector<std::vector<float>> queries, int w) {
  const llama::LlamaConfig& cfg = *p.config;
  const size_t row = static_cast<size_t>(cfg.num_kv_heads) * cfg.head_dim;
  PrefixCapture c;
  c.config = p.config;
  c.cache.num_tokens = end - begin;
  c.cache.positions.assign(p.cache.positions.begin() + begin, p.cache.positions.begin() + end);
  c.cache.next_position = p.cache.positions[end - 1] + 1;
  c.cache.layers.resize(p.cache.layers.size());
  for (size_t l = 0; l < p.cache.layers.size(); ++l) {
    const auto& src = p.cache.layers[l];
    c.cache.layers[l].k.assign(src.k.begin() + begin * row, src.k.begin() + end * row);
    c.cache.layers[l].v.assign(src.v.begin() + begin * row, src.v.begin() + end * row);
  }
  c.window_queries = std::move(queries);
  c.window = w;
  return c;
}

// Appends the slots of `part` to `whole` per (layer, KV head).
void AppendCompact(const llama::CompactKvCache& part, llama::CompactKvCache* whole) {
  if (whole->layers.empty()) whole->layers.resize(part.layers.size());
  for (size_t l = 0; l < part.layers.size(); ++l) {
    if (whole->layers[l].empty()) whole->layers[l].resize(part.layers[l].size());
    for (size_t h = 0; h < part.layers[l].size(); ++h) {
      const llama::CompactHeadKv& src = part.layers[l][h];
      llama::CompactHeadKv& dst = whole->layers[l][h];
      dst.num_slots += src.num_slots;
      dst.k.insert(dst.k.end(), src.k.begin(), src.k.end());
      dst.v.insert(dst.v.end(), src.v.begin(), src.v.end());
      dst.bias.insert(dst.bias.end(), src.bias.begin(), src.bias.end());
    }
  }
  whole->next_position = part.next_position;
}

// Greedy decoding's answer to a passkey prompt: the question and the key's tokens are
// teacher-forced in ONE call and the argmax before each key token must be that token (exactly
// what greedy generation of the key would produce, at 1 call instead of 1 per token).
struct Answer {
  int first_wrong = -1;  // the first answer token it gets wrong; -1: all right
  // The smallest, over the key's tokens, of the key token's logit minus the best other logit:
  // how near the answer is to flipping (negative at a wrong token).
  float margin = 0;
  bool right() const { return first_wrong < 0; }
};

StatusOr<Answer> AnswerKey(LlamaSession& s, const PasskeyPrompt& p) {
  std::vector<int32_t> feed = p.question;
  feed.insert(feed.end(), p.answer.begin(), p.answer.end() - 1);
  KVD_ASSIGN_OR_RETURN(std::vector<float> logits, s.Forward(feed, {.all_logits = true}));
  const size_t V = logits.size() / feed.size();
  Answer a;
  a.margin = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < p.answer.size(); ++i) {
    const size_t row = p.question.size() - 1 + i;
    std::span<const float> r(logits.data() + row * V, V);
    if (a.first_wrong < 0 && llama::Argmax(r) != p.answer[i]) a.first_wrong = static_cast<int>(i);
    float other = -std::numeric_limits<float>::infinity();
    for (size_t v = 0; v < V; ++v) {
      if (static_cast<int32_t>(v) != p.answer[i]) other = std::max(other, r[v]);
    }
    a.margin = std::min(a.margin, r[p.answer[i]] - other);
  }
  return a;
}

// The context positions of the first occurrence of the key's answer tokens (empty: not found).
std::vector<int> AnswerPositions(const PasskeyPrompt& p) {
  const auto it = std::search(p.context.begin(), p.context.end(), p.answer.begin(), p.answer.end());
  std::vector<int> at;
  if (it == p.context.end()) return at;
  for (size_t i = 0; i < p.answer.size(); ++i) {
    at.push_back(static_cast<int>(it - p.context.begin() + static_cast<ptrdiff_t>(i)));
  }
  return at;
}

// HarnessOptions::passkey_log: one line for prompt `pi`, with the uncompressed engine's answer.
// row_answer[k]: row k's answer, none where the row was not asked.
void LogPasskeyPrompt(size_t pi, const PasskeyPrompt& p, const HarnessOptions& o,
                      const HarnessReport& rep, const Answer& engine,
                      const std::vector<std::optional<Answer>>& row_answer) {
  std::string line = "[passkey] prompt " + std::to_string(pi) + " key " + p.key + " depth " +
                     (p.depth_index >= 0 ? std::to_string(o.passkey_depths[p.depth_index])
                                         : std::string("multi")) +
                     " positions";
  for (int a : AnswerPositions(p)) line += " " + std::to_string(a);
  auto answer = [](const Answer& a) {
    char cell[96];
    if (a.right()) {
      std::snprintf(cell, sizeof(cell), "right (margin %.2f)", a.margin);
    } else {
      std::snprintf(cell, sizeof(cell), "WRONG at answer token %d (margin %.2f)", a.first_wrong,
                    a.margin);
    }
    return std::string(cell);
  };
  line += " | engine " + answer(engine);
  for (size_t k = 0; k < row_answer.size(); ++k) {
    if (!row_answer[k]) continue;
    char cell[160];
    std::snprintf(cell, sizeof(cell), " | %s %s %.2f ", rep.rows[k].method.c_str(),
                  rep.rows[k].mode.c_str(), rep.rows[k].p_c);
    line += cell + answer(*row_answer[k]);
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

void Progress(const HarnessOptions& o, Clock::time_point t0, const std::string& msg) {
  if (o.progress) std::fprintf(stderr, "[quality %6.1fs] %s\n", Since(t0), msg.c_str());
}

}  // namespace

StatusOr<MethodRatios> ParseMethodSpec(const std::string& entry,
                                       const std::vector<double>& ratios) {
  const size_t at = entry.find('@');
  MethodRatios m{entry.substr(0, at), ratios};
  if (m.name.empty()) return Status::InvalidArgument("harness options: empty method name");
  if (at == std::string::npos) return m;
  m.ratios.clear();
  std::stringstream list(entry.substr(at + 1));
  std::string cell;
  while (std::getline(list, cell, ':')) {
    size_t used = 0;
    double r = -1;
    try {
      r = std::stod(cell, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != cell.size() || cell.empty() || !(r >= 0 && r < 1)) {
      return Status::InvalidArgument("harness options: method '" + entry + "': p_c '" + cell +
                                     "' is not a number in [0, 1)");
    }
    m.ratios.push_back(r);
  }
  if (m.ratios.empty()) {
    return Status::InvalidArgument("harness options: method '" + entry + "' lists no p_c");
  }
  return m;
}

int HarnessOptions::EffectiveJobs(size_t items) const {
  int j = jobs;
  if (j == 0) {
    const int cores = std::max(1u, std::thread::hardware_concurrency());
    const int per_job = threads > 0 ? threads : cores;
    j = std::max(1, cores / per_job);
  }
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(j), items)));
}

HarnessOptions HarnessOptions::Quick() {
  HarnessOptions o;
  o.methods = {"full",          "sink_recent",  "snapkv", "keydiff",
               "snapkv+vector", "kvslimmer_l2", "hybrid"};
  o.prefix_tokens = 512;
  o.continuation_tokens = 64;
  o.max_segments = 2;
  o.window = 32;
  o.chunk_tokens = 256;
  o.chunk_window = 16;
  o.calibration_segments = 1;
  o.passkey_filler_tokens = 384;
  o.passkey_depths = {0.5};
  o.passkey_trials = 1;
  o.multikey_trials = 1;
  o.multikey_keys = 2;
  o.bootstrap_samples = 200;
  o.ratios = {0.5, 0.9};
  o.passkey_methods.clear();  // every quick method answers the passkey prompts
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
  if (modes.empty()) return bad("no modes");
  bool chunked = false;
  for (const std::string& m : modes) {
    if (m == kModeChunkWise) {
      chunked = true;
    } else if (m != kModeOneShot) {
      return bad("unknown mode '" + m + "' (known: one-shot, chunk-wise)");
    }
  }
  if (prefix_tokens < 8) return bad("prefix_tokens must be >= 8");
  if (continuation_tokens < 2) return bad("continuation_tokens must be >= 2");
  if (max_segments < 1) return bad("max_segments must be >= 1");
  if (window < 1 || window > prefix_tokens) return bad("window must be in [1, prefix_tokens]");
  if (chunked) {
    if (chunk_tokens < 8 || prefix_tokens % chunk_tokens != 0) {
      return bad("chunk-wise mode needs chunk_tokens >= 8 dividing prefix_tokens (" +
                 std::to_string(chunk_tokens) + " vs " + std::to_string(prefix_tokens) + ")");
    }
    if (chunk_window < 1 || chunk_window > chunk_tokens) {
      return bad("chunk_window must be in [1, chunk_tokens]");
    }
    if (window > chunk_tokens) {
      return bad(
          "with chunk-wise mode the one-shot window must be <= chunk_tokens (the prefix "
          "is prefilled chunk by chunk)");
    }
  }
  if (calibration_segments < 0 || passkey_filler_tokens < 0 || passkey_trials < 0 ||
      multikey_trials < 0 || bootstrap_samples < 0 || threads < 0 || jobs < 0) {
    return bad("counts must be >= 0");
  }
  if (multikey_trials > 0 && (multikey_keys < 2 || multikey_keys > 8)) {
    return bad("multikey_keys must be in [2, 8]");
  }
  for (double d : passkey_depths) {
    if (!(d >= 0 && d <= 1)) return bad("passkey depth outside [0, 1]");
  }
  std::vector<std::string> names;
  for (const std::string& entry : methods) {
    KVD_ASSIGN_OR_RETURN(MethodRatios m, ParseMethodSpec(entry, ratios));
    names.push_back(m.name);
  }
  for (const std::string& m : passkey_methods) {
    if (std::find(names.begin(), names.end(), m) == names.end()) {
      return bad("passkey method '" + m + "' is not in methods");
    }
  }
  for (const std::string& m : paired_against) {
    if (std::find(names.begin(), names.end(), m) == names.end()) {
      return bad("paired-against method '" + m + "' is not in methods");
    }
  }
  if ((passkey_fronts || passkey_chunk_wise) && chunked &&
      passkey_filler_tokens % chunk_tokens != 0) {
    return bad("passkey in chunk-wise mode needs the passkey context (" +
               std::to_string(passkey_filler_tokens) + ") to be a multiple of chunk_tokens");
  }
  return Status::Ok();
}

namespace {

// Cuts consecutive non-overlapping pieces of `len` tokens from each text and takes them
// round-robin over the texts until `count` are taken (or the texts run out).
std::vector<std::vector<int32_t>> RoundRobinCuts(const std::vector<std::vector<int32_t>>& texts,
                                                 size_t len, int count) {
  std::vector<std::vector<int32_t>> out;
  for (size_t round = 0; static_cast<int>(out.size()) < count; ++round) {
    bool any = false;
    for (const auto& ids : texts) {
      const size_t s = round * len;
      if (s + len <= ids.size() && static_cast<int>(out.size()) < count) {
        out.emplace_back(ids.begin() + s, ids.begin() + s + len);
        any = true;
      }
    }
    if (!any) break;
  }
  return out;
}

struct ChunkQueries {
  std::vector<std::vector<float>> q;  // per layer [w, n_q, d]
  int w = 0;
};

// Prefills `prefix` chunk by chunk (chunk_tokens each; one call when chunk-wise mode is off),
// capturing each chunk's last chunk_window queries and the prefix's last `window` queries.
StatusOr<PrefixCapture> CaptureChunked(LlamaSession& s, const llama::LlamaModel& model,
                                       const std::vector<int32_t>& prefix, const HarnessOptions& o,
                                       bool chunked, std::vector<ChunkQueries>* chunks) {
  if (!chunked) return Capture(s, model, prefix, o.window);
  s.Reset();
  const llama::LlamaConfig& cfg = model.config();
  const size_t qrow = static_cast<size_t>(cfg.num_q_heads) * cfg.head_dim;
  const int n = static_cast<int>(prefix.size());
  PrefixCapture p;
  p.config = &cfg;
  chunks->clear();
  for (int b = 0; b < n; b += o.chunk_tokens) {
    const int e = std::min(n, b + o.chunk_tokens);
    const bool last = e == n;
    const int want = last ? std::max(o.window, o.chunk_window) : o.chunk_window;
    std::span<const int32_t> part(prefix.data() + b, e - b);
    KVD_RETURN_IF_ERROR(s.Forward(part, {.capture_queries = want}).status());
    const auto& q = s.captured_queries();
    const int got = s.captured_query_count();
    ChunkQueries cq;
    cq.w = std::min(o.chunk_window, got);
    cq.q.resize(q.size());
    for (size_t l = 0; l < q.size(); ++l) {
      cq.q[l].assign(q[l].end() - static_cast<ptrdiff_t>(cq.w * qrow), q[l].end());
    }
    chunks->push_back(std::move(cq));
    if (last) {
      p.window = std::min(o.window, got);
      p.window_queries.resize(q.size());
      for (size_t l = 0; l < q.size(); ++l) {
        p.window_queries[l].assign(q[l].end() - static_cast<ptrdiff_t>(p.window * qrow),
                                   q[l].end());
      }
    }
  }
  KVD_ASSIGN_OR_RETURN(p.cache, s.ExportDense());
  return p;
}

// Runs `m` on the prefix in `mode`; the compact cache and the stored fraction of raw K+V bytes.
StatusOr<CompressedPrefix> CompressInMode(CompressionMethod& m, const PrefixCapture& prefix,
                                          const std::vector<ChunkQueries>& chunks,
                                          const HarnessOptions& o, const std::string& mode,
                                          double p_c) {
  const int n = prefix.cache.num_tokens;
  if (mode == kModeOneShot) {
    KVD_ASSIGN_OR_RETURN(CompressedPrefix c, m.Compress(prefix, p_c));
    if (c.stored_fraction < 0) c.stored_fraction = 1.0 - AchievedCompression(c.cache, n);
    return c;
  }
  CompressedPrefix whole;
  whole.stored_fraction = 0;
  whole.stored_bytes_fraction = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int b = static_cast<int>(c) * o.chunk_tokens;
    const int e = std::min(n, b + o.chunk_tokens);
    PrefixCapture part = SliceCapture(prefix, b, e, chunks[c].q, chunks[c].w);
    auto out = m.Compress(part, p_c);
    if (!out.ok()) return out.status().WithContext("chunk " + std::to_string(c));
    const double stored = out->stored_fraction >= 0 ? out->stored_fraction
                                                    : 1.0 - AchievedCompression(out->cache, e - b);
    whole.stored_fraction += stored * (e - b) / n;
    // Raw bytes are proportional to tokens: the chunks' fractions weighted by their tokens.
    if (out->stored_bytes_fraction < 0 || whole.stored_bytes_fraction < 0) {
      whole.stored_bytes_fraction = -1;
    } else {
      whole.stored_bytes_fraction += out->stored_bytes_fraction * (e - b) / n;
    }
    AppendCompact(out->cache, &whole.cache);
  }
  return whole;
}

// The rows: which method, at which compression ratio, in which mode.
struct RowKey {
  size_t method;
  double p_c;
  std::string mode;
};

// One row's result on one segment.
struct RowOutcome {
  Scores scores;
  double stored = 0, stored_bytes = -1, seconds = 0, cpu_seconds = 0;
  bool keeps_positions = false;
};

// Every row's result on one segment, with the uncompressed engine's.
struct SegmentOutcome {
  Scores engine;
  std::vector<RowOutcome> rows;
};

// Every row's answer to one passkey prompt.
struct PromptOutcome {
  Answer engine;
  std::vector<std::optional<Answer>> row_answer;  // [keys]: each asked row's answer
};

// State passed between the steps of RunHarness.
struct HarnessRun {
  HarnessRun(const llama::LlamaModel& m, const HarnessOptions& opts, Clock::time_point start)
      : model(m), o(opts), tok(m.tokenizer()), cfg(m.config()), t0(start) {}
  const llama::LlamaModel& model;
  const HarnessOptions& o;
  const llama::Tokenizer* tok;
  const llama::LlamaConfig& cfg;
  const Clock::time_point t0;
  HarnessReport rep;
  std::vector<ManifestEntry> manifest;
  std::vector<Segment> segments;
  std::vector<std::unique_ptr<CompressionMethod>> methods;
  std::vector<std::vector<double>> method_ratios;
  std::vector<RowKey> keys;
  // A method carrying state between Compress calls (online calibration) runs one segment at a
  // time, in segment order.
  bool parallel_safe = true;
  // Worker w uses sessions[w] for the uncompressed prefix and others[w] for a method's cache.
  std::vector<std::unique_ptr<LlamaSession>> sessions, others;
  std::mutex progress_mu;
};

// Fails when the model has no tokenizer or the prompts exceed its context.
Status CheckModel(const llama::LlamaModel& model, const HarnessOptions& o) {
  if (model.tokenizer() == nullptr)
    return Status::FailedPrecondition("the harness needs a model with a tokenizer");
  const llama::LlamaConfig& cfg = model.config();
  if (o.prefix_tokens + o.continuation_tokens > cfg.context_length ||
      o.passkey_filler_tokens + 64 > cfg.context_length) {
    return Status::InvalidArgument("segments or passkey prompts exceed the model's context " +
                                   std::to_string(cfg.context_length));
  }
  return Status::Ok();
}

// Loads the manifest and cuts the eval texts into r.segments (rep.texts, rep.segments).
Status LoadSegments(HarnessRun& r) {
  const HarnessOptions& o = r.o;
  KVD_ASSIGN_OR_RETURN(r.manifest, LoadManifest(o.manifest_path));
  std::vector<ManifestText> eval_texts;
  if (o.text_files.empty()) {
    KVD_ASSIGN_OR_RETURN(eval_texts, ReadVerified(r.manifest, "eval", &r.rep.warnings));
  } else {
    KVD_ASSIGN_OR_RETURN(eval_texts, ReadTextFiles(o.text_files));
  }
  // Segments: consecutive non-overlapping (prefix, continuation) cuts, round-robin over texts.
  const int seg_len = o.prefix_tokens + o.continuation_tokens;
  std::vector<std::vector<int32_t>> eval_ids;
  for (const ManifestText& t : eval_texts) {
    eval_ids.push_back(r.tok->Encode(t.text));
    if (eval_ids.back().size() >= static_cast<size_t>(seg_len)) {
      r.rep.texts.push_back(t.entry.path + " " + t.entry.sha256);
    }
  }
  for (auto& cut : RoundRobinCuts(eval_ids, seg_len, o.max_segments)) {
    r.segments.push_back({std::vector<int32_t>(cut.begin(), cut.begin() + o.prefix_tokens),
                          std::vector<int32_t>(cut.begin() + o.prefix_tokens, cut.end())});
  }
  if (r.segments.empty()) {
    return Status::FailedPrecondition("no eval text is long enough for a segment of " +
                                      std::to_string(seg_len) + " tokens");
  }
  r.rep.segments = static_cast<int>(r.segments.size());
  Progress(o, r.t0,
           std::to_string(r.segments.size()) + " segments of " + std::to_string(o.prefix_tokens) +
               " + " + std::to_string(o.continuation_tokens) + " tokens from " +
               std::to_string(r.rep.texts.size()) + " texts");
  return Status::Ok();
}

// Creates the listed methods (r.methods, r.method_ratios) and the first worker's session.
Status CreateMethods(HarnessRun& r, const MethodRegistry& registry) {
  for (const std::string& entry : r.o.methods) {
    KVD_ASSIGN_OR_RETURN(MethodRatios spec, ParseMethodSpec(entry, r.o.ratios));
    KVD_ASSIGN_OR_RETURN(auto m, registry.Create(spec.name));
    r.methods.push_back(std::move(m));
    r.method_ratios.push_back(std::move(spec.ratios));
  }
  r.sessions.push_back(
      std::make_unique<LlamaSession>(r.model, llama::SessionOptions{.threads = r.o.threads}));
  return Status::Ok();
}

// Calibrates the methods that need it on prefixes of the calib texts (disjoint from eval).
Status CalibrateMethods(HarnessRun& r) {
  const HarnessOptions& o = r.o;
  const bool need_calibration = std::any_of(r.methods.begin(), r.methods.end(),
                                            [](const auto& m) { return m->NeedsCalibration(); });
  if (o.calibration_segments <= 0 || !need_calibration) return Status::Ok();
  std::vector<std::string> calib_warnings;
  auto calib = ReadVerified(r.manifest, "calib", &calib_warnings);
  r.rep.warnings.insert(r.rep.warnings.end(), calib_warnings.begin(), calib_warnings.end());
  std::vector<PrefixCapture> captures;
  if (calib.ok()) {
    // One prefix per calib text in turn (round-robin), so that every domain is represented.
    std::vector<std::vector<int32_t>> ids;
    for (const ManifestText& t : *calib) {
      ids.push_back(r.tok->Encode(t.text));
      r.rep.calib_texts.push_back(t.entry.path + " " + t.entry.sha256);
    }
    for (auto& prefix : RoundRobinCuts(ids, o.prefix_tokens, o.calibration_segments)) {
      KVD_ASSIGN_OR_RETURN(PrefixCapture p, Capture(*r.sessions[0], r.model, prefix, o.window));
      captures.push_back(std::move(p));
    }
  }
  Progress(o, r.t0, "calibration prefixes: " + std::to_string(captures.size()));
  for (auto& m : r.methods) {
    if (!m->NeedsCalibration()) continue;
    Status s = m->Calibrate(captures);
    if (!s.ok()) return s.WithContext("calibrating " + m->name());
    if (auto r2 = m->CalibrationR2(); !r2.empty()) r.rep.calibration_r2[m->name()] = r2;
  }
  return Status::Ok();
}

// Lays out r.keys and r.rep.rows: "full" once at p_c 0 (one-shot), every other method at every
// ratio in every mode.
void PlanRows(HarnessRun& r) {
  const HarnessOptions& o = r.o;
  for (const std::string& mode : o.modes) {
    for (size_t m = 0; m < r.methods.size(); ++m) {
      if (r.methods[m]->name() == "full") {
        if (mode == o.modes.front()) r.keys.push_back({m, 0.0, kModeOneShot});
      } else {
        for (double p_c : r.method_ratios[m]) r.keys.push_back({m, p_c, mode});
      }
    }
  }
  r.rep.rows.resize(r.keys.size());
  for (size_t k = 0; k < r.keys.size(); ++k) {
    MethodResult& row = r.rep.rows[k];
    row.method = r.methods[r.keys[k].method]->name();
    row.p_c = r.keys[k].p_c;
    row.mode = r.keys[k].mode;
    row.layer_rel_error.assign(r.cfg.num_layers, 0.0);
    row.passkey_depth_correct.assign(o.passkey_depths.size(), 0);
    row.passkey_depth_total.assign(o.passkey_depths.size(), 0);
  }
}

// Gives workers [0, jobs) their pair of sessions, creating the missing ones in worker order.
void AddWorkers(HarnessRun& r, int jobs) {
  const llama::SessionOptions so{.threads = r.o.threads};
  for (size_t w = 0; w < static_cast<size_t>(jobs); ++w) {
    if (w >= r.sessions.size()) r.sessions.push_back(std::make_unique<LlamaSession>(r.model, so));
    if (w >= r.others.size()) r.others.push_back(std::make_unique<LlamaSession>(r.model, so));
  }
}

// Compresses `prefix` with row k's method, loads it into `other` and scores the continuation.
StatusOr<RowOutcome> ScoreRow(HarnessRun& r, size_t k, const PrefixCapture& prefix,
                              const std::vector<ChunkQueries>& chunk_queries, LlamaSession& other,
                              const Segment& seg, const Reference& ref) {
  const HarnessOptions& o = r.o;
  RowOutcome out;
  const auto tr = Clock::now();
  const double cpu0 = ThreadCpuSeconds();
  const MethodResult& row = r.rep.rows[k];
  CompressionMethod& m = *r.methods[r.keys[k].method];
  auto cache = CompressInMode(m, prefix, chunk_queries, o, row.mode, row.p_c);
  if (!cache.ok()) {
    return cache.status().WithContext(m.name() + " p_c=" + std::to_string(row.p_c) + " " +
                                      row.mode);
  }
  if (cache->cache.next_position != o.prefix_tokens) {
    return Status::Internal(m.name() + " returned next_position " +
                            std::to_string(cache->cache.next_position) + ", expected " +
                            std::to_string(o.prefix_tokens));
  }
  Status ls = other.LoadCompact(cache->cache);
  if (!ls.ok()) return ls.WithContext(m.name() + " returned an unusable cache");
  KVD_ASSIGN_OR_RETURN(out.scores,
                       ScoreContinuation(other, r.cfg, seg.continuation, &ref, nullptr));
  out.stored = cache->stored_fraction;
  out.stored_bytes = cache->stored_bytes_fraction;
  out.keeps_positions = KeepsPositions(cache->cache, o.prefix_tokens);
  out.seconds = Since(tr);
  out.cpu_seconds = ThreadCpuSeconds() - cpu0;
  return out;
}

// Scores every row on segment si with worker w's sessions.
Status ScoreSegment(HarnessRun& r, int w, size_t si, bool chunked, SegmentOutcome& out,
                    int& segments_done) {
  LlamaSession& s = *r.sessions[w];
  const Segment& seg = r.segments[si];
  std::vector<ChunkQueries> chunk_queries;
  KVD_ASSIGN_OR_RETURN(PrefixCapture prefix,
                       CaptureChunked(s, r.model, seg.prefix, r.o, chunked, &chunk_queries));
  Reference ref;
  KVD_ASSIGN_OR_RETURN(out.engine, ScoreContinuation(s, r.cfg, seg.continuation, nullptr, &ref));
  out.rows.resize(r.keys.size());
  for (size_t k = 0; k < r.keys.size(); ++k) {
    KVD_ASSIGN_OR_RETURN(out.rows[k],
                         ScoreRow(r, k, prefix, chunk_queries, *r.others[w], seg, ref));
  }
  std::lock_guard<std::mutex> lock(r.progress_mu);
  ++segments_done;
  Progress(r.o, r.t0,
           "segment " + std::to_string(segments_done) + "/" + std::to_string(r.segments.size()) +
               " (#" + std::to_string(si + 1) + "): engine ppl " +
               std::to_string(std::exp(out.engine.nll / out.engine.n)));
  return Status::Ok();
}

// Scores the segments in parallel (jobs workers, each with its own two engine sessions); every
// result is kept per segment, so the sums below do not depend on jobs.
StatusOr<std::vector<SegmentOutcome>> ScoreSegments(HarnessRun& r) {
  const HarnessOptions& o = r.o;
  const bool chunked = std::find(o.modes.begin(), o.modes.end(), kModeChunkWise) != o.modes.end();
  std::vector<SegmentOutcome> outcomes(r.segments.size());
  r.parallel_safe = std::all_of(r.methods.begin(), r.methods.end(),
                                [](const auto& m) { return m->ParallelSafe(); });
  const int jobs = r.parallel_safe ? o.EffectiveJobs(std::max(r.segments.size(), size_t{1})) : 1;
  AddWorkers(r, jobs);
  int segments_done = 0;
  KVD_RETURN_IF_ERROR(ParallelItems(jobs, r.segments.size(), [&](int w, size_t si) -> Status {
    return ScoreSegment(r, w, si, chunked, outcomes[si], segments_done);
  }));
  return outcomes;
}

// Sums the segment outcomes into the rows and the engine's totals, in segment order.
void SumSegments(HarnessRun& r, const std::vector<SegmentOutcome>& outcomes) {
  HarnessReport& rep = r.rep;
  const double n_seg = static_cast<double>(r.segments.size());
  for (MethodResult& row : rep.rows) {
    row.stored_raw = 0;
    row.keeps_positions = true;
  }
  for (const SegmentOutcome& out : outcomes) {
    rep.engine_nll_sum += out.engine.nll;
    rep.engine_scored_tokens += out.engine.n;
    rep.engine_seg_nll.push_back(out.engine.nll);
    for (size_t k = 0; k < r.keys.size(); ++k) {
      MethodResult& row = rep.rows[k];
      const RowOutcome& ro = out.rows[k];
      row.achieved_p_c += (1.0 - ro.stored) / n_seg;
      row.stored_raw =
          ro.stored_bytes < 0 || row.stored_raw < 0 ? -1 : row.stored_raw + ro.stored_bytes / n_seg;
      row.keeps_positions = row.keeps_positions && ro.keeps_positions;
      row.nll_sum += ro.scores.nll;
      row.scored_tokens += ro.scores.n;
      row.top1_agreement += static_cast<double>(ro.scores.agree);
      row.seg_nll.push_back(ro.scores.nll);
      row.seg_n.push_back(ro.scores.n);
      row.seg_agree.push_back(ro.scores.agree);
      for (int l = 0; l < r.cfg.num_layers; ++l)
        row.layer_rel_error[l] += ro.scores.rel_err[l] / n_seg;
      row.seconds += ro.seconds;
      row.cpu_seconds += ro.cpu_seconds;
    }
  }
}

// Derives each row's perplexity, agreement, mean error and bootstrap intervals from its sums.
void FinishRows(HarnessRun& r) {
  HarnessReport& rep = r.rep;
  for (MethodResult& row : rep.rows) {
    row.perplexity = std::exp(row.nll_sum / static_cast<double>(row.scored_tokens));
    row.top1_agreement /= static_cast<double>(row.scored_tokens);
    double s = 0;
    for (double e : row.layer_rel_error) s += e;
    row.mean_rel_error = s / r.cfg.num_layers;
    const BootstrapResult b = BootstrapSegments(
        {row.seg_nll, rep.engine_seg_nll, row.seg_n, row.seg_agree}, r.o.bootstrap_samples);
    row.ppl_ratio_lo = b.ppl_ratio.lo;
    row.ppl_ratio_hi = b.ppl_ratio.hi;
    row.top1_lo = b.top1.lo;
    row.top1_hi = b.top1.hi;
  }
  rep.engine_perplexity =
      std::exp(rep.engine_nll_sum / static_cast<double>(rep.engine_scored_tokens));
}

// Which rows answer the passkey prompts: the listed methods' one-shot (and with
// passkey_chunk_wise chunk-wise) rows, and with passkey_fronts every row on a front.
std::vector<bool> PasskeyRows(const HarnessRun& r) {
  const HarnessOptions& o = r.o;
  std::vector<bool> passkey_row(r.keys.size());
  const std::vector<bool> on_front = OnAnyFront(r.rep);
  for (size_t k = 0; k < r.keys.size(); ++k) {
    const MethodResult& row = r.rep.rows[k];
    const bool listed = o.passkey_methods.empty() ||
                        std::find(o.passkey_methods.begin(), o.passkey_methods.end(), row.method) !=
                            o.passkey_methods.end();
    const bool listed_mode =
        row.mode == kModeOneShot || (o.passkey_chunk_wise && row.mode == kModeChunkWise);
    passkey_row[k] = (listed && listed_mode) || (o.passkey_fronts && on_front[k]);
  }
  return passkey_row;
}

// Passkey work shared by the prompt workers.
struct PasskeyPlan {
  std::vector<PasskeyPrompt> prompts;
  std::vector<bool> passkey_row;  // [keys]
  bool chunked_prompts = false;   // some asked row is chunk-wise
  int prompts_done = 0;
};

// Answers prompt pi with the engine and with every asked row, using worker w's sessions.
Status AnswerPrompt(HarnessRun& r, PasskeyPlan& plan, int w, size_t pi, PromptOutcome& out) {
  const HarnessOptions& o = r.o;
  LlamaSession& s = *r.sessions[w];
  LlamaSession& other = *r.others[w];
  const PasskeyPrompt& p = plan.prompts[pi];
  out.row_answer.assign(r.keys.size(), std::nullopt);
  std::vector<ChunkQueries> chunk_queries;
  KVD_ASSIGN_OR_RETURN(PrefixCapture prefix, CaptureChunked(s, r.model, p.context, o,
                                                            plan.chunked_prompts, &chunk_queries));
  KVD_ASSIGN_OR_RETURN(out.engine, AnswerKey(s, p));
  for (size_t k = 0; k < r.keys.size(); ++k) {
    const MethodResult& row = r.rep.rows[k];
    if (!plan.passkey_row[k]) continue;
    CompressionMethod& m = *r.methods[r.keys[k].method];
    auto cache = CompressInMode(m, prefix, chunk_queries, o, row.mode, row.p_c);
    if (!cache.ok()) return cache.status().WithContext(m.name() + " (passkey)");
    KVD_RETURN_IF_ERROR(other.LoadCompact(cache->cache));
    KVD_ASSIGN_OR_RETURN(out.row_answer[k], AnswerKey(other, p));
  }
  std::lock_guard<std::mutex> lock(r.progress_mu);
  if (o.passkey_log) LogPasskeyPrompt(pi, p, o, r.rep, out.engine, out.row_answer);
  ++plan.prompts_done;
  const size_t n = plan.prompts.size();
  if (plan.prompts_done == static_cast<int>(n) || plan.prompts_done % 10 == 0) {
    Progress(o, r.t0,
             "passkey " + std::to_string(plan.prompts_done) + "/" + std::to_string(n) + " (" +
                 std::to_string(p.context.size()) + " tokens)");
  }
  return Status::Ok();
}

// Adds prompt p's answers to the engine's and the rows' passkey (or multikey) counts.
void CountAnswers(HarnessRun& r, const PasskeyPrompt& p, const PromptOutcome& out) {
  HarnessReport& rep = r.rep;
  if (p.depth_index >= 0) {
    rep.engine_passkey_correct += out.engine.right();
    ++rep.engine_passkey_total;
  } else {
    rep.engine_multikey_correct += out.engine.right();
    ++rep.engine_multikey_total;
  }
  for (size_t k = 0; k < r.keys.size(); ++k) {
    if (!out.row_answer[k]) continue;
    MethodResult& row = rep.rows[k];
    const bool ok = out.row_answer[k]->right();
    if (p.depth_index >= 0) {
      row.passkey_correct += ok;
      ++row.passkey_total;
      row.passkey_depth_correct[p.depth_index] += ok;
      ++row.passkey_depth_total[p.depth_index];
    } else {
      row.multikey_correct += ok;
      ++row.multikey_total;
    }
  }
}

// Passkey retrieval (the question comes after the compressed context): prompts in parallel like
// the segments, results counted in prompt order.
Status RunPasskeys(HarnessRun& r) {
  const HarnessOptions& o = r.o;
  PasskeyPlan plan;
  plan.prompts = BuildPasskeyPrompts(*r.tok, o);
  plan.passkey_row = PasskeyRows(r);
  for (size_t k = 0; k < r.keys.size(); ++k) {
    plan.chunked_prompts =
        plan.chunked_prompts || (plan.passkey_row[k] && r.rep.rows[k].mode == kModeChunkWise);
  }
  std::vector<PromptOutcome> answers(plan.prompts.size());
  // More prompts than segments can take more workers than the segments had: each gets its own
  // pair of sessions.
  const int prompt_jobs =
      r.parallel_safe ? o.EffectiveJobs(std::max(plan.prompts.size(), size_t{1})) : 1;
  AddWorkers(r, prompt_jobs);
  KVD_RETURN_IF_ERROR(ParallelItems(
      prompt_jobs, plan.prompts.size(),
      [&](int w, size_t pi) -> Status { return AnswerPrompt(r, plan, w, pi, answers[pi]); }));
  for (size_t pi = 0; pi < plan.prompts.size(); ++pi)
    CountAnswers(r, plan.prompts[pi], answers[pi]);
  return Status::Ok();
}

}  // namespace

StatusOr<HarnessReport> RunHarness(const llama::LlamaModel& model, const HarnessOptions& o,
                                   const MethodRegistry& registry) {
  KVD_RETURN_IF_ERROR(o.Validate());
  HarnessRun r(model, o, Clock::now());
  KVD_RETURN_IF_ERROR(CheckModel(model, o));
  r.rep.options = o;
  KVD_RETURN_IF_ERROR(LoadSegments(r));
  KVD_RETURN_IF_ERROR(CreateMethods(r, registry));
  KVD_RETURN_IF_ERROR(CalibrateMethods(r));
  PlanRows(r);
  KVD_ASSIGN_OR_RETURN(const std::vector<SegmentOutcome> outcomes, ScoreSegments(r));
  SumSegments(r, outcomes);
  FinishRows(r);
  KVD_RETURN_IF_ERROR(RunPasskeys(r));
  r.rep.seconds = Since(r.t0);
  return std::move(r.rep);
}

}  // namespace kvd::quality
