// Kernel-backed compression methods of the quality harness (docs/algorithms.md 2-5): each one
// runs a kvd::kernels CompressionPlan (score -> select -> merge -> route) over the whole prefix as
// one raw chunk, then serves the CompactChunk to the engine in its compact form (post-RoPE keys at
// the representative position, mean values, bias ln l; VECTOR "rebuild me" values rebuilt as
// W RoPE^-1(k, pos) with serving.h).
//
// Methods (names as registered):
//   snapkv, keydiff, pyramidkv               evict-only baselines (section 5 item 1)
//   snapkv+vector, keydiff+vector, pyramidkv+vector   + VECTOR value routing (item 2)
//   kvslimmer_l2, kvslimmer_l1_code          KVSlimmer merging alone, both weight variants (item 3)
//   hybrid                                   SnapKV pool + KVSlimmer merge of the rest + VECTOR
//                                            (item 4, "the composed pipeline")
//   snapkv+vector_affine                     + VECTOR with the affine map v = W kpre + b
//   snapkv+vector_adaptive                   + VECTOR with adaptive routing (plan.h
//                                            route_adaptive; KVD_ROUTE_MAX_ERROR / KVD_ROUTE_MIN_R2
//                                            override the plan's thresholds)
//   snapkv+vector_online                     + VECTOR with W fitted online on the served document:
//                                            the tokens of the sequence up to the end of the chunk
//                                            being compressed (one-shot: the prefix; chunk-wise:
//                                            chunks 0..c for chunk c), never the continuation, as
//                                            a daemon calibrating on its own traffic would have;
//                                            no calibration texts
//   snapkv+vector_online_affine / _online_adaptive   online calibration with the affine map /
//                                            with adaptive routing
//   bf16                                     the full cache stored as kvd stores it: a bfloat16
//                                            compact chunk, encoded and decoded
//   int8, int4, fp8 (e4m3)                   + the quantize stage (quantize.h: keys per channel
//                                            over 64 slots, values per slot over 64 channels;
//                                            KVD_QUANT_GROUP overrides 64); recency at p_c, so
//                                            every token at p_c 0 (`--ratios 0`)
//   int8_kg256, int4_kg256, int4_rot_kg256   keys per channel over the whole 256-slot chunk
//                                            (int4_rot_kg256 rotated)
//   int4_kg96, int4_kg128                    int4 keys per channel over 96 / 128 slots
//   int4k_int4sv, int4k_int4sv_rot           int4 keys, symmetric int4 values (int4s), the
//                                            second rotated
//   int8_recent32, int4_recent32, fp8_recent32   the same with the last 32 slots of every head
//                                            (of every chunk, chunk-wise) unquantized
//   keydiff+int8, keydiff+int4               KeyDiff eviction at p_c, then the quantize stage
//   snapkv+int8, snapkv+int4                 SnapKV eviction at p_c, then the quantize stage
//   snapkv+int4_kg256,                       SnapKV / expected attention / the default's
//   snapkv+int4k_int2sv_rot_kg256,           scorer (ea_keydiff50_out2) eviction at p_c, then
//   expected_attention+int4k_int2sv_rot_kg256,  int4_kg256 / int4k_int2sv_rot_kg256 (below)
//   ea_keydiff50_out2+int4k_int2sv_rot_kg256
//   expected_attention                       expected attention (expected_attention.h) under the
//                                            query statistics of the calibration prefixes' window
//                                            queries (the last W of each, de-rotated at their
//                                            positions): what kvd would have accumulated from
//                                            earlier puts; the chunk's own queries are not used
//                                            (KVD_EA_FUTURE, KVD_EA_VALUE_NORM=0,
//                                            KVD_EA_COVARIANCE=0, KVD_EA_KEYDIFF_SHARE,
//                                            KVD_EA_RECENT_SHARE override
//                                            the method's terms)
//   expected_attention+int8                  the same, then the int8 quantize stage
//   expected_attention_nocov, _novnorm       without the covariance term, without the value norm
//   ea_keydiff25, ea_keydiff50, ea_keydiff75  a quarter / half / three quarters of the evictable
//   ea_nocov_keydiff50, ea_keydiff50+int8    tokens kept by KeyDiff's rank instead (keydiff_share;
//                                            the others by expected attention), without the
//                                            covariance, with int8
//   ea_keydiff40_recent20,                   expected attention / KeyDiff / recency shares
//   ea_keydiff33_recent33                    0.4 / 0.4 / 0.2 and 0.34 / 0.33 / 0.33 (recent_share:
//                                            the most recent evictable tokens, as sink_recent)
//   ea_keydiff50_out2+int8                   ea_keydiff50 with KeyDiff's outliers (z 2) first,
//   ea_keydiff50_out2+int4_exactsinks        then int8, or int4 with the sequence's sinks exact
//   ea_keydiff_pc, ea_keydiff_pc_recent20    KeyDiff share p_c (0.5 / 0.75 / 0.9), and 0.8 p_c
//                                            with recency 0.2
//   int4_rot, int3_rot, int2_rot             the quantize stage with the Hadamard rotation
//   int3                                     3-bit codes without it
//   int3_rot_recent32, int2_rot_recent32     rotated, the last 32 slots unquantized
//   int3k_int2v_rot, int2k_int3v_rot,        rotated, keys and values at different widths
//   int4k_int2v_rot                          (keys first); int4k_int2v, int3k_int2v unrotated
//   int3k_int2v_rot_kg32, int3k_int2v_kg32,  keys per channel over 32 / 256 / 37 / 43 slots
//   int4k_int2v_kg256, int3k_int2v_rot_kg37,  instead of 64
//   int3k_int2v_rot_kg43, int4k_int2v_rot_kg256
//   int4k_int2sv_rot_kg256,                  as int4k_int2v_rot_kg256 with symmetric 2-bit
//   int4sk_int2sv_rot_kg256                  values (int2s), and symmetric 4-bit keys (int4s)
//   int4_exactsinks, int4k_int4sv_exactsinks,  the same with the sequence's 4 sink tokens kept
//   int4_kg96_exactsinks, int4_kg128_...,    in bfloat16 and out of the quantization groups
//   int4_kg256_exactsinks,                   (quant_sinks: 4, QuantDescription::sinks)
//   int4k_int4sv_kg96_exactsinks,
//   int4k_int2sv_rot_kg256_exactsinks,
//   int4sk_int2sv_rot_kg256_exactsinks,
//   int3k_int2sv_rot_exactsinks,
//   int3k_int2sv_rot_kg37_exactsinks,
//   int3k_int2sv_rot_kg128_exactsinks
//   int4_kg96_sinks1, int4_kg96_sinks2       keys over 96 slots, 1 or 2 sinks exact
//   int4_sinks1, int4_kg128_sinks1,          keys over 64 / 128 / 256 slots, 1 sink exact
//   int4_kg256_sinks1
//   int4_prerope, int4_prerope_kg96,         an experiment (KVQuant): keys de-rotated with the
//   int4_prerope_kg128, int4_prerope_kg256,  model's RoPE at their positions before the quantize
//   and each with _sinks1 (quant_sinks 1),   stage (pre-RoPE keys per channel), rotated back at
//   int3k_int2sv_rot_prerope_kg37_exactsinks, the slots' positions when served; no bytes added
//   int3k_int2sv_prerope_kg37_exactsinks     (the _rot_ row: Hadamard after it, on keys and
//                                            values; the other without any rotation)
//   int4_rot_tokenkeys, int3_rot_tokenkeys   an experiment: rotated keys grouped per slot over
//                                            64 channels (as values), quantized in memory (the
//                                            format stores keys per channel); stored fraction
//                                            that of int4_rot / int3_rot
// Every method reports its stored fraction in half-pairs (CompressedPrefix::stored_fraction) and
// in bytes (stored_bytes_fraction: the encoded chunk, header, slot metadata, scales, padding and
// checksum included, over the raw bfloat16 chunk; stored_bytes.h).
// Every plan keeps 4 sinks and the W window tokens (W = the harness's window) and meets the
// half-pair budget 2 M, M = llround((1 - p_c) N), exactly (PyramidKV: over the whole prefix).
//
// VECTOR methods calibrate on the harness's calibration prefixes (texts disjoint from the eval
// texts): per (layer, KV head) the de-rotated keys and values are accumulated with
// VectorCalibrator and solved with a relative ridge kVectorRidge; CalibrationR2() is the mean R^2
// over the KV heads of each layer.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/kernels/plan.h"
#include "methods.h"

namespace kvd::quality {

// Relative ridge of the VECTOR solve (VectorSolveOptions::ridge, times trace(G)/d).
inline constexpr double kVectorRidge = 1e-4;

// Names of the kernel methods, in the order the report lists them.
const std::vector<std::string>& KernelMethodNames();

// The method `name` (one of KernelMethodNames()); NOT_FOUND otherwise.
StatusOr<std::unique_ptr<CompressionMethod>> CreateKernelMethod(const std::string& name);

// Registers every kernel method in `registry`. ALREADY_EXISTS if one of the names is taken.
// (kernel_methods.cc also registers them in MethodRegistry::Global() at static-initialisation
// time; it is linked as an object library so the registration is never dropped.)
Status RegisterKernelMethods(MethodRegistry* registry);

// Every method the default run compares: "full", "sink_recent", then KernelMethodNames().
std::vector<std::string> DefaultMethodList();

}  // namespace kvd::quality
