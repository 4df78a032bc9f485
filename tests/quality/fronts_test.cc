// The fronts (fronts.h) and the byte accounting behind them (stored_bytes.h), without a model:
// Pareto selection, serving-form classing, and stored bytes of synthetic compact chunks.
#include "fronts.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernel_methods.h"
#include "kvd/common/dtype.h"
#include "stored_bytes.h"

namespace kvd::quality {
namespace {

MethodResult Row(const std::string& method, double stored_raw, double ppl, bool dense,
                 const std::string& mode = kModeChunkWise) {
  MethodResult m;
  m.method = method;
  m.mode = mode;
  m.stored_raw = stored_raw;
  m.perplexity = ppl;
  m.keeps_positions = dense;
  return m;
}

std::vector<std::string> Names(const HarnessReport& r, const std::vector<size_t>& idx) {
  std::vector<std::string> out;
  for (size_t k : idx) out.push_back(r.rows[k].method);
  return out;
}

TEST(FrontsTest, ParetoFrontPerServingForm) {
  HarnessReport r;
  r.engine_perplexity = 10;
  r.rows = {Row("full", 1.0, 10.0, true, kModeOneShot),
            Row("int8", 0.53, 10.0, true),
            Row("bf16", 1.0, 10.0, true),  // equal to full: the first row keeps the point
            Row("int4", 0.28, 10.5, true),
            Row("fp8", 0.52, 10.3, true),      // fewer bytes than int8: on the front
            Row("snapkv", 0.50, 11.0, false),  // dominated by int4
            Row("keydiff+int4", 0.07, 12.0, false),
            Row("snapkv+int4", 0.10, 11.5, false),
            Row("sink_recent", -1, 9.0, false),            // bytes not measured: on no front
            Row("kvslimmer", 0.50, 20.0, true),            // dense, dominated by int4
            Row("int4", 0.28, 10.1, true, kModeOneShot)};  // another mode
  EXPECT_EQ(Names(r, ParetoFront(r, kModeChunkWise, ServingForm::kDense)),
            (std::vector<std::string>{"int4", "fp8", "int8"}));
  EXPECT_EQ(Names(r, ParetoFront(r, kModeChunkWise, ServingForm::kCompact)),
            (std::vector<std::string>{"keydiff+int4", "snapkv+int4", "int4", "fp8", "int8"}));
  EXPECT_EQ(Names(r, ParetoFront(r, kModeOneShot, ServingForm::kDense)),
            (std::vector<std::string>{"int4", "full"}));
  const std::vector<bool> on = OnAnyFront(r);
  EXPECT_TRUE(on[0]);   // full, on the one-shot front
  EXPECT_FALSE(on[2]);  // bf16: same point as full
  EXPECT_FALSE(on[5]);  // snapkv
  EXPECT_FALSE(on[8]);  // sink_recent
  EXPECT_TRUE(on[10]);
  const std::string md = FrontsToMarkdown(r);
  EXPECT_NE(md.find("### chunk-wise, dense front"), std::string::npos) << md;
  // Within 0.10 of the bytes: nothing dense, snapkv+int4 compact (lower perplexity than 0.07's).
  EXPECT_NE(md.find("| 0.10 | - | snapkv+int4 @0.00: 0.100, 1.150 |"), std::string::npos) << md;
}

llama::CompactKvCache Cache(const std::vector<std::vector<int>>& cardinalities) {
  llama::CompactKvCache c;
  c.layers.resize(1);
  for (const auto& head : cardinalities) {
    llama::CompactHeadKv h;
    h.num_slots = static_cast<int>(head.size());
    for (int l : head) h.bias.push_back(static_cast<float>(std::log(static_cast<double>(l))));
    h.k.assign(head.size() * 4, 0.0f);
    h.v.assign(head.size() * 4, 0.0f);
    c.layers[0].push_back(std::move(h));
  }
  return c;
}

TEST(FrontsTest, KeepsPositionsCountsMergedTokens) {
  EXPECT_TRUE(KeepsPositions(Cache({{1, 1, 1, 1}, {1, 1, 1, 1}}), 4));  // every token
  EXPECT_TRUE(KeepsPositions(Cache({{2, 1, 1}, {4}}), 4));              // merges expand to 4
  EXPECT_FALSE(KeepsPositions(Cache({{1, 1, 1}, {1, 1, 1, 1}}), 4));    // one head evicted one
  EXPECT_FALSE(KeepsPositions(Cache({{2, 1}, {1, 1, 1, 1}}), 4));       // merged and evicted
  EXPECT_FALSE(KeepsPositions(llama::CompactKvCache{}, 4));
}

// A chunk of `slots` l = 1 slots per head out of `tokens`, keys and values random float32.
kernels::CompactChunk SyntheticChunk(int layers, int heads, int dim, int tokens, int slots) {
  ModelLayout layout;
  layout.num_layers = layers;
  layout.num_kv_heads = heads;
  layout.num_q_heads = heads;
  layout.head_dim = dim;
  layout.dtype = DType::kFloat32;
  kernels::CompactChunk c = kernels::CompactChunk::ForLayout(layout, tokens);
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  for (kernels::CompactHead& h : c.heads) {
    std::vector<float> k(static_cast<size_t>(slots) * dim), v(k.size());
    for (float& x : k) x = g(rng);
    for (float& x : v) x = g(rng);
    h.keys.resize(k.size() * 4);
    h.values.resize(v.size() * 4);
    std::memcpy(h.keys.data(), k.data(), h.keys.size());
    std::memcpy(h.values.data(), v.data(), h.values.size());
    for (int s = 0; s < slots; ++s) {
      h.flags.push_back(0);
      h.cardinality.push_back(1);
      h.positions.push_back(tokens - slots + s);
    }
  }
  return c;
}

TEST(StoredBytesTest, EncodedBf16ChunkOverRawBf16) {
  constexpr int kL = 2, kH = 3, kD = 64, kN = 256;
  const kernels::CompactChunk full = SyntheticChunk(kL, kH, kD, kN, kN);
  EXPECT_EQ(RawBf16Bytes(full), int64_t{2} * kL * kN * kH * kD * 2);
  auto f = StoredBytesFraction(full);
  ASSERT_TRUE(f.ok()) << f.status();
  // The bfloat16 chunk of every token: the rows plus header, metadata, padding and checksum,
  // which is more than the raw bytes and well under 1% more at 256 tokens.
  EXPECT_GT(*f, 1.0);
  EXPECT_LT(*f, 1.01);
  // Exactly the bytes kvd's encoder writes for the chunk converted to bfloat16.
  kernels::CompactChunk bf16 = full;
  bf16.dtype = DType::kBFloat16;
  for (kernels::CompactHead& h : bf16.heads) {
    for (auto* rows : {&h.keys, &h.values}) {
      std::vector<uint8_t> out(rows->size() / 2);
      ConvertFromFloat(DType::kBFloat16, reinterpret_cast<const float*>(rows->data()), out.data(),
                       rows->size() / 4);
      *rows = std::move(out);
    }
  }
  auto encoded = kernels::EncodeCompactChunk(bf16);
  ASSERT_TRUE(encoded.ok());
  EXPECT_DOUBLE_EQ(*f, static_cast<double>(encoded->size()) / RawBf16Bytes(full));
  // A quarter of the slots: about a quarter of the bytes, the overhead on top.
  auto q = StoredBytesFraction(SyntheticChunk(kL, kH, kD, kN, kN / 4));
  ASSERT_TRUE(q.ok());
  EXPECT_GT(*q, 0.25);
  EXPECT_LT(*q, 0.26);
  // The empty chunk is refused.
  EXPECT_EQ(StoredBytesFraction(kernels::CompactChunk{}).status().code(),
            StatusCode::kInvalidArgument);
}

// Every kernel method measures its bytes; eviction alone stores its half-pairs plus the small
// overhead, quantization much less, and the dense ones keep every position.
TEST(StoredBytesTest, EveryKernelMethodReportsBytesAndItsForm) {
  llama::LlamaConfig cfg;
  cfg.dim = 4 * 64;
  cfg.hidden_dim = 64;
  cfg.num_layers = 2;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.vocab_size = 32;
  cfg.context_length = 512;
  cfg.rope.theta = 10000.0;
  constexpr int kN = 256, kW = 8;
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  PrefixCapture p;
  p.config = &cfg;
  p.cache.num_tokens = kN;
  p.cache.next_position = kN;
  for (int t = 0; t < kN; ++t) p.cache.positions.push_back(t);
  p.cache.layers.resize(cfg.num_layers);
  for (auto& l : p.cache.layers) {
    l.k.resize(static_cast<size_t>(kN) * cfg.num_kv_heads * cfg.head_dim);
    l.v.resize(l.k.size());
    for (float& x : l.k) x = g(rng);
    for (float& x : l.v) x = g(rng);
  }
  p.window = kW;
  p.window_queries.resize(cfg.num_layers);
  for (auto& q : p.window_queries) {
    q.resize(static_cast<size_t>(kW) * cfg.num_q_heads * cfg.head_dim);
    for (float& x : q) x = g(rng);
  }
  struct Expect {
    const char* name;
    double p_c, lo, hi;
    bool dense;
  };
  for (const Expect& e :
       {Expect{"keydiff", 0.5, 0.5, 0.51, false}, Expect{"snapkv", 0.9, 0.1, 0.11, false},
        Expect{"kvslimmer_l2", 0.5, 0.5, 0.51, true}, Expect{"bf16", 0.0, 1.0, 1.01, true},
        Expect{"int8", 0.0, 0.5, 0.55, true}, Expect{"int4", 0.0, 0.25, 0.3, true},
        Expect{"snapkv+int4", 0.5, 0.125, 0.15, false},
        Expect{"keydiff+int8", 0.75, 0.125, 0.15, false}}) {
    auto m = CreateKernelMethod(e.name);
    ASSERT_TRUE(m.ok()) << e.name;
    auto c = (*m)->Compress(p, e.p_c);
    ASSERT_TRUE(c.ok()) << e.name << ": " << c.status();
    EXPECT_GT(c->stored_bytes_fraction, e.lo) << e.name;
    EXPECT_LT(c->stored_bytes_fraction, e.hi) << e.name;
    EXPECT_EQ(KeepsPositions(c->cache, kN), e.dense) << e.name;
  }
}

}  // namespace
}  // namespace kvd::quality
