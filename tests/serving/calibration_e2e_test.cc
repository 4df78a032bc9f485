// Online VECTOR calibration and codec ids through real kvd processes (label `serving`): the saved
// weights survive a restart (same W bytes, same R^2, same codec id), so does a calibration still
// collecting (from its checkpoint), a damaged or mismatched saved record is refused and
// calibration starts again, a policy change gives a new codec id
// under which the old chunks (still stored on disk) are never served, and chunks stored before
// calibration completed are not served under the calibrated codec id; `kvdctl calibrate` (kvd-demo
// calibrate: the reference engine on stories260K) completes calibration and `kvdctl calibration`
// shows it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kvd/kernels/rope.h"
#include "kvd/kernels/vector.h"
#include "serving_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// 4 chunks of 256 tokens complete calibration.
constexpr int kCalibrationTokens = 4 * kTokens;
const std::string kVectorModel = "stories-vector";

std::string VectorPolicy(double p_c = 0.5) {
  return "{stages: [snapkv, vector], p_c: " + std::to_string(p_c) +
         ", window: 32, sinks: 4, r2_threshold: 0.5, calibration_tokens: " +
         std::to_string(kCalibrationTokens) + ", worker_threads: 2, queue_depth: 8}";
}

// A chunk whose values follow the pre-RoPE keys on even KV heads (v = kpre + 0.1 noise: R^2 near
// 0.99) and are independent noise on odd heads (R^2 near head_dim / tokens seen, far below 0.5).
// Keys are rotated with the model's RoPE at the chunk's positions, as an engine's keys are.
Chunk MakeStructuredChunk(const ModelLayout& layout, uint64_t first_position, uint32_t seed) {
  Chunk c = MakeChunk(layout, kTokens, seed);  // window queries and the raw buffer's size
  std::mt19937 rng(seed * 7919u + 1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int H = layout.num_kv_heads, d = layout.head_dim, n = kTokens;
  const size_t half = static_cast<size_t>(n) * H * d;
  std::vector<float> raw(2 * half * layout.num_layers);
  auto rope = kk::RopeTable::Create(layout.rope, d);
  EXPECT_TRUE(rope.ok()) << rope.status();
  std::vector<int64_t> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = static_cast<int64_t>(first_position) + i;
  for (int l = 0; l < layout.num_layers; ++l) {
    float* k = raw.data() + 2 * half * l;
    float* v = k + half;
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < H; ++h) {
        for (int j = 0; j < d; ++j) {
          const size_t at = (static_cast<size_t>(i) * H + h) * d + j;
          k[at] = dist(rng);
          v[at] = h % 2 == 0 ? k[at] + 0.1f * dist(rng) : dist(rng);
        }
      }
    }
    std::vector<kk::MatrixView> heads;
    for (int h = 0; h < H; ++h) heads.push_back({k + h * d, n, d, static_cast<int64_t>(H) * d});
    Status s = kk::ApplyRope(*rope, kk::RopeDirection::kRotate, positions, heads);
    EXPECT_TRUE(s.ok()) << s;
  }
  std::memcpy(c.raw.data(), raw.data(), c.raw.size());
  return c;
}

// Flips one byte of a file behind kvd's back.
void FlipByte(const fs::path& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char b = 0;
  f.seekg(offset);
  f.read(&b, 1);
  b = static_cast<char>(b ^ 0x5a);
  f.seekp(offset);
  f.write(&b, 1);
  ASSERT_TRUE(f.good()) << "cannot flip byte " << offset << " of " << path;
}

