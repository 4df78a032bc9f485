// The compression serving path through real kvd processes (label `serving`): the daemon
// compresses raw puts of a model with a compression policy and serves compact chunks that the
// client library expands. Small float32 stories260k-shaped chunks keep every case fast.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "e2e_common.h"
#include "kvd/client/client.h"
#include "kvd/client/expand.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/serving.h"
#include "kvd/kernels/vector.h"
#include "kvd_process.h"
#include "serving_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

class ServingE2eTest : public ServingFixture {};

TEST_F(ServingE2eTest, StoredChunkIsTheKernelsBytesAndExpandsLikeThem) {
  StartKvd(PolicyModel("stories-snapkv", kSnapKv));
  auto c = Connect("stories-snapkv");
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  EXPECT_NE(c->session().codec_id, 0u);
  EXPECT_EQ(c->session().window_tokens, static_cast<uint32_t>(kWindow));
  EXPECT_TRUE(c->session().needs_queries);
  EXPECT_FALSE(c->session().keeps_positions) << "SnapKV evicts tokens";
  EXPECT_THAT(c->session().policy, HasSubstr("score=snapkv"));

  // Chunk 1 of a prompt (positions 256..511).
  Chunk chunk = MakeChunk(layout, kTokens, 7);
  const Hash128 hash{11, 12};
  auto put = c->PutChunks(std::vector<client::PutItem>{Item(hash, chunk, 256)});
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();
  EXPECT_EQ((*put)[0].codec_id, c->session().codec_id);
  EXPECT_LT((*put)[0].stored_bytes, chunk.raw.size());

  auto hit = c->Lookup(std::vector<Hash128>{hash});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);
  client::GetResult got;
  std::vector<uint8_t> stored = GetCompact(*c, hit->lease_id, 0, &got);
  EXPECT_EQ(got.form, client::ChunkForm::kCompact);
  EXPECT_EQ(got.codec_id, c->session().codec_id);
  EXPECT_EQ(got.tokens, static_cast<uint32_t>(kTokens));
  EXPECT_EQ(got.bytes, (*put)[0].stored_bytes);

  // Byte for byte what the kernels produce in-process for the same input and policy: the same
  // code runs in the same order on the same floats, so no tolerance is involved.
  auto expected = InProcess(layout, chunk, 256, SnapKvOptions());
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_TRUE(stored == *expected) << stored.size() << " vs " << expected->size();

  // The stored ratio is the policy's, exactly: every head keeps llround((1 - p_c) * 256) = 128
  // tokens, a K and a V half each; an integer count, so no tolerance is involved.
  auto reader = client::CompactChunkReader::Open(stored, layout);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->half_pairs(), 2 * (kTokens / 2) * layout.num_layers * layout.num_kv_heads);
  EXPECT_EQ((*reader)->required_weights_version(), 0u);
  // And in bytes: stored / raw within 1% of 1 - p_c. Why it holds (docs/chunk-format.md, v2):
  // keys and values are exactly llround(0.5 * 256) = 128 of 256 tokens per head, 0.5 of the raw
  // chunk. The rest: <= 151 bytes of header, padding and trailer, < 1 byte of final pad bits, and
  // per (layer, head) the slot metadata. SnapKV evicts (every cardinality 1: one bit), so a head
  // holds Param(S) (17 bits for the first head, 1 bit once S repeats), 3 mode bits, Param(k)
  // (<= 13 bits) and the S = 128 position gaps r_j, which sum to the 128 skipped tokens. The
  // writer picks the shortest code, so the gaps cost at most plain Rice(r, 2): sum (r_j >> 2) +
  // 3 S <= 32 + 384 bits, or, when the one gap that can reach 128 escapes (96 bits), 96 + 3 * 127:
  // <= 477 bits. So < 510 bits per head; 20 heads: < 1,428 bytes, 0.44% of this float32 chunk's
  // 327,680 bytes, < 0.88% of 1 - p_c. (The real model's bf16 d = 64 heads make it < 0.2%.)
  const double stored_over_raw =
      static_cast<double>(stored.size()) / static_cast<double>(chunk.raw.size());
  EXPECT_GE(stored_over_raw, 0.5);
  EXPECT_LE(stored_over_raw / 0.5 - 1.0, 0.01) << stored.size() << " of " << chunk.raw.size();

  // Expansion: the reader's dense chunk == the kernels' ExpandDenseChunk of the in-process chunk.
  auto decoded = kk::DecodeCompactChunk(*expected);
  ASSERT_TRUE(decoded.ok());
  int64_t t_kernels = 0, t_reader = 0;
  auto dense_kernels = kk::ExpandDenseChunk(*decoded, nullptr, nullptr, &t_kernels);
  ASSERT_TRUE(dense_kernels.ok()) << dense_kernels.status();
  auto dense_reader = (*reader)->DenseChunk(&t_reader);
  ASSERT_TRUE(dense_reader.ok()) << dense_reader.status();
  EXPECT_EQ(t_reader, t_kernels);
  EXPECT_TRUE(*dense_reader == *dense_kernels);
  // GetDense: the same dense bytes in the raw chunk layout of its T (< 256: SnapKV evicts).
  std::vector<uint8_t> dense_get(chunk.raw.size());
  int64_t t_get = 0;
  auto got_dense = client::GetDense(*c, hit->lease_id, 0, dense_get.data(), dense_get.size(), &t_get);
  ASSERT_TRUE(got_dense.ok()) << got_dense.status();
  EXPECT_EQ(t_get, t_kernels);
  EXPECT_LT(t_get, kTokens);
  EXPECT_EQ(got_dense->form, client::ChunkForm::kCompact);
  ASSERT_EQ(got_dense->bytes, dense_kernels->size());
  EXPECT_EQ(std::memcmp(dense_get.data(), dense_kernels->data(), dense_kernels->size()), 0);

  // Layer-wise get: every layer lands in the caller's buffers, in order, with the same bytes.
  const size_t layer_bytes =
      static_cast<size_t>(t_kernels) * layout.num_kv_heads * layout.head_dim * sizeof(float);
  std::vector<std::vector<uint8_t>> k(layout.num_layers, std::vector<uint8_t>(layer_bytes));
  std::vector<std::vector<uint8_t>> v(layout.num_layers, std::vector<uint8_t>(layer_bytes));
  std::vector<client::MutableLayerKV> layers;
  for (int l = 0; l < layout.num_layers; ++l) layers.push_back({k[l].data(), v[l].data()});
  std::vector<int> order;
  int64_t tokens = 0;
  Status s = client::GetDenseLayerwise(
      *c, hit->lease_id, 1, layers, static_cast<int>(t_kernels),
      [&](int layer) { order.push_back(layer); }, &tokens);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(tokens, t_kernels);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  for (int l = 0; l < layout.num_layers; ++l) {
    EXPECT_EQ(std::memcmp(k[l].data(), dense_kernels->data() + 2 * l * layer_bytes, layer_bytes), 0)
        << "layer " << l;
    EXPECT_EQ(
        std::memcmp(v[l].data(), dense_kernels->data() + (2 * l + 1) * layer_bytes, layer_bytes), 0)
        << "layer " << l;
  }
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
}

