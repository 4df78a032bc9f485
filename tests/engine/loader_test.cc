// Model loaders: llama2.c checkpoints, GGUF (llama) files written from the same weights, and clean
// errors on bad files.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "gguf_builder.h"
#include "kvd/common/dtype.h"
#include "kvd/llama/engine.h"
#include "kvd/llama/model.h"
#include "test_models.h"

namespace kvd::llama {
namespace {

using testing::GgufBuilder;

std::string WriteTemp(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string F16Bytes(const std::vector<float>& v) {
  std::string s(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = FloatToHalf(v[i]);
    std::memcpy(&s[2 * i], &h, 2);
  }
  return s;
}

std::string Q8_0Bytes(const std::vector<float>& v) {  // ggml's quantize_row_q8_0 reference
  std::string s;
  for (size_t b = 0; b < v.size(); b += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[b + j]));
    const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    uint16_t h = FloatToHalf(d);
    s.append(reinterpret_cast<const char*>(&h), 2);
    for (int j = 0; j < 32; ++j)
      s.push_back(static_cast<char>(static_cast<int8_t>(std::lround(v[b + j] * id))));
  }
  return s;
}

// Writes `m`'s weights as a llama GGUF; matrices in `type` (0 = F32, 1 = F16, 8 = Q8_0 where
// rows are whole blocks, else F16).
std::string ToGguf(const LlamaModel& m, uint32_t type, const std::string& arch = "llama") {
  const LlamaConfig& c = m.config();
  GgufBuilder b;
  b.KvStr("general.architecture", arch);
  b.KvU32("llama.embedding_length", c.dim);
  b.KvU32("llama.feed_forward_length", c.hidden_dim);
  b.KvU32("llama.block_count", c.num_layers);
  b.KvU32("llama.attention.head_count", c.num_q_heads);
  b.KvU32("llama.attention.head_count_kv", c.num_kv_heads);
  b.KvU32("llama.context_length", c.context_length);
  b.KvF32("llama.rope.freq_base", 10000.0f);
  b.KvF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  auto mat = [&](const std::string& name, uint64_t in, uint64_t out, const std::vector<float>& w) {
    if (type == 0) {
      b.TensorF32(name, {in, out}, w);
    } else if (type == 1) {
      b.Tensor(name, {in, out}, 1, F16Bytes(w));
    } else if (in % 32 == 0) {
      b.Tensor(name, {in, out}, 8, Q8_0Bytes(w));
    } else {  // Q8_0 needs whole blocks of 32 per row (ffn_down has rows of 172)
      b.Tensor(name, {in, out}, 1, F16Bytes(w));
    }
  };
  const uint64_t d = c.dim, h = c.hidden_dim, qd = uint64_t(c.num_q_heads) * c.head_dim,
                 kvd = uint64_t(c.num_kv_heads) * c.head_dim;
  b.TensorF32("token_embd.weight", {d, uint64_t(c.vocab_size)}, m.token_embedding());
  b.TensorF32("output_norm.weight", {d}, m.output_norm());
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = m.layers()[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    b.TensorF32(p + "attn_norm.weight", {d}, w.attn_norm);
    b.TensorF32(p + "ffn_norm.weight", {d}, w.ffn_norm);
    mat(p + "attn_q.weight", d, qd, w.wq);
    mat(p + "attn_k.weight", d, kvd, w.wk);
    mat(p + "attn_v.weight", d, kvd, w.wv);
    mat(p + "attn_output.weight", qd, d, w.wo);
    mat(p + "ffn_gate.weight", d, h, w.w_gate);
    mat(p + "ffn_up.weight", d, h, w.w_up);
    mat(p + "ffn_down.weight", h, d, w.w_down);
  }
  return b.Build();
}

std::vector<float> LogitsFor(const LlamaModel& m, const std::vector<int32_t>& toks) {
  LlamaSession s(m, {.threads = 1});
  auto r = s.Forward(toks);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<float>{};
}

TEST(LoaderTest, Llama2cStories260KConfig) {
  KVD_REQUIRE_STORIES();
  auto m = LlamaModel::Load(testing::Stories260KPath());
  ASSERT_TRUE(m.ok()) << m.status();
  const LlamaConfig& c = (*m)->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.num_layers, 5);
  EXPECT_EQ(c.num_q_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.context_length, 512);
  EXPECT_EQ(c.rope.pairing, RopePairing::kInterleaved);
  EXPECT_EQ((*m)->tokenizer(), nullptr);
  EXPECT_EQ(&(*m)->output(), &(*m)->token_embedding());  // shared classifier
  EXPECT_TRUE(c.ToModelLayout().Validate().ok());
}