class CalibrationE2eTest : public ServingDirFixture {
 protected:
  // (Re)starts kvd with the vector model under `policy`, a disk tier in dir_/disk when `disk`,
  // and state_dir dir_/state otherwise.
  void Restart(const std::string& policy, bool disk) {
    if (kvd_ && kvd_->Alive()) ASSERT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    kvd_.reset();
    StartKvd(PolicyModel(kVectorModel, policy), disk ? "" : "state_dir: " + dir_ + "/state\n",
             disk ? dir_ + "/disk" : "");
  }
  client::CalibrationInfo Calibration() {
    auto c = Connect(kVectorModel);
    if (c == nullptr) return {};
    auto cal = c->GetCalibration(kVectorModel);
    EXPECT_TRUE(cal.ok()) << cal.status();
    if (!cal.ok() || cal->size() != 1) return {};
    return (*cal)[0];
  }
  // Puts `chunks` as one prompt (hash chain {tag, i}) and returns the chain.
  std::vector<Hash128> PutPrompt(client::Client& c, uint64_t tag, int chunks, uint32_t seed) {
    const ModelLayout layout = c.options().layout;
    std::vector<Hash128> chain;
    std::vector<Chunk> data;
    std::vector<client::PutItem> items;
    for (int i = 0; i < chunks; ++i) {
      chain.push_back({tag, static_cast<uint64_t>(i)});
      data.push_back(MakeStructuredChunk(layout, static_cast<uint64_t>(i) * kTokens, seed + i));
    }
    for (int i = 0; i < chunks; ++i) items.push_back(Item(chain[i], data[i], i * kTokens));
    auto put = c.PutChunks(items);
    EXPECT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();
    return chain;
  }
  uint32_t Matched(client::Client& c, const std::vector<Hash128>& chain) {
    auto hit = c.Lookup(chain);
    EXPECT_TRUE(hit.ok()) << hit.status();
    if (!hit.ok()) return 0;
    if (hit->lease_id != 0) EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
    return hit->matched_chunks;
  }
  // Chunks of the model stored in any tier (each listed once, at its highest tier).
  uint64_t StoredChunks() { return StoredChunksIn("", ""); }
  // Chunks of the model in namespace `ns` ("" = any) on tier `tier` ("" = any).
  uint64_t StoredChunksIn(const std::string& ns, const std::string& tier) {
    auto admin = client::Client::Connect(kvd_->AdminOptions());
    EXPECT_TRUE(admin.ok()) << admin.status();
    if (!admin.ok()) return 0;
    auto l = (*admin)->List({ns, kVectorModel, 0});
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return 0;
    uint64_t n = 0;
    for (const auto& chunk : l->chunks) n += tier.empty() || chunk.tier == tier;
    return n;
  }
  std::vector<uint8_t> Weights(uint64_t version) {
    auto c = Connect(kVectorModel);
    if (c == nullptr) return {};
    auto w = c->GetVectorWeights(version);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? **w : std::vector<uint8_t>{};
  }
};

// Calibrates with 4 structured chunks: even heads route, odd heads do not.
void ExpectCalibrated(const client::CalibrationInfo& cal, uint32_t collecting_codec) {
  EXPECT_EQ(cal.state, "calibrated");
  EXPECT_NE(cal.version, 0u);
  EXPECT_NE(cal.codec_id, 0u);
  EXPECT_NE(cal.codec_id, collecting_codec);
  EXPECT_EQ(cal.tokens_seen, static_cast<uint64_t>(kCalibrationTokens));
  ASSERT_EQ(cal.r2.size(), 5u * 4u);
  ASSERT_EQ(cal.routes.size(), 5u * 4u);
  for (size_t i = 0; i < cal.r2.size(); ++i) {
    // Even heads: v = kpre + 0.1 noise, R^2 = 1 - 0.01 / 1.01 ~ 0.99; odd heads: independent
    // noise, R^2 ~ d / n = 8 / 1024 plus sampling spread, far below 0.5.
    if (i % 2 == 0) {
      EXPECT_GT(cal.r2[i], 0.95) << "head " << i;
      EXPECT_TRUE(cal.routes[i]) << "head " << i;
    } else {
      EXPECT_LT(cal.r2[i], 0.1) << "head " << i;
      EXPECT_FALSE(cal.routes[i]) << "head " << i;
    }
  }
}

