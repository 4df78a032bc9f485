// VECTOR value routing (docs/algorithms.md 4): calibration of a per-(layer, KV head) linear map
// W with v ~= W kpre (or the affine map v ~= W kpre + b), residuals, three-way routing with an
// exact half-pair budget, value rebuild.
//
// Conventions (see types.h): float32 row-major views, one row per token; keys are PRE-RoPE here
// (de-rotate with rope.h first). W is [d, d] row-major with v[r] = sum_c W[r][c] * kpre[c] (+ b[r]
// for an affine fit).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// ---------------------------------------------------------------------------------------------
// Calibration
// ---------------------------------------------------------------------------------------------

// Streaming sufficient statistics of one (layer, KV head). Everything is float64 and additive, so
// two partial accumulations merge by addition and R^2 needs no second pass over the data.
struct VectorHeadStats {
  std::vector<double> gram;       // [d, d] sum_i kpre_i kpre_i^T (symmetric, row-major)
  std::vector<double> cross;      // [d, d] sum_i kpre_i v_i^T: cross[r * d + c] = sum kpre_r v_c
  std::vector<double> value_sum;  // [d]    sum_i v_i
  std::vector<double> key_sum;    // [d]    sum_i kpre_i (for the affine solve)
  double value_sq_sum = 0.0;      //        sum_i |v_i|^2
  int64_t count = 0;              //        number of tokens added
};

// Options of VectorCalibrator::Solve.
struct VectorSolveOptions {
  // Ridge added to the Gram diagonal before the Cholesky solve. With `ridge_relative` (default)
  // the added value is ridge * trace(G) / d, so the same setting fits any amount of data; else it
  // is added as is. 0 disables it (a singular Gram is then FAILED_PRECONDITION). Default 1e-6.
  double ridge = 1e-6;
  bool ridge_relative = true;
  // Minimum tokens per head; fewer is FAILED_PRECONDITION (W would be underdetermined noise).
  // Default 1. 0 is not allowed.
  int64_t min_tokens = 1;
  // Fit the affine map v ~= W kpre + b instead of v ~= W kpre (default false: linear). Solved on
  // the centred statistics (Gc = G - s_k s_k^T / n, Cc = C - s_k s_v^T / n: the least-squares
  // solution with the intercept unpenalised), ridge relative to trace(Gc) / d, b = (s_v - W s_k)
  // / n. Needs key sums (FAILED_PRECONDITION for accumulators restored from format version 1).
  bool affine = false;

  Status Validate() const;
};

// The solved map of one (layer, KV head).
struct VectorHeadFit {
  Matrix w;                 // [d, d] row-major: v ~= W kpre (+ bias)
  std::vector<float> bias;  // [d] intercept b of an affine fit; empty = linear map (b = 0)
  double r2 = 0.0;          // 1 - SSE / SST on the calibration data (SST = sum |v - mean v|^2);
                            // when SST == 0, 1 if SSE == 0 (to 1e-12 relative) else 0
  int64_t count = 0;        // tokens the fit saw
};

// The solved W set of a model (what a compact chunk's "calibration version" names).
struct VectorWeights {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  // Identifies this W set: Checksum64 of every W's float bytes (layer-major, then head; each
  // head's bias floats follow its W when the fit is affine), set by Solve and checked by
  // Deserialize. Compact chunks record it so serving uses the same W (and b).
  uint64_t version = 0;
  std::vector<VectorHeadFit> heads;  // [num_layers * num_kv_heads], index layer * H + head

  // REQUIRES: 0 <= layer < num_layers, 0 <= head < num_kv_heads.
  const VectorHeadFit& Head(int layer, int head) const {
    return heads[layer * num_kv_heads + head];
  }
  // Recomputes `version` from the W bytes.
  uint64_t ComputeVersion() const;

  // True when every head carries an intercept (VectorSolveOptions::affine).
  bool affine() const;