// A policy that keeps every position (`[quantize]`: what vLLM's connector serves): the session
// says so, and GetDense gives the raw chunk layout with all 256 tokens, each within int8's
// rounding of the raw value: half a step, a step being at most a group's range / 255
// (asymmetric) or its peak / 127 (symmetric), both <= 2 peak / 254 for the chunk's peak |x|;
// the float16 scale adds a relative 2^-11, covered by the 1% margin. A raw model's GetDense is
// its Get, byte for byte.
TEST_F(ServingE2eTest, GetDenseOfAPositionKeepingPolicyGivesEveryTokenInTheRawLayout) {
  StartKvd(PolicyModel("stories-int8", "{stages: [quantize], device: cpu}") +
           "  - name: stories-raw\n    layout: {layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, "
           "dtype: float32, rope: {theta: 10000, pairing: interleaved, scaling: none}}\n");
  auto c = Connect("stories-int8");
  auto raw = Connect("stories-raw");
  ASSERT_NE(c, nullptr);
  ASSERT_NE(raw, nullptr);
  EXPECT_TRUE(c->session().keeps_positions);
  EXPECT_FALSE(c->session().needs_queries);
  EXPECT_TRUE(raw->session().keeps_positions);
  const ModelLayout layout = c->options().layout;
  Chunk chunk = MakeChunk(layout, kTokens, 9);
  const Hash128 hash{21, 22};
  ASSERT_TRUE(c->Put(hash, kTokens, chunk.raw.data(), chunk.raw.size()).ok());
  ASSERT_TRUE(raw->Put(hash, kTokens, chunk.raw.data(), chunk.raw.size()).ok());
  for (client::Client* who : {c.get(), raw.get()}) {
    auto hit = who->Lookup(std::vector<Hash128>{hash});
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 1u);
    std::vector<uint8_t> out(chunk.raw.size());
    int64_t tokens = 0;
    auto got = client::GetDense(*who, hit->lease_id, 0, out.data(), out.size(), &tokens);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(tokens, kTokens);
    ASSERT_EQ(got->bytes, chunk.raw.size());
    if (who == raw.get()) {
      EXPECT_EQ(got->form, client::ChunkForm::kRaw);
      EXPECT_TRUE(out == chunk.raw);
    } else {
      EXPECT_EQ(got->form, client::ChunkForm::kCompact);
      const auto* want = reinterpret_cast<const float*>(chunk.raw.data());
      const auto* have = reinterpret_cast<const float*>(out.data());
      float worst = 0, peak = 0;
      for (size_t i = 0; i < chunk.raw.size() / sizeof(float); ++i) {
        worst = std::max(worst, std::fabs(want[i] - have[i]));
        peak = std::max(peak, std::fabs(want[i]));
      }
      EXPECT_LE(worst, peak / 254.0f * 1.01f) << "peak " << peak;
      EXPECT_GT(worst, 0.0f) << "int8 rounds";
    }
    std::vector<uint8_t> small(chunk.raw.size() - 1);
    EXPECT_EQ(client::GetDense(*who, hit->lease_id, 0, small.data(), small.size()).status().code(),
              StatusCode::kOutOfRange);
    ASSERT_TRUE(who->ReleaseLease(hit->lease_id).ok());
  }
}

