// kvd-bench --op pingpong and --pingpong-floor (internal to client/tools): the floor under one
// request/reply exchange on this machine (see kvd_bench.cc's header comment).
#pragma once

#include <cstdint>
#include <vector>

#include "bench_common.h"

namespace kvd::tools::bench {

// Both ping-pong phases (the cross-CPU one when two CPUs are allowed) into `phases`; false if
// one failed.
bool PingPongPhases(int64_t count, std::vector<PhaseResult>* phases);

// --op pingpong (see kvd_bench.cc's header comment). Returns the exit code.
int RunPingPong(int64_t count, bool json);

}  // namespace kvd::tools::bench
