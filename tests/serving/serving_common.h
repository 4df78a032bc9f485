// Shared by the serving e2e tests (label `serving`): a kvd process with compression policies on
// stories260k-shaped models, chunk generators and the in-process reference compression.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/client/expand.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/vector.h"
#include "kvd_process.h"

namespace kvd::e2e {

namespace kk = kvd::kernels;

inline constexpr int kTokens = 256;
inline constexpr int kWindow = 32;

// A model with the stories260k layout and `policy` (a YAML flow mapping).
inline std::string PolicyModel(const std::string& name, const std::string& policy) {
  return "  - name: " + name +
         "\n    layout: {layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, dtype: float32, rope: "
         "{theta: 10000, pairing: interleaved, scaling: none}}\n    compression: " +
         policy + "\n";
}

// On the CPU plan: the tests that use it compare with the CPU plan in-process byte for byte
// (ServingCudaE2eTest covers the CUDA plan).
inline constexpr char kSnapKv[] =
    "{stages: [snapkv], p_c: 0.5, window: 32, sinks: 4, worker_threads: 2, queue_depth: 4, "
    "device: cpu}";

// One put: raw K/V of `tokens` tokens (normal values, as a model's K/V are roughly) and the
// window queries of its last kWindow tokens, per layer [W, q_heads, d] float32.
struct Chunk {
  std::vector<uint8_t> raw;
  std::vector<float> queries;
};

inline Chunk MakeChunk(const ModelLayout& layout, int tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Chunk c;
  std::vector<float> raw(layout.ChunkBytes(tokens) / sizeof(float));
  for (float& v : raw) v = dist(rng);
  c.raw.resize(raw.size() * sizeof(float));
  std::memcpy(c.raw.data(), raw.data(), c.raw.size());
  c.queries.resize(client::WindowQueryBytes(layout, kWindow) / sizeof(float));
  for (float& v : c.queries) v = dist(rng);
  return c;
}

inline client::PutItem Item(const Hash128& hash, const Chunk& c, uint64_t first_position,
                            bool with_queries = true) {
  client::PutItem it;
  it.hash = hash;
  it.tokens = static_cast<int>(c.raw.size() / (5 * 2 * 4 * 8 * sizeof(float)));
  it.data = c.raw.data();
  it.bytes = c.raw.size();
  it.first_position = first_position;
  if (with_queries) {
    it.window = kWindow;
    it.window_queries = c.queries;
  }
  return it;
}

// A prompt put in one PutChunks: chunk i has tokens[i] tokens (kTokens each but maybe the last),
// seed `seed + i`, hash {seed, i} and starts at token i * kTokens; its item carries the window
// queries. The items point into `chunks` (a moved Prompt keeps them valid, a copy does not).
struct Prompt {
  std::vector<Chunk> chunks;
  std::vector<client::PutItem> items;
  std::vector<Hash128> chain;
  Prompt() = default;
  Prompt(Prompt&&) = default;
  Prompt(const Prompt&) = delete;
};
inline Prompt MakePrompt(const ModelLayout& layout, const std::vector<int>& tokens, uint32_t seed) {
  Prompt p;
  for (size_t i = 0; i < tokens.size(); ++i) {
    p.chunks.push_back(MakeChunk(layout, tokens[i], seed + static_cast<uint32_t>(i)));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    p.chain.push_back(Hash128{seed, i});
    p.items.push_back(Item(p.chain[i], p.chunks[i], i * kTokens));
  }
  return p;
}

// The same compression in-process (what the daemon must store byte for byte). The window
// queries go in for SnapKV and expected attention (whose statistics are `query_stats`).
inline StatusOr<std::vector<uint8_t>> InProcess(const ModelLayout& layout, const Chunk& c,
                                                uint64_t first_position,
                                                kk::CompressionPlanOptions o,
                                                const kk::VectorWeights* weights = nullptr,
                                                const kk::QueryStatistics* query_stats = nullptr) {
  const int64_t n = static_cast<int64_t>(c.raw.size() / layout.ChunkBytes(1));
  std::vector<int64_t> positions(n);
  for (int64_t i = 0; i < n; ++i) positions[i] = static_cast<int64_t>(first_position) + i;
  ModelLayout f32 = layout;
  f32.dtype = DType::kFloat32;
  std::vector<kk::Matrix> q;
  std::vector<kk::ConstMatrixView> views;
  if (o.score == kk::ScoreStage::kSnapKv || o.score == kk::ScoreStage::kExpectedAttention) {
    const size_t per_layer = c.queries.size() / layout.num_layers;
    for (int l = 0; l < layout.num_layers; ++l) {
      KVD_ASSIGN_OR_RETURN(auto m,
                           kk::GatherWindowQueries(f32, c.queries.data() + per_layer * l, kWindow));
      for (auto& x : m) q.push_back(std::move(x));
    }
    for (const auto& m : q) views.push_back(m.View());
  }
  kk::CompressionInput in;
  in.raw = c.raw;
  in.positions = positions;
  in.window_queries = views;
  in.weights = weights;
  in.query_stats = query_stats;
  kk::ExecOptions exec;
  exec.num_threads = 1;
  KVD_ASSIGN_OR_RETURN(auto chunk, kk::Compress(o, layout, in, nullptr, exec));
  return kk::EncodeCompactChunk(chunk);
}

class ServingFixture : public ::testing::Test {
 protected:
  void StartKvd(const std::string& extra_models, const std::string& extra_yaml = "",
                const std::string& disk = "", const std::string& host_segment = "") {
    KvdConfig c;
    c.host_segment = host_segment;
    c.extra_models = extra_models;
    c.extra_yaml = extra_yaml;
    c.disk_path = disk;
    auto kvd = KvdProcess::Start(c);
    ASSERT_TRUE(kvd.ok()) << kvd.status();
    kvd_ = std::move(*kvd);
  }
  std::unique_ptr<client::Client> Connect(const std::string& model, uint32_t codec = 0) {
    auto o = kvd_->EngineOptions("serving-" + model);
    o.model = model;
    o.codec_id = codec;
    auto c = client::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status() << "\n" << kvd_->Log();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // Gets chunk `index` of a lease in its stored (compact) form.
  static std::vector<uint8_t> GetCompact(client::Client& c, uint64_t lease, uint32_t index,
                                         client::GetResult* result = nullptr) {
    std::vector<uint8_t> buf(client::MaxCompactChunkBytes(c.options().layout, kTokens));
    client::GetItem it;
    it.chunk_index = index;
    it.out = buf.data();
    it.capacity = buf.size();
    auto r = c.GetChunks(lease, {&it, 1});
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    buf.resize((*r)[0].bytes);
    if (result != nullptr) *result = (*r)[0];
    return buf;
  }
  std::unique_ptr<KvdProcess> kvd_;
};

// A ServingFixture whose kvd keeps state in a temp folder `dir_` (a disk tier, a state_dir),
// removed with kvd at the end of each test.
class ServingDirFixture : public ServingFixture {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvd-serving-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (kvd_ && kvd_->Alive()) EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    kvd_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_;
};

inline kk::CompressionPlanOptions SnapKvOptions() {
  kk::CompressionPlanOptions o;
  o.score = kk::ScoreStage::kSnapKv;
  o.p_c = 0.5;
  o.window = kWindow;
  o.sinks = 4;
  return o;
}

}  // namespace kvd::e2e
