// Harness pieces without a model: SHA-256, manifest parsing and verification, the method
// registry and built-in methods, options, report formatting.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "bootstrap.h"
#include "harness.h"
#include "manifest.h"
#include "methods.h"
#include "plot.h"
#include "report.h"
#include "sha256.h"

namespace kvd::quality {
namespace {

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(ManifestTest, ParsesAndRejectsMalformedLines) {
  const std::string sha(64, 'a');
  auto ok = ParseManifest("# comment\n\n" + sha + " eval /x\n" + sha + "  calib  /y\n");
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[1].role, "calib");
  EXPECT_EQ((*ok)[1].path, "/y");
  auto role = ParseManifest(sha + " train /x\n");
  EXPECT_EQ(role.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(role.status().message().find("line 1"), std::string::npos);
  auto hex = ParseManifest("abc eval /x\n");
  EXPECT_EQ(hex.status().code(), StatusCode::kInvalidArgument);
  auto extra = ParseManifest(sha + " eval /x trailing\n");
  EXPECT_EQ(extra.status().code(), StatusCode::kInvalidArgument);
}

TEST(ManifestTest, VerifiesDigestsAndSkipsMismatches) {
  const std::string path = ::testing::TempDir() + "/quality_text.txt";
  std::ofstream(path) << "hello text";
  std::vector<ManifestEntry> entries = {{Sha256Hex("hello text"), "eval", path},
                                        {std::string(64, '0'), "eval", path},
                                        {Sha256Hex("x"), "eval", "/nonexistent/file"}};
  std::vector<std::string> warnings;
  auto r = ReadVerified(entries, "eval", &warnings);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0].text, "hello text");
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("sha256"), std::string::npos);
  auto none = ReadVerified(entries, "calib", &warnings);
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
}

TEST(ManifestTest, ShippedManifestParsesWithEnoughEvalTexts) {
  auto m = LoadManifest(KVD_QUALITY_DEFAULT_MANIFEST);
  ASSERT_TRUE(m.ok()) << m.status();
  int eval = 0, calib = 0;
  for (const auto& e : *m) (e.role == "eval" ? eval : calib)++;
  EXPECT_GE(eval, 4);
  EXPECT_GE(calib, 1);
}

llama::LlamaConfig TinyConfig() {
  llama::LlamaConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.num_q_heads = 4;
  c.head_dim = 4;
  c.dim = 16;
  return c;
}

PrefixCapture TinyPrefix(const llama::LlamaConfig& c, int n) {
  PrefixCapture p;
  p.config = &c;
  p.cache.num_tokens = n;
  p.cache.next_position = n;
  for (int i = 0; i < n; ++i) p.cache.positions.push_back(i);
  p.cache.layers.resize(c.num_layers);
  for (auto& l : p.cache.layers) {
    for (int i = 0; i < n * c.num_kv_heads * c.head_dim; ++i) {
      l.k.push_back(static_cast<float>(i));
      l.v.push_back(static_cast<float>(-i));
    }
  }
  return p;
}

