// Percentile bootstrap confidence intervals over evaluation segments (the harness's unit of
// independent text). Deterministic for a given seed.
#pragma once

#include <cstdint>
#include <vector>

namespace kvd::quality {

struct Interval {
  double lo = 0;
  double hi = 0;
  // True when the two intervals share no point (the harness's rule for calling a difference a win).
  bool Disjoint(const Interval& o) const { return hi < o.lo || o.hi < lo; }
};

// Per-segment sums of one row and of the uncompressed engine on the same segments.
struct SegmentSums {
  std::vector<double> nll;         // method's NLL sum per segment
  std::vector<double> engine_nll;  // engine's NLL sum per segment (same predictions)
  std::vector<int64_t> n;          // scored tokens per segment
  std::vector<int64_t> agree;      // top-1 agreements per segment
};

struct BootstrapResult {
  Interval ppl_ratio;  // exp((sum nll - sum engine_nll) / sum n) over resampled segments
  Interval top1;       // sum agree / sum n over resampled segments
};

// Resamples the segments with replacement `samples` times (paired: a resample draws the same
// segments for the method and the engine) and returns the [(1-level)/2, (1+level)/2] percentile
// intervals. With one segment (or samples == 0) both intervals collapse to the point estimate.
// Sizes of the four vectors must match (else the intervals are left {0, 0}).
BootstrapResult BootstrapSegments(const SegmentSums& s, int samples, double level = 0.95,
                                  uint32_t seed = 12345);

}  // namespace kvd::quality