  // Versioned, checksummed little-endian bytes (format in docs/chunk-format.md, "VECTOR weights"):
  // version 1 for linear weights (byte-identical to what older builds wrote), version 2 with a
  // per-head intercept for affine ones. Both versions load.
  std::vector<uint8_t> Serialize() const;
  // DATA_LOSS on truncation, checksum mismatch or what Solve never writes (a negative token count,
  // a non-finite W, bias or R^2 entry); INVALID_ARGUMENT on bad magic or unknown version.
  static StatusOr<VectorWeights> Deserialize(std::span<const uint8_t> bytes);
};

// Streaming calibration of all (layer, KV head) pairs of a model.
//
// Thread safety: Add() on DIFFERENT (layer, head) pairs may run concurrently; everything else
// needs external synchronisation.
class VectorCalibrator {
 public:
  // INVALID_ARGUMENT unless num_layers, num_kv_heads >= 1 and head_dim in [1, 1024].
  static StatusOr<VectorCalibrator> Create(int num_layers, int num_kv_heads, int head_dim);

  // Accumulates one batch of tokens for (layer, head): kpre [n, d] de-rotated keys, values [n, d].
  // n may be 0. INVALID_ARGUMENT on a bad index, shape mismatch or any NaN/Inf.
  // kCuda accumulates the batch's Gram/cross on the device (float32 products, float64 sums).
  Status Add(int layer, int head, ConstMatrixView kpre, ConstMatrixView values,
             const ExecOptions& exec = {});

  // Adds another calibrator's statistics (same shape, else FAILED_PRECONDITION).
  Status Merge(const VectorCalibrator& other);

  // Solves W^T = (G + ridge I)^-1 C for every head (Cholesky) and R^2 from the accumulators.
  // FAILED_PRECONDITION naming the head when it has too few tokens, its Gram is singular or its
  // fit is not finite in float32. Every weight set it returns is finite.
  StatusOr<VectorWeights> Solve(const VectorSolveOptions& options = {}) const;

  // Versioned, checksummed bytes of the accumulators (to persist and resume calibration).
  // Writes version 2 (with key sums); version 1 (without) still loads, with key_sums_known()
  // false from then on. Deserialize: DATA_LOSS on truncation, checksum mismatch, a shape or
  // body size that does not match, a negative token count or a non-finite accumulator;
  // INVALID_ARGUMENT on bad magic or unknown version.
  std::vector<uint8_t> Serialize() const;
  static StatusOr<VectorCalibrator> Deserialize(std::span<const uint8_t> bytes);
  // False once accumulators without key sums (format version 1) were restored or merged in:
  // the affine solve then refuses.
  bool key_sums_known() const { return key_sums_known_; }

  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  // REQUIRES: valid indices.
  const VectorHeadStats& Head(int layer, int head) const {
    return heads_[layer * num_kv_heads_ + head];
  }

 private:
  VectorCalibrator(int num_layers, int num_kv_heads, int head_dim);
  int num_layers_ = 0;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  bool key_sums_known_ = true;
  std::vector<VectorHeadStats> heads_;  // [num_layers * num_kv_heads]
};

// ---------------------------------------------------------------------------------------------
// Residuals and rebuild
// ---------------------------------------------------------------------------------------------

// The VECTOR kernels (calibration, residuals, rebuild) call CBLAS, which they load on first use
// (a process that never routes never maps it); without a loadable library that first call
// aborts the process. LoadBlas loads it now: OK when it is loaded (now or before),
// FAILED_PRECONDITION naming every library tried and why otherwise. For a process that must
// find out at start (kvd with a model whose policy routes). Thread-safe; loads at most once.
//
// Threads: the kernels parallelize over heads themselves (ExecOptions::num_threads), so a BLAS
// call runs on the calling thread. When the kernels are the ones loading OpenBLAS into the
// process, they set it to one thread per call (openblas_set_num_threads(1)) unless the
// environment chose a count (OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or OMP_NUM_THREADS set).
// Without that, every call on a head thread could fan out to OpenBLAS's own pool of one thread
// per core: cores x cores threads in kvd, and a pool competing with the engine in a client that
// decodes compressed chunks. A library the process had already loaded (an engine linking
// OpenBLAS) keeps the setting its owner gave it.
Status LoadBlas();

// Threads the loaded CBLAS library runs one call on (OpenBLAS's openblas_get_num_threads); 0
// when no library is loaded or it does not say (not OpenBLAS). Loads the library like LoadBlas.
int BlasThreads();

