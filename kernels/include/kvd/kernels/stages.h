// The compression stage registry: one registration per method of the plan (plan.h), holding what
// the plans, the chunk format and the daemon's policy need to know about it.
//
// Every stage a compact chunk can record is registered here: its policy name (what a YAML
// `stages:` list says), its kind (score, merge, route, quantize), its on-disk code (the byte a
// compact chunk records in CodecDescription; it never changes once chunks carry it), its
// capabilities, and, for a score stage, the function that scores one head. The CPU plan
// (Compress), the device plan's support check, the compact chunk's codec check and the daemon's
// policy parser, compression policy and chunk codec all read this registry.
//
// Built-in stages (registered before the first lookup):
//   score:    none (code 0: recency, the latest tokens win), snapkv (1), keydiff (2),
//             pyramidkv (3), expected_attention (4)
//   merge:    kvslimmer (1)
//   route:    vector (1)
//   quantize: quantize (code 0: a chunk records the element format, QuantFormat, instead)
//
// Adding a score stage: its kernel (scores of one head: higher = keep) and one Register call
// with a code not yet used, e.g.
//   StageRegistry::Global().Register({.name = "key_norm", .kind = StageKind::kScore, .code = 200,
//                                     .score = KeyNormScores});
// then `stages: [key_norm]` in a policy, and CompressionPlanOptions::score =
// static_cast<ScoreStage>(200) in the plan (docs/extending.md).
//
// Policy keys: a registration may declare the keys of kvd's compression policy it reads
// (StagePolicyKey: name, type int / double / bool / choice, range, default). The daemon's policy
// parser accepts such a key only in a policy that lists the stage, checks its value here
// (CheckStagePolicyKey), records it in the policy's canonical form (so in the codec id) when set
// and hands it to the plan in CompressionPlanOptions::stage_keys, where the stage reads it with
// StageKeyValue. A stage whose plan options are typed fields fills them from its keys
// (apply_keys); the built-in quantize (quant_*) and expected_attention (ea_*) stages do, and write
// their keys into the canonical form as they did before the registry held them (canonical_form).
//
// Adding a merge or route stage: its kernel and one Register call with a MergeFn (it writes the
// head's slots, HeadSlots) or a RouteFn (the cost of dropping each slot's value) and a RebuildFn
// (the dropped values rebuilt from what the chunk holds, at serving); the CPU plan (plan_head.cc)
// runs it and serving (serving.h, device_serving.h) rebuilds through the registry.
// tests/kernels/pair_mean_stage.h (merge) and tests/kernels/mean_value_stage.h (route) are
// examples.
//
// The device plan: a stage it runs has `.device = true` here and its device step (a CUDA method
// of the plan's state) in one row of the CUDA module's stage table, kDeviceStages in
// kernels/src/cuda/plan_device.cu, keyed by the same (kind, code). The module is loaded apart
// and cannot read this registry; kernels_test checks the table and the `device` flags agree.
//
// Thread safety: Register and the lookups may be called from any thread; a registration is never
// removed, so the pointers the lookups return stay valid for the life of the process.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"

