// Byte-level BPE tokenizer on small hand-made vocabularies (the SmolLM2 vocabulary is tested in
// smollm2_test.cc): GPT-2 pre-tokenizer splits, digit splitting, merges, specials, round trips.
#include "kvd/llama/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "gguf_builder.h"
#include "kvd/llama/gguf.h"

namespace kvd::llama {
namespace {

using testing::ByteTokens;

std::unique_ptr<Tokenizer> Make(std::vector<std::string> extra, std::vector<std::string> merges,
                                std::string pre = "smollm",
                                std::vector<std::string> specials = {}) {
  std::vector<std::string> toks = ByteTokens();
  std::vector<int32_t> types(toks.size(), Tokenizer::kNormal);
  for (auto& s : specials) {
    toks.push_back(s);
    types.push_back(Tokenizer::kControl);
  }
  for (auto& e : extra) {
    toks.push_back(e);
    types.push_back(Tokenizer::kNormal);
  }
  auto t = Tokenizer::Create(toks, types, merges, pre, -1, -1);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<std::string> Split(const Tokenizer& t, std::string_view s) {
  std::vector<std::string> out;
  for (auto p : t.PreTokenize(s)) out.emplace_back(p);
  return out;
}

using V = std::vector<std::string>;

TEST(TokenizerTest, PreTokenizerFollowsGpt2Regex) {
  auto t = Make({}, {});
  EXPECT_EQ(Split(*t, "Hello world"), (V{"Hello", " world"}));
  // The expectations below match HF tokenizers' Digits(individual)+ByteLevel on the same input.
  EXPECT_EQ(Split(*t, "  two  spaces\n\nand\ttab"),
            (V{" ", " two", " ", " spaces", "\n", "\n", "and", "\t", "tab"}));
  EXPECT_EQ(Split(*t, "It's 2024, we'll"),
            (V{"It", "'s", " ", "2", "0", "2", "4", ",", " we", "'ll"}));
  EXPECT_EQ(Split(*t, "don't STOP'S x  "), (V{"don", "'t", " STOP", "'", "S", " x", "  "}));
  EXPECT_EQ(Split(*t, "a...b ?!c"), (V{"a", "...", "b", " ?!", "c"}));
  EXPECT_EQ(Split(*t, "naïve café 日本語"), (V{"naïve", " café", " 日本語"}));
  EXPECT_EQ(Split(*t, "x\n\n\ny"), (V{"x", "\n\n", "\n", "y"}));
  EXPECT_EQ(Split(*t, ""), V{});
}

TEST(TokenizerTest, Gpt2PreTokenizerKeepsNumbersWhole) {
  auto t = Make({}, {}, "gpt2");
  EXPECT_EQ(Split(*t, "in 2024 ½"), (V{"in", " 2024", " ½"}));
  auto s = Make({}, {}, "smollm");
  EXPECT_EQ(Split(*s, "in 2024"), (V{"in", " ", "2", "0", "2", "4"}));
}

TEST(TokenizerTest, MergesApplyByRank) {
  // "a b" first, then "ab ab": "abab" -> one token; "aba" -> "ab" + "a".
  auto t = Make({"ab", "abab", "Ġa"}, {"a b", "ab ab", "Ġ a"});
  const int32_t ab = t->Find("ab"), abab = t->Find("abab"), a = t->Find("a"), sp_a = t->Find("Ġa");
  ASSERT_GE(ab, 0);
  EXPECT_EQ(t->Encode("abab"), (std::vector<int32_t>{abab}));
  EXPECT_EQ(t->Encode("aba"), (std::vector<int32_t>{ab, a}));
  EXPECT_EQ(t->Encode("aba a"), (std::vector<int32_t>{ab, a, sp_a}));
}

TEST(TokenizerTest, RoundTripsArbitraryBytes) {
  auto t = Make({"ab"}, {"a b"});
  const std::string texts[] = {
      "plain ASCII, with punctuation!?",
      "UTF-8: naïve café — Ünïcödé 日本語 😀👍🏽",
      std::string("invalid \xff\xfe bytes \xc3 cut"),
      std::string("nul\0inside", 10),
      "\t\r\n  mixed   whitespace \u00a0\u3000 end  ",
  };
  for (const std::string& s : texts) {
    auto ids = t->Encode(s);
    auto back = t->Decode(ids);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, s);
  }
}

TEST(TokenizerTest, SpecialTokensOnlyWhenAsked) {
  auto t = Make({}, {}, "smollm", {"<|im_start|>", "<|im_end|>"});
  const int32_t start = t->Find("<|im_start|>");
  ASSERT_GE(start, 0);
  auto with = t->Encode("<|im_start|>hi<|im_end|>", /*parse_special=*/true);
  ASSERT_EQ(with.size(), 4u);
  EXPECT_EQ(with.front(), start);
  EXPECT_EQ(with.back(), t->Find("<|im_end|>"));
  auto without = t->Encode("<|im_start|>hi", /*parse_special=*/false);
  EXPECT_EQ(std::count(without.begin(), without.end(), start), 0);
  EXPECT_EQ(*t->Decode(with), "<|im_start|>hi<|im_end|>");
  EXPECT_EQ(*t->Decode(with, /*render_special=*/false), "hi");
}

TEST(TokenizerTest, ErrorsAreSpecific) {
  auto t = Make({}, {});
  std::vector<int32_t> bad = {5, 100000};
  auto d = t->Decode(bad);
  EXPECT_EQ(d.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(d.status().message().find("100000"), std::string::npos);

  auto pre = Tokenizer::Create(ByteTokens(), {}, {}, "deepseek-llm", -1, -1);
  EXPECT_EQ(pre.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(pre.status().message().find("deepseek-llm"), std::string::npos);

  auto merge = Tokenizer::Create(ByteTokens(), {}, {"nospace"}, "gpt2", -1, -1);
  EXPECT_EQ(merge.status().code(), StatusCode::kInvalidArgument);

  testing::GgufBuilder b;
  b.KvStr("tokenizer.ggml.model", "llama");
  auto g = GgufFile::Parse(b.Build());
  ASSERT_TRUE(g.ok());
  auto spm = Tokenizer::FromGguf(**g);
  EXPECT_EQ(spm.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(spm.status().message().find("'llama'"), std::string::npos);
}

}  // namespace
}  // namespace kvd::llama
