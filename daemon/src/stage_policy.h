// The compression policy's side of the stage registry (kernels/stages.h): which registered stage
// a policy's method names, and what the policy's stages need. Internal to the daemon.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kvd/daemon/compression_policy.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/stages.h"

namespace kvd::daemon {

// The registered stage of `kind` a policy names `name`; null for "none" (the stage is not
// listed; score none is recency), an unknown name or a stage of another kind.
const kernels::StageRegistration* PolicyStage(kernels::StageKind kind, const std::string& name);

// The policy names of `kind` in registration order, e.g. "snapkv, keydiff, pyramidkv,
// expected_attention" (recency, score code 0, is not a method a policy lists).
std::string PolicyMethodList(kernels::StageKind kind);

// The registered stages the policy lists (score, merge, route, quantize; not "none").
std::vector<const kernels::StageRegistration*> ListedStages(const CompressionPolicy& p);

// A listed stage needs VECTOR-style calibration (needs_calibration) / the model's query
// statistics (needs_query_stats).
bool NeedsCalibration(const CompressionPolicy& p);
bool NeedsQueryStats(const CompressionPolicy& p);

// The plan's stage codes for the policy's score, merge and route (none: kNone), the policy's
// stage keys, and the typed options the listed stages fill from them (apply_keys).
void SetPlanStages(const CompressionPolicy& p, kernels::CompressionPlanOptions* o);

// The kernels' plan options of a policy whose methods and stage keys are valid: its stages and
// their keys (SetPlanStages), then its fields. Config load checks them (CompressionPlanOptions::
// Validate, in CompressionPolicy::Validate); the chunk codec compresses with them.
kernels::CompressionPlanOptions PlanOptions(const CompressionPolicy& p);

// A `stages` list that has `s`, for error messages: "[keydiff, quantize]" for a quantize stage,
// "[snapkv, <name>]" for a route stage, else "[<name>]".
std::string StageExample(const kernels::StageRegistration& s);

// The error for `<path>.<key>` set in a policy whose stages lack `owner`, the stage that owns the
// key: "set, but stages has no <owner> stage (e.g. stages: <example>)".
Status StrayStageKey(const std::string& path, const std::string& key,
                     const kernels::StageRegistration& owner);

// p.stage_keys: each a key of a listed stage, with a value that fits its declaration
// (INVALID_ARGUMENT naming `<path>.<key>`). Checks across keys and fields (a stage's own check,
// e.g. ea_keydiff_share + ea_recent_share < 1) are the plan's: CompressionPolicy::Validate runs
// CompressionPlanOptions::Validate on PlanOptions(p).
Status CheckStageKeys(const CompressionPolicy& p, const std::string& path);

// The stage keys' part of the canonical form: each listed stage's canonical_form, then
// " <key>=<value>" per other key set, in key order ("" when none, so that the codec ids of
// policies without them stay).
std::string StageKeysCanonicalForm(const CompressionPolicy& p);

// The text of the policy key `key` in p (set or default; a choice's name): "" when no registered
// stage declares it.
std::string PolicyKeyText(const CompressionPolicy& p, std::string_view key);

// The quantize stage as StagesName writes it: "none" without it, else its quant_format ("int8").
std::string QuantizeName(const CompressionPolicy& p);

}  // namespace kvd::daemon