TEST(MethodsTest, FullKeepsEverythingAndSinkRecentMeetsTheBudget) {
  const llama::LlamaConfig c = TinyConfig();
  const PrefixCapture p = TinyPrefix(c, 40);
  auto full = MethodRegistry::Global().Create("full");
  ASSERT_TRUE(full.ok());
  auto fr = (*full)->Compress(p, 0.9);
  ASSERT_TRUE(fr.ok());
  const llama::CompactKvCache* fc = &fr->cache;
  EXPECT_LT(fr->stored_fraction, 0);  // counted from slots
  EXPECT_EQ(AchievedCompression(*fc, 40), 0.0);
  EXPECT_TRUE(fc->Validate(c.num_layers, c.num_kv_heads, c.head_dim).ok());
  // Head 1 of layer 0, slot 5 is dense entry (5, head 1).
  EXPECT_EQ(fc->layers[0][1].k[5 * 4], static_cast<float>((5 * 2 + 1) * 4));

  auto sr = MethodRegistry::Global().Create("sink_recent");
  ASSERT_TRUE(sr.ok());
  auto sr_out = (*sr)->Compress(p, 0.75);
  ASSERT_TRUE(sr_out.ok());
  const llama::CompactKvCache* sc = &sr_out->cache;
  EXPECT_TRUE(sc->Validate(c.num_layers, c.num_kv_heads, c.head_dim).ok());
  EXPECT_NEAR(AchievedCompression(*sc, 40), 0.75, 1e-9);
  const auto& h = sc->layers[1][0];
  ASSERT_EQ(h.num_slots, 10);
  EXPECT_EQ(h.k[3 * 4], static_cast<float>(3 * 2 * 4));   // sink 3 = token 3
  EXPECT_EQ(h.k[4 * 4], static_cast<float>(34 * 2 * 4));  // then tokens 34..39
  EXPECT_EQ(sc->next_position, 40);
  EXPECT_EQ((*sr)->Compress(p, 1.0).status().code(), StatusCode::kInvalidArgument);
}

TEST(MethodsTest, RegistryErrors) {
  MethodRegistry r;
  auto f = []() -> StatusOr<std::unique_ptr<CompressionMethod>> {
    return Status::Unimplemented("x");
  };
  ASSERT_TRUE(r.Register("a", f).ok());
  EXPECT_EQ(r.Register("a", f).code(), StatusCode::kAlreadyExists);
  auto missing = r.Create("snapkv");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("known: a"), std::string::npos);
}