TEST_F(ServingE2eTest, PrefixIsReusedBitIdenticalAndShortChunksAreLossless) {
  StartKvd(PolicyModel("stories-snapkv", kSnapKv));
  auto a = Connect("stories-snapkv");
  auto b = Connect("stories-snapkv");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const ModelLayout layout = a->options().layout;
  // Prompt P = chunks 0, 1, then a 40-token tail (too short for sinks + window: lossless).
  const Prompt prompt = MakePrompt(layout, {kTokens, kTokens, 40}, 1);
  const std::vector<Chunk>& p = prompt.chunks;
  const std::vector<Hash128>& chain = prompt.chain;
  auto put = a->PutChunks(prompt.items);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();

  auto hit_a = a->Lookup(chain);
  ASSERT_TRUE(hit_a.ok());
  ASSERT_EQ(hit_a->matched_chunks, 3u);
  EXPECT_EQ(hit_a->matched_tokens, 2u * kTokens + 40u);
  std::vector<std::vector<uint8_t>> first;
  for (uint32_t i = 0; i < 3; ++i) first.push_back(GetCompact(*a, hit_a->lease_id, i));

  // The tail chunk is stored losslessly: its dense form is the raw chunk, byte for byte.
  auto tail = client::CompactChunkReader::Open(first[2], layout);
  ASSERT_TRUE(tail.ok()) << tail.status();
  int64_t t = 0;
  auto dense = (*tail)->DenseChunk(&t);
  ASSERT_TRUE(dense.ok());
  EXPECT_EQ(t, 40);
  EXPECT_TRUE(*dense == p[2].raw);

  // Prompt Q shares P's first two chunks: another engine finds and reads them, bit-identical;
  // putting them again stores nothing new.
  std::vector<Hash128> q_chain = {chain[0], chain[1], {2, 3}};
  auto again = b->PutChunks(std::vector<client::PutItem>{Item(chain[0], p[0], 0)});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)[0].already_stored);
  auto hit_b = b->Lookup(q_chain);
  ASSERT_TRUE(hit_b.ok());
  ASSERT_EQ(hit_b->matched_chunks, 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(GetCompact(*b, hit_b->lease_id, i) == first[i]) << "chunk " << i;
  }
}

