#include "kvd/daemon/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "kvd/daemon/chunk_codec.h"
#include "kvd/kernels/stages.h"

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The policy key `key` of p as the canonical form writes it (a choice's name), set or default.
std::string KeyText(const CompressionPolicy& p, const std::string& key) {
  const kernels::StagePolicyKey* k = nullptr;
  if (kernels::StageRegistry::Global().FindPolicyKey(key, &k) == nullptr) return "unregistered";
  return kernels::StageKeyText(*k, kernels::StageKeyValue(p.stage_keys, key));
}

// Sets the policy key `key` of *p to `text` (a choice's name, else a number).
void SetKey(CompressionPolicy* p, const std::string& key, const std::string& text) {
  const kernels::StagePolicyKey* k = nullptr;
  ASSERT_NE(kernels::StageRegistry::Global().FindPolicyKey(key, &k), nullptr) << key;
  p->stage_keys[key] = k->type == kernels::PolicyKeyType::kChoice
                           ? kernels::StageKeyChoice(*k, text).value()
                           : std::stod(text);
}

// Every field that the YAML binds, compared one by one (the option structs of other modules
// have no operator==).
void ExpectSameConfig(const DaemonConfig& a, const DaemonConfig& b) {
  EXPECT_EQ(a.node_name, b.node_name);
  EXPECT_EQ(a.listen.tcp, b.listen.tcp);
  EXPECT_EQ(a.listen.unix_path, b.listen.unix_path);
  EXPECT_EQ(a.transport.backend, b.transport.backend);
  const auto& ua = transport::BackendOptionsOf<transport::UcxOptions>(a.transport);
  const auto& ub = transport::BackendOptionsOf<transport::UcxOptions>(b.transport);
  EXPECT_EQ(ua.ucx_tls, ub.ucx_tls);
  EXPECT_EQ(ua.net_devices, ub.net_devices);
  EXPECT_EQ(ua.keepalive_interval_ms, ub.keepalive_interval_ms);
  EXPECT_EQ(ua.enable_rma, ub.enable_rma);
  EXPECT_EQ(a.transport.close_timeout_ms, b.transport.close_timeout_ms);
  EXPECT_EQ(a.chunk_tokens, b.chunk_tokens);
  EXPECT_EQ(a.hash_seed, b.hash_seed);
  EXPECT_EQ(a.models, b.models);
  EXPECT_EQ(a.host_tier.capacity_bytes, b.host_tier.capacity_bytes);
  EXPECT_EQ(a.host_tier.alignment, b.host_tier.alignment);
  EXPECT_EQ(a.host_tier.read_ttl, b.host_tier.read_ttl);
  EXPECT_EQ(a.host_prefault, b.host_prefault);
  EXPECT_EQ(a.host_shared_memory, b.host_shared_memory);
  EXPECT_EQ(a.host_verify_shm_commits, b.host_verify_shm_commits);
  EXPECT_EQ(a.limits, b.limits);
  EXPECT_EQ(a.protocol, b.protocol);
  EXPECT_EQ(a.quotas, b.quotas);
  EXPECT_EQ(a.disk_tier.has_value(), b.disk_tier.has_value());
  EXPECT_EQ(a.placement.high_watermark, b.placement.high_watermark);
  EXPECT_EQ(a.placement.low_watermark, b.placement.low_watermark);
  EXPECT_EQ(a.placement.promote_on_hit, b.placement.promote_on_hit);
  EXPECT_EQ(a.allow_overcommit, b.allow_overcommit);
}

TEST(ConfigTest, EmbeddedDefaultEqualsDeployFileAndStructDefaults) {
  auto embedded = ParseConfigYaml(EmbeddedDefaultConfigYaml(), "embedded");
  ASSERT_TRUE(embedded.ok()) << embedded.status();
  std::string file_text = ReadFile(std::string(KVD_SOURCE_DIR) + "/deploy/configs/default.yaml");
  ASSERT_FALSE(file_text.empty());
  EXPECT_EQ(file_text, EmbeddedDefaultConfigYaml());
  auto file = ParseConfigYaml(file_text, "default.yaml");
  ASSERT_TRUE(file.ok()) << file.status();
  ExpectSameConfig(*embedded, *file);
  ExpectSameConfig(*embedded, DaemonConfig{});
}

TEST(ConfigTest, EmbeddedDefaultRegistersTheThreeModels) {
  auto c = ParseConfigYaml(EmbeddedDefaultConfigYaml()).value();
  const ModelConfig* smol = c.FindModel("smollm2-135m");
  ASSERT_NE(smol, nullptr);
  EXPECT_EQ(smol->layout.num_layers, 30);
  EXPECT_EQ(smol->layout.num_kv_heads, 3);
  EXPECT_EQ(smol->layout.num_q_heads, 9);
  EXPECT_EQ(smol->layout.head_dim, 64);
  EXPECT_EQ(smol->layout.dtype, DType::kBFloat16);
  EXPECT_EQ(smol->layout.rope.theta, 100000);
  // The serving default (docs/quality.md, "Choosing a policy"): expected attention with half the
  // evictable tokens by KeyDiff's rank, p_c 0.5, 16-token window, 4 sinks, then int8
  // quantization; its query statistics grow from the window queries.
  ASSERT_TRUE(smol->compression.has_value());
  EXPECT_EQ(smol->compression->StagesName(), "expected_attention+int8");
  EXPECT_EQ(KeyText(*smol->compression, "ea_keydiff_share"), "0.5");
  EXPECT_EQ(KeyText(*smol->compression, "ea_covariance"), "1");
  EXPECT_EQ(smol->compression->p_c, 0.5);
  EXPECT_EQ(smol->compression->window, 16);
  EXPECT_EQ(smol->compression->sinks, 4);
  EXPECT_TRUE(smol->compression->NeedsQueries());
  const ModelConfig* stories = c.FindModel("stories260k");
  ASSERT_NE(stories, nullptr);
  EXPECT_EQ(stories->layout.dtype, DType::kFloat32);
  EXPECT_EQ(stories->layout.rope.pairing, RopePairing::kInterleaved);
  EXPECT_EQ(stories->layout.head_dim, 8);
  const ModelConfig* llama = c.FindModel("llama-3.1-8b");
  ASSERT_NE(llama, nullptr);
  EXPECT_EQ(llama->layout.rope.scaling, RopeScaling::kLlama3);
  EXPECT_EQ(llama->layout.rope.factor, 8);
  EXPECT_EQ(llama->layout.rope.original_max_positions, 8192);
  EXPECT_EQ(llama->layout.rope.theta, 500000);
  EXPECT_EQ(c.chunk_tokens, 256);
  EXPECT_EQ(c.hash_seed, "kvd-default-seed");
  EXPECT_EQ(c.host_tier.capacity_bytes, 1ull << 30);
  EXPECT_EQ(c.listen.tcp, "127.0.0.1:7400");
}

TEST(ConfigTest, AbsentKeysKeepDefaults) {
  auto c = ParseConfigYaml("node: n1\nlimits:\n  max_sessions: 7\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->node_name, "n1");
  EXPECT_EQ(c->limits.max_sessions, 7);
  EXPECT_EQ(c->limits.lease_ttl_ms, LimitsOptions{}.lease_ttl_ms);
  EXPECT_EQ(c->models.size(), 3u);
  auto empty = ParseConfigYaml("");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->chunk_tokens, 256);
  // No one-sided RMA unless asked for: with it, any UCX peer can read and write kvd's memory.
  EXPECT_FALSE(transport::BackendOptionsOf<transport::UcxOptions>(empty->transport).enable_rma);
  EXPECT_FALSE(
      transport::BackendOptionsOf<transport::UcxOptions>(DaemonConfig{}.transport).enable_rma);
}

TEST(ConfigTest, OverridesBind) {
  auto c = ParseConfigYaml(R"(
listen: {tcp: "0.0.0.0:9000", unix: ""}
transport: {backend: loopback, ucx_tls: tcp, enable_rma: true}
chunk_tokens: 64
hash_seed: s3cret
tiers: {host: {capacity: 512MiB}}
limits: {max_frame_bytes: 1MiB, transfer_timeout_ms: 1234}
protocol: {releases_on_requests: false, inline_put: false, lease_releases_on_requests: false,
           reserve_ahead: false}
models:
  - name: tiny
    layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 4, dtype: f16,
             rope: {theta: 1e4, pairing: halves, scaling: linear, factor: 2}}
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.tcp, "0.0.0.0:9000");
  EXPECT_EQ(c->listen.unix_path, "");
  EXPECT_EQ(c->transport.backend, "loopback");
  EXPECT_TRUE(transport::BackendOptionsOf<transport::UcxOptions>(c->transport).enable_rma);
  EXPECT_EQ(c->chunk_tokens, 64);
  EXPECT_EQ(c->hash_seed, "s3cret");
  EXPECT_EQ(c->host_tier.capacity_bytes, 512ull << 20);
  EXPECT_EQ(c->limits.max_frame_bytes, 1u << 20);
  EXPECT_EQ(c->limits.transfer_timeout_ms, 1234);
  EXPECT_FALSE(c->protocol.releases_on_requests);
  EXPECT_FALSE(c->protocol.inline_put);
  EXPECT_FALSE(c->protocol.lease_releases_on_requests);
  EXPECT_FALSE(c->protocol.reserve_ahead);
  ASSERT_EQ(c->models.size(), 1u);
  EXPECT_EQ(c->models[0].layout.dtype, DType::kFloat16);
  EXPECT_EQ(c->models[0].layout.rope.scaling, RopeScaling::kLinear);
  EXPECT_EQ(c->models[0].layout.rope.factor, 2);
}

