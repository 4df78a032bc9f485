// The compression policy -> the kernels' plan options (PlanOptions, chunk_codec_impl.h).
#include "codec/chunk_codec_impl.h"
#include "stage_policy.h"

namespace kvd::daemon {

kk::CompressionPlanOptions PlanOptions(const CompressionPolicy& p) {
  kk::CompressionPlanOptions o;
  SetPlanStages(p, &o);  // the stages, their keys and the typed options they fill
  o.p_c = p.p_c;
  o.window = p.window;
  o.sinks = p.sinks;
  o.pooling_kernel = p.pooling_kernel;
  o.pooling = p.pooling == "max" ? kk::PoolingKind::kMax : kk::PoolingKind::kAvg;
  o.keydiff_block = p.keydiff_block;
  o.pyramid_beta = p.pyramid_beta;
  o.merge_norm = p.merge_norm == "l1code" ? kk::MergeNorm::kL1Code : kk::MergeNorm::kL2;
  o.position = p.position == "weighted" ? kk::RepresentativePosition::kWeighted
                                        : kk::RepresentativePosition::kLast;
  o.route_eps = p.route_eps;
  o.hybrid_max_group = p.max_group;
  o.hybrid_min_cos = p.min_cos;
  return o;
}

}  // namespace kvd::daemon