namespace kvd::kernels {

enum class StageKind : uint8_t { kScore = 0, kMerge = 1, kRoute = 2, kQuantize = 3 };

// "score", "merge", "route", "quantize".
std::string_view StageKindName(StageKind kind);

// What a score stage sees of one (layer, KV head).
struct ScoreHeadInput {
  const CompressionPlanOptions* options = nullptr;
  ConstMatrixView keys;     // [N, d] post-RoPE
  ConstMatrixView values;   // [N, d]
  ConstMatrixView queries;  // [W*G, d] post-RoPE window queries, or rows == 0 (none)
  int64_t window = 0;       // effective window (0 without queries)
  int group_size = 1;       // query heads per KV head
  // Tokens the head's budget keeps, sinks and window included (the layer's budget when head-wise
  // budgets are shared out after scoring).
  int64_t kept = 0;
  // needs_query_stats stages: this head's expected queries (non-null there), else null.
  const ExpectedQueries* expected = nullptr;
};

// Scores one head into scores[N] (higher = keep). Single-threaded.
using ScoreFn = Status (*)(const ScoreHeadInput& in, std::span<float> scores);
// Per-layer kept-token budgets of a chunk of n tokens summing to exactly layers * m, each within
// [forced, n] (plan.h PyramidKV). Null in a registration: every layer keeps m.
using LayerBudgetsFn = StatusOr<std::vector<int64_t>> (*)(int64_t n, int layers, int64_t m,
                                                          int64_t forced,
                                                          const CompressionPlanOptions& options);
// Checks the plan options the stage reads (INVALID_ARGUMENT naming the field); run by
// CompressionPlanOptions::Validate when the stage is the plan's.
using ValidateFn = Status (*)(const CompressionPlanOptions& options);

// The slots of one (layer, KV head) before encoding: what a merge stage writes (the plan's
// eviction without one) and a route stage flags. Slot j holds a key, the sum of its
// cardinality[j] tokens' values (stored as their mean) and a position.
struct HeadSlots {
  Matrix keys_post;                  // [S, d] post-RoPE, at positions[j]
  Matrix keys_pre;                   // [S, d] de-rotated (route stages read cardinality-1 slots')
  Matrix value_sums;                 // [S, d]
  std::vector<int32_t> cardinality;  // tokens in the slot, >= 1
  std::vector<int64_t> positions;
  std::vector<uint8_t> forced;   // a sink or window slot: never routed
  std::vector<uint8_t> rebuild;  // set by the route step: the value is dropped
  std::vector<int64_t> token;    // the token of a cardinality-1 slot, -1 when not known
  int64_t size() const { return static_cast<int64_t>(cardinality.size()); }
  // s zeroed slots of d columns: cardinality 1, position 0, not forced, token -1.
  void Resize(int64_t s, int64_t d) {
    keys_post = Matrix(s, d);
    keys_pre = Matrix(s, d);
    value_sums = Matrix(s, d);
    cardinality.assign(s, 1);
    positions.assign(s, 0);
    forced.assign(s, 0);
    rebuild.assign(s, 0);
    token.assign(s, -1);
  }
};

// What a merge or route stage may ask of its head beyond its inputs: computed once per head
// (timed in the plan's stage times) and shared by the stages. Implemented by the plan.
class HeadCache {
 public:
  virtual ~HeadCache() = default;
  // The de-rotated (pre-RoPE) keys [N, d].
  virtual StatusOr<ConstMatrixView> KeysPre() = 0;
  // The window queries' attention mass per token [N] (causal window); empty without queries.
  virtual StatusOr<std::span<const float>> Mass() = 0;
  // The head's mean pre-RoPE key [d] (kvslimmer.h MeanCentredAdjacentCosine).
  virtual StatusOr<std::span<const float>> Center() = 0;
};

// A merge stage's state for one head, kept across its calls for that head (the plan calls the
// merge again with fewer slots when routing lowers its budget). Its counters are added to the
// chunk's CompressionStats once, after the last call.
class MergeState {
 public:
  virtual ~MergeState() = default;
  virtual void AddStats(CompressionStats* stats) const = 0;
};

// What a merge stage sees of one head.
struct MergeHeadInput {
  const CompressionPlanOptions* options = nullptr;
  const RopeTable* rope = nullptr;
  ConstMatrixView keys;                // [N, d] post-RoPE
  ConstMatrixView values;              // [N, d]
  std::span<const int64_t> positions;  // [N]
  ConstMatrixView queries;             // [W*G, d] post-RoPE window queries, or rows == 0
  int64_t window = 0;                  // effective window (0 without queries)
  int group_size = 1;                  // query heads per KV head
  bool layer_open = true;              // merge_gate's layer gate (plan.h)
  int64_t slots = 0;                   // S: the slots to write
  // With a score stage: the S tokens it kept (ascending, sinks and window included), the slots
  // the merge fills. Without one (the merge alone): empty.
  std::span<const int32_t> pool;
  bool selected = false;  // the plan has a score stage: `pool` holds its S tokens
  HeadCache* cache = nullptr;
  std::unique_ptr<MergeState>* state = nullptr;  // empty until the stage's first call fills it
};
// Writes the head's S slots into *out (Resize(S, d) first; the sinks' and window's slots
// forced). The plan encodes them as they are. Single-threaded.
using MergeFn = Status (*)(const MergeHeadInput& in, HeadSlots* out);

// What a route stage sees of one head.
struct RouteHeadInput {
  const CompressionPlanOptions* options = nullptr;
  ConstMatrixView values;              // [N, d] of the head's tokens
  const VectorHeadFit* fit = nullptr;  // needs_calibration stages: the head's weights
  HeadCache* cache = nullptr;
};
// Per slot of `slots`, the cost of dropping its value into *err (size S): finite where the slot
// may drop it, +Inf elsewhere (forced and merged slots among them). The plan drops the values of
// the 2a cheapest (ties: lower slot), lowering a until 2a slots may. Single-threaded.
using RouteFn = Status (*)(const RouteHeadInput& in, const HeadSlots& slots,
                           std::vector<float>* err);

// What a route stage's rebuild sees of one head of a compact chunk when it is served
// (serving.h): the head's S slots as the chunk holds them.
struct RebuildHeadInput {
  int layer = 0;
  int head = 0;
  ConstMatrixView keys;                  // [S, d] post-RoPE keys (float32)
  std::span<const int32_t> cardinality;  // [S] tokens per slot, >= 1
  std::span<const int64_t> positions;    // [S] representative positions
  std::span<const uint8_t> flags;        // [S] kSlotRebuildValue: the slot's value was dropped
  // De-rotates keys into pre-RoPE keys (ApplyRope kDerotate at `positions`); null when the caller
  // gave none (a stage that needs it refuses, FAILED_PRECONDITION). Its head_dim is d.
  const RopeTable* rope = nullptr;
  // needs_calibration stages: the calibration the chunk records (version and shape checked by the
  // caller); null for the others.
  const VectorWeights* weights = nullptr;
  ExecOptions exec;  // kCuda only for a stage registered with device_rebuild
};
// Fills the rows of `values` [S, d] of the slots flagged kSlotRebuildValue. On entry the other
// rows hold the slots' stored mean values (float32) and the flagged rows zeros; it leaves the
// other rows as they are. Single-threaded unless `in.exec` says otherwise.
using RebuildFn = Status (*)(const RebuildHeadInput& in, MatrixView values);

// The value type of a stage's policy key. Values travel as double (kInt: an integer, kBool: 0 or
// 1, kChoice: the index of the name in StagePolicyKey::choices; the YAML and the canonical form
// use the name).
enum class PolicyKeyType : uint8_t { kInt = 0, kDouble = 1, kBool = 2, kChoice = 3 };

// The policy keys a policy sets, by name (CompressionPlanOptions::stage_keys).
using StageKeyValues = std::map<std::string, double, std::less<>>;

// One key of kvd's compression policy (`models[i].compression.<name>`) that a stage owns.
struct StagePolicyKey {
  std::string name;  // unique over the keys of all stages, e.g. "key_norm_smallest"
  PolicyKeyType type = PolicyKeyType::kDouble;
  // kInt, kDouble: the accepted range, both ends included (max excluded with max_open).
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool max_open = false;
  double default_value = 0.0;  // the value when the policy does not set it (within the range)
  // kChoice: the names a policy may write, e.g. {"none", "hadamard"} (default_value: an index).
  std::vector<std::string> choices;
  // Appended to the error for a name that is not a choice, e.g. "(drop the quantize stage ...)".
  std::string choice_hint;
  // Non-empty: unset, the key takes that key's value (a key of the same stage and type; e.g.
  // quant_key_group follows quant_group) instead of default_value.
  std::string default_key;
  // Written into the canonical form by the stage's canonical_form, not as " <name>=<value>".
  bool in_stage_canonical_form = false;
};

// Stages whose plan options are typed fields (QuantDescription, ExpectedAttentionOptions): fills
// them from the policy's keys (StageKeyValue: the set value or the default).
using ApplyKeysFn = void (*)(const StageKeyValues& keys, CompressionPlanOptions* options);
// The stage's part of the policy's canonical form (so of its codec id) for its keys declared
// in_stage_canonical_form: the form their chunks were stored under before the registry held them.
using CanonicalFormFn = std::string (*)(const StageKeyValues& keys);

struct StageRegistration {
  std::string name;  // policy name, unique over all kinds ("snapkv")
  StageKind kind = StageKind::kScore;
  uint8_t code = 0;  // on-disk code, unique within the kind
  // The stage alone keeps one slot per token position of the raw chunk (KVSlimmer merges every
  // token into a slot); a score stage with p_c > 0 evicts.
  bool keeps_positions = false;
  // The plan refuses to run it without window queries (FAILED_PRECONDITION).
  bool needs_window_queries = false;
  // It needs a calibration before it acts (VECTOR's weights).
  bool needs_calibration = false;
  // It scores with the model's query statistics (CompressionInput::query_stats), built from the
  // window queries of every put: engines must send them. Until the statistics hold
  // expected_attention_min_queries queries the plan scores with one-shot KeyDiff.
  bool needs_query_stats = false;
  // The device plan (plan_device.h) runs it (its row of kDeviceStages: file comment); else
  // CheckDevicePlanSupported is UNIMPLEMENTED.
  bool device = false;
  // Score stages: the head scorer (required). Others: null.
  ScoreFn score = nullptr;
  // Score stages: per-layer budgets (null = uniform).
  LayerBudgetsFn layer_budgets = nullptr;
  // Score stages: the check of its options (null = none).
  ValidateFn validate = nullptr;
  // Merge stages: the step that writes a head's slots (required). Others: null.
  MergeFn merge = nullptr;
  // Route stages: the step that prices dropping each slot's value (required). Others: null.
  RouteFn route = nullptr;
  // Route stages: the serving step that rebuilds the dropped values of one head (required).
  // Others: null.
  RebuildFn rebuild = nullptr;
  // Route stages: `rebuild` runs with ExecOptions::backend kCuda (VECTOR's: RoPE^-1 and W on the
  // device); serving a chunk of a stage without it on kCuda is UNIMPLEMENTED.
  // DeviceCompactChunk (device_serving.h) rebuilds on the host for every route stage.
  bool device_rebuild = false;
  // The policy keys it reads (file comment; empty = none).
  std::vector<StagePolicyKey> policy_keys;
  // Fills the plan's typed options from its keys (null = the stage reads StageKeyValue).
  ApplyKeysFn apply_keys = nullptr;
  // Its part of the canonical form (null = none: every set key as " <name>=<value>").
  CanonicalFormFn canonical_form = nullptr;
};

class StageRegistry {
 public:
  // The process-wide registry, built-in stages included.
  static StageRegistry& Global();