// Each bad input: the error is INVALID_ARGUMENT and names the key and the value.
struct BadCase {
  const char* yaml;
  std::vector<const char*> fragments;
};

TEST(ConfigTest, InvalidValuesNameKeyAndValue) {
  const BadCase cases[] = {
      {"limits: {max_sessions: -3}", {"limits.max_sessions", "-3"}},
      {"limits: {max_sessions: many}", {"limits.max_sessions", "many", "not an integer"}},
      {"tiers: {host: {capacity: lots}}", {"tiers.host.capacity", "lots"}},
      {"chunk_tokens: 0", {"chunk_tokens", "0"}},
      {"listen: {tcp: 'localhost'}", {"listen.tcp", "localhost"}},
      {"listen: {tcp: '127.0.0.1:70000'}", {"listen.tcp", "70000"}},
      {"listen: {tpc: '127.0.0.1:1'}", {"listen.tpc", "unknown key"}},
      {"colour: blue", {"colour", "unknown key"}},
      {"models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 1, head_dim: 4, dtype: "
       "int8}}]",
       {"models[0].layout.dtype", "int8"}},
      {"models: [{name: m, layout: {layers: 2, kv_heads: 2, q_heads: 3, head_dim: 4}}]",
       {"models[0] (m).layout", "num_q_heads"}},
      {"models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 1, head_dim: 4, rope: "
       "{pairing: diagonal}}}]",
       {"models[0].layout.rope.pairing", "diagonal"}},
      {"models: [{name: m, layout: {layers: 1, kv_heads: 1, q_heads: 1, head_dim: 2}}, "
       "{name: m, layout: {layers: 1, kv_heads: 1, q_heads: 1, head_dim: 2}}]",
       {"models[1].name", "registered twice"}},
      {"models: [{name: m, compression: kvslimmer, layout: {layers: 1, kv_heads: 1, q_heads: 1, "
       "head_dim: 2}}]",
       {"models[0].compression", "kvslimmer"}},
      {"transport: {enable_rma: maybe}", {"transport.enable_rma", "maybe"}},
      // The backends bind their own keys (kvd/transport/registry.h); errors still name them.
      {"transport: {ucx_tsl: tcp}", {"transport.ucx_tsl", "unknown key", "ucx_tls"}},
      {"transport: {backend: loopback, colour:}", {"transport.colour", "unknown key"}},
      {"transport: {nccl_device: 1024}", {"transport.nccl_device", "1024", "[0, 1023]"}},
      {"transport: {keepalive_interval_ms: soon}", {"transport.keepalive_interval_ms", "soon"}},
      {"transport: {close_timeout_ms: -1}", {"transport.close_timeout_ms", "-1"}},
      {"transport: [ucx]", {"transport", "mapping"}},
      {"transport: {backend: none}\ntiers: {host: {shared_memory: false}}",
       {"transport.backend: none", "tiers.host.shared_memory"}},
      {"transport: {backend: none}\ntiers: {host: {capacity: 64MiB, segment: 64MiB}}",
       {"transport.backend: none", "tiers.host.segment"}},
      {"protocol: {inline_put: 2}", {"protocol.inline_put", "2"}},
      {"protocol: {release_reads: false}", {"protocol.release_reads", "unknown key"}},
      {"limits: {max_frame_bytes: 1KiB}", {"limits.max_frame_bytes", "1024"}},
      {"hash_seed: ''", {"hash_seed"}},
      {"listen: {tcp: '', unix: ''}", {"listen", "disabled"}},
      {"node: [1, 2", {"YAML error", "line"}},
      // Strings kvd sends to clients must be UTF-8 (raw bytes 0xff, 0xc3 0x28 here).
      {"node: \"kvd-\xff\"", {"node: not valid UTF-8", "0xff", "offset 4"}},
      {"hash_seed: \"seed\xc3\x28\"", {"hash_seed: not valid UTF-8", "0xc3"}},
      {"models: [{name: \"m\xfe\", layout: {layers: 1, kv_heads: 1, q_heads: 1, head_dim: 2}}]",
       {"models[0].name: not valid UTF-8", "0xfe"}},
      {"limits: {unauthenticated_share: 0}", {"limits.unauthenticated_share", "(0, 1]"}},
      {"limits: {max_frame_bytes_before_hello: 512}",
       {"limits.max_frame_bytes_before_hello", "512"}},
      {"limits: {max_frame_bytes: 128MiB}", {"limits.frame_buffer_budget_bytes", "134217728"}},
      {"limits: {idle_timeout_ms: -1}", {"limits.idle_timeout_ms", "-1"}},
  };
  for (const auto& c : cases) {
    auto parsed = ParseConfigYaml(c.yaml, "test.yaml");
    ASSERT_FALSE(parsed.ok()) << c.yaml;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_THAT(parsed.status().message(), HasSubstr("test.yaml")) << c.yaml;
    for (const char* f : c.fragments) {
      EXPECT_THAT(parsed.status().message(), HasSubstr(f)) << c.yaml;
    }
  }
}