TEST_F(ServingE2eTest, BadInputsGetSpecificErrorsWhileOthersAreServed) {
  StartKvd(PolicyModel("stories-snapkv", kSnapKv));
  auto c = Connect("stories-snapkv");
  ASSERT_NE(c, nullptr);
  const ModelLayout layout = c->options().layout;
  Chunk good = MakeChunk(layout, kTokens, 5);

  // Window queries of the wrong shape (W != the policy's window).
  {
    client::PutItem it = Item({3, 1}, good, 0, false);
    std::vector<uint8_t> buf(good.raw.size() + client::WindowQueryBytes(layout, 16));
    std::memcpy(buf.data(), good.raw.data(), good.raw.size());
    it.data = buf.data();
    it.bytes = buf.size();
    it.window = 16;
    auto r = c->PutChunks({&it, 1});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("neither 0 nor the policy's window 32"));
  }
  // A put without the queries the policy needs.
  {
    auto r = c->PutChunks(std::vector<client::PutItem>{Item({3, 2}, good, 0, false)});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("needs the window queries"));
  }
  // Non-finite K: the commit fails with the kernels' finite check, nothing is stored.
  {
    Chunk bad = good;
    const float nan = std::nanf("");
    std::memcpy(bad.raw.data() + 64, &nan, sizeof(nan));
    auto r = c->PutChunks(std::vector<client::PutItem>{Item({3, 3}, bad, 0)});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("compressing reservation"));
    auto miss = c->Lookup(std::vector<Hash128>{{3, 3}});
    ASSERT_TRUE(miss.ok());
    EXPECT_EQ(miss->matched_chunks, 0u);
  }
  // A compressed put (window queries) for a model without a policy.
  {
    auto raw = Connect("stories260k");
    ASSERT_NE(raw, nullptr);
    EXPECT_EQ(raw->session().codec_id, 0u);
    auto r = raw->PutChunks(std::vector<client::PutItem>{Item({3, 4}, good, 0)});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("has no compression policy"));
    // The raw form of a raw chunk works; its compact form does not exist.
    auto ok = raw->Put({3, 5}, kTokens, good.raw.data(), good.raw.size());
    ASSERT_TRUE(ok.ok()) << ok.status();
    auto hit = raw->Lookup(std::vector<Hash128>{{3, 5}});
    ASSERT_TRUE(hit.ok());
    std::vector<uint8_t> buf(good.raw.size() * 2);
    client::GetItem it;
    it.out = buf.data();
    it.capacity = buf.size();
    it.form = client::ChunkForm::kCompact;
    auto g = raw->GetChunks(hit->lease_id, {&it, 1});
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), StatusCode::kFailedPrecondition) << g.status();
    EXPECT_THAT(g.status().message(), HasSubstr("stored raw (codec 0)"));
  }
  // A codec id asked for a raw model, and a stale codec id for the policy model.
  {
    auto o = kvd_->EngineOptions("codec-raw");
    o.codec_id = 1234;
    auto r = client::Client::Connect(o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(r.status().message(), HasSubstr("has no compression policy"));
    auto o2 = kvd_->EngineOptions("codec-stale");
    o2.model = "stories-snapkv";
    o2.codec_id = c->session().codec_id + 1;
    auto r2 = client::Client::Connect(o2);
    ASSERT_FALSE(r2.ok());
    EXPECT_EQ(r2.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(r2.status().message(), HasSubstr("send codec 0 to follow the policy"));
  }
  // The daemon still serves: a good put, then a get asking the raw form of a compact chunk (a
  // form it cannot give), then the compact form.
  auto put = c->PutChunks(std::vector<client::PutItem>{Item({3, 6}, good, 0)});
  ASSERT_TRUE(put.ok()) << put.status();
  auto hit = c->Lookup(std::vector<Hash128>{{3, 6}});
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->matched_chunks, 1u);
  std::vector<uint8_t> buf(client::MaxCompactChunkBytes(layout, kTokens));
  client::GetItem it;
  it.out = buf.data();
  it.capacity = buf.size();
  it.form = client::ChunkForm::kRaw;
  auto g = c->GetChunks(hit->lease_id, {&it, 1});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kFailedPrecondition) << g.status();
  EXPECT_THAT(g.status().message(), HasSubstr("is stored compact"));
  EXPECT_FALSE(GetCompact(*c, hit->lease_id, 0).empty());
}

TEST_F(ServingE2eTest, FullIngestQueueIsResourceExhaustedWhileGetsGoOn) {
  StartKvd(PolicyModel("stories-q2",
                       "{stages: [snapkv], p_c: 0.5, worker_threads: 1, "
                       "queue_depth: 2}"));
  auto c = Connect("stories-q2");
  auto reader = Connect("stories-q2");
  ASSERT_NE(c, nullptr);
  ASSERT_NE(reader, nullptr);
  const ModelLayout layout = c->options().layout;
  Chunk first = MakeChunk(layout, kTokens, 9);
  ASSERT_TRUE(c->PutChunks(std::vector<client::PutItem>{Item({4, 0}, first, 0)}).ok());
  auto hit = reader->Lookup(std::vector<Hash128>{{4, 0}});
  ASSERT_TRUE(hit.ok());
  std::vector<uint8_t> before = GetCompact(*reader, hit->lease_id, 0);

  // A window of 8 puts reserves 8 chunks at once: the third Reserve finds 2 admitted.
  std::vector<Chunk> flood;
  for (int i = 0; i < 8; ++i) flood.push_back(MakeChunk(layout, kTokens, 100 + i));
  std::vector<client::PutItem> items;
  for (int i = 0; i < 8; ++i) items.push_back(Item({4, 1 + static_cast<uint64_t>(i)}, flood[i], 0));
  auto r = c->PutChunks(items);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("ingest queue of model stories-q2 is full"));
  EXPECT_THAT(r.status().message(), HasSubstr("retry"));

  // Gets go on meanwhile and read the same bytes.
  EXPECT_TRUE(GetCompact(*reader, hit->lease_id, 0) == before);
  // The refused puts were never acknowledged; retried one at a time, they all store.
  for (const auto& it : items) {
    auto one = c->PutChunks({&it, 1});
    ASSERT_TRUE(one.ok()) << one.status();
  }
  std::vector<Hash128> all;
  for (const auto& it : items) all.push_back(it.hash);
  auto every = reader->Lookup(std::vector<Hash128>{all.front()});
  ASSERT_TRUE(every.ok());
  EXPECT_EQ(every->matched_chunks, 1u);
  auto stats = reader->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE(CounterValue(*stats, "ingest_rejected"), 1u);
  EXPECT_EQ(CounterValue(*stats, "chunks_compressed"), 9u);
}

