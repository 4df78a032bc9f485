// The compression policy of one model (topology key `models[i].compression`): which stages of
// the kernels' compression plan run on the chunks kvd stores for that model, and how.
//
// A model without a policy stays raw: its chunks are stored and served byte for byte as the
// engine put them. A model with a policy gets its raw puts compressed by the daemon into compact
// chunks (docs/chunk-format.md) that Lookup/Get then serve.
//
// Stages run in the fixed order score -> merge -> route -> quantize (the kernels' plan order).
// The YAML names them as an ordered list of methods, e.g. `stages: [snapkv]`, `[snapkv, vector]`,
// `[snapkv, kvslimmer]` (the hybrid; `hybrid` is an alias), `[kvslimmer]`, `[keydiff]`,
// `[quantize]`, `[keydiff, quantize]`. The methods are the stages of the kernels' stage
// registry (kernels/stages.h); the built-in ones:
//   score:    snapkv | keydiff | pyramidkv | expected_attention
//                                             (absent = recency: the latest tokens win)
//   merge:    kvslimmer
//   route:    vector                          (needs a score or merge stage before it: routing
//                                              picks among the slots an earlier stage kept)
//   quantize: quantize                        (keys and values in fewer bits: quant_format,
//                                              quant_group, ...; `[quantize]` alone keeps every
//                                              token: its p_c defaults to 0)
// A registered stage may own policy keys of its own (kernels/stages.h StagePolicyKey); they are
// accepted only when the stage is listed and land in `stage_keys`.
// Refused (INVALID_ARGUMENT naming the key and value, kvd exits 2): an unknown method, two
// methods of one stage, a method listed after a later stage (e.g. [vector, snapkv]), an empty
// list, a lone `vector`, quant_* keys without the quantize stage, p_c outside [0, 1), a budget that
// cannot hold the sinks and window of a full chunk (llround((1 - p_c) * chunk_tokens) < sinks +
// window), plan options the kernels' plan refuses (kernels/plan.h CompressionPlanOptions::Validate,
// e.g. quant_sinks over sinks: `key` and the plan's message).
//
// Codec id: the 32-bit digest of CanonicalForm() and the calibration version (0 before VECTOR
// calibration completes, or when the policy does not route). It is part of every chunk key, so a
// changed policy (or a new calibration) never serves a chunk made under another one. Never 0
// (0 is raw).
//
// Thread safety: plain value type.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "kvd/common/layout.h"
#include "kvd/common/status.h"