TEST(LoaderTest, GgufOfTheSameWeightsGivesTheSameLogits) {
  KVD_REQUIRE_STORIES();
  auto ref = LlamaModel::Load(testing::Stories260KPath());
  ASSERT_TRUE(ref.ok());
  const std::vector<int32_t> toks = {1, 461, 401, 378, 455, 13, 299};
  const std::vector<float> want = LogitsFor(**ref, toks);

  auto f32 = LlamaModel::Load(WriteTemp("stories_f32.gguf", ToGguf(**ref, 0)));
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ((*f32)->tensor_types(), "F32:47");
  EXPECT_EQ(LogitsFor(**f32, toks), want);  // same float32 weights: bit-identical

  for (uint32_t type : {1u, 8u}) {  // F16 and Q8_0: close, same argmax
    auto q = LlamaModel::Load(WriteTemp("stories_q.gguf", ToGguf(**ref, type)));
    ASSERT_TRUE(q.ok()) << q.status();
    const std::vector<float> got = LogitsFor(**q, toks);
    ASSERT_EQ(got.size(), want.size());
    double max_err = 0, max_abs = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_err = std::max(max_err, double(std::fabs(got[i] - want[i])));
      max_abs = std::max(max_abs, double(std::fabs(want[i])));
    }
    // Measured: F16 0.0014, Q8_0 0.068 of the largest logit (8-bit weights, 5 layers).
    EXPECT_LT(max_err, (type == 1 ? 0.005 : 0.15) * max_abs) << "type " << type;
    EXPECT_EQ(Argmax(got), Argmax(want)) << "type " << type;
    // Weight level: every dequantised weight lies within half a quantisation step of the
    // original (F16: 2^-11 relative; Q8_0: amax/127/2 of its block, plus the f16 scale rounding).
    const std::vector<float>& wq = (*q)->layers()[0].wq;
    const std::vector<float>& wr = (*ref)->layers()[0].wq;
    ASSERT_EQ(wq.size(), wr.size());
    for (size_t b = 0; b < wr.size(); b += 32) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(wr[b + j]));
      for (int j = 0; j < 32; ++j) {
        const float tol = type == 1 ? std::fabs(wr[b + j]) * 0.0005f + 1e-7f
                                    : amax / 127.0f * 0.5f + amax * 0.001f;
        ASSERT_NEAR(wq[b + j], wr[b + j], tol) << "type " << type << " weight " << b + j;
      }
    }
  }
}

TEST(LoaderTest, UnsupportedArchitectureIsUnimplemented) {
  KVD_REQUIRE_STORIES();
  auto ref = LlamaModel::Load(testing::Stories260KPath());
  ASSERT_TRUE(ref.ok());
  auto m = LlamaModel::Load(WriteTemp("gpt2.gguf", ToGguf(**ref, 0, "gpt2")));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(m.status().message().find("architecture 'gpt2'"), std::string::npos);
}

TEST(LoaderTest, MissingTensorOrWrongShapeIsInvalidArgument) {
  GgufBuilder b;
  b.KvStr("general.architecture", "llama");
  b.KvU32("llama.embedding_length", 8);
  b.KvU32("llama.feed_forward_length", 16);
  b.KvU32("llama.block_count", 1);
  b.KvU32("llama.attention.head_count", 2);
  b.KvU32("llama.context_length", 32);
  b.KvU32("llama.vocab_size", 4);
  b.TensorF32("token_embd.weight", {4, 8}, std::vector<float>(32, 0.0f));  // transposed on purpose
  auto m = LlamaModel::Load(WriteTemp("bad_shape.gguf", b.Build()));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("token_embd.weight has shape [4, 8], expected [8, 4]"),
            std::string::npos)
      << m.status();
}

// A small file claiming far more layers than it has tensors is refused before anything is sized
// by the claim (found by the GGUF fuzz target: 14 KB asking for 8M layers allocated 1.7 GB).
TEST(LoaderTest, BlockCountBeyondTheFilesTensorsIsRefusedUpFront) {
  GgufBuilder b;
  b.KvStr("general.architecture", "llama");
  b.KvU32("llama.embedding_length", 8);
  b.KvU32("llama.feed_forward_length", 16);
  b.KvU32("llama.block_count", 1u << 29);
  b.KvU32("llama.attention.head_count", 2);
  b.KvU32("llama.context_length", 32);
  b.KvU32("llama.vocab_size", 4);
  b.TensorF32("token_embd.weight", {8, 4}, std::vector<float>(32, 0.0f));
  b.TensorF32("output_norm.weight", {8}, std::vector<float>(8, 1.0f));
  auto m = LlamaModel::Load(WriteTemp("many_layers.gguf", b.Build()));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("llama.block_count 536870912 needs 9 tensors per layer; "
                                      "the file holds 2 tensors"),
            std::string::npos)
      << m.status();
}

TEST(LoaderTest, TruncatedCheckpointsAreDataLoss) {
  KVD_REQUIRE_STORIES();
  const std::string full = ReadAll(testing::Stories260KPath());
  auto m = LlamaModel::Load(WriteTemp("stories_cut.bin", full.substr(0, full.size() - 1000)));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("truncated llama2.c checkpoint"), std::string::npos);

  auto ref = LlamaModel::Load(testing::Stories260KPath());
  ASSERT_TRUE(ref.ok());
  const std::string g = ToGguf(**ref, 8);
  auto t = LlamaModel::Load(WriteTemp("stories_cut.gguf", g.substr(0, g.size() / 2)));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
}

TEST(LoaderTest, GarbageAndMissingFiles) {
  auto g = LlamaModel::Load(WriteTemp("garbage.bin", "hello"));
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("neither a GGUF file nor a llama2.c checkpoint"),
            std::string::npos);
  std::string junk(4096, '\xff');
  auto j = LlamaModel::Load(WriteTemp("junk.bin", junk));
  EXPECT_EQ(j.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(j.status().message().find("not a llama2.c checkpoint"), std::string::npos);
  auto n = LlamaModel::Load("/nonexistent/model.gguf");
  EXPECT_EQ(n.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvd::llama