TEST(ConfigTest, DiskTierAndPlacement) {
  EXPECT_FALSE(DaemonConfig{}.disk_tier.has_value());
  auto c = ParseConfigYaml(
      "tiers: {disk: {path: /tmp/x, capacity: 2GiB, use_wal: false}, placement: "
      "{high_watermark: 0.8, low_watermark: 0.5}}");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->disk_tier.has_value());
  EXPECT_EQ(c->disk_tier->path, "/tmp/x");
  EXPECT_EQ(c->disk_tier->capacity_bytes, 2ull << 30);
  EXPECT_FALSE(c->disk_tier->use_wal);
  EXPECT_EQ(c->placement.high_watermark, 0.8);
  EXPECT_EQ(c->placement.low_watermark, 0.5);
  auto no_path = ParseConfigYaml("tiers: {disk: {capacity: 1GiB}}");
  EXPECT_EQ(no_path.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(no_path.status().message(), HasSubstr("tiers.disk.path"));
  // What a put gets while the disk's writes are stopped: keep_in_host by default.
  using OnDiskError = storage::TierManagerOptions::OnDiskError;
  EXPECT_EQ(c->placement.on_disk_error, OnDiskError::kKeepInHost);
  auto fail_puts = ParseConfigYaml("tiers: {disk: {path: /tmp/x, on_error: fail_puts}}");
  ASSERT_TRUE(fail_puts.ok()) << fail_puts.status();
  EXPECT_EQ(fail_puts->placement.on_disk_error, OnDiskError::kFailPuts);
  auto bad_on_error = ParseConfigYaml("tiers: {disk: {path: /tmp/x, on_error: ignore}}");
  EXPECT_EQ(bad_on_error.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_on_error.status().message(),
              HasSubstr("tiers.disk.on_error: \"ignore\" is not keep_in_host or fail_puts"));
  auto bad = ParseConfigYaml("tiers: {placement: {high_watermark: 0.5, low_watermark: 0.7}}");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("tiers.placement"));
  // The GPU tier: parsed here, allocated (or refused with the reason) when kvd starts.
  EXPECT_FALSE(DaemonConfig{}.gpu_tier.has_value());
  auto gpu = ParseConfigYaml("tiers: {gpu: {capacity: 8GiB, device: 1, verify_checksums: false}}");
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE(gpu->gpu_tier.has_value());
  EXPECT_EQ(gpu->gpu_tier->capacity_bytes, 8ull << 30);
  EXPECT_FALSE(gpu->gpu_tier->verify_checksums);
  EXPECT_EQ(gpu->gpu_device, 1);
  auto no_capacity = ParseConfigYaml("tiers: {gpu: {device: 0}}");
  EXPECT_EQ(no_capacity.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(no_capacity.status().message(), HasSubstr("tiers.gpu.capacity"));
  auto bad_key = ParseConfigYaml("tiers: {gpu: {capacity: 1GiB, devices: 2}}");
  EXPECT_EQ(bad_key.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_key.status().message(), HasSubstr("devices"));
  auto bad_alignment = ParseConfigYaml("tiers: {gpu: {capacity: 1GiB, alignment: 100}}");
  EXPECT_EQ(bad_alignment.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_alignment.status().message(), HasSubstr("tiers.gpu"));
  // The example topologies in deploy/configs parse.
  for (const char* name : {"disk.yaml", "two-node.yaml"}) {
    auto example = LoadConfigFile(std::string(KVD_SOURCE_DIR) + "/deploy/configs/" + name);
    EXPECT_TRUE(example.ok()) << name << ": " << example.status();
  }
}

TEST(ConfigTest, MissingFileIsNotFound) {
  auto c = LoadConfigFile("/nonexistent/kvd.yaml");
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/kvd.yaml"));
}

