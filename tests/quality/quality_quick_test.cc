// kvd-quality --quick on SmolLM2 (label quality): the full-cache row equals the uncompressed
// engine exactly, budgets are met, quality degrades as p_c rises, and the orderings the papers
// predict at p_c = 0.9 are checked (the robust ones asserted, the rest printed with the numbers).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include "harness.h"
#include "kernel_methods.h"
#include "kvd/llama/model.h"
#include "report.h"

namespace kvd::quality {
namespace {

std::string ModelPath() {
  const char* dir = std::getenv("KVD_MODELS_DIR");
  return std::string(dir != nullptr ? dir : KVD_TEST_MODELS_CACHE_DIR) +
         "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

const MethodResult* Row(const HarnessReport& r, const std::string& method, double p_c,
                        const std::string& mode = kModeOneShot) {
  for (const MethodResult& m : r.rows) {
    if (m.method == method && m.mode == mode && std::abs(m.p_c - p_c) < 1e-9) return &m;
  }
  return nullptr;
}

// One of the orderings docs/algorithms.md / the papers predict, checked on the quick run's data.
struct Claim {
  std::string text;
  bool holds;
  // Asserted only when it held with a margin in the measured quick runs (docs/quality.md); the
  // others (e.g. the hybrid and KVSlimmer, which lose to eviction at p_c 0.9 on this model) are
  // printed with the numbers, never silently dropped.
  bool asserted;
};

// Each test: the model (skipped without it) and the quick preset as the tests run it.
class QualityQuickTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(ModelPath())) {
      GTEST_SKIP() << "SmolLM2 GGUF not found at " << ModelPath() << ": run deploy/fetch-models.sh";
    }
    auto model = llama::LlamaModel::Load(ModelPath());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }

  static HarnessOptions QuickOptions() {
    HarnessOptions o = HarnessOptions::Quick();
    o.manifest_path = KVD_QUALITY_DEFAULT_MANIFEST;
    // One engine thread: ctest runs two tests at a time, and OpenBLAS's second thread spin-waits
    // (sched_yield) on a busy machine; measured in docs/quality.md ("Running it").
    o.threads = 1;
    // Two workers over the segments and prompts (the default on 2 cores); the sanity test
    // checks that one worker gives the same numbers.
    o.jobs = 2;
    return o;
  }

  std::unique_ptr<llama::LlamaModel> model_;
};