  // ALREADY_EXISTS when the name, (kind, code) or a policy key's name is taken; INVALID_ARGUMENT
  // for an empty name, a score / merge / route stage without its `score` / `merge` / `route`
  // function (a route stage also without `rebuild`), such a function (or `layer_budgets`,
  // `validate`, `rebuild`, `device_rebuild`) on another kind, or a policy key without a name or
  // whose default fails CheckStagePolicyKey.
  Status Register(StageRegistration registration);

  // Null when not registered.
  const StageRegistration* Find(StageKind kind, uint8_t code) const;
  const StageRegistration* Find(std::string_view name) const;
  // The stages of one kind in registration order.
  std::vector<const StageRegistration*> OfKind(StageKind kind) const;
  // The stage that declares the policy key `key` (and the key in *out when non-null); null when
  // none does.
  const StageRegistration* FindPolicyKey(std::string_view key,
                                         const StagePolicyKey** out = nullptr) const;
  // Every declared policy key's name, in registration order.
  std::vector<std::string> PolicyKeyNames() const;

 private:
  StageRegistry();
  struct Impl;
  Impl* impl_;  // never freed: the registry lives as long as the process
};

// Shorthands on the global registry (null when not registered).
const StageRegistration* FindStage(ScoreStage s);
const StageRegistration* FindStage(MergeStage s);
const StageRegistration* FindStage(RouteStage s);

// INVALID_ARGUMENT "<key>: <value> is not an integer / a boolean (0 or 1) / a finite number /
// a choice index / outside [min, max]" when `value` does not fit the key.
Status CheckStagePolicyKey(const StagePolicyKey& key, double value);
// A kChoice key's value for the name `text`: INVALID_ARGUMENT
// `<key>: "<text>" is not one of <choices>` (and the key's choice_hint) when it is none of them.
StatusOr<double> StageKeyChoice(const StagePolicyKey& key, std::string_view text);
// The value as the canonical form and the YAML write it: a choice's name, else "%.17g".
std::string StageKeyText(const StagePolicyKey& key, double value);
// The value of the policy key `key` in `keys`: its entry, else its default (default_key's value
// where it follows one); 0 when no registered stage declares it.
double StageKeyValue(const StageKeyValues& keys, std::string_view key);
// StageKeyValue(options.stage_keys, key).
double StageKeyValue(const CompressionPlanOptions& options, std::string_view key);

}  // namespace kvd::kernels