TEST_F(CalibrationE2eTest, CalibrationSurvivesARestartWithTheDiskTier) {
  Restart(VectorPolicy(), /*disk=*/true);
  auto c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  client::CalibrationInfo before = Calibration();
  EXPECT_EQ(before.state, "collecting");
  EXPECT_EQ(before.tokens_seen, 0u);
  EXPECT_EQ(before.tokens_needed, static_cast<uint64_t>(kCalibrationTokens));
  EXPECT_EQ(before.version, 0u);
  const uint32_t collecting_codec = c->session().codec_id;
  EXPECT_EQ(before.codec_id, collecting_codec);

  // Three chunks: still collecting, stored (and served) under the collecting codec id.
  std::vector<Hash128> early = PutPrompt(*c, 1, 3, 100);
  EXPECT_EQ(Calibration().tokens_seen, 3u * kTokens);
  EXPECT_EQ(Matched(*c, early), 3u);

  // The fourth completes calibration: the codec id changes, the early chunks are not served
  // under it (though still stored), and chunks put now are served under it.
  PutPrompt(*c, 2, 1, 200);
  client::CalibrationInfo cal = Calibration();
  ExpectCalibrated(cal, collecting_codec);
  auto fresh = Connect(kVectorModel);
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(fresh->session().codec_id, cal.codec_id);
  EXPECT_EQ(fresh->session().calibration_version, cal.version);
  EXPECT_EQ(Matched(*fresh, early), 0u);
  EXPECT_EQ(StoredChunks(), 4u);
  std::vector<Hash128> late = PutPrompt(*fresh, 3, 2, 300);
  EXPECT_EQ(Matched(*fresh, late), 2u);
  const std::vector<uint8_t> w = Weights(cal.version);
  ASSERT_FALSE(w.empty());

  // Restart on the same disk tier: same calibration, same W bytes, same codec id, no new
  // collection; the chunks put under it are served again.
  Restart(VectorPolicy(), /*disk=*/true);
  EXPECT_THAT(kvd_->Log(), HasSubstr("VECTOR calibration reloaded"));
  client::CalibrationInfo again = Calibration();
  EXPECT_EQ(again.state, "calibrated");
  EXPECT_EQ(again.version, cal.version);
  EXPECT_EQ(again.codec_id, cal.codec_id);
  EXPECT_EQ(again.tokens_seen, cal.tokens_seen);
  EXPECT_EQ(again.r2, cal.r2);  // exact: the saved bytes, not a new fit
  EXPECT_EQ(again.routes, cal.routes);
  EXPECT_TRUE(Weights(cal.version) == w);
  auto after = Connect(kVectorModel);
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(after->session().codec_id, cal.codec_id);
  EXPECT_EQ(Matched(*after, late), 2u);
  EXPECT_EQ(Matched(*after, early), 0u);
  EXPECT_EQ(StoredChunks(), 6u);
}