// `kvdctl stats`, its JSON and /metrics split the compression time by stage: after compressed
// puts every stage the policy runs has time and the chunks it ran in, the stages it does not run
// stay at zero, and a lossless (too short) chunk counts in `serialize` only.
TEST_F(ServingE2eTest, StatsSplitCompressionTimeByStage) {
  KvdConfig config;
  config.extra_models = PolicyModel("stories-snapkv", kSnapKv) +
                        PolicyModel("stories-hybrid", "{stages: [snapkv, kvslimmer], p_c: 0.5}");
  config.metrics = true;
  auto kvd = KvdProcess::Start(config);
  ASSERT_TRUE(kvd.ok()) << kvd.status();
  kvd_ = std::move(*kvd);
  auto snap = Connect("stories-snapkv");
  auto hybrid = Connect("stories-hybrid");
  ASSERT_NE(snap, nullptr);
  ASSERT_NE(hybrid, nullptr);
  const ModelLayout layout = snap->options().layout;
  const Prompt prompt = MakePrompt(layout, {kTokens, kTokens, 40}, 41);
  const std::vector<client::PutItem>& items = prompt.items;
  auto put = snap->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();
  auto put_hybrid = hybrid->PutChunks(std::vector<client::PutItem>{items[0]});
  ASSERT_TRUE(put_hybrid.ok()) << put_hybrid.status() << "\n" << kvd_->Log();

  auto stats = snap->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->compression.size(), 2u);
  const std::vector<std::string> names = {"convert", "derotate", "score",  "select",
                                          "merge",   "route",    "encode", "serialize"};
  auto stage = [&](const std::string& model, const std::string& name) {
    for (const auto& m : stats->compression) {
      if (m.model != model) continue;
      std::vector<std::string> order;
      for (const auto& t : m.stages) order.push_back(t.stage);
      EXPECT_EQ(order, names) << model;
      for (const auto& t : m.stages) {
        if (t.stage == name) return t;
      }
    }
    ADD_FAILURE() << model << " " << name << " not in the stats";
    return client::IngestStageTime{};
  };
  // stories-snapkv: two full chunks ran the plan, the 40-token tail was stored losslessly.
  for (const char* ran : {"convert", "score", "select", "encode"}) {
    const client::IngestStageTime t = stage("stories-snapkv", ran);
    EXPECT_EQ(t.chunks, 2u) << ran;
    EXPECT_GT(t.nanos, 0u) << ran;
  }
  for (const char* idle : {"derotate", "merge", "route"}) {
    const client::IngestStageTime t = stage("stories-snapkv", idle);
    EXPECT_EQ(t.chunks, 0u) << idle;
    EXPECT_EQ(t.nanos, 0u) << idle;
  }
  EXPECT_EQ(stage("stories-snapkv", "serialize").chunks, 3u);
  EXPECT_GT(stage("stories-snapkv", "serialize").nanos, 0u);
  // The hybrid de-rotates and merges; nothing routes.
  for (const char* ran : {"convert", "derotate", "score", "merge", "encode", "serialize"}) {
    const client::IngestStageTime t = stage("stories-hybrid", ran);
    EXPECT_EQ(t.chunks, 1u) << ran;
    EXPECT_GT(t.nanos, 0u) << ran;
  }
  EXPECT_EQ(stage("stories-hybrid", "route").chunks, 0u);