// residuals[i] = |v_i - W kpre_i|^2 for kpre [n, d], values [n, d], w [d, d]; residuals has n
// entries. INVALID_ARGUMENT on shape mismatch or NaN/Inf in any input.
Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                       std::span<float> residuals, const ExecOptions& exec = {});

// out_i = W kpre_i for kpre [n, d], w [d, d], out [n, d] (the value rebuild of a routed slot;
// the caller de-rotates the served key first). INVALID_ARGUMENT on shape mismatch or NaN/Inf.
Status RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out,
                     const ExecOptions& exec = {});

// The same two operations with a head's fit: W kpre_i + b (b = fit.bias, none when empty).
// INVALID_ARGUMENT additionally when the bias has neither 0 nor d entries or is not finite.
Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, const VectorHeadFit& fit,
                       std::span<float> residuals, const ExecOptions& exec = {});
Status RebuildValues(ConstMatrixView kpre, const VectorHeadFit& fit, MatrixView out,
                     const ExecOptions& exec = {});

// ---------------------------------------------------------------------------------------------
// Three-way routing (docs/algorithms.md 4.2)
// ---------------------------------------------------------------------------------------------

enum class RouteDecision : uint8_t {
  kEvict = 0,     // token dropped
  kKeyOnly = 1,   // key kept, value rebuilt from W at serve time (half a pair)
  kKeyValue = 2,  // key and value kept (one pair)
};

// Integer counts of one head's routing. Invariant: keys + values == 2 * kept_pairs exactly.
//
// Rounding rule:
//   kept_pairs M = llround((1 - p_c) * n)            (round half away from zero; or the override)
//   p_a          = min(p_c / 2, (1 - p_c - eps) / 2)
//   a            = min(llround(p_a * n), n - M, M - forced)   (clamped at 0)
//   pool = M + a tokens get a key; key_only = 2a of them drop the value; key_value = M - a.
// So keys = M + a and values = M - a: the half-pair budget 2M is met EXACTLY for every n and
// p_c; only the split between key-only and key+value is rounded (a is the closest integer to
// p_a * n that fits the pool in n tokens and leaves every forced token its value).
struct RouteBudget {
  int64_t tokens = 0;      // n
  int64_t kept_pairs = 0;  // M
  int64_t pool = 0;        // M + a: tokens that keep their key
  int64_t key_only = 0;    // 2a
  int64_t key_value = 0;   // M - a
  int64_t keys() const { return pool; }
  int64_t values() const { return key_value; }
  int64_t half_pairs() const { return keys() + values(); }
};

struct RouteOptions {
  double p_c = 0.5;  // compression ratio in [0, 1): stored K+V bytes are (1 - p_c) of raw
  double eps = 0.0;  // p_a margin of section 4.2, in [0, 1); 0 reproduces the paper's p_a values
  // Overrides M (e.g. a PyramidKV layer budget); -1 = llround((1 - p_c) n). When set, p_a uses
  // the effective ratio 1 - M / n. Must be in [0, n].
  int64_t kept_pairs = -1;
  Status Validate() const;
};

// Counts for n tokens of which `forced` must keep key and value (sinks, window).
// OUT_OF_RANGE when M < forced (the budget cannot hold the forced tokens); INVALID_ARGUMENT on
// bad options or negative counts.
StatusOr<RouteBudget> ComputeRouteBudget(int64_t n, int64_t forced, const RouteOptions& options);

// Routes n tokens: the pool is the forced tokens plus the highest `base_score` tokens up to
// budget.pool (ties: lower index first); in the pool, the budget.key_only non-forced tokens with
// the smallest residuals drop their value (ties: lower index first). `forced` may be empty (no
// forced tokens) or have n entries (nonzero = forced). Output `decisions` has n entries.
// INVALID_ARGUMENT on size mismatch or NaN (Inf scores are allowed: +Inf ranks first).
StatusOr<RouteBudget> RouteValues(std::span<const float> base_score,
                                  std::span<const float> residuals, std::span<const uint8_t> forced,
                                  const RouteOptions& options, std::span<RouteDecision> decisions);

}  // namespace kvd::kernels