TEST_F(CalibrationE2eTest, WithoutADiskTierTheStateDirKeepsItAndADamagedRecordIsRefused) {
  Restart(VectorPolicy(), /*disk=*/false);
  auto c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  const uint32_t collecting_codec = c->session().codec_id;
  PutPrompt(*c, 1, 4, 100);
  client::CalibrationInfo cal = Calibration();
  ExpectCalibrated(cal, collecting_codec);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir_ + "/state")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const fs::path saved = files[0];
  EXPECT_THAT(saved.filename().string(), HasSubstr("vector-weights-" + kVectorModel + "-"));

  // Restart: reloaded from the file.
  Restart(VectorPolicy(), /*disk=*/false);
  client::CalibrationInfo again = Calibration();
  EXPECT_EQ(again.version, cal.version);
  EXPECT_EQ(again.r2, cal.r2);

  // One flipped byte: refused with a log line naming the record and the reason, calibration
  // starts again from zero, and the daemon serves (and calibrates) as before.
  ASSERT_EQ(kvd_->Stop(), 0);
  FlipByte(saved, 100);
  Restart(VectorPolicy(), /*disk=*/false);
  EXPECT_THAT(kvd_->Log(), HasSubstr("saved VECTOR calibration refused, calibrating again"));
  EXPECT_THAT(kvd_->Log(), HasSubstr(saved.string()));
  EXPECT_THAT(kvd_->Log(), HasSubstr("checksum"));
  client::CalibrationInfo reset = Calibration();
  EXPECT_EQ(reset.state, "collecting");
  EXPECT_EQ(reset.tokens_seen, 0u);
  EXPECT_EQ(reset.codec_id, collecting_codec);
  auto c2 = Connect(kVectorModel);
  ASSERT_NE(c2, nullptr);
  PutPrompt(*c2, 2, 4, 500);
  ExpectCalibrated(Calibration(), collecting_codec);

  // Weights of another shape under this model's record name (e.g. written by a build with
  // another layout): refused the same way, never used.
  ASSERT_EQ(kvd_->Stop(), 0);
  {
    auto other = kk::VectorCalibrator::Create(2, 2, 8);
    ASSERT_TRUE(other.ok());
    std::mt19937 rng(9);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    kk::Matrix k(64, 8), v(64, 8);
    for (float& x : k.values) x = dist(rng);
    for (float& x : v.values) x = dist(rng);
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) ASSERT_TRUE(other->Add(l, h, k.View(), v.View()).ok());
    }
    auto w = other->Solve();
    ASSERT_TRUE(w.ok()) << w.status();
    const std::vector<uint8_t> bytes = w->Serialize();
    std::ofstream out(saved, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  Restart(VectorPolicy(), /*disk=*/false);
  EXPECT_THAT(kvd_->Log(), HasSubstr("saved weights are for 2 layers x 2 KV heads x head_dim 8, "
                                     "the model's layout has 5 x 4 x 8"));
  EXPECT_EQ(Calibration().state, "collecting");
}

TEST_F(CalibrationE2eTest, CollectingResumesFromItsCheckpointAfterARestart) {
  Restart(VectorPolicy(), /*disk=*/true);
  auto c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  const uint32_t collecting_codec = c->session().codec_id;
  PutPrompt(*c, 1, 3, 100);  // 768 of 1024 tokens; checkpoints every 128
  c.reset();

  Restart(VectorPolicy(), /*disk=*/true);
  EXPECT_THAT(kvd_->Log(), HasSubstr("VECTOR calibration progress reloaded"));
  client::CalibrationInfo resumed = Calibration();
  EXPECT_EQ(resumed.state, "collecting");
  EXPECT_EQ(resumed.tokens_seen, 3u * kTokens);
  c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  PutPrompt(*c, 2, 1, 200);  // the fourth chunk completes it
  ExpectCalibrated(Calibration(), collecting_codec);
  c.reset();

  // Once the weights are saved the checkpoint is gone: a restart loads the weights only.
  Restart(VectorPolicy(), /*disk=*/true);
  EXPECT_THAT(kvd_->Log(), HasSubstr("VECTOR calibration reloaded"));
  EXPECT_THAT(kvd_->Log(), ::testing::Not(HasSubstr("progress reloaded")));
  EXPECT_EQ(Calibration().state, "calibrated");

  // Without a disk tier the checkpoint is a file in state_dir; a damaged one is refused and
  // collecting starts from zero.
  Restart(VectorPolicy(), /*disk=*/false);
  c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  PutPrompt(*c, 3, 2, 300);
  c.reset();
  ASSERT_EQ(kvd_->Stop(), 0);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir_ + "/state")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_THAT(files[0].filename().string(), HasSubstr("vector-accumulators-" + kVectorModel));
  Restart(VectorPolicy(), /*disk=*/false);
  EXPECT_EQ(Calibration().tokens_seen, 2u * kTokens);
  ASSERT_EQ(kvd_->Stop(), 0);
  FlipByte(files[0], 64);
  Restart(VectorPolicy(), /*disk=*/false);
  EXPECT_THAT(kvd_->Log(),
              HasSubstr("saved VECTOR calibration progress refused, collecting from zero"));
  EXPECT_THAT(kvd_->Log(), HasSubstr("checksum"));
  client::CalibrationInfo zero = Calibration();
  EXPECT_EQ(zero.state, "collecting");
  EXPECT_EQ(zero.tokens_seen, 0u);
}