#ifdef KVDCTL_BINARY
  // kvdctl stats: the table, and the same figures in --json.
  std::string out;
  ASSERT_EQ(RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "stats"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("Compression time per stage"));
  EXPECT_THAT(out, ::testing::ContainsRegex("stories-snapkv +score +2 +[0-9]+\\.[0-9]{3}"));
  EXPECT_THAT(out, ::testing::ContainsRegex("stories-snapkv +serialize +3 "));
  ASSERT_EQ(RunProgram({KVDCTL_BINARY, "--addr", kvd_->tcp_address(), "--json", "stats"}, &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("\"compression\""));
  EXPECT_THAT(
      out, ::testing::ContainsRegex("\"chunks\": 2,[[:space:]]*\"nanos\": [1-9][0-9]*,[[:space:]]*"
                                    "\"stage\": \"score\""));
#endif

  // /metrics: one counter pair per (model, stage).
  auto scrape = HttpGet(kvd_->metrics_address(), "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_THAT(*scrape, HasSubstr("# TYPE kvd_compress_stage_seconds_total counter"));
  EXPECT_THAT(*scrape,
              HasSubstr("model=\"stories-snapkv\",stage=\"score\"} 2\n"));  // chunks_total
  EXPECT_THAT(*scrape, ::testing::ContainsRegex(
                           "kvd_compress_stage_seconds_total\\{[^}]*model=\"stories-hybrid\","
                           "stage=\"merge\"\\} [0-9.e-]*[1-9]"));
  EXPECT_THAT(*scrape, HasSubstr("model=\"stories-snapkv\",stage=\"route\"} 0\n"));
}

// compression.device at start on a node without a usable CUDA device (this machine kind): `auto`
// keeps the CPU plan and says why (log, kvdctl stats); `cuda` is refused, exit 2, naming the key,
// the value and the reason.
TEST_F(ServingE2eTest, WithoutADeviceAutoIsTheCpuAndCudaIsRefused) {
  const Status probe = kk::CheckDevicePlanDevice(0);
  if (probe.ok()) GTEST_SKIP() << "a CUDA device is present: ServingCudaE2eTest covers it";
  const auto reason =
      ::testing::AnyOf(HasSubstr("no CUDA device"), HasSubstr("built without CUDA"));
  StartKvd(PolicyModel("stories-auto", "{stages: [snapkv]}") +
           PolicyModel("stories-cpu", "{stages: [snapkv], device: cpu}"));
  auto c = Connect("stories-auto");
  ASSERT_NE(c, nullptr);
  Chunk chunk = MakeChunk(c->options().layout, kTokens, 51);
  auto put = c->PutChunks(std::vector<client::PutItem>{Item({51, 1}, chunk, 0)});
  ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();
  auto expected = InProcess(c->options().layout, chunk, 0, SnapKvOptions());
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ((*put)[0].stored_bytes, expected->size());
  auto stats = c->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->compression.size(), 2u);
  EXPECT_EQ(stats->compression[0].model, "stories-auto");
  EXPECT_EQ(stats->compression[0].device, "cpu");
  EXPECT_THAT(stats->compression[0].device_reason, HasSubstr("auto: "));
  EXPECT_THAT(stats->compression[0].device_reason, reason);
  EXPECT_EQ(stats->compression[1].device, "cpu");
  EXPECT_THAT(stats->compression[1].device_reason, HasSubstr("compression.device is cpu"));
  EXPECT_THAT(kvd_->Log(), ::testing::ContainsRegex("ingest device.*stories-auto.*cpu"));

  KvdConfig cuda;
  cuda.extra_models = PolicyModel("stories-cuda", "{stages: [snapkv], device: cuda}");
  auto refused = KvdProcess::Start(cuda);
  ASSERT_FALSE(refused.ok()) << "kvd started with compression.device cuda and no usable device";
  EXPECT_THAT(refused.status().message(), HasSubstr("kvd exited with 2"));
  EXPECT_THAT(refused.status().message(),
              ::testing::ContainsRegex("models\\[[0-9]+\\]\\.compression\\.device: \"cuda\" "
                                       "cannot be honoured: "));
  EXPECT_THAT(refused.status().message(), reason);
}