TEST(HarnessOptionsTest, Validate) {
  HarnessOptions o;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);  // no manifest
  o.manifest_path = "m";
  EXPECT_TRUE(o.Validate().ok());
  o.ratios = {1.0};
  EXPECT_NE(o.Validate().message().find("outside [0, 1)"), std::string::npos);
  HarnessOptions q = HarnessOptions::Quick();
  q.manifest_path = "m";
  EXPECT_TRUE(q.Validate().ok());
  q.window = q.prefix_tokens + 1;
  EXPECT_EQ(q.Validate().code(), StatusCode::kInvalidArgument);
  HarnessOptions c;
  c.manifest_path = "m";
  c.chunk_tokens = 300;  // does not divide 1024
  EXPECT_NE(c.Validate().message().find("chunk_tokens >= 8 dividing prefix_tokens"),
            std::string::npos)
      << c.Validate();
  c.chunk_tokens = 256;
  c.chunk_window = 257;
  EXPECT_NE(c.Validate().message().find("chunk_window must be in [1, chunk_tokens]"),
            std::string::npos);
  c.chunk_window = 16;
  c.modes = {"one-shot", "streaming"};
  EXPECT_NE(c.Validate().message().find("unknown mode 'streaming'"), std::string::npos);
  c.modes = {"one-shot"};
  c.chunk_tokens = 300;  // irrelevant without chunk-wise mode
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  c.multikey_keys = 1;
  EXPECT_NE(c.Validate().message().find("multikey_keys must be in [2, 8]"), std::string::npos);
  HarnessOptions p;
  p.manifest_path = "m";
  p.methods = {"full", "snapkv"};
  p.passkey_methods = {"snapkv", "keydiff"};
  EXPECT_EQ(p.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.Validate().message().find("passkey method 'keydiff' is not in methods"),
            std::string::npos)
      << p.Validate();
  // Per-method p_c lists: the name counts for the passkey and paired lists.
  p.methods = {"full", "snapkv", "keydiff@0.5:0.9"};
  EXPECT_TRUE(p.Validate().ok()) << p.Validate();
  auto spec = ParseMethodSpec("keydiff+int4@0:0.65", {0.5});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "keydiff+int4");
  EXPECT_EQ(spec->ratios, (std::vector<double>{0.0, 0.65}));
  EXPECT_EQ(ParseMethodSpec("snapkv", {0.5, 0.9})->ratios, (std::vector<double>{0.5, 0.9}));
  for (const char* bad : {"snapkv@", "snapkv@1", "snapkv@0.5:x", "@0.5"}) {
    EXPECT_EQ(ParseMethodSpec(bad, {0.5}).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  // Passkey on the fronts, chunk-wise: the context must be whole chunks.
  p.passkey_fronts = true;
  p.passkey_filler_tokens = 1000;
  EXPECT_NE(p.Validate().message().find("multiple of chunk_tokens"), std::string::npos);
  p.passkey_filler_tokens = 1024;
  EXPECT_TRUE(p.Validate().ok()) << p.Validate();
  // The passkey methods asked chunk-wise: the same condition.
  p.passkey_fronts = false;
  p.passkey_chunk_wise = true;
  p.passkey_filler_tokens = 1000;
  EXPECT_NE(p.Validate().message().find("multiple of chunk_tokens"), std::string::npos);
  p.passkey_filler_tokens = 1024;
  EXPECT_TRUE(p.Validate().ok()) << p.Validate();
}

TEST(ManifestTest, TextFilesAreHashedAndMustBeUtf8) {
  const std::string dir = ::testing::TempDir();
  const std::string good = dir + "/quality_text_good.txt", bad = dir + "/quality_text_bad.txt";
  std::ofstream(good, std::ios::binary) << "abc";
  std::ofstream(bad, std::ios::binary) << "ab\xC3(";
  auto t = ReadTextFiles({good});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 1u);
  EXPECT_EQ((*t)[0].text, "abc");
  EXPECT_EQ((*t)[0].entry.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  auto b = ReadTextFiles({good, bad});
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b.status().message(), "text file " + bad + " is not valid UTF-8");
  auto missing = ReadTextFiles({dir + "/quality_no_such_file"});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("cannot read text file"), std::string::npos);
  EXPECT_TRUE(IsValidUtf8("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xF4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xE2\x82"));          // truncated
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST(BootstrapTest, PointEstimateInsideAndIntervalsShrinkWithMoreSegments) {
  // Segments whose method/engine NLL gap varies: ratio per segment exp(gap / n).
  SegmentSums s;
  for (int i = 0; i < 8; ++i) {
    s.engine_nll.push_back(100.0);
    s.nll.push_back(100.0 + (i % 4) * 2.0);  // gaps 0, 2, 4, 6 per 50 tokens
    s.n.push_back(50);
    s.agree.push_back(40 + i % 3);
  }
  const BootstrapResult b = BootstrapSegments(s, 2000);
  const double point = std::exp(24.0 / 400.0);  // total gap 24 over 400 tokens
  EXPECT_LT(b.ppl_ratio.lo, point);
  EXPECT_GT(b.ppl_ratio.hi, point);
  EXPECT_GE(b.ppl_ratio.lo, 1.0);                 // no resample has a negative gap
  EXPECT_LE(b.ppl_ratio.hi, std::exp(6.0 / 50));  // nor one above the largest
  EXPECT_LT(b.top1.lo, 327.0 / 400);
  EXPECT_GT(b.top1.hi, 327.0 / 400);
  // Same per-segment spread, 4x the segments: the interval narrows (about 2x).
  SegmentSums big;
  for (int r = 0; r < 4; ++r) {
    big.nll.insert(big.nll.end(), s.nll.begin(), s.nll.end());
    big.engine_nll.insert(big.engine_nll.end(), s.engine_nll.begin(), s.engine_nll.end());
    big.n.insert(big.n.end(), s.n.begin(), s.n.end());
    big.agree.insert(big.agree.end(), s.agree.begin(), s.agree.end());
  }
  const BootstrapResult bb = BootstrapSegments(big, 2000);
  EXPECT_LT(bb.ppl_ratio.hi - bb.ppl_ratio.lo, 0.7 * (b.ppl_ratio.hi - b.ppl_ratio.lo));
  // Deterministic for a seed.
  const BootstrapResult again = BootstrapSegments(s, 2000);
  EXPECT_EQ(again.ppl_ratio.lo, b.ppl_ratio.lo);
  // One segment or no resamples: the point estimate; mismatched sizes: {0, 0}.
  SegmentSums one{{102.0}, {100.0}, {50}, {40}};
  const BootstrapResult b1 = BootstrapSegments(one, 100);
  EXPECT_DOUBLE_EQ(b1.ppl_ratio.lo, std::exp(2.0 / 50));
  EXPECT_DOUBLE_EQ(b1.ppl_ratio.hi, std::exp(2.0 / 50));
  SegmentSums broken = s;
  broken.n.pop_back();
  EXPECT_EQ(BootstrapSegments(broken, 100).ppl_ratio.hi, 0.0);
  EXPECT_TRUE((Interval{1.0, 1.1}).Disjoint(Interval{1.2, 1.3}));
  EXPECT_FALSE((Interval{1.0, 1.25}).Disjoint(Interval{1.2, 1.3}));
}

