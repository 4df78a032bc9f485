// The compression policy -> the kernels' plan options (PlanOptions, chunk_codec_impl.h).
#include <cstdint>
#include <string>

#include "codec/chunk_codec_impl.h"
#include "stage_policy.h"

namespace kvd::daemon {

namespace {

// A validated quant_format / quant_value_format name (not "none" / "same").
kk::QuantFormat QuantFormatOf(const std::string& name) {
  return kk::QuantFormatFromName(name).value_or(kk::QuantFormat::kInt8);
}

}  // namespace

kk::CompressionPlanOptions PlanOptions(const CompressionPolicy& p) {
  kk::CompressionPlanOptions o;
  SetPlanStages(p, &o);
  o.expected_attention.future_positions = p.ea_future_positions;
  o.expected_attention_min_queries = p.ea_min_queries;
  o.expected_attention.use_covariance = p.ea_covariance;
  o.expected_attention.keydiff_share = p.ea_keydiff_share;
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
  if (p.Quantizes()) {
    const kk::QuantFormat keys = QuantFormatOf(p.quant_format);
    const kk::QuantFormat values =
        p.quant_value_format == "same" ? keys : QuantFormatOf(p.quant_value_format);
    o.quant = {.format = keys,
               .key_group =
                   static_cast<uint32_t>(p.quant_key_group > 0 ? p.quant_key_group : p.quant_group),
               .value_group = static_cast<uint32_t>(p.quant_group),
               .recent = static_cast<uint32_t>(p.quant_recent),
               .rotation = p.quant_rotate == "hadamard" ? kk::QuantRotation::kHadamard
                                                        : kk::QuantRotation::kNone,
               .value_format = values == keys ? kk::QuantFormat::kNone : values};
  }
  return o;
}

}  // namespace kvd::daemon