TEST(ConfigTest, ByteSizes) {
  EXPECT_EQ(ParseByteSize("4096").value(), 4096u);
  EXPECT_EQ(ParseByteSize("1GiB").value(), 1ull << 30);
  EXPECT_EQ(ParseByteSize("512 MiB").value(), 512ull << 20);
  EXPECT_EQ(ParseByteSize("4kib").value(), 4096u);
  EXPECT_EQ(ParseByteSize("2GB").value(), 2000000000u);
  EXPECT_EQ(ParseByteSize("1.5KiB").value(), 1536u);
  EXPECT_EQ(ParseByteSize("7B").value(), 7u);
  for (const char* bad : {"", "GiB", "-1", "1.3B", "12 parsecs", "1e3"}) {
    auto r = ParseByteSize(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(FormatByteSize(1ull << 30), "1GiB");
  EXPECT_EQ(FormatByteSize(1536), "1536B");
  EXPECT_EQ(FormatByteSize(3 << 20), "3MiB");
}

TEST(ConfigTest, UnixPathAutoResolves) {
  ListenOptions l;
  EXPECT_EQ(l.ResolvedUnixPath(), ListenOptions::DefaultUnixPath());
  EXPECT_THAT(l.ResolvedUnixPath(), HasSubstr("kvd"));
  l.unix_path = "/tmp/x.sock";
  EXPECT_EQ(l.ResolvedUnixPath(), "/tmp/x.sock");
  l.unix_path = "/tmp/" + std::string(200, 'a');
  EXPECT_EQ(l.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(ConfigResourcesTest, HostCapacityOverMemoryIsRefusedNamingKeyValueAndMachine) {
  auto c = ParseConfigYaml("tiers:\n  host:\n    capacity: 64GiB\n", "t.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  MachineResources m;
  m.memory_bytes = 24ull << 30;
  m.memory_source = "physical memory (/proc/meminfo MemTotal)";
  const Status s = c->CheckResources(m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tiers.host.capacity: 64GiB (68719476736 bytes) is more "
                                     "than physical memory (/proc/meminfo MemTotal), "
                                     "25769803776 bytes"));
  EXPECT_THAT(s.message(), HasSubstr("tiers.allow_overcommit: true"));
  m.memory_bytes = 64ull << 30;  // exactly fits
  EXPECT_TRUE(c->CheckResources(m).ok());
  m.memory_bytes = 0;  // unknown: not checked
  EXPECT_TRUE(c->CheckResources(m).ok());
}

TEST(ConfigResourcesTest, DevShmIsCheckedOnlyWhereUcxMayPlaceTheArenaThere) {
  MachineResources m;
  m.memory_bytes = 64ull << 30;
  m.dev_shm_free_bytes = 512ull << 20;
  // The shared-memory path (memfd segments: not in /dev/shm): only memory counts.
  auto shm = ParseConfigYaml("tiers:\n  host:\n    capacity: 2GiB\n    segment: 64MiB\n", "t");
  ASSERT_TRUE(shm.ok()) << shm.status();
  EXPECT_TRUE(shm->SharedMemoryArena());
  EXPECT_TRUE(shm->CheckResources(m).ok());
  // The path off, UCX with shared-memory transports: the arena may be UCX's, in /dev/shm.
  auto off =
      ParseConfigYaml("tiers:\n  host:\n    capacity: 2GiB\n    shared_memory: false\n", "t");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->SharedMemoryArena());
  const Status s = off->CheckResources(m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tiers.host.capacity: 2GiB (2147483648 bytes) does not fit "
                                     "in the 536870912 bytes free in /dev/shm"));
  EXPECT_THAT(s.message(), HasSubstr("transport.ucx_tls \"sm,tcp\""));
  // Without UCX shared-memory transports the arena is not in /dev/shm.
  auto tcp = ParseConfigYaml(
      "transport:\n  ucx_tls: tcp\ntiers:\n  host:\n    capacity: 2GiB\n    shared_memory: false\n",
      "t");
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  EXPECT_TRUE(tcp->CheckResources(m).ok());
}

TEST(ConfigResourcesTest, DiskCapacityOverFreeSpaceIsRefused) {
  auto c = ParseConfigYaml("tiers:\n  disk:\n    path: /tmp/x\n    capacity: 10GiB\n", "t");
  ASSERT_TRUE(c.ok()) << c.status();
  MachineResources m;
  m.disk_free_bytes = 1ull << 30;
  const Status s = c->CheckResources(m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tiers.disk.capacity: 10GiB (10737418240 bytes) is more "
                                     "than the 1073741824 bytes free for the disk tier at /tmp/x"));
}

TEST(ConfigResourcesTest, ProbeSeesThisMachineAndOvercommitKeyParses) {
  DaemonConfig c;
  c.disk_tier = storage::DiskTierOptions{};
  c.disk_tier->path = "/tmp/kvd-config-test-does-not-exist/db";  // nearest existing: /tmp
  const MachineResources m = MachineResources::Probe(c);
  EXPECT_GT(m.memory_bytes, 64ull << 20);
  EXPECT_FALSE(m.memory_source.empty());
  EXPECT_GT(m.disk_free_bytes, 0u);
  EXPECT_FALSE(c.allow_overcommit);
  auto over = ParseConfigYaml("tiers:\n  allow_overcommit: true\n", "t");
  ASSERT_TRUE(over.ok()) << over.status();
  EXPECT_TRUE(over->allow_overcommit);
  auto bad = ParseConfigYaml("tiers:\n  allow_overcommit: maybe\n", "t");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("tiers.allow_overcommit"));
}
}  // namespace
}  // namespace kvd::daemon

namespace kvd::daemon {
namespace {

TEST(ConfigHardeningTest, DuplicateKeysSecondDocumentAndDirectoryAreRefused) {
  auto dup = ParseConfigYaml("chunk_tokens: 256\nlimits:\n  max_sessions: 4\n  max_sessions: 8\n",
                             "t.yaml");
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("limits.max_sessions: duplicate key (line 4)"),
            std::string::npos)
      << dup.status();
  auto top = ParseConfigYaml("node: a\nnode: b\n", "t.yaml");
  EXPECT_NE(top.status().message().find("node: duplicate key (line 2)"), std::string::npos)
      << top.status();
  auto two = ParseConfigYaml("node: a\n---\nnode: b\n", "t.yaml");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("more than one YAML document"), std::string::npos)
      << two.status();
  // yaml-cpp's LoadAll never returns on this (found by fuzz_config): refused, promptly.
  auto stray = ParseConfigYaml(",iB", "t.yaml");
  ASSERT_FALSE(stray.ok());
  EXPECT_EQ(stray.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stray.status().message().find("more than one YAML document"), std::string::npos)
      << stray.status();
  EXPECT_TRUE(ParseConfigYaml("---\nnode: a\n", "t.yaml").ok());  // one explicit document
  auto dir = LoadConfigFile("/tmp");
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.status().message().find("is a directory"), std::string::npos) << dir.status();
}

std::string PolicyYaml(const std::string& policy) {
  return "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8}, "
         "compression: " +
         policy + "}]";
}

TEST(ConfigPolicyTest, ParsesStagesAndParameters) {
  auto c =
      ParseConfigYaml(PolicyYaml("{stages: [snapkv, vector], p_c: 0.75, window: 16, sinks: "
                                 "2, r2_threshold: 0.3, calibration_tokens: 4096, "
                                 "worker_threads: 3, queue_depth: 7}"));
  ASSERT_TRUE(c.ok()) << c.status();
  const CompressionPolicy& p = *c->models[0].compression;
  EXPECT_EQ(p.score, "snapkv");
  EXPECT_EQ(p.merge, "none");
  EXPECT_EQ(p.route, "vector");
  EXPECT_EQ(p.p_c, 0.75);
  EXPECT_EQ(p.window, 16);
  EXPECT_EQ(p.worker_threads, 3);
  EXPECT_EQ(p.queue_depth, 7);
  EXPECT_TRUE(p.NeedsQueries());
  EXPECT_EQ(p.StagesName(), "snapkv+vector");

  auto hybrid = ParseConfigYaml(PolicyYaml("{stages: [hybrid]}")).value();
  EXPECT_EQ(hybrid.models[0].compression->score, "snapkv");
  EXPECT_EQ(hybrid.models[0].compression->merge, "kvslimmer");
  auto keydiff = ParseConfigYaml(PolicyYaml("{stages: [keydiff]}")).value();
  EXPECT_FALSE(keydiff.models[0].compression->NeedsQueries());
  auto off = ParseConfigYaml(PolicyYaml("off")).value();
  EXPECT_FALSE(off.models[0].compression.has_value());
}

