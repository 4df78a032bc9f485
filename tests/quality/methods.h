// The quality harness's method hook: a CompressionMethod turns a prefix's full KV cache (plus the
// prefix's last W post-RoPE queries) into a compact cache the engine continues from.
//
// Built in (no kernels needed): "full" (every entry, l = 1: must equal the uncompressed engine
// exactly) and "sink_recent" (StreamingLLM-style: the first sinks + the most recent tokens; a
// sanity baseline). Kernel-backed methods (SnapKV, KeyDiff, PyramidKV, + VECTOR, KVSlimmer, the
// composed pipeline) are registered by the code that links kvd::kernels, through
// MethodRegistry::Register, without touching the harness.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/llama/kv_cache.h"
#include "kvd/llama/model.h"

namespace kvd::quality {

// What the engine hands a method for one prefix of N tokens.
struct PrefixCapture {
  const llama::LlamaConfig* config = nullptr;
  llama::DenseKvCache cache;  // full prefix cache: per layer K, V [N, n_kv, d], positions 0..N-1
  // Per layer, the last `window` prefix tokens' post-RoPE queries [window, n_q, d] (row-major,
  // token-major: row w*n_q + q). window = min(HarnessOptions::window, N).
  std::vector<std::vector<float>> window_queries;
  int window = 0;
};

// A method's output: the cache the engine continues from, and what it costs to store.
struct CompressedPrefix {
  llama::CompactKvCache cache;
  // Fraction of the raw K+V bytes the method stores, in half-pair units (a kept key is half a
  // pair, a kept value half; docs/algorithms.md 0). Negative (default) = count the cache's slots
  // (right when every slot stores its key and value; VECTOR stores fewer values than keys and
  // its rebuilt values are not stored, so it sets this itself).
  double stored_fraction = -1;
  // Stored bytes over raw bytes: the encoded chunk kvd would store for this cache (bfloat16,
  // header, slot metadata, quantization scales, padding and checksum included) over the raw
  // bfloat16 chunk. Negative (default) = not measured (the row is left out of the fronts).
  double stored_bytes_fraction = -1;
};

class CompressionMethod {
 public:
  virtual ~CompressionMethod() = default;
  virtual std::string name() const = 0;
  // Whether Calibrate needs prefixes (the harness skips their prefill otherwise). Default false.
  virtual bool NeedsCalibration() const { return false; }
  // Whether Compress may run on several segments at once (no state carried between calls). A
  // method that is not makes the harness evaluate segments one at a time (HarnessOptions::jobs).
  virtual bool ParallelSafe() const { return true; }
  // Optional: fit per-layer parameters on calibration prefixes (texts disjoint from the eval
  // texts). Called once before any Compress (with no prefixes when none needs them).
  virtual Status Calibrate(const std::vector<PrefixCapture>& calibration) { return Status::Ok(); }
  // Per-layer calibration R^2 (VECTOR); empty when the method has none.
  virtual std::vector<double> CalibrationR2() const { return {}; }
  // Returns a compact cache for the prefix storing about (1 - p_c) of the raw K and V bytes
  // (a kept key counts as half a KV pair, a kept value as half). cache.next_position must be N.
  // p_c in [0, 1).
  virtual StatusOr<CompressedPrefix> Compress(const PrefixCapture& prefix, double p_c) = 0;
};

using MethodFactory = std::function<StatusOr<std::unique_ptr<CompressionMethod>>()>;

// Name -> factory. Thread-compatible: register everything before running.
class MethodRegistry {
 public:
  // The registry with the built-in methods ("full", "sink_recent").
  static MethodRegistry& Global();
  // ALREADY_EXISTS for a taken name.
  Status Register(const std::string& name, MethodFactory factory);
  // NOT_FOUND listing the known names.
  StatusOr<std::unique_ptr<CompressionMethod>> Create(const std::string& name) const;
  std::vector<std::string> Names() const;

 private:
  std::map<std::string, MethodFactory> factories_;
};

// The compact form of a dense cache with every entry kept (bias 0).
llama::CompactKvCache CompactFromDense(const llama::DenseKvCache& cache, int num_kv_heads,
                                       int head_dim);

// Fraction of raw K/V bytes a compact cache removes relative to `num_tokens` entries per head:
// 1 - slots / (num_tokens * layers * heads).
double AchievedCompression(const llama::CompactKvCache& cache, int num_tokens);

}  // namespace kvd::quality