TEST_F(QualityQuickTest, SanityOfTheQuickRun) {
  HarnessOptions o = QuickOptions();
  // Quick() runs one method per stage kind (two scorers, VECTOR routing, KVSlimmer merging, the
  // hybrid); quality_kernel_methods_test covers every registered method without a model.
  auto rep = RunHarness(*model_, o);
  ASSERT_TRUE(rep.ok()) << rep.status();
  std::cout << ToMarkdown(*rep, "quality_quick_test");
  ASSERT_EQ(rep->segments, o.max_segments);
  ASSERT_EQ(rep->rows.size(), 1 + (o.methods.size() - 1) * o.ratios.size() * o.modes.size());
  ASSERT_EQ(o.modes.size(), 2u);  // one-shot and chunk-wise

  const MethodResult& full = rep->rows[0];
  ASSERT_EQ(full.method, "full");
  // Exactly the uncompressed engine: same NLL sum to the last bit, same argmax everywhere.
  EXPECT_EQ(full.nll_sum, rep->engine_nll_sum);
  EXPECT_EQ(full.top1_agreement, 1.0);
  EXPECT_EQ(full.mean_rel_error, 0.0);
  EXPECT_EQ(full.passkey_correct, rep->engine_passkey_correct);
  EXPECT_EQ(full.multikey_correct, rep->engine_multikey_correct);
  EXPECT_EQ(full.ppl_ratio_lo, 1.0);  // identical NLL on every segment: a zero-width interval
  EXPECT_EQ(full.ppl_ratio_hi, 1.0);
  // A plausible perplexity for a 135M model on English prose and code.
  EXPECT_GT(rep->engine_perplexity, 1.5);
  EXPECT_LT(rep->engine_perplexity, 60.0);

  // Budgets: every method stores (1 - p_c) of the raw K+V half-pairs, in both modes; the 95%
  // intervals hold the point estimate; passkey is run in one-shot mode only.
  const int prompts = static_cast<int>(o.passkey_depths.size()) * o.passkey_trials;
  for (const MethodResult& m : rep->rows) {
    if (m.method != "full") {
      EXPECT_NEAR(m.achieved_p_c, m.p_c, 0.01)
          << m.method << " " << m.mode << " budget not met at " << m.p_c;
    }
    const double ratio = m.perplexity / rep->engine_perplexity;
    EXPECT_LE(m.ppl_ratio_lo, ratio * (1 + 1e-12)) << m.method << " " << m.mode;
    EXPECT_GE(m.ppl_ratio_hi, ratio * (1 - 1e-12)) << m.method << " " << m.mode;
    EXPECT_LE(m.top1_lo, m.top1_agreement + 1e-12);
    EXPECT_GE(m.top1_hi, m.top1_agreement - 1e-12);
    EXPECT_EQ(m.seg_nll.size(), static_cast<size_t>(rep->segments));
    EXPECT_EQ(m.passkey_total, m.mode == kModeOneShot ? prompts : 0) << m.method << " " << m.mode;
    EXPECT_EQ(m.multikey_total, m.mode == kModeOneShot ? o.multikey_trials : 0);
  }
  EXPECT_EQ(rep->engine_passkey_total, prompts);
  EXPECT_EQ(rep->engine_multikey_total, o.multikey_trials);
  // Calibration R^2 per layer for every VECTOR method, each in [0, 1] (values are reported).
  for (const char* name : {"snapkv+vector", "hybrid"}) {
    auto it = rep->calibration_r2.find(name);
    ASSERT_NE(it, rep->calibration_r2.end()) << name << " reported no R^2";
    ASSERT_EQ(it->second.size(), static_cast<size_t>(model_->config().num_layers));
    for (double r : it->second) {
      EXPECT_GE(r, 0.0) << name;
      EXPECT_LE(r, 1.0) << name;
    }
  }
  // Every method moves the attention output further from the full cache as p_c rises, and
  // sink_recent (no scoring) also loses top-1 agreement.
  const double lo = o.ratios.front(), hi = o.ratios.back();
  for (const std::string& mode : o.modes) {
    for (const std::string& name : o.methods) {
      if (name == "full") continue;
      const MethodResult* a = Row(*rep, name, lo, mode);
      const MethodResult* b = Row(*rep, name, hi, mode);
      ASSERT_NE(a, nullptr) << name << " " << mode;
      ASSERT_NE(b, nullptr) << name << " " << mode;
      EXPECT_GT(a->mean_rel_error, 0.0) << name << " " << mode;
      EXPECT_GT(b->mean_rel_error, a->mean_rel_error) << name << " " << mode;
    }
  }
  EXPECT_LT(Row(*rep, "sink_recent", hi)->top1_agreement,
            Row(*rep, "sink_recent", lo)->top1_agreement);
  // At p_c = 0.9 the continuation is clearly harder to predict than with the full cache.
  EXPECT_GT(Row(*rep, "sink_recent", hi)->perplexity, full.perplexity * 1.05);

  // The paper orderings at the highest ratio.
  constexpr double kVectorTolerance = 1.02;  // +VECTOR may cost at most 2% perplexity
  auto ppl = [&](const std::string& m) { return Row(*rep, m, hi)->perplexity; };
  auto err = [&](const std::string& m) { return Row(*rep, m, hi)->mean_rel_error; };
  std::vector<Claim> claims;
  claims.push_back(
      {"snapkv attention error < sink_recent's", err("snapkv") < err("sink_recent"), true});
  claims.push_back(
      {"snapkv perplexity < sink_recent's", ppl("snapkv") < ppl("sink_recent"), false});
  claims.push_back(
      {"snapkv top-1 agreement > sink_recent's",
       Row(*rep, "snapkv", hi)->top1_agreement > Row(*rep, "sink_recent", hi)->top1_agreement,
       true});
  claims.push_back(
      {"hybrid attention error < sink_recent's", err("hybrid") < err("sink_recent"), false});
  claims.push_back(
      {"hybrid perplexity < sink_recent's", ppl("hybrid") < ppl("sink_recent"), false});
  // Reported only: on the varied texts keydiff+vector lost 6% to keydiff in a quick run (two
  // segments cannot separate such differences; the default run's intervals do).
  claims.push_back({"snapkv+vector perplexity <= snapkv's x 1.02",
                    ppl("snapkv+vector") <= ppl("snapkv") * kVectorTolerance, false});
  std::string best_single;
  for (const std::string& m : o.methods) {
    if (m == "full" || m == "hybrid" || m == "sink_recent") continue;
    if (best_single.empty() || ppl(m) < ppl(best_single)) best_single = m;
  }
  claims.push_back({"hybrid perplexity <= every single method's (best: " + best_single + ")",
                    ppl("hybrid") <= ppl(best_single), false});
  std::cout << "\nPaper orderings at p_c = " << hi << " (perplexity / attention error):\n";
  for (const std::string& m : o.methods) {
    if (m == "full") continue;
    std::cout << "  " << m << ": " << ppl(m) << " / " << err(m) << "\n";
  }
  for (const Claim& c : claims) {
    std::cout << "  [" << (c.holds ? "holds" : "DOES NOT HOLD") << "]"
              << (c.asserted ? " (asserted) " : " (reported) ") << c.text << "\n";
    if (c.asserted) {
      EXPECT_TRUE(c.holds) << c.text;
    }
  }

  // Parallel segments change nothing: the same run of full and snapkv with one worker gives the
  // same per-segment NLL, agreement and passkey answers to the last bit.
  HarnessOptions one = o;
  one.jobs = 1;
  one.methods = {"full", "snapkv"};
  one.passkey_methods.clear();
  one.progress = false;
  auto serial = RunHarness(*model_, one);
  ASSERT_TRUE(serial.ok()) << serial.status();
  EXPECT_EQ(serial->engine_seg_nll, rep->engine_seg_nll);
  EXPECT_EQ(serial->engine_passkey_correct, rep->engine_passkey_correct);
  for (const MethodResult& m : serial->rows) {
    const MethodResult* p = Row(*rep, m.method, m.p_c, m.mode);
    ASSERT_NE(p, nullptr) << m.method;
    EXPECT_EQ(m.seg_nll, p->seg_nll) << m.method << " " << m.mode << " " << m.p_c;
    EXPECT_EQ(m.seg_agree, p->seg_agree) << m.method << " " << m.mode << " " << m.p_c;
    EXPECT_EQ(m.passkey_correct, p->passkey_correct) << m.method << " " << m.p_c;
    EXPECT_EQ(m.multikey_correct, p->multikey_correct) << m.method << " " << m.p_c;
    EXPECT_GT(p->cpu_seconds, 0.0) << m.method;
  }

  // One segment and two passkey prompts with two workers: the prompts take a worker the segments
  // did not need (its sessions are made for the prompts), with the same answers.
  HarnessOptions few = o;
  few.max_segments = 1;
  few.methods = {"full"};
  few.modes = {kModeOneShot};
  few.passkey_methods.clear();
  few.progress = false;
  ASSERT_EQ(few.EffectiveJobs(1), 1);
  ASSERT_EQ(few.EffectiveJobs(2), 2);
  auto one_segment = RunHarness(*model_, few);
  ASSERT_TRUE(one_segment.ok()) << one_segment.status();
  EXPECT_EQ(one_segment->engine_passkey_correct, rep->engine_passkey_correct);
  EXPECT_EQ(one_segment->engine_multikey_correct, rep->engine_multikey_correct);
}

