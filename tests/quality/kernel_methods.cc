#include "kernel_methods.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <span>

#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/expected_attention.h"
#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/quantize.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/serving.h"
#include "kvd/kernels/vector.h"
#include "stored_bytes.h"

namespace kvd::quality {
namespace {

using kernels::CompressionPlanOptions;
using kernels::MergeNorm;
using kernels::MergeStage;
using kernels::RouteStage;
using kernels::ScoreStage;

struct MethodSpec {
  const char* name;
  ScoreStage score = ScoreStage::kNone;
  MergeStage merge = MergeStage::kNone;
  MergeNorm norm = MergeNorm::kL2;
  RouteStage route = RouteStage::kNone;
  kernels::HeadBudget budget = kernels::HeadBudget::kUniform;
  bool error_aware = false;  // hybrid: CompressionPlanOptions::hybrid_error_aware
  kernels::MergeGuard guard = kernels::MergeGuard::kClamp;  // merge key weight guard
  bool gate = false;  // CompressionPlanOptions::merge_gate (plan defaults: pair 0.5, layer 0.3)
  // VECTOR variants (kernel_methods.h): the affine map v = W k + b, adaptive routing, and W
  // fitted online on the served document instead of the calibration texts.
  bool affine = false;
  bool route_adaptive = false;
  bool online = false;
  // Stored as kvd stores it (kernel_methods.h): the cache as a bfloat16 chunk, the quantize stage
  // (format kNone: none) with its recent window, encoded and decoded (every method's stored bytes
  // are measured on its chunk in bfloat16: stored_bytes.h).
  bool stored_bf16 = false;
  kernels::QuantFormat quant = kernels::QuantFormat::kNone;
  uint32_t quant_recent = 0;
  bool quant_rotate = false;  // the Hadamard rotation before quantization
  kernels::QuantFormat quant_values = kernels::QuantFormat::kNone;  // kNone: values as keys
  // An experiment the chunk format cannot store: keys grouped per slot over channels (as values
  // are) instead of per channel over slots. Served from that quantization done in memory; the
  // stored fraction is that of the chunk with per-channel keys (the same bytes when the slot
  // count is a multiple of the group).
  bool keys_per_token = false;
  // The quantize stage's quant_sinks: the sequence's first tokens (the plan's sinks) stored in
  // bfloat16 and left out of the quantization groups (QuantDescription::sinks).
  uint32_t quant_sinks = 0;
  uint32_t key_group = 0;  // slots per key group; 0: as values (64 or KVD_QUANT_GROUP)
  // Keys quantized pre-RoPE: de-rotated with the model's RoPE at their positions before the plan,
  // rotated back at their positions once served (no bytes: the positions are the chunk's). Only
  // for plans without score, merge and route stages (they read post-RoPE keys).
  bool prerope = false;
  // Expected-attention terms (ExpectedAttentionOptions): covariance, value norm, KeyDiff share.
  bool ea_covariance = true;
  bool ea_value_norm = true;
  double ea_keydiff_share = 0.0;
  double ea_recent_share = 0.0;  // the share kept by recency (ExpectedAttentionOptions)
  // The KeyDiff share grows with the ratio: s = p_c (1 - ea_recent_share), ea_keydiff_share unused.
  bool ea_keydiff_by_ratio = false;
  // KeyDiff's outliers first (ProtectKeyDiffOutliers): the policy keys ea_keydiff_outlier_z
  // (0: off) and ea_keydiff_outlier_share (the share of the free budget they may take).
  double ea_outlier_z = 0.0;
  double ea_outlier_share = 1.0;
  // KeyDiff's scores max-pooled over this many neighbours before the fused rank (policy key
  // ea_keydiff_pool; 1: none).
  int ea_keydiff_pool = 1;
};

constexpr kernels::QuantFormat kI4 = kernels::QuantFormat::kInt4;
constexpr kernels::QuantFormat kI3 = kernels::QuantFormat::kInt3;
constexpr kernels::QuantFormat kI2 = kernels::QuantFormat::kInt2;
constexpr kernels::QuantFormat kI4s = kernels::QuantFormat::kInt4Sym;
constexpr kernels::QuantFormat kI2s = kernels::QuantFormat::kInt2Sym;
constexpr kernels::QuantFormat kI4z = kernels::QuantFormat::kInt4Zero;

constexpr kernels::HeadBudget kAda = kernels::HeadBudget::kAdaptive;
constexpr kernels::HeadBudget kUni = kernels::HeadBudget::kUniform;

constexpr MethodSpec kSpecs[] = {
    {"snapkv", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2, RouteStage::kNone},
    {"keydiff", ScoreStage::kKeyDiff, MergeStage::kNone, MergeNorm::kL2, RouteStage::kNone},
    {"pyramidkv", ScoreStage::kPyramidKv, MergeStage::kNone, MergeNorm::kL2, RouteStage::kNone},
    {"snapkv+vector", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2, RouteStage::kVector},
    {"keydiff+vector", ScoreStage::kKeyDiff, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector},
    {"pyramidkv+vector", ScoreStage::kPyramidKv, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector},
    {"kvslimmer_l2", ScoreStage::kNone, MergeStage::kKvSlimmer, MergeNorm::kL2, RouteStage::kNone},
    {"kvslimmer_l1_code", ScoreStage::kNone, MergeStage::kKvSlimmer, MergeNorm::kL1Code,
     RouteStage::kNone},
    {"hybrid", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, MergeNorm::kL2, RouteStage::kVector},
    // The hybrid merging a token only where its estimated merge error is below its eviction's.
    {"hybrid_ea", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, MergeNorm::kL2, RouteStage::kVector,
     kernels::HeadBudget::kUniform, true},
    // AdaKV-style head-wise budgets (plan.h kAdaptive, floor 0.2) on every scorer.
    {"adakv", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2, RouteStage::kNone, kAda},
    {"keydiff_ada", ScoreStage::kKeyDiff, MergeStage::kNone, MergeNorm::kL2, RouteStage::kNone,
     kAda},
    {"pyramidkv_ada", ScoreStage::kPyramidKv, MergeStage::kNone, MergeNorm::kL2, RouteStage::kNone,
     kAda},
    {"adakv+vector", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2, RouteStage::kVector,
     kAda},
    // Merge weight guards (kvslimmer.h MergeGuard): KVSlimmer alone with the plain mean and with
    // the alpha-weighted fallback; the error-aware hybrid with plain-mean group keys.
    {"kvslimmer_mean", ScoreStage::kNone, MergeStage::kKvSlimmer, MergeNorm::kL2, RouteStage::kNone,
     kUni, false, kernels::MergeGuard::kMean},
    {"kvslimmer_alpha", ScoreStage::kNone, MergeStage::kKvSlimmer, MergeNorm::kL2,
     RouteStage::kNone, kUni, false, kernels::MergeGuard::kAlphaFallback},
    {"hybrid_ea_mean", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, MergeNorm::kL2,
     RouteStage::kVector, kUni, true, kernels::MergeGuard::kMean},
    // Merges gated by centred key similarity, only in layers where adjacent keys are alike.
    {"kvslimmer_gated", ScoreStage::kNone, MergeStage::kKvSlimmer, MergeNorm::kL2,
     RouteStage::kNone, kUni, false, kernels::MergeGuard::kClamp, true},
    {"hybrid_gated", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, MergeNorm::kL2,
     RouteStage::kVector, kUni, false, kernels::MergeGuard::kClamp, true},
    {"hybrid_ea_gated", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, MergeNorm::kL2,
     RouteStage::kVector, kUni, true, kernels::MergeGuard::kClamp, true},
    // VECTOR variants against snapkv+vector: intercept, adaptive routing, online calibration.
    {"snapkv+vector_affine", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector, kUni, false, kernels::MergeGuard::kClamp, false, true},
    {"snapkv+vector_adaptive", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector, kUni, false, kernels::MergeGuard::kClamp, false, false, true},
    {"snapkv+vector_online", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector, kUni, false, kernels::MergeGuard::kClamp, false, false, false, true},
    // Online calibration combined with the intercept / with adaptive routing.
    {"snapkv+vector_online_affine", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector, kUni, false, kernels::MergeGuard::kClamp, false, true, false, true},
    {"snapkv+vector_online_adaptive", ScoreStage::kSnapKv, MergeStage::kNone, MergeNorm::kL2,
     RouteStage::kVector, kUni, false, kernels::MergeGuard::kClamp, false, false, true, true},
    // The quantize stage (keys per channel over 64 slots, values per slot over 64 channels; the
    // group from KVD_QUANT_GROUP for comparisons), alone (recency at p_c: every token at p_c 0)
    // and after KeyDiff; "bf16" is the chunk stored in bfloat16 without it.
    {.name = "bf16", .stored_bf16 = true},
    {.name = "int8", .stored_bf16 = true, .quant = kernels::QuantFormat::kInt8},
    {.name = "int4", .stored_bf16 = true, .quant = kernels::QuantFormat::kInt4},
    {.name = "fp8", .stored_bf16 = true, .quant = kernels::QuantFormat::kFp8E4M3},
    // One key group over the whole 256-slot chunk: int8 at 0.520 and int4 at 0.270 of the bytes
    // (per 64 slots 0.531 and 0.281), and int4 rotated.
    {.name = "int8_kg256",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8,
     .key_group = 256},
    {.name = "int4_kg256",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .key_group = 256},
    {.name = "int4_rot_kg256",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_rotate = true,
     .key_group = 256},
    // int4 in fewer bytes than per 64 slots: keys per channel over 96 / 128 slots (0.276 / 0.273
    // of the bytes), or symmetric values (int4s: one float16 scale a group, 0.273), rotated or not.
    // The same with the sequence's sinks exact and out of the groups (quant_sinks: 4).
    {.name = "int4_exactsinks",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_sinks = 4},
    {.name = "int4k_int4sv_exactsinks",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_values = kernels::QuantFormat::kInt4Sym,
     .quant_sinks = 4},
    {.name = "int4k_int2sv_rot_kg256_exactsinks",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_rotate = true,
     .quant_values = kernels::QuantFormat::kInt2Sym,
     .quant_sinks = 4,
     .key_group = 256},
    {.name = "int4_kg128_exactsinks",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_sinks = 4,
     .key_group = 128},
    {.name = "int4_kg256_exactsinks",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_sinks = 4,
     .key_group = 256},
    {.name = "int4sk_int2sv_rot_kg256_exactsinks",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4Sym,
     .quant_rotate = true,
     .quant_values = kernels::QuantFormat::kInt2Sym,
     .quant_sinks = 4,
     .key_group = 256},
    {.name = "int4_kg96_exactsinks",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 4,
     .key_group = 96},
    {.name = "int4_kg96_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .key_group = 96},
    {.name = "int4_kg96_sinks2",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 2,
     .key_group = 96},
    {.name = "int4k_int4sv_kg96_exactsinks",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_values = kI4s,
     .quant_sinks = 4,
     .key_group = 96},
    {.name = "int3k_int2sv_rot_exactsinks",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2s,
     .quant_sinks = 4},
    {.name = "int3k_int2sv_rot_kg37_exactsinks",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2s,
     .quant_sinks = 4,
     .key_group = 37},
    {.name = "int3k_int2sv_rot_kg128_exactsinks",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2s,
     .quant_sinks = 4,
     .key_group = 128},
    // int4 with one exact sink over 64, 128, 256 slots (96: above): the post-RoPE twins of the
    // pre-RoPE rows below.
    {.name = "int4_sinks1", .stored_bf16 = true, .quant = kI4, .quant_sinks = 1},
    {.name = "int4_kg128_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .key_group = 128},
    {.name = "int4_kg256_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .key_group = 256},
    // int4 keys with zero-anchored int4 values (int4z: a float16 scale and a one-byte zero code a
    // group, 3 bytes where int4 stores 4): 0.0039 of the bytes less than the int4 rows above.
    {.name = "int4k_int4zv", .stored_bf16 = true, .quant = kI4, .quant_values = kI4z},
    {.name = "int8k_int8zv_kg256",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8,
     .quant_values = kernels::QuantFormat::kInt8Zero,
     .key_group = 256},
    {.name = "int4k_int4zv_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_values = kI4z,
     .quant_sinks = 1},
    // The same after the Hadamard rotation of keys and values (quant_rotate; no bytes).
    {.name = "int4k_int4zv_rot_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI4z,
     .quant_sinks = 1},
    {.name = "int4_rot_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_sinks = 1},
    {.name = "int4k_int4zv_exactsinks",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_values = kI4z,
     .quant_sinks = 4},
    {.name = "int4k_int4zv_kg96_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_values = kI4z,
     .quant_sinks = 1,
     .key_group = 96},
    {.name = "int4k_int4zv_kg128_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_values = kI4z,
     .quant_sinks = 1,
     .key_group = 128},
    // Keys quantized pre-RoPE (MethodSpec::prerope), as KVQuant: RoPE turns each key channel's
    // stable offset into a position-dependent rotation of its pair, which per-channel groups
    // then have to span.
    {.name = "int4_prerope", .stored_bf16 = true, .quant = kI4, .prerope = true},
    {.name = "int4_prerope_kg96",
     .stored_bf16 = true,
     .quant = kI4,
     .key_group = 96,
     .prerope = true},
    {.name = "int4_prerope_kg128",
     .stored_bf16 = true,
     .quant = kI4,
     .key_group = 128,
     .prerope = true},
    {.name = "int4_prerope_kg256",
     .stored_bf16 = true,
     .quant = kI4,
     .key_group = 256,
     .prerope = true},
    {.name = "int4_prerope_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .prerope = true},
    {.name = "int4_prerope_kg96_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .key_group = 96,
     .prerope = true},
    {.name = "int4_prerope_kg128_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .key_group = 128,
     .prerope = true},
    {.name = "int4_prerope_kg256_sinks1",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_sinks = 1,
     .key_group = 256,
     .prerope = true},
    // The Hadamard rotation then applies to the pre-RoPE keys too (the quantize stage rotates
    // keys and values alike); without it, unrotated symmetric 2-bit values.
    {.name = "int3k_int2sv_rot_prerope_kg37_exactsinks",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2s,
     .quant_sinks = 4,
     .key_group = 37,
     .prerope = true},
    {.name = "int3k_int2sv_prerope_kg37_exactsinks",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_values = kI2s,
     .quant_sinks = 4,
     .key_group = 37,
     .prerope = true},
    {.name = "int4_kg96",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .key_group = 96},
    {.name = "int4_kg128",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .key_group = 128},
    {.name = "int4k_int4sv",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_values = kernels::QuantFormat::kInt4Sym},
    {.name = "int4k_int4sv_rot",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_rotate = true,
     .quant_values = kernels::QuantFormat::kInt4Sym},
    {.name = "int8_recent32",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8,
     .quant_recent = 32},
    {.name = "int4_recent32",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_recent = 32},
    {.name = "fp8_recent32",
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kFp8E4M3,
     .quant_recent = 32},
    {.name = "keydiff+int8",
     .score = ScoreStage::kKeyDiff,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8},
    {.name = "keydiff+int4",
     .score = ScoreStage::kKeyDiff,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4},
    {.name = "snapkv+int8",
     .score = ScoreStage::kSnapKv,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8},
    {.name = "snapkv+int4",
     .score = ScoreStage::kSnapKv,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4},
    // Eviction at a lower p_c, then the denser quantizers of the dense front: int4 with one key
    // group a chunk (0.270 of a kept token's bytes), rotated 4-bit keys over the chunk with
    // symmetric 2-bit values (0.199); SnapKV, and the query-agnostic scorers (expected attention,
    // and the default's scorer ea_keydiff50_out2) with the same codecs.
    {.name = "snapkv+int4_kg256",
     .score = ScoreStage::kSnapKv,
     .stored_bf16 = true,
     .quant = kI4,
     .key_group = 256},
    {.name = "snapkv+int4k_int2sv_rot_kg256",
     .score = ScoreStage::kSnapKv,
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2s,
     .key_group = 256},
    {.name = "expected_attention+int4k_int2sv_rot_kg256",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2s,
     .key_group = 256},
    {.name = "ea_keydiff50_out2+int4k_int2sv_rot_kg256",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2s,
     .key_group = 256,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0},
    // Expected attention under the query statistics of the calibration prefixes' window queries
    // (kernel_methods.h), and the same with the int8 quantize stage.
    {"expected_attention", ScoreStage::kExpectedAttention},
    {.name = "expected_attention+int8",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8},
    // Its terms one by one: without the covariance, without the value norm; and with a share of
    // the evictable tokens kept by KeyDiff's rank (FuseKeyDiffRanks), alone and with int8.
    {.name = "expected_attention_nocov",
     .score = ScoreStage::kExpectedAttention,
     .ea_covariance = false},
    {.name = "expected_attention_novnorm",
     .score = ScoreStage::kExpectedAttention,
     .ea_value_norm = false},
    {.name = "ea_keydiff25", .score = ScoreStage::kExpectedAttention, .ea_keydiff_share = 0.25},
    {.name = "ea_keydiff50", .score = ScoreStage::kExpectedAttention, .ea_keydiff_share = 0.5},
    {.name = "ea_keydiff75", .score = ScoreStage::kExpectedAttention, .ea_keydiff_share = 0.75},
    {.name = "ea_nocov_keydiff50",
     .score = ScoreStage::kExpectedAttention,
     .ea_covariance = false,
     .ea_keydiff_share = 0.5},
    {.name = "ea_keydiff50+int8",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8,
     .ea_keydiff_share = 0.5},
    // Part kept by recency (the most recent evictable tokens, as sink_recent keeps them): EA /
    // KeyDiff / recency 0.4 / 0.4 / 0.2 and thirds; the KeyDiff share p_c, alone and with a
    // fifth by recency.
    {.name = "ea_keydiff40_recent20",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.4,
     .ea_recent_share = 0.2},
    {.name = "ea_keydiff33_recent33",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.33,
     .ea_recent_share = 0.33},
    // KeyDiff's outliers (scores above mean + z std of the evictable range) first, up to a
    // share of the free budget, then the fused rank.
    {.name = "ea_keydiff50_out2",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0},
    // The same with KeyDiff's scores max-pooled over 3, 5 or 7 neighbours before the fused rank:
    // a token next to one KeyDiff ranks high ranks as high (spans of digits, names).
    {.name = "ea_keydiff50_out2_pool3",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0,
     .ea_keydiff_pool = 3},
    {.name = "ea_keydiff50_out2_pool5",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0,
     .ea_keydiff_pool = 5},
    {.name = "ea_keydiff50_out2_pool7",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0,
     .ea_keydiff_pool = 7},
    {.name = "ea_keydiff50_out15",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 1.5},
    {.name = "ea_keydiff50_out3",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 3.0},
    // The embedded default: KeyDiff's outliers (z 2) first, then half and half, then int8.
    {.name = "ea_keydiff50_out2+int8",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0},
    // The same scorer with KeyDiff's scores max-pooled over 3 neighbours, then int8.
    {.name = "ea_keydiff50_out2_pool3+int8",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt8,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0,
     .ea_keydiff_pool = 3},
    // The same with int4 and the sequence's sinks exact (quant_sinks: 4) after it.
    {.name = "ea_keydiff50_out2+int4_exactsinks",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_sinks = 4,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0},
    // The same with the default's pool (ea_keydiff_pool: 3).
    {.name = "ea_keydiff50_out2_pool3+int4_exactsinks",
     .score = ScoreStage::kExpectedAttention,
     .stored_bf16 = true,
     .quant = kernels::QuantFormat::kInt4,
     .quant_sinks = 4,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0,
     .ea_keydiff_pool = 3},
    {.name = "ea_keydiff50_out2_half",
     .score = ScoreStage::kExpectedAttention,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0,
     .ea_outlier_share = 0.5},
    // Without the covariance, with KeyDiff's outliers first.
    {.name = "ea_nocov_keydiff50_out2",
     .score = ScoreStage::kExpectedAttention,
     .ea_covariance = false,
     .ea_keydiff_share = 0.5,
     .ea_outlier_z = 2.0},
    {.name = "ea_keydiff_pc", .score = ScoreStage::kExpectedAttention, .ea_keydiff_by_ratio = true},
    {.name = "ea_keydiff_pc_recent20",
     .score = ScoreStage::kExpectedAttention,
     .ea_recent_share = 0.2,
     .ea_keydiff_by_ratio = true},
    // The dense front below int4: the Hadamard rotation, 3 and 2 bits, keys and values at
    // different widths ("int3k_int2v": keys int3, values int2), a bfloat16 recent window.
    {.name = "int4_rot", .stored_bf16 = true, .quant = kI4, .quant_rotate = true},
    {.name = "int3", .stored_bf16 = true, .quant = kI3},
    {.name = "int3_rot", .stored_bf16 = true, .quant = kI3, .quant_rotate = true},
    {.name = "int2_rot", .stored_bf16 = true, .quant = kI2, .quant_rotate = true},
    {.name = "int3_rot_recent32",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_recent = 32,
     .quant_rotate = true},
    {.name = "int2_rot_recent32",
     .stored_bf16 = true,
     .quant = kI2,
     .quant_recent = 32,
     .quant_rotate = true},
    {.name = "int3k_int2v_rot",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2},
    {.name = "int2k_int3v_rot",
     .stored_bf16 = true,
     .quant = kI2,
     .quant_rotate = true,
     .quant_values = kI3},
    {.name = "int4k_int2v_rot",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2},
    {.name = "int4k_int2v", .stored_bf16 = true, .quant = kI4, .quant_values = kI2},
    {.name = "int3k_int2v", .stored_bf16 = true, .quant = kI3, .quant_values = kI2},
    // Key groups of other sizes (slots per channel group; values stay per 64 channels).
    {.name = "int3k_int2v_rot_kg32",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2,
     .key_group = 32},
    // 7 and 6 key groups per 256-slot chunk: 51 and 50 bytes a slot with int2 values (<= 0.20).
    {.name = "int3k_int2v_rot_kg37",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2,
     .key_group = 37},
    {.name = "int3k_int2v_rot_kg43",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .quant_values = kI2,
     .key_group = 43},
    {.name = "int3k_int2v_kg32",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_values = kI2,
     .key_group = 32},
    {.name = "int4k_int2v_kg256",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_values = kI2,
     .key_group = 256},
    {.name = "int4k_int2v_rot_kg256",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2,
     .key_group = 256},
    // The same with symmetric 2-bit values (one float16 scale a group instead of a minimum and a
    // scale: 51 bytes a slot, 0.199 of the bytes), and with symmetric 4-bit keys too.
    {.name = "int4k_int2sv_rot_kg256",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2s,
     .key_group = 256},
    {.name = "int4sk_int2sv_rot_kg256",
     .stored_bf16 = true,
     .quant = kI4s,
     .quant_rotate = true,
     .quant_values = kI2s,
     .key_group = 256},
    // The dense front below 0.20 of the bytes: KVSlimmer merges at p_c (every position kept, a
    // merged slot expands to its tokens), then the rotated 4-bit keys / 2-bit values above.
    {.name = "kvslimmer+int4k_int2v_rot_kg256",
     .merge = MergeStage::kKvSlimmer,
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .quant_values = kI2,
     .key_group = 256},
    {.name = "int4_rot_tokenkeys",
     .stored_bf16 = true,
     .quant = kI4,
     .quant_rotate = true,
     .keys_per_token = true},
    {.name = "int3_rot_tokenkeys",
     .stored_bf16 = true,
     .quant = kI3,
     .quant_rotate = true,
     .keys_per_token = true},
};

// `chunk` (unquantized) with every head's keys and values quantized per slot (the values'
// grouping for both, MethodSpec::keys_per_token) and dequantized back into the chunk dtype.
Status QuantizeKeysPerToken(const kernels::QuantDescription& q, kernels::CompactChunk* chunk) {
  const int d = chunk->head_dim;
  for (kernels::CompactHead& h : chunk->heads) {
    for (const bool keys : {true, false}) {
      std::vector<uint8_t>& rows = keys ? h.keys : h.values;
      const int64_t n = keys ? h.slots() : h.value_slots();
      kernels::Matrix m(n, d);
      ConvertToFloat(chunk->dtype, rows.data(), m.values.data(), static_cast<size_t>(n) * d);
      kernels::QuantDescription qt = q;
      if (keys) qt.value_format = kernels::QuantFormat::kNone;  // keys in the key format
      std::vector<uint8_t> bytes(kernels::QuantizedRowsBytes(n, d, chunk->dtype, qt, false));
      KVD_RETURN_IF_ERROR(kernels::QuantizeRows(m.View(), chunk->dtype, qt, false, bytes));
      KVD_RETURN_IF_ERROR(kernels::DequantizeRows(bytes, chunk->dtype, qt, false, m.View()));
      ConvertFromFloat(chunk->dtype, m.values.data(), rows.data(), static_cast<size_t>(n) * d);
    }
  }
  return Status::Ok();
}

// The prefix cache as one raw float32 chunk: per layer K[N, H, d] then V[N, H, d].
std::vector<uint8_t> RawChunk(const llama::DenseKvCache& cache) {
  std::vector<uint8_t> raw;
  size_t total = 0;
  for (const auto& l : cache.layers) total += (l.k.size() + l.v.size()) * sizeof(float);
  raw.resize(total);
  size_t off = 0;
  for (const auto& l : cache.layers) {
    std::memcpy(raw.data() + off, l.k.data(), l.k.size() * sizeof(float));
    off += l.k.size() * sizeof(float);
    std::memcpy(raw.data() + off, l.v.data(), l.v.size() * sizeof(float));
    off += l.v.size() * sizeof(float);
  }
  return raw;
}

std::vector<int64_t> Positions(const llama::DenseKvCache& cache) {
  return std::vector<int64_t>(cache.positions.begin(), cache.positions.end());
}

// The float32 raw chunk `raw` (RawChunk's layout) in bfloat16.
std::vector<uint8_t> Bf16Raw(const std::vector<uint8_t>& raw) {
  std::vector<uint8_t> out(raw.size() / 2);
  ConvertFromFloat(DType::kBFloat16, reinterpret_cast<const float*>(raw.data()), out.data(),
                   raw.size() / sizeof(float));
  return out;
}

// The prefix's window queries per (layer, KV head), layer-major, [W*G, d] each (each layer's
// [W, n_q, d] through GatherWindowQueries); INVALID_ARGUMENT unless there is one per layer.
StatusOr<std::vector<kernels::Matrix>> WindowQueries(const ModelLayout& layout,
                                                     const PrefixCapture& p) {
  const int L = layout.num_layers;
  std::vector<kernels::Matrix> q_store;
  q_store.reserve(static_cast<size_t>(L) * layout.num_kv_heads);
  if (static_cast<int>(p.window_queries.size()) != L) {
    return Status::InvalidArgument("window queries for " + std::to_string(p.window_queries.size()) +
                                   " layers, model has " + std::to_string(L));
  }
  for (int l = 0; l < L; ++l) {
    KVD_ASSIGN_OR_RETURN(
        std::vector<kernels::Matrix> per_head,
        kernels::GatherWindowQueries(layout, p.window_queries[l].data(), p.window));
    for (auto& m : per_head) q_store.push_back(std::move(m));
  }
  return q_store;
}

// The environment variable `name`, or nullptr when it is unset or empty (comparison-run
// overrides).
const char* NonEmptyEnv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// MethodSpec::prerope rows run no stage that reads keys as post-RoPE keys.
static_assert(std::ranges::all_of(kSpecs, [](const MethodSpec& s) {
  return !s.prerope || (s.score == ScoreStage::kNone && s.merge == MergeStage::kNone &&
                        s.route == RouteStage::kNone);
}));

// Rotates (kRotate) or de-rotates (kDerotate) every key row of a float32 raw chunk (RawChunk's
// layout) in place, row i at pos[i], with the model's RoPE.
Status RopeRawKeys(const kernels::RopeTable& rope, kernels::RopeDirection direction,
                   const ModelLayout& layout, std::span<const int64_t> pos,
                   std::vector<uint8_t>* raw) {
  const int64_t N = static_cast<int64_t>(pos.size());
  const int64_t row = static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim;
  float* f = reinterpret_cast<float*>(raw->data());
  std::vector<kernels::MatrixView> heads;
  for (int l = 0; l < layout.num_layers; ++l) {
    float* k = f + static_cast<size_t>(l) * 2 * N * row;
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      heads.push_back({k + static_cast<int64_t>(h) * layout.head_dim, N, layout.head_dim, row});
    }
  }
  return kernels::ApplyRope(rope, direction, pos, heads);
}

class KernelMethod : public CompressionMethod {
 public:
  explicit KernelMethod(const MethodSpec& spec) : spec_(spec) {}

  std::string name() const override { return spec_.name; }
  bool NeedsCalibration() const override {
    return (spec_.route == RouteStage::kVector && !spec_.online) ||
           spec_.score == ScoreStage::kExpectedAttention;
  }
  // Online calibration carries the document's calibrator from chunk to chunk.
  bool ParallelSafe() const override { return !spec_.online; }

  Status Calibrate(const std::vector<PrefixCapture>& calibration) override {
    if (!NeedsCalibration()) return Status::Ok();
    if (calibration.empty()) {
      return Status::FailedPrecondition(name() +
                                        " needs calibration prefixes (VECTOR or query "
                                        "statistics), got none");
    }
    const llama::LlamaConfig& cfg = *calibration.front().config;
    const ModelLayout layout = cfg.ToModelLayout();
    if (spec_.score == ScoreStage::kExpectedAttention) {
      KVD_RETURN_IF_ERROR(CalibrateQueries(cfg, calibration));
    }
    if (spec_.route != RouteStage::kVector) return Status::Ok();
    KVD_ASSIGN_OR_RETURN(
        kernels::VectorCalibrator cal,
        kernels::VectorCalibrator::Create(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim));
    for (const PrefixCapture& p : calibration) {
      const std::vector<uint8_t> raw = RawChunk(p.cache);
      const std::vector<int64_t> pos = Positions(p.cache);
      KVD_RETURN_IF_ERROR(kernels::CalibrateFromChunk(layout, raw, pos, &cal));
    }
    KVD_ASSIGN_OR_RETURN(weights_, cal.Solve(SolveOptions()));
    r2_.assign(cfg.num_layers, 0.0);
    for (int l = 0; l < cfg.num_layers; ++l) {
      for (int h = 0; h < cfg.num_kv_heads; ++h) r2_[l] += weights_->Head(l, h).r2;
      r2_[l] /= cfg.num_kv_heads;
    }
    return Status::Ok();
  }

  std::vector<double> CalibrationR2() const override { return r2_; }

  StatusOr<CompressedPrefix> Compress(const PrefixCapture& p, double p_c) override {
    KVD_RETURN_IF_ERROR(CheckReady(p));
    const llama::LlamaConfig& cfg = *p.config;
    const ModelLayout layout = cfg.ToModelLayout();
    const std::vector<uint8_t> raw = RawChunk(p.cache);
    const std::vector<int64_t> pos = Positions(p.cache);
    if (spec_.online) KVD_RETURN_IF_ERROR(CalibrateOnline(cfg, layout, raw, pos));
    KVD_ASSIGN_OR_RETURN(kernels::RopeTable rope,
                         kernels::RopeTable::Create(cfg.rope, cfg.head_dim));
    std::vector<uint8_t> prerope_raw;  // spec_.prerope: raw with its keys de-rotated
    if (spec_.prerope) {
      prerope_raw = raw;
      KVD_RETURN_IF_ERROR(
          RopeRawKeys(rope, kernels::RopeDirection::kDerotate, layout, pos, &prerope_raw));
    }
    const std::vector<uint8_t>& plan_raw = spec_.prerope ? prerope_raw : raw;
    KVD_ASSIGN_OR_RETURN(CompressionPlanOptions o, PlanOptions(p, p_c));
    KVD_ASSIGN_OR_RETURN(const std::vector<kernels::Matrix> q_store, WindowQueries(layout, p));
    std::vector<kernels::ConstMatrixView> q_views;
    q_views.reserve(q_store.size());
    for (const auto& m : q_store) q_views.push_back(m.View());
    SetExpectedAttention(p_c, &o);
    SetQuant(&o);

    // spec_.stored_bf16: the plan runs on the raw chunk in bfloat16.
    const std::vector<uint8_t> stored_raw =
        spec_.stored_bf16 ? Bf16Raw(plan_raw) : std::vector<uint8_t>{};
    ModelLayout stored_layout = layout;
    if (spec_.stored_bf16) stored_layout.dtype = DType::kBFloat16;
    kernels::CompressionInput in;
    in.raw = spec_.stored_bf16 ? stored_raw : plan_raw;
    in.positions = pos;
    in.window_queries = q_views;
    in.weights = weights_.has_value() ? &*weights_ : nullptr;
    in.query_stats = query_stats_.has_value() ? &*query_stats_ : nullptr;
    kernels::CompressionStats stats;
    KVD_ASSIGN_OR_RETURN(PlannedChunk planned, RunPlan(stored_layout, in, &o, &stats));
    const kernels::CompactChunk& chunk = planned.chunk;

    KVD_ASSIGN_OR_RETURN(CompressedPrefix out, ServeHeads(cfg, chunk, rope, in.weights));
    out.cache.next_position = p.cache.next_position;
    if (std::getenv("KVD_QUALITY_STATS") != nullptr) PrintStats(p_c, chunk, stats);
    if (const char* t = NonEmptyEnv("KVD_QUALITY_TRACE_POS"); t != nullptr) {
      KVD_RETURN_IF_ERROR(TraceHeads(t, cfg, raw, pos, o, p_c, chunk));
    }
    // Stored fraction in half-pairs: keys + stored values over 2 N per (layer, head).
    out.stored_fraction =
        static_cast<double>(chunk.HalfPairs()) /
        (2.0 * static_cast<double>(p.cache.num_tokens) * cfg.num_layers * cfg.num_kv_heads);
    out.stored_bytes_fraction = planned.stored_bytes_fraction;
    return out;
  }

 private:
  static constexpr int kSinks = 4;

  // What RunPlan made: the chunk to serve and the stored-bytes fraction of the chunk the plan
  // stored (before MethodSpec::keys_per_token's re-plan).
  struct PlannedChunk {
    kernels::CompactChunk chunk;
    double stored_bytes_fraction = 0;
  };

  // Ok when `p` has a config and the calibration this method needs has run.
  Status CheckReady(const PrefixCapture& p) const {
    if (p.config == nullptr) return Status::InvalidArgument("prefix without a model config");
    if (spec_.route == RouteStage::kVector && !spec_.online && !weights_.has_value()) {
      return Status::FailedPrecondition(name() + ": Compress before Calibrate (VECTOR weights)");
    }
    if (spec_.score == ScoreStage::kExpectedAttention && !query_stats_.has_value()) {
      return Status::FailedPrecondition(name() + ": Compress before Calibrate (query statistics)");
    }
    return Status::Ok();
  }

  // The plan's stages, routing, hybrid and sink options for `p` at p_c, validated (before the
  // expected-attention and quantization options, SetExpectedAttention / SetQuant).
  StatusOr<CompressionPlanOptions> PlanOptions(const PrefixCapture& p, double p_c) const {
    CompressionPlanOptions o;
    o.score = spec_.score;
    o.merge = spec_.merge;
    o.merge_norm = spec_.norm;
    o.route = spec_.route;
    o.head_budget = spec_.budget;
    o.hybrid_error_aware = spec_.error_aware;
    o.merge_guard = spec_.guard;
    o.merge_gate = spec_.gate;
    o.route_adaptive = spec_.route_adaptive;
    // Adaptive routing thresholds: the plan defaults unless KVD_ROUTE_MAX_ERROR /
    // KVD_ROUTE_MIN_R2 override them (comparison runs).
    if (const char* e = NonEmptyEnv("KVD_ROUTE_MAX_ERROR"))
      o.route_max_error = std::strtod(e, nullptr);
    if (const char* r = NonEmptyEnv("KVD_ROUTE_MIN_R2")) o.route_min_r2 = std::strtod(r, nullptr);
    o.p_c = p_c;
    o.window = p.window;
    // Sinks are the first tokens of the sequence: a chunk that does not start at position 0
    // (chunk-wise mode) has none.
    o.sinks = !p.cache.positions.empty() && p.cache.positions.front() == 0 ? kSinks : 0;
    // Hybrid group cap and cosine gate: the plan defaults (4, off) unless KVD_HYBRID_MAX_GROUP /
    // KVD_HYBRID_MIN_COS override them (comparison runs; a huge cap = the uncapped hybrid).
    if (const char* g = NonEmptyEnv("KVD_HYBRID_MAX_GROUP")) {
      o.hybrid_max_group = std::strtoll(g, nullptr, 10);
    }
    if (const char* c = NonEmptyEnv("KVD_HYBRID_MIN_COS"))
      o.hybrid_min_cos = std::strtod(c, nullptr);
    KVD_RETURN_IF_ERROR(o.Validate());
    return o;
  }

  // Sets o->expected_attention (and the KeyDiff outlier stage keys) from the spec at p_c.
  void SetExpectedAttention(double p_c, CompressionPlanOptions* o) const {
    // Every calibration query is in before the first chunk: the statistics score from the start.
    o->expected_attention_min_queries = 1;
    kernels::ExpectedAttentionOptions& ea = o->expected_attention;
    ea.use_covariance = spec_.ea_covariance;
    ea.value_norm = spec_.ea_value_norm;
    ea.keydiff_share =
        spec_.ea_keydiff_by_ratio ? p_c * (1.0 - spec_.ea_recent_share) : spec_.ea_keydiff_share;
    ea.recent_share = spec_.ea_recent_share;
    // Expected-attention terms: the method's unless KVD_EA_FUTURE (future positions),
    // KVD_EA_VALUE_NORM / KVD_EA_COVARIANCE (0 = off), KVD_EA_KEYDIFF_SHARE,
    // KVD_EA_RECENT_SHARE, KVD_EA_OUTLIER_Z / KVD_EA_OUTLIER_SHARE and KVD_EA_KEYDIFF_POOL
    // override them (comparison runs).
    if (const char* f = NonEmptyEnv("KVD_EA_FUTURE"))
      ea.future_positions = std::strtoll(f, nullptr, 10);
    if (const char* v = NonEmptyEnv("KVD_EA_VALUE_NORM"))
      ea.value_norm = std::strtol(v, nullptr, 10) != 0;
    if (const char* c = NonEmptyEnv("KVD_EA_COVARIANCE"))
      ea.use_covariance = std::strtol(c, nullptr, 10) != 0;
    if (const char* k = NonEmptyEnv("KVD_EA_KEYDIFF_SHARE"))
      ea.keydiff_share = std::strtod(k, nullptr);
    if (const char* r = NonEmptyEnv("KVD_EA_RECENT_SHARE"))
      ea.recent_share = std::strtod(r, nullptr);
    double outlier_z = spec_.ea_outlier_z, outlier_share = spec_.ea_outlier_share;
    if (const char* z = NonEmptyEnv("KVD_EA_OUTLIER_Z")) outlier_z = std::strtod(z, nullptr);
    if (const char* c = NonEmptyEnv("KVD_EA_OUTLIER_SHARE"))
      outlier_share = std::strtod(c, nullptr);
    if (o->score == ScoreStage::kExpectedAttention && outlier_z > 0.0) {
      o->stage_keys["ea_keydiff_outlier_z"] = outlier_z;
      o->stage_keys["ea_keydiff_outlier_share"] = outlier_share;
    }
    int pool = spec_.ea_keydiff_pool;
    if (const char* p = NonEmptyEnv("KVD_EA_KEYDIFF_POOL")) pool = std::atoi(p);
    if (o->score == ScoreStage::kExpectedAttention && pool > 1) {
      o->stage_keys["ea_keydiff_pool"] = pool;
    }
  }

  // Sets o->quant from the spec (groups of 64 unless KVD_QUANT_GROUP; sinks at most o->sinks);
  // leaves it unset for an unquantized spec.
  void SetQuant(CompressionPlanOptions* o) const {
    if (spec_.quant == kernels::QuantFormat::kNone) return;
    uint32_t group = 64;
    if (const char* g = NonEmptyEnv("KVD_QUANT_GROUP")) {
      group = static_cast<uint32_t>(std::strtoul(g, nullptr, 10));
    }
    o->quant = {.format = spec_.quant,
                .key_group = spec_.key_group > 0 ? spec_.key_group : group,
                .value_group = group,
                .recent = spec_.quant_recent,
                .sinks = std::min(spec_.quant_sinks, static_cast<uint32_t>(o->sinks)),
                .rotation = spec_.quant_rotate ? kernels::QuantRotation::kHadamard
                                               : kernels::QuantRotation::kNone,
                .value_format = spec_.quant_values};
  }

  // Runs the plan on `in`: the chunk (served from its encoded bytes for stored_bf16) and its
  // stored-bytes fraction; for keys_per_token the chunk is re-planned unquantized (o->quant
  // cleared) and quantized per slot (QuantizeKeysPerToken).
  StatusOr<PlannedChunk> RunPlan(const ModelLayout& layout, const kernels::CompressionInput& in,
                                 CompressionPlanOptions* o,
                                 kernels::CompressionStats* stats) const {
    PlannedChunk out;
    KVD_ASSIGN_OR_RETURN(out.chunk, kernels::Compress(*o, layout, in, stats));
    if (spec_.stored_bf16) {
      // Served from the real bytes: encoded, then decoded.
      KVD_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes,
                           kernels::EncodeCompactChunk(out.chunk));
      KVD_ASSIGN_OR_RETURN(out.chunk, kernels::DecodeCompactChunk(bytes));
    }
    KVD_ASSIGN_OR_RETURN(out.stored_bytes_fraction, StoredBytesFraction(out.chunk));
    if (spec_.keys_per_token) {
      const kernels::QuantDescription q = o->quant;
      o->quant = {};
      KVD_ASSIGN_OR_RETURN(out.chunk, kernels::Compress(*o, layout, in, stats));
      KVD_RETURN_IF_ERROR(QuantizeKeysPerToken(q, &out.chunk));
    }
    return out;
  }

  // Every (layer, KV head) of `chunk` as served (BuildServingHead; keys rotated back to post-RoPE
  // for prerope specs); next_position and the fractions are left to the caller.
  StatusOr<CompressedPrefix> ServeHeads(const llama::LlamaConfig& cfg,
                                        const kernels::CompactChunk& chunk,
                                        const kernels::RopeTable& rope,
                                        const kernels::VectorWeights* weights) const {
    CompressedPrefix out;
    out.cache.layers.resize(cfg.num_layers);
    for (int l = 0; l < cfg.num_layers; ++l) {
      out.cache.layers[l].resize(cfg.num_kv_heads);
      for (int h = 0; h < cfg.num_kv_heads; ++h) {
        KVD_ASSIGN_OR_RETURN(kernels::ServingHead sh,
                             kernels::BuildServingHead(chunk, l, h, &rope, weights));
        if (spec_.prerope) {  // served post-RoPE, at the slots' positions
          const kernels::MatrixView keys = sh.keys.View();
          KVD_RETURN_IF_ERROR(kernels::ApplyRope(rope, kernels::RopeDirection::kRotate,
                                                 sh.positions, std::span(&keys, 1)));
        }
        llama::CompactHeadKv& hk = out.cache.layers[l][h];
        hk.num_slots = static_cast<int>(sh.keys.rows);
        hk.k = std::move(sh.keys.values);
        hk.v = std::move(sh.values.values);
        hk.bias = std::move(sh.bias);
      }
    }
    return out;
  }

  kernels::VectorSolveOptions SolveOptions() const {
    kernels::VectorSolveOptions so;
    so.ridge = kVectorRidge;
    so.affine = spec_.affine;
    return so;
  }

  // The query statistics of kernel_methods.h: each calibration prefix's window queries at their
  // positions (the last W of the prefix), as kvd accumulates the window queries of puts.
  Status CalibrateQueries(const llama::LlamaConfig& cfg,
                          const std::vector<PrefixCapture>& calibration) {
    KVD_ASSIGN_OR_RETURN(kernels::RopeTable rope,
                         kernels::RopeTable::Create(cfg.rope, cfg.head_dim));
    KVD_ASSIGN_OR_RETURN(query_stats_,
                         kernels::QueryStatistics::Create(cfg.num_layers, cfg.num_q_heads, rope));
    for (const PrefixCapture& p : calibration) {
      const std::vector<int64_t> pos = Positions(p.cache);
      if (static_cast<int>(pos.size()) < p.window ||
          static_cast<int>(p.window_queries.size()) != cfg.num_layers) {
        return Status::InvalidArgument(name() + ": calibration prefix without its window queries");
      }
      const std::span<const int64_t> qpos(pos.data() + pos.size() - p.window,
                                          static_cast<size_t>(p.window));
      for (int l = 0; l < cfg.num_layers; ++l) {
        KVD_RETURN_IF_ERROR(query_stats_->Add(l, p.window_queries[l], qpos));
      }
    }
    return Status::Ok();
  }

  // Online calibration (kernel_methods.h): a chunk that starts the sequence (position 0) starts
  // a new accumulation; every chunk is added before it is compressed, so W is fitted on the
  // served document's tokens up to the end of this chunk, never on the continuation.
  Status CalibrateOnline(const llama::LlamaConfig& cfg, const ModelLayout& layout,
                         const std::vector<uint8_t>& raw, const std::vector<int64_t>& pos) {
    if (!online_.has_value() || (!pos.empty() && pos.front() == 0)) {
      KVD_ASSIGN_OR_RETURN(online_, kernels::VectorCalibrator::Create(
                                        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim));
    }
    KVD_RETURN_IF_ERROR(kernels::CalibrateFromChunk(layout, raw, pos, &*online_));
    KVD_ASSIGN_OR_RETURN(weights_, online_->Solve(SolveOptions()));
    return Status::Ok();
  }

  // KVD_QUALITY_TRACE_POS (comma-separated positions): for a chunk holding any of them, one line
  // per (layer, KV head) on stderr (TraceHead). The raw chunk is float32 (RawChunk).
  Status TraceHeads(const char* list, const llama::LlamaConfig& cfg,
                    const std::vector<uint8_t>& raw, const std::vector<int64_t>& pos,
                    const CompressionPlanOptions& o, double p_c,
                    const kernels::CompactChunk& chunk) const {
    std::vector<int64_t> traced;  // indices into pos
    for (const char* c = list; *c != '\0';) {
      char* end = nullptr;
      const long long v = std::strtoll(c, &end, 10);
      if (end == c) break;
      const auto it = std::find(pos.begin(), pos.end(), v);
      if (it != pos.end()) traced.push_back(it - pos.begin());
      c = *end == ',' ? end + 1 : end;
    }
    if (traced.empty()) return Status::Ok();
    const int H = cfg.num_kv_heads, d = cfg.head_dim;
    const int64_t N = static_cast<int64_t>(pos.size()), row = static_cast<int64_t>(H) * d;
    const float* f = reinterpret_cast<const float*>(raw.data());
    for (int l = 0; l < cfg.num_layers; ++l) {
      const float* k = f + static_cast<size_t>(l) * 2 * N * row;
      for (int h = 0; h < H; ++h) {
        const kernels::ConstMatrixView keys{k + h * d, N, d, row};
        const kernels::ConstMatrixView values{k + N * row + h * d, N, d, row};
        KVD_ASSIGN_OR_RETURN(const std::string line,
                             TraceHead(cfg, l, h, keys, values, pos, o, traced, chunk));
        std::fprintf(stderr, "[trace] %s p_c %.2f L%d H%d%s\n", spec_.name, p_c, l, h,
                     line.c_str());
      }
    }
    return Status::Ok();
  }

  // One head of TraceHeads: its slots and free slots (less the sinks and window), then for each
  // traced token whether it was kept ("K" / "-"), its rank among the evictable tokens by KeyDiff
  // (rk) and by expected attention (re, "-" without query statistics; ties to the lower index)
  // and its KeyDiff score's z over the evictable tokens (mean, population std).
  StatusOr<std::string> TraceHead(const llama::LlamaConfig& cfg, int l, int h,
                                  kernels::ConstMatrixView keys, kernels::ConstMatrixView values,
                                  const std::vector<int64_t>& pos, const CompressionPlanOptions& o,
                                  const std::vector<int64_t>& traced,
                                  const kernels::CompactChunk& chunk) const {
    const int64_t N = keys.rows;
    const int64_t begin = std::min<int64_t>(o.sinks, N), end = std::max(begin, N - o.window);
    std::vector<float> kd(N), ea(N);
    KVD_RETURN_IF_ERROR(kernels::KeyDiffScores(keys, kd));
    if (query_stats_.has_value()) {
      KVD_ASSIGN_OR_RETURN(
          const kernels::ExpectedQueries q,
          kernels::ExpectedQueriesFor(*query_stats_, l, h, cfg.num_q_heads / cfg.num_kv_heads,
                                      pos.back(), o.expected_attention));
      KVD_RETURN_IF_ERROR(kernels::ExpectedAttentionScores(
          q, keys, o.expected_attention.value_norm ? values : kernels::ConstMatrixView{}, ea));
    }
    double sum = 0, sq = 0;
    for (int64_t j = begin; j < end; ++j) sum += kd[j];
    const double mean = sum / static_cast<double>(std::max<int64_t>(1, end - begin));
    for (int64_t j = begin; j < end; ++j) sq += (kd[j] - mean) * (kd[j] - mean);
    const double sd = std::sqrt(sq / static_cast<double>(std::max<int64_t>(1, end - begin)));
    const kernels::CompactHead& head = chunk.Head(l, h);
    std::string line = " slots " + std::to_string(head.slots()) + " free " +
                       std::to_string(head.slots() - begin - (N - end));
    for (int64_t i : traced) {
      int64_t rk = 0, re = 0;
      for (int64_t j = begin; j < end; ++j) {
        rk += kd[j] > kd[i] || (kd[j] == kd[i] && j < i);
        re += ea[j] > ea[i] || (ea[j] == ea[i] && j < i);
      }
      const bool kept =
          std::find(head.positions.begin(), head.positions.end(), pos[i]) != head.positions.end();
      char cell[128];
      std::snprintf(cell, sizeof(cell), " | %lld %s rk %lld re %s z %.2f",
                    static_cast<long long>(pos[i]), kept ? "K" : "-", static_cast<long long>(rk),
                    query_stats_.has_value() ? std::to_string(re).c_str() : "-",
                    sd > 0 ? (kd[i] - mean) / sd : 0.0);
      line += cell;
    }
    return line;
  }

  // One diagnostic line on stderr (KVD_QUALITY_STATS set): what the plan did to the prefix.
  void PrintStats(double p_c, const kernels::CompactChunk& chunk,
                  const kernels::CompressionStats& st) const {
    int32_t max_l = 0;
    for (const auto& h : chunk.heads) {
      for (int32_t l : h.cardinality) max_l = std::max(max_l, l);
    }
    std::fprintf(
        stderr,
        "[quality stats] %s p_c=%.2f slots=%lld rebuild=%lld merged_tokens=%lld "
        "evicted=%lld max_l=%d route_reductions=%lld kvslimmer rounds=%lld pairs=%lld "
        "guard_fallbacks=%lld guard_clamps=%lld clamp_to_less=%lld alpha_fallbacks=%lld "
        "error_aware_evicted=%lld gate_closed_layers=%lld gate_evicted=%lld\n",
        spec_.name, p_c, static_cast<long long>(st.slots), static_cast<long long>(st.rebuild_slots),
        static_cast<long long>(st.merged_tokens), static_cast<long long>(st.evicted_tokens), max_l,
        static_cast<long long>(st.route_reductions), static_cast<long long>(st.kvslimmer.rounds),
        static_cast<long long>(st.kvslimmer.pairs_merged),
        static_cast<long long>(st.kvslimmer.guard_fallbacks),
        static_cast<long long>(st.kvslimmer.guard_clamps),
        static_cast<long long>(st.kvslimmer.guard_clamp_to_less),
        static_cast<long long>(st.kvslimmer.guard_alpha_fallbacks),
        static_cast<long long>(st.error_aware_evicted),
        static_cast<long long>(st.gate_closed_layers),
        static_cast<long long>(st.gate_evicted_tokens));
  }
  MethodSpec spec_;
  std::optional<kernels::VectorWeights> weights_;
  std::optional<kernels::VectorCalibrator> online_;      // spec_.online: the document so far
  std::optional<kernels::QueryStatistics> query_stats_;  // kExpectedAttention
  std::vector<double> r2_;
};

// Registers the kernel methods in the global registry before main() runs.
[[maybe_unused]] const bool kRegistered = [] {
  Status s = RegisterKernelMethods(&MethodRegistry::Global());
  return s.ok();
}();

}  // namespace

const std::vector<std::string>& KernelMethodNames() {
  static const std::vector<std::string>* names = [] {
    auto* v = new std::vector<std::string>();
    for (const MethodSpec& s : kSpecs) v->push_back(s.name);
    return v;
  }();
  return *names;
}

StatusOr<std::unique_ptr<CompressionMethod>> CreateKernelMethod(const std::string& name) {
  for (const MethodSpec& s : kSpecs) {
    if (name == s.name) return std::unique_ptr<CompressionMethod>(new KernelMethod(s));
  }
  return Status::NotFound("no kernel method named '" + name + "'");
}

Status RegisterKernelMethods(MethodRegistry* registry) {
  for (const MethodSpec& s : kSpecs) {
    const std::string name = s.name;
    KVD_RETURN_IF_ERROR(registry->Register(name, [name] { return CreateKernelMethod(name); }));
  }
  return Status::Ok();
}

std::vector<std::string> DefaultMethodList() {
  std::vector<std::string> out = {"full", "sink_recent"};
  for (const auto& n : KernelMethodNames()) out.push_back(n);
  return out;
}

}  // namespace kvd::quality