TEST(ConfigPolicyTest, ParsesTheQuantizeStageAndItsKeys) {
  auto alone = ParseConfigYaml(PolicyYaml("{stages: [quantize]}"));
  ASSERT_TRUE(alone.ok()) << alone.status();
  const CompressionPolicy& a = *alone->models[0].compression;
  EXPECT_EQ(KeyText(a, "quant_format"), "int8");
  EXPECT_EQ(KeyText(a, "quant_group"), "64");
  EXPECT_EQ(KeyText(a, "quant_recent"), "0");
  EXPECT_EQ(a.p_c, 0.0);  // alone it keeps every token
  EXPECT_EQ(a.score, "none");
  EXPECT_EQ(a.StagesName(), "int8");
  EXPECT_FALSE(a.NeedsQueries());

  auto composed = ParseConfigYaml(PolicyYaml(
      "{stages: [keydiff, quantize], quant_format: int4, quant_group: 32, quant_recent: 16}"));
  ASSERT_TRUE(composed.ok()) << composed.status();
  const CompressionPolicy& c = *composed->models[0].compression;
  EXPECT_EQ(c.score, "keydiff");
  EXPECT_EQ(KeyText(c, "quant_format"), "int4");
  EXPECT_EQ(KeyText(c, "quant_group"), "32");
  EXPECT_EQ(KeyText(c, "quant_recent"), "16");
  EXPECT_EQ(c.p_c, 0.5);  // a score stage keeps the default ratio
  EXPECT_EQ(c.StagesName(), "keydiff+int4");

  auto fp8 = ParseConfigYaml(PolicyYaml("{stages: [quantize], quant_format: fp8_e4m3, p_c: 0.25}"));
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_EQ(KeyText(*fp8->models[0].compression, "quant_format"), "fp8_e4m3");
  EXPECT_EQ(fp8->models[0].compression->p_c, 0.25);  // recency then evicts a quarter

  // Each quantize parameter changes the codec id; a policy without the stage keeps its id.
  CompressionPolicy plain;
  CompressionPolicy q = plain;
  q.quantize = "quantize";
  CompressionPolicy q4 = q;
  SetKey(&q4, "quant_format", "int4");
  CompressionPolicy qg = q;
  SetKey(&qg, "quant_group", "32");
  CompressionPolicy qr = q;
  SetKey(&qr, "quant_recent", "8");
  CompressionPolicy qrot = q;
  SetKey(&qrot, "quant_rotate", "hadamard");
  CompressionPolicy qv = q;
  SetKey(&qv, "quant_value_format", "int2");
  CompressionPolicy qk = q;
  SetKey(&qk, "quant_key_group", "37");
  CompressionPolicy qs = q;
  SetKey(&qs, "quant_sinks", "4");
  CompressionPolicy qz = q;
  SetKey(&qz, "quant_value_format", "int4z");
  EXPECT_EQ(plain.CanonicalForm().find("quant"), std::string::npos);
  for (const CompressionPolicy* other : {&q4, &qg, &qr, &qrot, &qv, &qk, &qs, &qz}) {
    EXPECT_NE(q.CodecId(0), other->CodecId(0));
  }
  EXPECT_NE(plain.CodecId(0), q.CodecId(0));
  // Without them the canonical form (so every stored chunk's key) is what it was; a value
  // format equal to the key format is the same policy.
  EXPECT_EQ(q.CanonicalForm().find("quant_rotate"), std::string::npos);
  EXPECT_EQ(q.CanonicalForm().find("quant_values"), std::string::npos);
  EXPECT_EQ(q.CanonicalForm().find("quant_sinks"), std::string::npos);
  EXPECT_NE(qs.CanonicalForm().find(" quant_sinks=4"), std::string::npos) << qs.CanonicalForm();
  CompressionPolicy qsame = q;
  SetKey(&qsame, "quant_value_format", "int8");
  SetKey(&qsame, "quant_key_group", "64");
  SetKey(&qsame, "quant_format", "int8");
  EXPECT_EQ(q.CodecId(0), qsame.CodecId(0));

  auto rot =
      ParseConfigYaml(PolicyYaml("{stages: [quantize], quant_format: int3, quant_rotate: hadamard, "
                                 "quant_value_format: int2}"));
  ASSERT_TRUE(rot.ok()) << rot.status();
  EXPECT_EQ(KeyText(*rot->models[0].compression, "quant_rotate"), "hadamard");
  EXPECT_EQ(KeyText(*rot->models[0].compression, "quant_value_format"), "int2");
  EXPECT_EQ(KeyText(*rot->models[0].compression, "quant_format"), "int3");
  auto zero = ParseConfigYaml(PolicyYaml(
      "{stages: [quantize], quant_format: int4, quant_value_format: int4z, quant_sinks: 1}"));
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(KeyText(*zero->models[0].compression, "quant_value_format"), "int4z");
  // The rotation needs a power-of-two head_dim.
  auto odd = ParseConfigYaml(
      "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 12}, "
      "compression: {stages: [quantize], quant_rotate: hadamard}}]");
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.status().message(),
              HasSubstr("models[0].compression.quant_rotate: \"hadamard\" needs a power-of-two "
                        "head_dim; m has 12"));
}

TEST(ConfigPolicyTest, CodecIdFollowsEveryByteChangingParameterAndCalibration) {
  CompressionPolicy a;
  CompressionPolicy b = a;
  b.p_c = 0.75;
  CompressionPolicy threads = a;
  threads.worker_threads = 9;  // not part of the stored bytes
  EXPECT_NE(a.CodecId(0), 0u);
  EXPECT_NE(a.CodecId(0), b.CodecId(0));
  EXPECT_NE(a.CodecId(0), a.CodecId(42));
  EXPECT_EQ(a.CodecId(0), threads.CodecId(0));
  EXPECT_EQ(a.CodecId(7), CompressionPolicy{}.CodecId(7));
  EXPECT_NE(a.Digest(), b.Digest());
  CompressionPolicy on_cuda = a;
  on_cuda.device = "cuda:1";  // where it runs, not what it stores
  EXPECT_EQ(a.CodecId(0), on_cuda.CodecId(0));
}