TEST(ReportTest, CsvAndMarkdown) {
  HarnessReport r;
  r.engine_perplexity = 10;
  r.engine_scored_tokens = 100;
  MethodResult m;
  m.method = "sink_recent";
  m.p_c = 0.5;
  m.perplexity = 12.5;
  m.top1_agreement = 0.9;
  m.layer_rel_error = {0.1, 0.3};
  m.mean_rel_error = 0.2;
  m.stored_raw = 0.5123;
  r.rows.push_back(m);
  const std::string csv = ToCsv(r);
  m.ppl_ratio_lo = 1.2;
  m.ppl_ratio_hi = 1.3;
  m.top1_lo = 0.85;
  m.top1_hi = 0.95;
  r.rows.back() = m;
  const std::string csv2 = ToCsv(r);
  EXPECT_NE(csv2.find("sink_recent,one-shot,0.5000,0.0000,0,12.500000,1.250000,1.200000,1.300000,"
                      "0.900000,0.850000,0.950000,0.200000"),
            std::string::npos)
      << csv2;
  EXPECT_NE(LayersToCsv(r).find("sink_recent,one-shot,0.5000,1,0.300000"), std::string::npos);
  auto back = FromCsv(csv2);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->rows.size(), 1u);
  EXPECT_EQ(back->rows[0].method, "sink_recent");
  EXPECT_EQ(back->rows[0].mode, "one-shot");
  EXPECT_DOUBLE_EQ(back->rows[0].ppl_ratio_hi, 1.3);
  EXPECT_DOUBLE_EQ(back->rows[0].top1_lo, 0.85);
  EXPECT_DOUBLE_EQ(back->rows[0].stored_raw, 0.5123);
  EXPECT_FALSE(back->rows[0].keeps_positions);
  // The 19-field layout (before stored bytes and forms) reads with no bytes measured.
  auto no_bytes =
      FromCsv("h\nsnapkv,chunk-wise,0.5,0.5,10,12,1.2,1.1,1.3,0.9,0.8,1,0.1,0,0,0,0,1,1\n");
  ASSERT_TRUE(no_bytes.ok()) << no_bytes.status();
  EXPECT_LT(no_bytes->rows[0].stored_raw, 0);
  // The 11-field layout of earlier runs still re-plots (as one-shot rows).
  auto old = FromCsv(
      "h\nengine,0,0,2040,14.054,1,1,0,3,3,0\nsnapkv,0.5000,0.5,2040,14.212,1.011,0.942,0.09,0,3,"
      "12.5\n");
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_DOUBLE_EQ(old->engine_perplexity, 14.054);
  EXPECT_EQ(old->engine_passkey_total, 3);
  ASSERT_EQ(old->rows.size(), 1u);
  EXPECT_DOUBLE_EQ(old->rows[0].perplexity, 14.212);
  EXPECT_DOUBLE_EQ(old->rows[0].top1_agreement, 0.942);
  EXPECT_DOUBLE_EQ(old->rows[0].seconds, 12.5);
  EXPECT_DOUBLE_EQ(back->rows[0].perplexity, 12.5);
  EXPECT_DOUBLE_EQ(back->engine_perplexity, 10.0);
  auto bad = FromCsv("header\nbad,row\n");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("line 2 has 2 fields, expected 21"), std::string::npos)
      << bad.status();
  const std::string md = ToMarkdown(r, "kvd-quality --quick");
  EXPECT_NE(md.find("| sink_recent | 0.50 |"), std::string::npos) << md;
  EXPECT_NE(md.find("1.250 [1.200, 1.300]"), std::string::npos) << md;
  EXPECT_NE(md.find("`kvd-quality --quick`"), std::string::npos);
}

