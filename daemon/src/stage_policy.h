// The compression policy's side of the stage registry (kernels/stages.h): which registered stage
// a policy's method names, and what the policy's stages need. Internal to the daemon.
#pragma once

#include <string>
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

// The plan's stage codes for the policy's score, merge and route (none: kNone).
void SetPlanStages(const CompressionPolicy& p, kernels::CompressionPlanOptions* o);

}  // namespace kvd::daemon