TEST_F(CalibrationE2eTest, APolicyChangeGivesANewCodecIdThatServesNoneOfTheOldChunks) {
  const std::string snapkv50 = "{stages: [snapkv], p_c: 0.5, window: 32, sinks: 4}";
  const std::string snapkv75 = "{stages: [snapkv], p_c: 0.75, window: 32, sinks: 4}";
  Restart(snapkv50, /*disk=*/true);
  auto c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  const uint32_t codec50 = c->session().codec_id;
  const ModelLayout layout = c->options().layout;
  std::vector<Chunk> data = {MakeChunk(layout, kTokens, 1), MakeChunk(layout, kTokens, 2)};
  const std::vector<Hash128> chain = {{9, 0}, {9, 1}};
  std::vector<client::PutItem> items = {Item(chain[0], data[0], 0),
                                        Item(chain[1], data[1], kTokens)};
  ASSERT_TRUE(c->PutChunks(items).ok());
  auto hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->matched_chunks, 2u);
  const std::vector<uint8_t> old0 = GetCompact(*c, hit->lease_id, 0);
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  c.reset();

  // Another p_c: another codec id; the old chunks are still on disk but never served under it.
  Restart(snapkv75, /*disk=*/true);
  EXPECT_EQ(StoredChunks(), 2u);
  c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  const uint32_t codec75 = c->session().codec_id;
  EXPECT_NE(codec75, codec50);
  EXPECT_EQ(Matched(*c, chain), 0u);
  // Asking for the old codec id explicitly is refused, naming the current one.
  {
    auto o = kvd_->EngineOptions("old-codec");
    o.model = kVectorModel;
    o.codec_id = codec50;
    auto stale = client::Client::Connect(o);
    ASSERT_FALSE(stale.ok());
    EXPECT_EQ(stale.status().code(), StatusCode::kFailedPrecondition) << stale.status();
    EXPECT_THAT(stale.status().message(), HasSubstr(std::to_string(codec75)));
  }
  // A raw re-put of the same prompt is compressed under the new policy and served.
  auto put = c->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_FALSE((*put)[0].already_stored);
  EXPECT_EQ((*put)[0].codec_id, codec75);
  hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->matched_chunks, 2u);
  client::GetResult got;
  const std::vector<uint8_t> new0 = GetCompact(*c, hit->lease_id, 0, &got);
  EXPECT_EQ(got.codec_id, codec75);
  kk::CompressionPlanOptions o75 = SnapKvOptions();
  o75.p_c = 0.75;
  auto expected = InProcess(layout, data[0], 0, o75);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_TRUE(new0 == *expected);
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  EXPECT_EQ(StoredChunks(), 4u);
  c.reset();

  // Back to the first policy: its codec id again, and its chunks, byte for byte.
  Restart(snapkv50, /*disk=*/true);
  c = Connect(kVectorModel);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->session().codec_id, codec50);
  hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->matched_chunks, 2u);
  EXPECT_TRUE(GetCompact(*c, hit->lease_id, 0) == old0);
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
}

#ifdef KVD_DEMO_BINARY
// Token ids in [3, 512) (stories260K has no tokenizer), one per line.
std::string WriteTokenIds(const std::string& path, int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> id(3, 511);
  std::ofstream out(path);
  for (int i = 0; i < count; ++i) out << id(rng) << "\n";
  return path;
}