// compression.device (chunk_codec.h ChooseIngestDevice), with the device probe's answers this
// machine may or may not give passed in.
CompressionPolicy Policy(const std::string& yaml) {
  return *ParseConfigYaml(PolicyYaml(yaml)).value().models[0].compression;
}

const Status kNoDevice =
    Status::Unavailable("no CUDA device (cudaGetDeviceCount: cudaErrorNoDevice)");
const Status kNoCuda = Status::Unimplemented("built without CUDA (this build has no CUDA kernels)");

TEST(ConfigPolicyTest, ParsesTheExpectedAttentionStageAndItsKeys) {
  auto c = ParseConfigYaml(
      PolicyYaml("{stages: [expected_attention], ea_future_positions: 128, ea_min_queries: 64}"));
  ASSERT_TRUE(c.ok()) << c.status();
  const CompressionPolicy& p = *c->models[0].compression;
  EXPECT_EQ(p.score, "expected_attention");
  EXPECT_EQ(KeyText(p, "ea_future_positions"), "128");
  EXPECT_EQ(KeyText(p, "ea_min_queries"), "64");
  EXPECT_TRUE(p.NeedsQueries()) << "its statistics are built from the window queries";
  EXPECT_EQ(p.StagesName(), "expected_attention");
  const CompressionPolicy defaults = Policy("{stages: [expected_attention]}");
  EXPECT_EQ(KeyText(defaults, "ea_future_positions"), "512");
  EXPECT_EQ(KeyText(defaults, "ea_min_queries"), "256");
  // Both keys change the stored bytes, so the codec id; a policy without the stage keeps its id.
  EXPECT_NE(p.CodecId(0), defaults.CodecId(0));
  CompressionPolicy other = defaults;
  SetKey(&other, "ea_min_queries", "257");
  EXPECT_NE(other.CodecId(0), defaults.CodecId(0));
  const CompressionPolicy keydiff = Policy("{stages: [keydiff]}");
  EXPECT_EQ(keydiff.CanonicalForm().find("ea="), std::string::npos);
}

TEST(ConfigPolicyTest, ParsesTheExpectedAttentionCovarianceAndKeyDiffShare) {
  const CompressionPolicy defaults = Policy("{stages: [expected_attention]}");
  EXPECT_EQ(KeyText(defaults, "ea_covariance"), "1");
  EXPECT_EQ(KeyText(defaults, "ea_keydiff_share"), "0");
  const CompressionPolicy p =
      Policy("{stages: [expected_attention], ea_covariance: false, ea_keydiff_share: 0.5}");
  EXPECT_EQ(KeyText(p, "ea_covariance"), "0");
  EXPECT_EQ(KeyText(p, "ea_keydiff_share"), "0.5");
  // Each changes what is kept, so the codec id; the defaults keep the id they had.
  CompressionPolicy cov = defaults;
  SetKey(&cov, "ea_covariance", "0");
  CompressionPolicy share = defaults;
  SetKey(&share, "ea_keydiff_share", "0.25");
  EXPECT_NE(cov.CodecId(0), defaults.CodecId(0));
  EXPECT_NE(share.CodecId(0), defaults.CodecId(0));
  EXPECT_NE(share.CodecId(0), cov.CodecId(0));
  EXPECT_EQ(defaults.CanonicalForm().find("ea_covariance"), std::string::npos);
  EXPECT_EQ(defaults.CanonicalForm().find("ea_keydiff_share"), std::string::npos);
}

TEST(IngestDeviceTest, ParsesTheSettingWithAutoAsDefault) {
  EXPECT_EQ(Policy("{stages: [snapkv]}").device, "auto");
  EXPECT_EQ(Policy("{stages: [snapkv], device: cpu}").device, "cpu");
  EXPECT_EQ(Policy("{stages: [snapkv], device: cuda}").CudaOrdinal(), 0);
  EXPECT_EQ(Policy("{stages: [snapkv], device: \"cuda:3\"}").CudaOrdinal(), 3);
  EXPECT_EQ(Policy("{stages: [snapkv], device: auto}").CudaOrdinal(), -1);
}

TEST(IngestDeviceTest, CpuIsTheCpuPlanWhateverTheNodeHas) {
  for (const Status& probe : {Status::Ok(), kNoDevice, kNoCuda}) {
    auto d = ChooseIngestDevice(Policy("{stages: [snapkv], device: cpu}"), "models[0].compression",
                                probe);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_FALSE(d->cuda);
    EXPECT_EQ(d->Name(), "cpu");
    EXPECT_THAT(d->reason, HasSubstr("compression.device is cpu"));
  }
}

TEST(IngestDeviceTest, AutoPicksTheCudaPlanWhenTheDeviceRunsThePolicy) {
  for (const char* stages : {"[snapkv]", "[pyramidkv]", "[snapkv, vector]", "[keydiff]",
                             "[keydiff, vector]", "[hybrid]", "[keydiff, kvslimmer]"}) {
    auto d = ChooseIngestDevice(Policy(std::string("{stages: ") + stages + "}"), "k", Status::Ok());
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(d->cuda) << stages;
    EXPECT_EQ(d->Name(), "cuda:0");
    EXPECT_THAT(d->reason, HasSubstr("auto: CUDA device 0 runs the CUDA plan"));
  }
  auto block =
      ChooseIngestDevice(Policy("{stages: [keydiff], keydiff_block: 128}"), "k", Status::Ok());
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_TRUE(block->cuda);
}

// kvd's default policy (the built-in model list and deploy/configs/default.yaml: expected
// attention with a KeyDiff share) runs on the CPU plan, saying why: the CUDA plan has no
// expected_attention stage; and without a device, saying that.
TEST(IngestDeviceTest, TheDefaultPolicyRunsOnTheCpuPlanSayingWhy) {
  std::vector<CompressionPolicy> defaults;
  for (const ModelConfig& m : DaemonConfig::BuiltinModels()) {
    if (m.compression) defaults.push_back(*m.compression);
  }
  auto file = LoadConfigFile(std::string(KVD_SOURCE_DIR) + "/deploy/configs/default.yaml");
  ASSERT_TRUE(file.ok()) << file.status();
  for (const ModelConfig& m : file->models) {
    if (m.compression) defaults.push_back(*m.compression);
  }
  ASSERT_FALSE(defaults.empty());
  for (const CompressionPolicy& p : defaults) {
    SCOPED_TRACE(p.CanonicalForm());
    EXPECT_EQ(p.score, "expected_attention");
    EXPECT_EQ(p.device, "auto");
    auto on_gpu = ChooseIngestDevice(p, "models[0].compression", Status::Ok());
    ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
    EXPECT_FALSE(on_gpu->cuda);
    EXPECT_THAT(on_gpu->reason,
                HasSubstr("auto: the CUDA plan does not implement expected_attention+int8"));
    auto no_gpu = ChooseIngestDevice(p, "models[0].compression", kNoDevice);
    ASSERT_TRUE(no_gpu.ok()) << no_gpu.status();
    EXPECT_FALSE(no_gpu->cuda);
    EXPECT_THAT(no_gpu->reason, HasSubstr("auto: no CUDA device"));
  }
}