namespace kvd::daemon {

struct CompressionPolicy {
  // ---- stages (see the file comment) ----
  std::string score = "snapkv";  // none or a registered score stage (snapkv, keydiff, ...)
  std::string merge = "none";    // none | kvslimmer
  std::string route = "none";    // none | vector
  // none | quantize: the quantize stage (kernels/quantize.h), whose keys (quant_format, ...) are
  // its registered policy keys in `stage_keys`.
  std::string quantize = "none";
  // Fraction of the chunk's K/V half-pairs removed, in [0, 1). Default 0.5.
  double p_c = 0.5;
  // Window queries per chunk: the last `window` tokens of the chunk, whose post-RoPE queries the
  // prefill engine sends with the put (kept uncompressed). Default 32, >= 1.
  int window = 32;
  // First tokens of every chunk never evicted/merged/routed. Default 4, >= 0.
  int sinks = 4;
  // SnapKV/PyramidKV score pooling: "avg" (default) or "max", kernel odd >= 1 (default 5).
  std::string pooling = "avg";
  int pooling_kernel = 5;
  // KeyDiff block size; 0 (default) = one-shot.
  int keydiff_block = 0;
  // PyramidKV beta, >= 1. Default 20.
  double pyramid_beta = 20.0;
  // KVSlimmer weight variant: "l2" (default) or "l1code".
  std::string merge_norm = "l2";
  // Representative position of a merged slot: "last" (default) or "weighted".
  std::string position = "last";
  // Hybrid: most tokens per merged slot (>= 1, default 4) and the cosine gate (0 = off,
  // in [-1, 1]).
  int max_group = 4;
  double min_cos = 0.0;
  // VECTOR: p_a margin in [0, 1) (default 0); heads whose calibration R^2 is below
  // `r2_threshold` (default 0.5, in [0, 1]) route nothing; `calibration_tokens` (default 65536,
  // >= 1) raw tokens per (layer, head) are accumulated before W is solved.
  double route_eps = 0.0;
  double r2_threshold = 0.5;
  int64_t calibration_tokens = 65536;
  // Ingest worker pool of this model: threads compressing chunks (default 2, >= 1) and chunks
  // admitted but not yet compressed (default 16, >= 1; a Reserve beyond it gets
  // RESOURCE_EXHAUSTED with a retry hint).
  int worker_threads = 2;
  int queue_depth = 16;
  // Where the ingest workers compress (chunk_codec.h ChooseIngestDevice): "auto" (default: the
  // CUDA plan on device 0 when kvd is built with CUDA, a device is present and the CUDA plan
  // implements the stages; else the CPU plan, saying why in the start-up log and `kvdctl stats`),
  // "cpu", "cuda" or "cuda:N" (CUDA device N; kvd refuses to start, exit 2, naming the reason,
  // when that cannot be honoured). Not part of the codec id: both plans implement the same
  // compression (the CUDA plan's float32 scores may order two near-equal tokens differently).
  std::string device = "auto";
  // Values of the policy keys that registered stages declare (kernels/stages.h StagePolicyKey),
  // by key name: only the keys the YAML sets (the others have the stage's default), a choice key
  // as the index of its name; the built-in ones are the quantize stage's quant_* keys and
  // expected_attention's ea_* keys (docs/configuration.md lists them). Each belongs to a listed
  // stage and fits its declaration (Validate).
  // Part of the canonical form, and handed to the plan as CompressionPlanOptions::stage_keys
  // (a stage with typed plan options fills them from the keys, StageRegistration::apply_keys).
  std::map<std::string, double, std::less<>> stage_keys;

  // INVALID_ARGUMENT naming `key` + ".<field>" and the value (see the file comment).
  Status Validate(const std::string& key, int chunk_tokens) const;
  // True when the quantize stage is on.
  bool Quantizes() const { return quantize != "none"; }
  // True when a listed stage needs the window queries (snapkv, pyramidkv, kvslimmer) or
  // statistics built from them (expected_attention): the registry's capabilities.
  bool NeedsQueries() const;
  // True when the dense expansion of every chunk has one slot per token position of the raw
  // chunk: nothing is removed (p_c 0, e.g. `[quantize]` alone) or KVSlimmer alone merges every
  // token into a slot. A score stage with p_c > 0 evicts tokens (so does the hybrid, whose
  // merge groups are capped at max_group).
  bool KeepsPositions() const;
  // The stages and every parameter that changes the stored bytes, as one line (worker_threads,
  // queue_depth and device are not part of it), e.g.
  // "v1 score=snapkv merge=none route=none p_c=0.5 window=32 sinks=4 ...".
  std::string CanonicalForm() const;
  // 64-bit digest of CanonicalForm() (HelloReply.policyDigest).
  uint64_t Digest() const;
  // The codec id of chunks made under this policy with `calibration_version` (see above).
  uint32_t CodecId(uint64_t calibration_version) const;
  // "snapkv", "snapkv+vector", "snapkv+kvslimmer", "keydiff+int4", "int8", ...: for logs and
  // kvdctl.
  std::string StagesName() const;
  // The CUDA device ordinal `device` names: 0 for "cuda", N for "cuda:N", -1 for "auto"/"cpu".
  int CudaOrdinal() const;

  bool operator==(const CompressionPolicy&) const = default;
};

}  // namespace kvd::daemon
