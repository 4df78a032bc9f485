// The canonical form and the codec id of existing policies, pinned: chunks already stored carry
// these codec ids, so a change to how the policy is parsed, held or written out must leave them
// as they are.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvd/daemon/config.h"

namespace kvd::daemon {
namespace {

struct Pinned {
  std::string policy;     // the YAML `compression:` value
  std::string canonical;  // CompressionPolicy::CanonicalForm()
  uint32_t codec_id;      // CodecId(0)
  uint32_t calibrated;    // CodecId(0x2a)
};

const std::vector<Pinned>& PinnedPolicies() {
  static const std::vector<Pinned> pinned = {
      {"{stages: [snapkv]}",
       "v1 score=snapkv merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536",
       0x906e596cu, 0x7494fa36u},
      {"{stages: [keydiff], p_c: 0.75, window: 16, sinks: 2}",
       "v1 score=keydiff merge=none route=none p_c=0.75 window=16 sinks=2 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536",
       0xa525b03au, 0x78cefde8u},
      {"{stages: [snapkv, vector], route_eps: 0.1}",
       "v1 score=snapkv merge=none route=vector p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0.10000000000000001 r2_threshold=0.5 calibration_tokens=65536",
       0x82eecbd8u, 0x319cf650u},
      {"{stages: [hybrid], max_group: 2, min_cos: 0.5}",
       "v1 score=snapkv merge=kvslimmer route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=2 min_cos=0.5 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536",
       0xa71c12bdu, 0xbca3369au},
      {"{stages: [pyramidkv], pooling: max, pyramid_beta: 10}",
       "v1 score=pyramidkv merge=none route=none p_c=0.5 window=32 sinks=4 pooling=max/5 "
       "keydiff_block=0 pyramid_beta=10 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536",
       0x11867983u, 0xab819c28u},
      {"{stages: [expected_attention]}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=512/256",
       0xa255549eu, 0xdb1ebd69u},
      {"{stages: [expected_attention], ea_future_positions: 128, ea_min_queries: 64}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=128/64",
       0x67325e14u, 0xf6bf71a0u},
      {"{stages: [expected_attention], ea_covariance: false, ea_keydiff_share: 0.5}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=512/256 ea_covariance=0 "
       "ea_keydiff_share=0.5",
       0xb116675bu, 0x8ae342efu},
      {"{stages: [expected_attention], ea_covariance: true, ea_keydiff_share: 0}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=512/256",
       0xa255549eu, 0xdb1ebd69u},
      {"{stages: [expected_attention], ea_keydiff_share: 0.25, ea_keydiff_outlier_z: 2}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=512/256 ea_keydiff_share=0.25 "
       "ea_keydiff_outlier_z=2",
       0x4405bafeu, 0xe1052f18u},
      {"{stages: [expected_attention, quantize], ea_keydiff_share: 0.5, ea_keydiff_outlier_z: 2, "
       "ea_keydiff_outlier_share: 0.75}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=512/256 ea_keydiff_share=0.5 "
       "quant=int8/64/0 ea_keydiff_outlier_share=0.75 ea_keydiff_outlier_z=2",
       0xc67fcf67u, 0xf1e3d071u},
      {"{stages: [quantize]}",
       "v1 score=none merge=none route=none p_c=0 window=32 sinks=4 pooling=avg/5 keydiff_block=0 "
       "pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 route_eps=0 "
       "r2_threshold=0.5 calibration_tokens=65536 quant=int8/64/0",
       0x3a1c59d7u, 0x776a7319u},
      {"{stages: [quantize], p_c: 0.25, quant_format: fp8_e4m3}",
       "v1 score=none merge=none route=none p_c=0.25 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 quant=fp8_e4m3/64/0",
       0xfda76fd6u, 0x396d34c8u},
      {"{stages: [keydiff, quantize], quant_format: int4, quant_group: 32, quant_recent: 16}",
       "v1 score=keydiff merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 quant=int4/32/16",
       0x6027ef25u, 0xe70917d4u},
      {"{stages: [quantize], quant_format: int3, quant_group: 8, quant_key_group: 5, quant_rotate: "
       "hadamard, quant_value_format: int2}",
       "v1 score=none merge=none route=none p_c=0 window=32 sinks=4 pooling=avg/5 keydiff_block=0 "
       "pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 route_eps=0 "
       "r2_threshold=0.5 calibration_tokens=65536 quant=int3/8/0 quant_rotate=hadamard "
       "quant_key_group=5 quant_values=int2",
       0x8a45d848u, 0x51bd2105u},
      {"{stages: [quantize], quant_format: int8, quant_key_group: 64, quant_value_format: int8, "
       "quant_rotate: none}",
       "v1 score=none merge=none route=none p_c=0 window=32 sinks=4 pooling=avg/5 keydiff_block=0 "
       "pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 route_eps=0 "
       "r2_threshold=0.5 calibration_tokens=65536 quant=int8/64/0",
       0x3a1c59d7u, 0x776a7319u},
      {"{stages: [keydiff, quantize], quant_format: int2, quant_value_format: same, "
       "quant_key_group: 16}",
       "v1 score=keydiff merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 quant=int2/64/0 quant_key_group=16",
       0x9094f6a0u, 0xa9a8aacfu},
      {"{stages: [expected_attention, quantize], quant_format: int4, ea_min_queries: 32}",
       "v1 score=expected_attention merge=none route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 ea=512/32 quant=int4/64/0",
       0xa89b453eu, 0xa374e95au},
      {"{stages: [kvslimmer, quantize], quant_format: int8}",
       "v1 score=none merge=kvslimmer route=none p_c=0.5 window=32 sinks=4 pooling=avg/5 "
       "keydiff_block=0 pyramid_beta=20 merge_norm=l2 position=last max_group=4 min_cos=0 "
       "route_eps=0 r2_threshold=0.5 calibration_tokens=65536 quant=int8/64/0",
       0x92794b89u, 0xd5156daau},
  };
  return pinned;
}

TEST(PolicyCodecIdTest, ExistingPoliciesKeepTheirCanonicalFormAndCodecId) {
  for (const Pinned& p : PinnedPolicies()) {
    SCOPED_TRACE(p.policy);
    auto config = ParseConfigYaml(
        "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8}, "
        "compression: " +
        p.policy + "}]");
    ASSERT_TRUE(config.ok()) << config.status();
    const CompressionPolicy& policy = *config->models[0].compression;
    EXPECT_EQ(policy.CanonicalForm(), p.canonical);
    EXPECT_EQ(policy.CodecId(0), p.codec_id);
    EXPECT_EQ(policy.CodecId(0x2a), p.calibrated);
  }
}

}  // namespace
}  // namespace kvd::daemon