TEST(IngestDeviceTest, AutoFallsBackToTheCpuPlanSayingWhy) {
  struct Case {
    std::string policy;
    Status probe;
    std::vector<const char*> reason;
  };
  const std::vector<Case> cases = {
      {"{stages: [snapkv]}", kNoDevice, {"auto: no CUDA device (cudaGetDeviceCount"}},
      {"{stages: [snapkv]}", kNoCuda, {"auto: built without CUDA"}},
      // Methods the CUDA plan refuses: named, with the kernels' reason.
      {"{stages: [snapkv, kvslimmer, vector]}",
       Status::Ok(),
       {"auto: the CUDA plan does not implement snapkv+kvslimmer+vector",
        "route kVector after merge kKvSlimmer"}},
      {"{stages: [kvslimmer]}", Status::Ok(), {"does not implement kvslimmer"}},
  };
  for (const Case& c : cases) {
    auto d = ChooseIngestDevice(Policy(c.policy), "models[0].compression", c.probe);
    ASSERT_TRUE(d.ok()) << c.policy << ": " << d.status();
    EXPECT_FALSE(d->cuda) << c.policy;
    EXPECT_EQ(d->Name(), "cpu");
    for (const char* f : c.reason) EXPECT_THAT(d->reason, HasSubstr(f)) << c.policy;
  }
}

TEST(IngestDeviceTest, ExplicitCudaIsHonouredOrRefusedNamingKeyValueAndReason) {
  auto two =
      ChooseIngestDevice(Policy("{stages: [snapkv], device: \"cuda:2\"}"), "k", Status::Ok());
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->Name(), "cuda:2");
  EXPECT_THAT(two->reason, HasSubstr("compression.device is cuda:2"));
  struct Case {
    std::string policy;
    Status probe;
    std::vector<const char*> fragments;
  };
  const std::vector<Case> cases = {
      {"{stages: [snapkv], device: cuda}",
       kNoDevice,
       {"models[1].compression.device: \"cuda\" cannot be honoured: no CUDA device"}},
      {"{stages: [snapkv], device: cuda}",
       kNoCuda,
       {"models[1].compression.device: \"cuda\" cannot be honoured: built without CUDA"}},
      {"{stages: [kvslimmer], device: \"cuda:1\"}",
       Status::Ok(),
       {"models[1].compression.device: \"cuda:1\" cannot be honoured",
        "the CUDA plan does not implement kvslimmer"}},
  };
  for (const Case& c : cases) {
    auto d = ChooseIngestDevice(Policy(c.policy), "models[1].compression", c.probe);
    ASSERT_FALSE(d.ok()) << c.policy;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << c.policy;
    for (const char* f : c.fragments) EXPECT_THAT(d.status().message(), HasSubstr(f)) << c.policy;
  }
}

// This process's own probe: without a device (this machine kind) auto keeps the CPU plan and
// cuda is refused before kvd starts (CheckIngestDevices, exit 2 in main).
TEST(IngestDeviceTest, ThisNodesProbeDecidesAtStart) {
  const Status probe = ProbeIngestDevice(0);
  if (probe.ok()) GTEST_SKIP() << "a CUDA device is present (the device checks cover it)";
  EXPECT_TRUE(probe.code() == StatusCode::kUnavailable ||
              probe.code() == StatusCode::kUnimplemented)
      << probe;
  EXPECT_THAT(probe.message(),
              ::testing::AnyOf(HasSubstr("no CUDA device"), HasSubstr("built without CUDA")));
  auto config = ParseConfigYaml(
      "models:\n"
      "  - {name: raw, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8}}\n"
      "  - {name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8}, "
      "compression: {stages: [snapkv]}}\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(CheckIngestDevices(*config).ok());
  config->models[1].compression->device = "cuda";
  const Status refused = CheckIngestDevices(*config);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(),
              HasSubstr("models[1].compression.device: \"cuda\" cannot be honoured: "));
  EXPECT_THAT(refused.message(), HasSubstr(probe.message()));
}