TEST(ReportTest, WritesFilesAndAValidPng) {
  HarnessReport r;
  r.engine_perplexity = 10;
  for (double pc : {0.5, 0.75, 0.9}) {
    MethodResult m;
    m.method = "sink_recent";
    m.p_c = pc;
    m.perplexity = 10 + 10 * pc;
    r.rows.push_back(m);
    m.mode = kModeChunkWise;
    m.perplexity = 11 + 10 * pc;
    r.rows.push_back(m);
  }
  MethodResult f;
  f.method = "full";
  f.perplexity = 10;
  r.rows.insert(r.rows.begin(), f);
  const std::string dir = ::testing::TempDir() + "/quality_report";
  ASSERT_TRUE(WriteReport(r, dir, "cmd").ok());
  EXPECT_EQ(ModesOf(r), (std::vector<std::string>{"one-shot", "chunk-wise"}));
  for (const char* mode : {"one-shot", "chunk-wise"}) {
    std::ifstream in(dir + "/" + PlotFileName(mode), std::ios::binary);
    std::string png((std::istreambuf_iterator<char>(in)), {});
    ASSERT_GT(png.size(), 100u) << mode;
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_EQ(png.substr(12, 4), "IHDR");
    EXPECT_EQ(png.substr(png.size() - 8, 4), "IEND");
    const HarnessReport one = RowsOfMode(r, mode);
    ASSERT_EQ(one.rows.size(), 4u);  // full + 3 ratios of this mode
    EXPECT_EQ(PlotLegend(one), (std::vector<std::string>{"full: black", "sink_recent: red"}));
  }
  for (const char* f : {"results.csv", "segments.csv", "layers.csv", "results.md",
                        "fronts-one-shot.png", "fronts-chunk-wise.png"}) {
    EXPECT_TRUE(std::ifstream(dir + "/" + f).good()) << f;
  }
}

TEST(PlotTest, PngOfATinyImageHasTheRightSizeAndChecksums) {
  // 2x1 RGB: 2 rows of (filter byte + 6 bytes) = 14 raw bytes in one stored block.
  const std::string png = EncodePng(2, 1, {255, 0, 0, 0, 255, 0});
  // signature 8 + IHDR (12+13) + IDAT (12 + 2 zlib + 5 block header + 7 + 4 adler) + IEND 12
  EXPECT_EQ(png.size(), 8u + 25u + 12u + 2u + 5u + 7u + 4u + 12u);
  // Adler-32 of {0, 255, 0, 0, 0, 255, 0}: a = 1 + 510 = 511, b = sum of running a.
  uint32_t a = 1, b = 0;
  for (int c : {0, 255, 0, 0, 0, 255, 0}) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  const size_t adler_at = 8 + 25 + 8 + 2 + 5 + 7;
  const uint32_t got =
      (uint32_t(uint8_t(png[adler_at])) << 24) | (uint32_t(uint8_t(png[adler_at + 1])) << 16) |
      (uint32_t(uint8_t(png[adler_at + 2])) << 8) | uint32_t(uint8_t(png[adler_at + 3]));
  EXPECT_EQ(got, (b << 16) | a);
}

}  // namespace
}  // namespace kvd::quality