// With a CUDA device (tests/gpu/run_device_checks.sh): a kvd whose policy says `device: cuda`
// compresses on the GPU and stores what the CPU plan stores for the same put. The CUDA plan's
// float32 scores are summed in another order than the CPU's (plan_device.h), so two middle tokens
// whose scores are within float32 rounding may be chosen differently: the kernels' own device
// test (DevicePlanCuda.MatchesTheCpuPlan) bounds that; here every head must have the CPU's slot
// count and header, every slot's key and value must be its token's raw bytes bit for bit (so the
// compact chunk is the raw chunk's own data), and at most 2 tokens per head may differ from the
// CPU's selection (near-ties; on random data almost every head matches exactly, then the head is
// byte-identical).
class ServingCudaIngest : public ServingFixture {
 protected:
  // Starts kvd with one model `model` under `policy` (it must pick cuda:0, saying `reason`), puts
  // four chunks (with or without window queries) and compares what it stores with the CPU plan of
  // options `o` in-process.
  void ExpectTheCpuPlansChunks(const std::string& model, const std::string& policy,
                               const kk::CompressionPlanOptions& o, bool with_queries,
                               const std::string& reason) {
    StartKvd(PolicyModel(model, policy));
    auto c = Connect(model);
    ASSERT_NE(c, nullptr);
    const ModelLayout layout = c->options().layout;
    std::vector<Chunk> chunks;
    std::vector<client::PutItem> items;
    for (int i = 0; i < 4; ++i) chunks.push_back(MakeChunk(layout, kTokens, 61 + i));
    for (int i = 0; i < 4; ++i) {
      items.push_back(Item({61, static_cast<uint64_t>(i)}, chunks[i], i * kTokens, with_queries));
    }
    auto put = c->PutChunks(items);
    ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd_->Log();
    std::vector<Hash128> chain;
    for (const auto& it : items) chain.push_back(it.hash);
    auto hit = c->Lookup(chain);
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 4u);
    const size_t row = layout.head_dim * sizeof(float);
    int64_t differ = 0, identical_heads = 0;
    for (uint32_t i = 0; i < 4; ++i) {
      int64_t chunk_differ = 0;
      std::vector<uint8_t> stored = GetCompact(*c, hit->lease_id, i);
      auto expected = InProcess(layout, chunks[i], i * kTokens, o);
      ASSERT_TRUE(expected.ok()) << expected.status();
      auto dev = kk::DecodeCompactChunk(stored);
      auto cpu = kk::DecodeCompactChunk(*expected);
      ASSERT_TRUE(dev.ok()) << dev.status();
      ASSERT_TRUE(cpu.ok()) << cpu.status();
      EXPECT_EQ(dev->codec, cpu->codec);
      EXPECT_EQ(dev->original_tokens, cpu->original_tokens);
      EXPECT_EQ(dev->HalfPairs(), cpu->HalfPairs());
      for (int l = 0; l < layout.num_layers; ++l) {
        const uint8_t* k = chunks[i].raw.data() + layout.LayerOffset(l, kTokens);
        const uint8_t* v = k + static_cast<size_t>(kTokens) * layout.TokenBytes();
        for (int h = 0; h < layout.num_kv_heads; ++h) {
          const kk::CompactHead& d = dev->Head(l, h);
          const kk::CompactHead& x = cpu->Head(l, h);
          ASSERT_EQ(d.slots(), x.slots());
          for (int64_t j = 0; j < d.slots(); ++j) {
            const int64_t t = d.positions[j] - static_cast<int64_t>(i) * kTokens;
            ASSERT_TRUE(t >= 0 && t < kTokens);
            EXPECT_EQ(
                std::memcmp(d.keys.data() + j * row, k + t * layout.TokenBytes() + h * row, row),
                0);
            EXPECT_EQ(
                std::memcmp(d.values.data() + j * row, v + t * layout.TokenBytes() + h * row, row),
                0);
          }
          std::vector<int64_t> only;
          std::set_symmetric_difference(d.positions.begin(), d.positions.end(), x.positions.begin(),
                                        x.positions.end(), std::back_inserter(only));
          EXPECT_LE(only.size(), 4u) << "chunk " << i << " layer " << l << " head " << h;
          chunk_differ += static_cast<int64_t>(only.size()) / 2;
          if (only.empty()) {
            EXPECT_EQ(d.keys, x.keys);
            EXPECT_EQ(d.values, x.values);
            ++identical_heads;
          }
        }
      }
      if (chunk_differ == 0) EXPECT_TRUE(stored == *expected) << "chunk " << i;
      differ += chunk_differ;
    }
    RecordProperty("near_tie_tokens", static_cast<int>(differ));
    RecordProperty("identical_heads", static_cast<int>(identical_heads));
    ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
    auto stats = c->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_EQ(stats->compression.size(), 1u);
    EXPECT_EQ(stats->compression[0].device, "cuda:0");
    EXPECT_THAT(stats->compression[0].device_reason, HasSubstr(reason));
    for (const auto& t : stats->compression[0].stages) {
      if (t.stage == "convert" || t.stage == "score" || t.stage == "select" ||
          t.stage == "encode") {
        EXPECT_EQ(t.chunks, 4u) << t.stage;  // device times (CUDA events)
      }
    }
  }
};

TEST_F(ServingCudaIngest, CudaIngestStoresWhatTheCpuPlanStores) {
  const Status probe = kk::CheckDevicePlanDevice(0);
  if (!probe.ok()) GTEST_SKIP() << "no CUDA device: the CUDA ingest needs one (" << probe << ")";
  ExpectTheCpuPlansChunks("stories-cuda", "{stages: [snapkv], device: cuda, worker_threads: 2}",
                          SnapKvOptions(), true, "compression.device is cuda");
}

