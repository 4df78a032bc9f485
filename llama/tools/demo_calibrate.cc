// kvd-demo calibrate: a corpus through the engine until kvd's VECTOR calibration completes.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <span>
#include <sstream>
#include <thread>

#include "demo.h"

namespace kvd::demo {
namespace {

// The corpus as token ids: text through the model's tokenizer, or (--token-ids) ids as written.
StatusOr<std::vector<int32_t>> CorpusTokens(const llama::LlamaModel& model, const std::string& path,
                                            bool token_ids) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot read the corpus " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!token_ids) {
    const llama::Tokenizer* tok = model.tokenizer();
    if (tok == nullptr) {
      return Status::InvalidArgument(
          "the model file has no tokenizer: give the corpus as token ids with --token-ids");
    }
    return tok->Encode(ss.str());
  }
  std::vector<int32_t> ids;
  std::string word;
  const int vocab = model.config().vocab_size;
  while (ss >> word) {
    char* end = nullptr;
    const long id = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || id < 0 || id >= vocab) {
      return Status::InvalidArgument(path + ": '" + word + "' (token " +
                                     std::to_string(ids.size()) + ") is not a token id in [0, " +
                                     std::to_string(vocab) + ")");
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// The model's calibration row (exactly one, since the model is named).
StatusOr<client::CalibrationInfo> CalibrationOf(client::Client& c, const std::string& model) {
  KVD_ASSIGN_OR_RETURN(auto all, c.GetCalibration(model));
  if (all.size() != 1) {
    return Status::Internal("kvd answered " + std::to_string(all.size()) +
                            " calibration rows for model " + model);
  }
  return all[0];
}

struct CalibrationPut {
  int threads = 1;
  int chunk_tokens = 0;
  int window = 0;                  // the session's window tokens (0: none sent, 32 prefilled)
  uint64_t salt = 0;               // xor-ed into every chunk hash's high word
  uint64_t* chunks_put = nullptr;  // counts the chunks put
};

// Prefills one calibration prompt and puts its chunks (salted, with window queries when the
// session takes them), retrying a full ingest queue after a pause.
Status PutCalibrationPrompt(client::Client& c, const llama::LlamaModel& model,
                            std::span<const int32_t> prompt, const CalibrationPut& p) {
  llama::LlamaSession ses(model, {.threads = p.threads});
  KVD_ASSIGN_OR_RETURN(
      auto pre,
      llama::PrefillChunks(ses, prompt, c.options().layout,
                           {.chunk_tokens = p.chunk_tokens,
                            .window = p.window > 0 ? p.window : std::min(32, p.chunk_tokens)}));
  std::vector<Hash128> chain = c.hasher().ChunkChain(prompt, false);
  for (size_t i = 0; i < pre.chunks.size(); ++i) {
    const llama::PrefillChunk& ch = pre.chunks[i];
    client::PutItem item{.hash = {chain[i].hi ^ p.salt, chain[i].lo},
                         .tokens = ch.tokens,
                         .data = ch.raw.data(),
                         .bytes = ch.raw.size(),
                         .first_position = static_cast<uint64_t>(ch.first_position)};
    if (p.window > 0) {
      item.window = ch.window;
      item.window_queries = ch.window_queries;
    }
    for (;;) {  // the ingest queue may be full: retry after the hinted pause
      auto put = c.PutChunks(std::span<const client::PutItem>(&item, 1));
      if (put.ok()) break;
      if (put.status().code() != StatusCode::kResourceExhausted) {
        return put.status().WithContext("put chunk " + std::to_string(*p.chunks_put));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ++*p.chunks_put;
  }
  return Status::Ok();
}

// The calibration chunks are no prompt anyone will look up: evicts them when allowed (an admin
// session; KVD_ADMIN_TOKEN when the daemon takes tokens), else says how to.
void EvictCalibrationChunks(client::Client& c) {
  client::ClientOptions admin_options = c.options();
  admin_options.role = client::Role::kAdmin;
  if (const char* token = std::getenv("KVD_ADMIN_TOKEN")) admin_options.auth_token = token;
  auto admin = client::Client::Connect(admin_options);
  auto evicted = admin.ok() ? (*admin)->Evict({.kind = client::EvictFilter::Kind::kNamespace,
                                               .name = c.options().name_space})
                            : StatusOr<client::EvictResult>(admin.status());
  if (evicted.ok()) {
    std::printf("[calibrate] evicted the %llu calibration chunks of namespace %s\n",
                static_cast<unsigned long long>(evicted->chunks), c.options().name_space.c_str());
  } else {
    std::printf(
        "[calibrate] calibration chunks left in namespace %s (%s); evict them with: "
        "kvdctl evict --namespace %s\n",
        c.options().name_space.c_str(), evicted.status().ToString().c_str(),
        c.options().name_space.c_str());
  }
}

// The calibration row before feeding: FAILED_PRECONDITION when the policy routes no values.
// *segment: the prompt length (--segment-tokens, default 4 chunks, at most the model's
// context); 2 (usage) is returned through *usage_rc when it is out of range.
StatusOr<client::CalibrationInfo> StartCalibration(client::Client& c, const Setup& s,
                                                   const llama::LlamaModel& model, int64_t* segment,
                                                   int* usage_rc) {
  const std::string& name = c.options().model;
  KVD_ASSIGN_OR_RETURN(client::CalibrationInfo cal, CalibrationOf(c, name));
  if (cal.state == "not-routing") {
    return Status::FailedPrecondition("model " + name + "'s compression policy (" +
                                      c.session().policy + ") does not route values (no vector " +
                                      "stage): there is nothing to calibrate");
  }
  const int64_t context = model.config().context_length;
  const int64_t max_segment =
      (context > 0 ? context : 4 * s.chunk_tokens) / s.chunk_tokens * s.chunk_tokens;
  if (*segment == 0) *segment = std::min<int64_t>(4 * s.chunk_tokens, max_segment);
  if (*segment < s.chunk_tokens || *segment > max_segment) {
    std::cerr << "kvd-demo calibrate: --segment-tokens must be in [" << s.chunk_tokens << ", "
              << max_segment << "] (one chunk .. the model's context)\n";
    *usage_rc = 2;
  }
  return cal;
}

// Puts the corpus prompt by prompt until the calibration leaves "collecting" or the corpus ends;
// *cal is the last row read.
Status FeedCorpus(client::Client& c, const Setup& s, const llama::LlamaModel& model,
                  const std::vector<int32_t>& ids, int64_t segment, int threads,
                  client::CalibrationInfo* cal, uint64_t* chunks_put) {
  // Salt: this run's chunk hashes differ from every earlier run's, so no put dedups.
  const uint64_t salt =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count() ^
                            (static_cast<uint64_t>(::getpid()) << 32));
  const int window = static_cast<int>(c.session().window_tokens);
  for (size_t off = 0; off + s.chunk_tokens <= ids.size() && cal->state == "collecting";
       off += static_cast<size_t>(segment)) {
    const std::span<const int32_t> prompt =
        std::span<const int32_t>(ids).subspan(off, std::min<size_t>(segment, ids.size() - off));
    KVD_RETURN_IF_ERROR(PutCalibrationPrompt(c, model, prompt,
                                             {.threads = threads,
                                              .chunk_tokens = s.chunk_tokens,
                                              .window = window,
                                              .salt = salt,
                                              .chunks_put = chunks_put}));
    auto row = CalibrationOf(c, c.options().model);
    if (!row.ok()) return row.status().WithContext("calibration of " + c.options().model);
    *cal = std::move(*row);
    std::printf(
        "[calibrate] %zu corpus tokens: %llu chunks put, %llu of %llu tokens per head, %s\n",
        off + prompt.size(), static_cast<unsigned long long>(*chunks_put),
        static_cast<unsigned long long>(cal->tokens_seen),
        static_cast<unsigned long long>(cal->tokens_needed), cal->state.c_str());
  }
  return Status::Ok();
}

}  // namespace

int RunCalibrate(const Flags& f) {
  auto model = llama::LlamaModel::Load(f.model_file);
  if (!model.ok()) return Fail("model", model.status());
  auto ids = CorpusTokens(**model, f.from, f.token_ids);
  if (!ids.ok()) return Fail("corpus", ids.status());
  Setup s;
  auto client = ConnectEngine(f, &s, "kvd-calibrate");
  if (!client.ok()) return Fail("connect", client.status());
  client::Client& c = **client;
  const std::string name = c.options().model;
  int64_t segment = f.segment_tokens;
  int usage_rc = 0;
  auto cal = StartCalibration(c, s, **model, &segment, &usage_rc);
  if (!cal.ok()) {
    return Fail(cal.status().code() == StatusCode::kFailedPrecondition ? "calibrate"
                                                                       : "calibration of " + name,
                cal.status());
  }
  if (cal->state == "calibrated") {
    std::printf("[calibrate] model %s is already calibrated\n", name.c_str());
    tools::PrintCalibration(std::cout, {*cal});
    return 0;
  }
  if (usage_rc != 0) return usage_rc;
  std::printf(
      "[calibrate] model %s (%s): %llu of %llu tokens per head seen; corpus %s: %zu tokens, "
      "prompts of %lld tokens, namespace %s\n",
      name.c_str(), c.options().layout.ToString().c_str(),
      static_cast<unsigned long long>(cal->tokens_seen),
      static_cast<unsigned long long>(cal->tokens_needed), f.from.c_str(), ids->size(),
      static_cast<long long>(segment), c.options().name_space.c_str());
  uint64_t chunks_put = 0;
  const auto t0 = std::chrono::steady_clock::now();
  if (Status fed = FeedCorpus(c, s, **model, *ids, segment, f.threads, &*cal, &chunks_put);
      !fed.ok()) {
    return Fail("calibrate", fed);
  }
  const double seconds = Since(t0);
  EvictCalibrationChunks(c);
  if (cal->state != "calibrated") {
    return Fail("calibrate", Status::FailedPrecondition(
                                 "the corpus " + f.from + " (" + std::to_string(ids->size()) +
                                 " tokens) gave " + std::to_string(cal->tokens_seen) + " of the " +
                                 std::to_string(cal->tokens_needed) +
                                 " tokens per head calibration needs: give a longer corpus"));
  }
  std::printf("[calibrate] calibrated in %.1f s: %llu chunks put\n", seconds,
              static_cast<unsigned long long>(chunks_put));
  tools::PrintCalibration(std::cout, {*cal});
  return 0;
}

}  // namespace kvd::demo