TEST(ConfigPolicyTest, RefusesBadPoliciesNamingKeyAndValue) {
  struct Case {
    std::string policy;
    std::vector<const char*> fragments;
  };
  const std::vector<Case> cases = {
      {"{stages: [snapkvv]}", {"models[0].compression.stages[0]", "snapkvv", "is not a method"}},
      {"{stages: [vector, snapkv]}",
       {"stages[1]", "snapkv", "listed after the route stage", "score, merge, route"}},
      {"{stages: [snapkv, keydiff]}", {"stages[1]", "keydiff", "second score method"}},
      {"{stages: [vector]}", {"models[0].compression.stages", "vector", "needs a score or merge"}},
      {"{stages: []}", {"models[0].compression.stages", "required"}},
      {"{p_c: 0.5}", {"models[0].compression.stages", "required"}},
      {"{stages: [snapkv], p_c: 1}", {"models[0].compression.p_c", "\"1\"", "[0, 1)"}},
      {"{stages: [snapkv], p_c: -0.1}", {"models[0].compression.p_c", "-0.1"}},
      {"{stages: [snapkv], p_c: 0.9}",
       {"models[0].compression.p_c", "0.9", "fewer than sinks (4) + window (32)"}},
      {"{stages: [snapkv], pooling: median}", {"models[0].compression.pooling", "median"}},
      {"{stages: [snapkv], queue_depth: 0}", {"models[0].compression.queue_depth", "\"0\""}},
      {"{stages: [snapkv], colour: red}", {"models[0].compression.colour", "unknown key"}},
      {"lossy", {"models[0].compression", "lossy", "policy mapping"}},
      {"{stages: [snapkv], device: gpu}",
       {"models[0].compression.device", "\"gpu\"", "auto, cpu, cuda or cuda:N"}},
      {"{stages: [snapkv], device: \"cuda:x\"}", {"models[0].compression.device", "cuda:x"}},
      {"{stages: [snapkv], device: \"cuda:\"}", {"models[0].compression.device", "cuda:"}},
      // expected attention
      {"{stages: [expected_attention], ea_future_positions: 0}",
       {"models[0].compression.ea_future_positions", "\"0\""}},
      {"{stages: [expected_attention], ea_min_queries: -3}",
       {"models[0].compression.ea_min_queries", "\"-3\""}},
      {"{stages: [keydiff], ea_min_queries: 64}",
       {"models[0].compression.ea_min_queries", "no expected_attention stage"}},
      {"{stages: [keydiff], ea_keydiff_share: 0.5}",
       {"models[0].compression.ea_keydiff_share", "no expected_attention stage"}},
      {"{stages: [expected_attention], ea_keydiff_share: 1}",
       {"models[0].compression.ea_keydiff_share", "[0, 1)"}},
      {"{stages: [expected_attention], ea_covariance: maybe}",
       {"models[0].compression.ea_covariance", "maybe"}},
      {"{stages: [expected_attention], ea_recent_share: 1}",
       {"models[0].compression.ea_recent_share", "[0, 1)"}},
      {"{stages: [expected_attention], ea_keydiff_share: 0.5, ea_recent_share: 0.5}",
       {"models[0].compression", "keydiff_share + recent_share < 1"}},
      {"{stages: [keydiff], ea_recent_share: 0.2}",
       {"models[0].compression.ea_recent_share", "no expected_attention stage"}},
      {"{stages: [expected_attention, keydiff]}", {"stages[1]", "keydiff", "second score method"}},
      // the quantize stage
      {"{stages: [quantize], quant_format: int5}",
       {"models[0].compression.quant_format",
        "\"int5\" is not one of int8, int4, int3, int2, int8z, int4z, int3z, int2z, int4s, int3s, "
        "int2s, fp8_e4m3"}},
      {"{stages: [quantize], quant_rotate: walsh}",
       {"models[0].compression.quant_rotate", "\"walsh\" is not one of none, hadamard"}},
      {"{stages: [quantize], quant_value_format: int1}",
       {"models[0].compression.quant_value_format", "\"int1\" is not one of same, int8, int4"}},
      {"{stages: [keydiff], quant_rotate: hadamard}",
       {"models[0].compression.quant_rotate", "no quantize stage"}},
      {"{stages: [quantize], quant_key_group: 0}",
       {"models[0].compression.quant_key_group", "\"0\"", "[1, 65536]"}},
      {"{stages: [keydiff], quant_key_group: 32}",
       {"models[0].compression.quant_key_group", "no quantize stage"}},
      {"{stages: [keydiff], quant_value_format: int2}",
       {"models[0].compression.quant_value_format", "no quantize stage"}},
      {"{stages: [quantize], quant_format: none}",
       {"models[0].compression.quant_format", "\"none\"", "drop the quantize stage"}},
      {"{stages: [quantize], quant_group: 0}",
       {"models[0].compression.quant_group", "\"0\"", "[1, 65536]"}},
      {"{stages: [quantize], quant_group: 70000}", {"models[0].compression.quant_group"}},
      {"{stages: [quantize], quant_recent: -1}", {"models[0].compression.quant_recent", "\"-1\""}},
      {"{stages: [quantize], quant_sinks: 8}",
       {"models[0].compression: plan: quant_sinks (quant.sinks) 8 exceeds sinks 4",
        "lower quant_sinks or raise sinks"}},
      {"{stages: [quantize], sinks: 2, quant_sinks: 4}",
       {"models[0].compression: plan: quant_sinks (quant.sinks) 4 exceeds sinks 2"}},
      {"{stages: [keydiff], quant_sinks: 4}",
       {"models[0].compression.quant_sinks", "no quantize stage"}},
      {"{stages: [keydiff], quant_format: int4}",
       {"models[0].compression.quant_format", "no quantize stage"}},
      {"{stages: [keydiff], quant_group: 32}",
       {"models[0].compression.quant_group", "no quantize stage"}},
      {"{stages: [quantize, keydiff]}",
       {"stages[1]", "keydiff", "listed after the quantize stage",
        "score, merge, route, quantize"}},
      {"{stages: [quantize, quantize]}", {"stages[1]", "second quantize method"}},
      {"{stages: [quantize, vector]}", {"stages[1]", "vector", "after the quantize stage"}},
  };
  for (const auto& c : cases) {
    auto parsed = ParseConfigYaml(PolicyYaml(c.policy), "p.yaml");
    ASSERT_FALSE(parsed.ok()) << c.policy;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << c.policy;
    for (const char* f : c.fragments) {
      EXPECT_THAT(parsed.status().message(), HasSubstr(f)) << c.policy;
    }
  }
}

TEST(ConfigQuotaTest, DefaultAndNamedNamespacesBindAndBadValuesAreNamed) {
  auto c = ParseConfigYaml(R"(
quotas:
  protect: false
  default: {reserved_bytes: 64MiB, leases: 100}
  namespaces:
    team-a: {pinned_bytes: 1GiB, queued_events: 10}
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->quotas.protect);
  const storage::QuotaTable& t = c->quotas.table;
  EXPECT_EQ(t.defaults.reserved_bytes, 64ull << 20);
  EXPECT_EQ(t.defaults.leases, 100u);
  EXPECT_EQ(t.defaults.queued_events, 65536u);  // unset: the struct's default
  // A named namespace starts from the default.
  const storage::NamespaceQuota& a = t.For("team-a");
  EXPECT_EQ(a.reserved_bytes, 64ull << 20);
  EXPECT_EQ(a.pinned_bytes, 1ull << 30);
  EXPECT_EQ(a.queued_events, 10u);
  EXPECT_EQ(t.For("team-b").pinned_bytes, 0u);

  const BadCase cases[] = {
      {"quotas: {default: {reserved: 1MiB}}", {"quotas.default", "unknown quota \"reserved\""}},
      {"quotas: {namespaces: {x: {leases: -1}}}", {"quotas.namespaces.x", "leases", "-1"}},
      {"quotas: {default: {pinned_bytes: lots}}", {"quotas.default", "pinned_bytes", "lots"}},
      {"quotas: {limit: 1}", {"quotas.limit", "unknown key"}},
  };
  for (const BadCase& bad : cases) {
    auto r = ParseConfigYaml(bad.yaml);
    ASSERT_FALSE(r.ok()) << bad.yaml;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad.yaml;
    for (const char* f : bad.fragments) {
      EXPECT_THAT(r.status().message(), ::testing::HasSubstr(f)) << bad.yaml;
    }
  }
}

}  // namespace
}  // namespace kvd::daemon