// kvd's default policy (KeyDiff, device auto) on a node with a GPU: auto picks the CUDA plan and
// stores what the CPU plan stores (KeyDiff's cosines are float32 on both sides, the anchor summed
// in another order: the same near-tie allowance).
TEST_F(ServingCudaIngest, CudaIngestOfTheDefaultKeyDiffPolicy) {
  const Status probe = kk::CheckDevicePlanDevice(0);
  if (!probe.ok()) GTEST_SKIP() << "no CUDA device: the CUDA ingest needs one (" << probe << ")";
  kk::CompressionPlanOptions o = SnapKvOptions();
  o.score = kk::ScoreStage::kKeyDiff;
  ExpectTheCpuPlansChunks("stories-keydiff", "{stages: [keydiff], p_c: 0.5, window: 32, sinks: 4}",
                          o, false, "auto: CUDA device 0 runs the CUDA plan of keydiff");
}

// The same-node shared-memory path feeds the same ingest: a put written into the arena slot is
// compressed and stored like a transport put, and its compact form comes back through the slot.
TEST_F(ServingE2eTest, SharedMemoryPutsAreCompressedLikeTransportPuts) {
  StartKvd(PolicyModel("stories-snapkv", kSnapKv), "", "", "8MiB");
  auto o = kvd_->UnixEngineOptions("serving-shm");
  o.model = "stories-snapkv";
  auto shm = client::Client::Connect(o);
  ASSERT_TRUE(shm.ok()) << shm.status() << "\n" << kvd_->Log();
  ASSERT_TRUE((*shm)->session().shared_memory) << kvd_->Log();
  auto tcp = Connect("stories-snapkv");
  ASSERT_NE(tcp, nullptr);
  const ModelLayout layout = tcp->options().layout;

  Chunk chunk = MakeChunk(layout, kTokens, 21);
  auto expected = InProcess(layout, chunk, 0, SnapKvOptions());
  ASSERT_TRUE(expected.ok()) << expected.status();
  const Hash128 via_shm{31, 1}, via_tcp{31, 2};
  auto put_shm = (*shm)->PutChunks(std::vector<client::PutItem>{Item(via_shm, chunk, 0)});
  ASSERT_TRUE(put_shm.ok()) << put_shm.status() << "\n" << kvd_->Log();
  auto put_tcp = tcp->PutChunks(std::vector<client::PutItem>{Item(via_tcp, chunk, 0)});
  ASSERT_TRUE(put_tcp.ok()) << put_tcp.status();
  EXPECT_EQ((*put_shm)[0].codec_id, tcp->session().codec_id);
  EXPECT_EQ((*put_shm)[0].stored_bytes, expected->size());
  EXPECT_EQ((*put_tcp)[0].stored_bytes, expected->size());

  // Each chunk read back through the other path is the kernels' bytes.
  for (auto [reader, hash] : {std::pair{shm->get(), via_tcp}, std::pair{tcp.get(), via_shm}}) {
    auto hit = reader->Lookup(std::vector<Hash128>{hash});
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 1u);
    client::GetResult got;
    std::vector<uint8_t> stored = GetCompact(*reader, hit->lease_id, 0, &got);
    EXPECT_EQ(got.form, client::ChunkForm::kCompact);
    EXPECT_EQ(got.codec_id, tcp->session().codec_id);
    EXPECT_TRUE(stored == *expected) << stored.size() << " vs " << expected->size();
    ASSERT_TRUE(reader->ReleaseLease(hit->lease_id).ok());
  }

  // Read in place, the compact chunk is the kernels' bytes too; the raw form it cannot give is
  // the daemon's FAILED_PRECONDITION, and no view.
  auto hit = (*shm)->Lookup(std::vector<Hash128>{via_tcp});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto view = (*shm)->ReadInPlace(hit->lease_id, 0);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->result().form, client::ChunkForm::kCompact);
  EXPECT_EQ(view->result().codec_id, tcp->session().codec_id);
  const auto* at = reinterpret_cast<const uint8_t*>(view->data());
  EXPECT_TRUE(std::vector<uint8_t>(at, at + view->size()) == *expected);
  client::ReadInPlaceOptions raw;
  raw.form = client::ChunkForm::kRaw;
  auto refused = (*shm)->ReadInPlace(hit->lease_id, 0, raw);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  view->Release();
  ASSERT_TRUE((*shm)->ReleaseLease(hit->lease_id).ok());
  // A zero-copy put writes the raw chunk alone: a policy that needs window queries refuses it
  // before anything is reserved.
  ASSERT_TRUE((*shm)->session().needs_queries);
  auto slot = (*shm)->ReservePut(Hash128{31, 3}, kTokens, chunk.raw.size());
  EXPECT_EQ(slot.status().code(), StatusCode::kFailedPrecondition) << slot.status();
  EXPECT_THAT(slot.status().message(), HasSubstr("window queries"));
}

}  // namespace
}  // namespace kvd::e2e