// Zero-anchored values on the model's own values (docs/algorithms.md 6): a value row's group of
// 64 channels holds 0, so int4z's grid is int4's with a scale at most 255/254 (1 + 2^-10) wider,
// for one byte of parameters a group less: 1 of the 256 raw bytes of every quantized slot of a
// head. Bounds: the bytes fall by 1/256 of the quantized slots' share (the first token, exact,
// is under 1 in 1024); the attention-output error, which the value codes enter linearly, may
// grow by the scale's 0.5% plus the change of grid under each element (measured +0.2% on 24
// segments: docs/quality.md), 2% allowed; perplexity within 0.5% of int4's (24 segments: equal
// to the fourth digit). A group that did not hold 0 would pay its offset, many times more.
TEST_F(QualityQuickTest, ZeroAnchoredValuesErrAsInt4DoesOnTheModelsValues) {
  HarnessOptions o = QuickOptions();
  o.methods = {"full", "int4_sinks1", "int4k_int4zv_sinks1"};
  o.ratios = {0.0};
  o.modes = {kModeChunkWise};
  o.passkey_filler_tokens = 0;
  o.multikey_trials = 0;
  o.progress = false;
  auto rep = RunHarness(*model_, o);
  ASSERT_TRUE(rep.ok()) << rep.status();
  const MethodResult* i4 = Row(*rep, "int4_sinks1", 0.0, kModeChunkWise);
  const MethodResult* z4 = Row(*rep, "int4k_int4zv_sinks1", 0.0, kModeChunkWise);
  ASSERT_NE(i4, nullptr);
  ASSERT_NE(z4, nullptr);
  std::cout << "int4_sinks1: stored/raw " << i4->stored_raw << ", attention error "
            << i4->mean_rel_error << ", perplexity " << i4->perplexity
            << "\nint4k_int4zv_sinks1: stored/raw " << z4->stored_raw << ", attention error "
            << z4->mean_rel_error << ", perplexity " << z4->perplexity << "\n";
  EXPECT_NEAR(i4->stored_raw - z4->stored_raw, 1.0 / 256, 1.0 / 256 * 0.01);
  EXPECT_GT(z4->mean_rel_error, 0.0);
  EXPECT_LT(z4->mean_rel_error, i4->mean_rel_error * 1.02);
  EXPECT_NEAR(z4->perplexity / i4->perplexity, 1.0, 0.005);
}

}  // namespace
}  // namespace kvd::quality
