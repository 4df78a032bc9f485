// SmolLM2-135M-Instruct (GGUF Q4_1) end to end: metadata, tokenizer against ids produced by
// HF `tokenizers` from the same vocabulary and merges, fluent greedy text, plausible perplexity.
// Skips when deploy/fetch-models.sh has not fetched the model.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvd/llama/engine.h"
#include "kvd/llama/eval.h"
#include "kvd/llama/model.h"
#include "kvd/llama/tokenizer.h"
#include "test_models.h"

namespace kvd::llama {
namespace {

class SmolLM2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::Exists(testing::SmolLM2Path())) return;
    auto m = LlamaModel::Load(testing::SmolLM2Path());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    KVD_REQUIRE_SMOLLM2();
    ASSERT_NE(model_, nullptr);
    ASSERT_NE(model_->tokenizer(), nullptr);
  }
  const Tokenizer& tok() const { return *model_->tokenizer(); }
  static LlamaModel* model_;
};
LlamaModel* SmolLM2Test::model_ = nullptr;

TEST_F(SmolLM2Test, MetadataAndTensorTypes) {
  const LlamaConfig& c = model_->config();
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.num_q_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.dim, 576);
  EXPECT_EQ(c.hidden_dim, 1536);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.context_length, 8192);
  EXPECT_DOUBLE_EQ(c.rope.theta, 100000.0);
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_NEAR(c.norm_eps, 1e-5f, 1e-9f);
  // The file's real tensor types: Q4_1 matrices, F32 norms, a Q8_0 embedding (tied output).
  EXPECT_EQ(model_->tensor_types(), "F32:61 Q4_1:210 Q8_0:1");
  EXPECT_EQ(&model_->output(), &model_->token_embedding());
  EXPECT_EQ(tok().bos(), 1);
  EXPECT_EQ(tok().eos(), 2);
  EXPECT_EQ(tok().pre(), "smollm");
}

// Expected ids from HF tokenizers (BPE over this GGUF's tokens/merges, pre-tokenizer
// Digits(individual_digits) + ByteLevel(add_prefix_space=False)), the same pipeline as the
// model's own tokenizer.json.
TEST_F(SmolLM2Test, EncodesLikeHfTokenizers) {
  EXPECT_EQ(tok().Encode("Hello world"), (std::vector<int32_t>{19556, 905}));
  EXPECT_EQ(tok().Encode("Once upon a time"), (std::vector<int32_t>{6403, 1980, 253, 655}));
  EXPECT_EQ(tok().Encode("It's 2024, we'll see: naïve café — 日本語 😀!"),
            (std::vector<int32_t>{1589, 506,   216, 34,    32,    34,    36,   28,    392,
                                  3060, 963,   42,  15486, 46494, 37366, 1841, 17097, 241,
                                  115,  40993, 179, 120,   248,   40303, 218,  17}));
  EXPECT_EQ(tok().Encode("  two  spaces\n\nand\ttab"),
            (std::vector<int32_t>{216, 827, 216, 5600, 198, 198, 397, 197, 15999}));
  EXPECT_EQ(tok().Encode("<|im_start|>user", /*parse_special=*/true),
            (std::vector<int32_t>{1, 4093}));
  EXPECT_EQ(tok().TokenText(905), "Ġworld");
}

TEST_F(SmolLM2Test, RoundTripsRealText) {
  std::ifstream in("/usr/share/common-licenses/GPL-3", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  if (text.empty()) text = "The GNU General Public License is a free, copyleft license.\n";
  text +=
      "\nUTF-8: Ünïcödé ½ ⅷ 日本語のテキスト Αλφα βήτα ‘quoted’ 😀👍🏽\r\n\t "
      "end "
      " ";
  auto ids = tok().Encode(text);
  auto back = tok().Decode(ids);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, text);
  EXPECT_LT(ids.size(), text.size() / 3);  // a real BPE vocabulary compresses English text
}

TEST_F(SmolLM2Test, GreedyContinuationIsFluentEnglish) {
  LlamaSession s(*model_);
  auto r = GenerateGreedy(s, tok().Encode("Once upon a time"), 32);
  ASSERT_TRUE(r.ok()) << r.status();
  auto text = tok().Decode(r->tokens);
  ASSERT_TRUE(text.ok());
  std::cout << "[continuation] Once upon a time" << *text << "\n";
  // Fluency proxies: mostly letters and spaces, several common English words.
  int letters = 0;
  for (char ch : *text) letters += std::isalpha(static_cast<unsigned char>(ch)) || ch == ' ';
  EXPECT_GT(letters, static_cast<int>(text->size() * 0.85)) << *text;
  int common = 0;
  for (const char* w : {" the ", " a ", " and ", " of ", " was ", " in ", " to "}) {
    common += text->find(w) != std::string::npos;
  }
  EXPECT_GE(common, 2) << *text;
}

TEST_F(SmolLM2Test, PerplexityOfRealEnglishIsPlausible) {
  std::ifstream in("/usr/share/common-licenses/GPL-3", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  if (text.empty()) GTEST_SKIP() << "/usr/share/common-licenses/GPL-3 is absent";
  auto ids = tok().Encode(text);
  ids.resize(512);
  auto r = Perplexity(*model_, ids, {.window = 512});
  ASSERT_TRUE(r.ok()) << r.status();
  std::cout << "[ppl] GPL-3 first 512 tokens: " << r->perplexity << "\n";
  EXPECT_GT(r->perplexity, 2.0);
  EXPECT_LT(r->perplexity, 40.0);
  // A shuffled token order must be far less likely: the score measures the model, not noise.
  std::vector<int32_t> shuffled(ids.rbegin(), ids.rend());
  auto s = Perplexity(*model_, shuffled, {.window = 512});
  ASSERT_TRUE(s.ok());
  EXPECT_GT(s->perplexity, 3 * r->perplexity);
}

}  // namespace
}  // namespace kvd::llama