TEST_F(CalibrationE2eTest, KvdctlCalibrateRunsTheEngineAndCalibrationShowsEveryHead) {
  const std::string model_file = std::string(KVD_TEST_SHARED_MODELS_DIR) + "/stories260K.bin";
  if (!fs::exists(model_file)) GTEST_SKIP() << model_file << " not found";
  Restart(VectorPolicy(), /*disk=*/false);
  // kvdctl with stderr folded into the captured output (the error messages are checked too).
  auto kvdctl = [&](std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(), {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>&1", KVDCTL_BINARY, "--addr",
                               kvd_->tcp_address()});
    out->clear();
    return RunProgram(args, out, std::chrono::seconds(120));
  };
  std::string out;
  ASSERT_EQ(kvdctl({"calibration", "--model", kVectorModel, "--json"}, &out), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out);
  ASSERT_EQ(j["models"].size(), 1u);
  EXPECT_EQ(j["models"][0]["state"], "collecting");
  EXPECT_EQ(j["models"][0]["tokens_seen"], 0);
  EXPECT_EQ(j["models"][0]["tokens_needed"], kCalibrationTokens);
  EXPECT_TRUE(j["models"][0]["r2"].empty());
  ASSERT_EQ(kvdctl({"calibration", "--model", kVectorModel}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("state collecting"));
  EXPECT_THAT(out, HasSubstr("tokens 0 / 1024 per head (0.0%)"));

  const std::vector<std::string> engine = {
      "--model",   kVectorModel, "--model-file",  model_file, "--token-ids",
      "--ucx-tls", "sm,tcp",     "--net-devices", "lo",       "--threads",
      "1"};
  auto calibrate = [&](const std::string& corpus, std::string* o) {
    std::vector<std::string> args = {"calibrate", "--from", corpus};
    args.insert(args.end(), engine.begin(), engine.end());
    return kvdctl(args, o);
  };
  // A corpus too short: 600 tokens make 2 chunks (prompts of 512 tokens = the model's context).
  EXPECT_EQ(calibrate(WriteTokenIds(dir_ + "/short.txt", 600, 1), &out), 1) << out;
  EXPECT_THAT(out, HasSubstr("gave 512 of the 1024 tokens per head calibration needs: give a "
                             "longer corpus"));
  EXPECT_EQ(Calibration().tokens_seen, 512u);

  // Enough: calibration completes after 2 more chunks (the 512 tokens above were counted), and
  // the calibration chunks are evicted again.
  ASSERT_EQ(calibrate(WriteTokenIds(dir_ + "/corpus.txt", 3000, 2), &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("calibrated in"));
  EXPECT_THAT(out, HasSubstr("evicted the 2 calibration chunks of namespace kvd-calibrate"));
  EXPECT_THAT(out, HasSubstr("LAYER"));
  client::CalibrationInfo cal = Calibration();
  EXPECT_EQ(cal.state, "calibrated");
  EXPECT_EQ(cal.tokens_seen, static_cast<uint64_t>(kCalibrationTokens));
  EXPECT_EQ(StoredChunksIn("kvd-calibrate", ""), 0u);

  // --json: R^2 per layer and head as the daemon reports it, routes where R^2 >= threshold.
  ASSERT_EQ(kvdctl({"calibration", "--json"}, &out), 0) << out;
  j = nlohmann::json::parse(out);
  ASSERT_EQ(j["models"].size(), 1u);
  const auto& m = j["models"][0];
  EXPECT_EQ(m["model"], kVectorModel);
  EXPECT_EQ(m["state"], "calibrated");
  EXPECT_EQ(m["codec_id"], cal.codec_id);
  char version[17];
  std::snprintf(version, sizeof version, "%016llx", static_cast<unsigned long long>(cal.version));
  EXPECT_EQ(m["version"], version);
  ASSERT_EQ(m["r2"].size(), 5u);
  int routing = 0;
  for (int l = 0; l < 5; ++l) {
    ASSERT_EQ(m["r2"][l].size(), 4u);
    for (int h = 0; h < 4; ++h) {
      EXPECT_EQ(m["r2"][l][h].get<double>(), cal.r2[l * 4 + h]);
      EXPECT_EQ(m["routes"][l][h].get<bool>(), cal.r2[l * 4 + h] >= 0.5);
      routing += m["routes"][l][h].get<bool>();
    }
  }
  EXPECT_EQ(m["routing_heads"], routing);

  // The table: layers as rows, heads as columns, * on routing heads.
  ASSERT_EQ(kvdctl({"calibration"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("state calibrated"));
  EXPECT_THAT(out, HasSubstr("LAYER"));
  EXPECT_THAT(out, HasSubstr("H3"));
  EXPECT_THAT(out, HasSubstr(std::to_string(routing) + " of 20 heads"));
  const std::string table = out.substr(out.find("LAYER"));
  EXPECT_EQ(std::count(table.begin(), table.end(), '*'), routing);
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 6);  // header + 5 layers

  // Again: nothing to do.
  ASSERT_EQ(calibrate(dir_ + "/corpus.txt", &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("already calibrated"));

  // A model without a policy, a bad corpus, a missing argument: specific errors.
  EXPECT_EQ(kvdctl({"calibration", "--model", "stories260k"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("model stories260k has no compression policy: nothing to calibrate"));
  EXPECT_EQ(kvdctl({"calibration", "--model", "no-such-model"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("unknown model \"no-such-model\""));
  {
    std::ofstream bad(dir_ + "/bad.txt");
    bad << "12 13 hello 14\n";
  }
  EXPECT_EQ(calibrate(dir_ + "/bad.txt", &out), 1);
  EXPECT_THAT(out, HasSubstr("'hello' (token 2) is not a token id in [0, 512)"));
  EXPECT_EQ(kvdctl({"calibrate", "--model", kVectorModel}, &out), 2);
  EXPECT_THAT(out, HasSubstr("--model-file is required"));
}

// The text path on the demo model (SmolLM2-135M, its GGUF tokenizer, bfloat16 chunks).
TEST_F(CalibrationE2eTest, KvdctlCalibrateTokenisesATextCorpusForAGgufModel) {
  const char* dir = std::getenv("KVD_MODELS_DIR");  // deploy/fetch-models.sh's cache
  const std::string model_file = std::string(dir != nullptr ? dir : KVD_TEST_MODELS_CACHE_DIR) +
                                 "/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(model_file)) GTEST_SKIP() << model_file << " not found";
  StartKvd(
      "  - name: smollm2-vector\n    layout: {layers: 30, kv_heads: 3, q_heads: 9, head_dim: 64, "
      "dtype: bfloat16, rope: {theta: 100000, pairing: interleaved, scaling: none}}\n"
      "    compression: {stages: [snapkv, vector], p_c: 0.5, window: 32, sinks: 4, "
      "calibration_tokens: 512}\n");
  std::string out;
  const int rc = RunProgram({"/bin/sh",
                             "-c",
                             "exec \"$0\" \"$@\" 2>&1",
                             KVDCTL_BINARY,
                             "--addr",
                             kvd_->tcp_address(),
                             "calibrate",
                             "--model",
                             "smollm2-vector",
                             "--model-file",
                             model_file,
                             "--from",
                             std::string(KVD_SOURCE_DIR) + "/deploy/demo/text.txt",
                             "--segment-tokens",
                             "512",
                             "--threads",
                             "2",
                             "--ucx-tls",
                             "sm,tcp",
                             "--net-devices",
                             "lo"},
                            &out, std::chrono::seconds(240));
  ASSERT_EQ(rc, 0) << out << "\n" << kvd_->Log();
  EXPECT_THAT(out, HasSubstr("calibrated in"));
  EXPECT_THAT(out, HasSubstr("512 corpus tokens: 2 chunks put, 512 of 512 tokens per head"));
  auto o = kvd_->EngineOptions("smollm2-engine");
  o.model = "smollm2-vector";
  o.layout = Smollm2Layout();
  auto engine = client::Client::Connect(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto& c = *engine;
  auto cal = c->GetCalibration("smollm2-vector");
  ASSERT_TRUE(cal.ok()) << cal.status();
  ASSERT_EQ(cal->size(), 1u);
  EXPECT_EQ((*cal)[0].state, "calibrated");
  ASSERT_EQ((*cal)[0].r2.size(), 30u * 3u);
  for (double r2 : (*cal)[0].r2) {
    EXPECT_GE(r2, 0.0);
    EXPECT_LE(r2, 1.0);
  }
  EXPECT_EQ(c->session().codec_id, (*cal)[0].codec_id);
}
#endif  // KVD_DEMO_BINARY

}  // namespace
}  // namespace kvd::e2e
