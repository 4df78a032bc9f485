// Writes the binary seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): a few small,
// valid inputs each, built with the project's own encoders so the fuzzer starts from the real
// formats. The YAML seeds of fuzz_config are hand-written text (corpus/config/); the v1-chunk-*
// seeds of fuzz_compact_chunk were written by a format-1 encoder (still read, no longer written).
//
//   kvd_fuzz_make_seeds <tests/fuzz/corpus>
#include <capnp/message.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../engine/gguf_builder.h"
#include "key_codec.h"  // storage-private: the disk tier's record encoders
#include "kvd/common/hash.h"
#include "kvd/daemon/config.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/vector.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"

namespace {

namespace fs = std::filesystem;
namespace proto = kvd::proto;

void Write(const fs::path& path, const void* data, size_t size) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

// One framed message (header + payload) built by `fill`.
template <typename Root, typename Fill>
std::vector<uint8_t> Frame(Fill&& fill) {
  capnp::MallocMessageBuilder builder;
  fill(builder.initRoot<Root>());
  return proto::EncodeFrame(builder);
}

std::vector<std::vector<uint8_t>> Requests(const kvd::daemon::DaemonConfig& config) {
  const kvd::daemon::ModelConfig& model = config.models.at(0);
  std::vector<std::vector<uint8_t>> out;
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(1);
    auto h = r.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setClientId("fuzz-seed");
    h.setRole(proto::Role::ENGINE);
    h.setNamespace("tenant-a");
    h.setModel(model.name);
    proto::ToProto(model.layout, h.initLayout());
    h.setHashSeedDigest(kvd::Digest64(config.hash_seed));
    h.setChunkTokens(static_cast<uint32_t>(config.chunk_tokens));
    const std::string addr = "ucx-worker-address";
    h.setWorkerAddress(
        kj::arrayPtr(reinterpret_cast<const capnp::byte*>(addr.data()), addr.size()));
    h.setAuthToken("token");
    h.setSharedMemory(true);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(2);
    auto h = r.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setClientId("kvdctl");
    h.setRole(proto::Role::ADMIN);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(3);
    auto l = r.initLookup();
    auto chain = l.initChain(3);
    for (uint32_t i = 0; i < 3; ++i) proto::ToProto(kvd::Hash128{i + 1, i * 7 + 3}, chain[i]);
    l.setLeaseTtlMs(5000);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(4);
    auto res = r.initReserve();
    proto::ToProto(kvd::Hash128{11, 12}, res.initChunkHash());
    res.setTokens(static_cast<uint32_t>(config.chunk_tokens));
    res.setBytes(model.layout.ChunkBytes(config.chunk_tokens));
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(5);
    r.initCommit().setReservationId(9);
    r.getCommit().setChecksum(0x1234);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(6);
    auto g = r.initGet();
    g.setLeaseId(77);
    g.setChunkIndex(1);
    g.setTag(5);
    g.setBufferBytes(1 << 20);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(7);
    auto l = r.initList();
    l.setNamespace("tenant-a");
    l.setModel(model.name);
    l.setLimit(10);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(8);
    proto::ToProto(kvd::Hash128{1, 2}, r.initEvict().initChunk());
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(9);
    r.initReleaseLease().setLeaseId(77);
  }));
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(10);
    auto l = r.initLookup();
    auto chain = l.initChain(2);
    for (uint32_t i = 0; i < 2; ++i) proto::ToProto(kvd::Hash128{i + 5, i * 3 + 1}, chain[i]);
    l.setCluster(true);
  }));
  for (const char* node : {"", "decode-07"}) {
    out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
      r.setRequestId(11);
      auto p = r.initPlacement();
      proto::ToProto(kvd::Hash128{21, 22}, p.initChain(1)[0]);
      p.setNode(node);
    }));
  }
  out.push_back(Frame<proto::Request>([&](proto::Request::Builder r) {
    r.setRequestId(12);
    r.setBye();
  }));
  return out;
}

std::vector<std::vector<uint8_t>> Responses(const kvd::daemon::DaemonConfig& config) {
  std::vector<std::vector<uint8_t>> out;
  out.push_back(Frame<proto::Response>([&](proto::Response::Builder r) {
    r.setRequestId(1);
    proto::ToProto(kvd::Status::NotFound("unknown model \"x\""), r.initError());
  }));
  out.push_back(Frame<proto::Response>([&](proto::Response::Builder r) {
    r.setRequestId(2);
    auto s = r.initStats();
    s.setNodeName("kvd-local");
    auto tiers = s.initTiers(1);
    tiers[0].setName("host");
    tiers[0].setCapacityBytes(1 << 30);
    auto models = s.initRegisteredModels(1);
    models[0].setName(config.models.at(0).name);
    proto::ToProto(config.models.at(0).layout, models[0].initLayout());
    models[0].setChunkBytes(config.models.at(0).layout.ChunkBytes(config.chunk_tokens));
  }));
  out.push_back(Frame<proto::Response>([&](proto::Response::Builder r) {
    r.setRequestId(10);
    auto l = r.initLookup();
    l.setMatchedChunks(2);
    l.setMatchedTokens(512);
    l.setLeaseId(3);
    l.setLeaseTtlMs(5000);
    l.setFetchedChunks(1);
    auto found = l.initFoundIn(1);
    found[0].setTier("host");
    found[0].setChunks(2);
    auto holders = l.initHolders(2);
    holders[0].setNode("prefill-01");
    holders[0].setMatchedChunks(2);
    holders[1].setNode("decode-07");
    holders[1].setError("UNAVAILABLE: connect to 10.0.0.7:7400");
    l.setMembershipCurrent(false);
    l.setMembershipAgeMs(1500);
  }));
  out.push_back(Frame<proto::Response>([&](proto::Response::Builder r) {
    r.setRequestId(11);
    auto p = r.initPlacement();
    auto targets = p.initTargets(1);
    targets[0].setNode("decode-07");
    targets[0].setControlAddress("10.0.0.7:7400");
    p.setMembershipCurrent(true);
  }));
  out.push_back(Frame<proto::Response>([&](proto::Response::Builder r) {
    // An Error whose message holds NUL bytes (valid UTF-8): its round trip keeps every byte.
    r.setRequestId(12);
    auto e = r.initError();
    e.setCode(static_cast<uint16_t>(kvd::StatusCode::kInvalidArgument));
    static constexpr char kText[] = "echo \"\0\0\x06\xfa\0x\"";
    e.setMessage(kj::StringPtr(kText, sizeof kText - 1));
  }));
  return out;
}

void WriteMessages(const fs::path& corpus, const kvd::daemon::DaemonConfig& config) {
  auto requests = Requests(config);
  auto responses = Responses(config);
  // fuzz_frame: streams of frames (first byte: which frame limit); the last one has a bad header.
  std::vector<uint8_t> stream{0};
  for (const auto& f : requests) stream.insert(stream.end(), f.begin(), f.end());
  Write(corpus / "frame" / "session", stream.data(), stream.size());
  std::vector<uint8_t> one{1};
  one.insert(one.end(), requests[0].begin(), requests[0].end());
  Write(corpus / "frame" / "hello", one.data(), one.size());
  std::vector<uint8_t> bad = one;
  bad[1] ^= 0xff;  // magic
  Write(corpus / "frame" / "bad-magic", bad.data(), bad.size());
  // fuzz_control_message: payloads (the bytes after the header).
  int i = 0;
  for (const auto* list : {&requests, &responses}) {
    for (const auto& f : *list) {
      char name[32];
      std::snprintf(name, sizeof name, "%s-%02d", list == &requests ? "request" : "response", i++);
      Write(corpus / "control_message" / name, f.data() + proto::kFrameHeaderBytes,
            f.size() - proto::kFrameHeaderBytes);
    }
  }
}

kvd::kernels::CompactChunk SmallChunk(kvd::DType dtype, bool rebuild, uint64_t seed) {
  using namespace kvd::kernels;
  std::mt19937_64 rng(seed);
  CompactChunk c;
  c.num_layers = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.dtype = dtype;
  c.original_tokens = 16;
  c.layout_digest = rng();
  c.codec.score = ScoreStage::kSnapKv;
  c.codec.merge = rebuild ? MergeStage::kKvSlimmer : MergeStage::kNone;
  c.codec.route = rebuild ? RouteStage::kVector : RouteStage::kNone;
  c.codec.p_c = 0.5;
  c.codec.calibration_version = rebuild ? rng() : 0;
  c.heads.resize(2);
  const size_t e = kvd::DTypeSize(dtype);
  for (CompactHead& h : c.heads) {
    const int s = 3;
    for (int j = 0; j < s; ++j) {
      h.flags.push_back(rebuild && j == 1 ? kSlotRebuildValue : 0);
      h.cardinality.push_back(1 + j);
      h.positions.push_back(2 * j + 1);
    }
    h.keys.resize(s * c.head_dim * e);
    for (auto& b : h.keys) b = static_cast<uint8_t>(rng());
    h.values.resize(h.value_slots() * c.head_dim * e);
    for (auto& b : h.values) b = static_cast<uint8_t>(rng());
  }
  return c;
}

void WriteCompactChunks(const fs::path& corpus) {
  int i = 0;
  for (auto [dtype, rebuild] :
       {std::pair{kvd::DType::kFloat16, false}, std::pair{kvd::DType::kBFloat16, true},
        std::pair{kvd::DType::kFloat32, false}}) {
    auto bytes = kvd::kernels::EncodeCompactChunk(SmallChunk(dtype, rebuild, 100 + i));
    if (!bytes.ok()) {
      std::fprintf(stderr, "EncodeCompactChunk: %s\n", bytes.status().ToString().c_str());
      std::exit(1);
    }
    Write(corpus / "compact_chunk" / ("v2-chunk-" + std::to_string(i++)), bytes->data(),
          bytes->size());
  }
}

// A complete (tiny) llama model: dim 8, 2 heads (1 KV head), 1 layer, hidden 16, byte-level BPE.
std::string TinyLlama(uint32_t matrix_type) {
  kvd::llama::testing::GgufBuilder b;
  std::vector<std::string> tokens = kvd::llama::testing::ByteTokens();
  tokens.push_back("he");
  tokens.push_back("<|im_start|>");
  std::vector<int32_t> types(tokens.size(), 1);
  types.back() = 3;  // control
  const uint64_t d = 8, h = 16, kv = 4, vocab = tokens.size();
  b.KvStr("general.architecture", "llama");
  b.KvU32("llama.embedding_length", d);
  b.KvU32("llama.feed_forward_length", h);
  b.KvU32("llama.block_count", 1);
  b.KvU32("llama.attention.head_count", 2);
  b.KvU32("llama.attention.head_count_kv", 1);
  b.KvU32("llama.context_length", 64);
  b.KvF32("llama.rope.freq_base", 10000.0f);
  b.KvF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  b.KvStr("tokenizer.ggml.model", "gpt2");
  b.KvStr("tokenizer.ggml.pre", "smollm");
  b.KvStrArray("tokenizer.ggml.tokens", tokens);
  b.KvI32Array("tokenizer.ggml.token_type", types);
  b.KvStrArray("tokenizer.ggml.merges", {"h e"});
  b.KvU32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(vocab - 1));
  b.KvU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(vocab - 1));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  auto values = [&](uint64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
  };
  auto mat = [&](const std::string& name, uint64_t in, uint64_t out) {
    std::vector<float> w = values(in * out);
    if (matrix_type == 1) {  // F16: ggml's IEEE half, built from float bits (round to zero)
      std::string bytes;
      for (float x : w) {
        uint32_t f;
        std::memcpy(&f, &x, 4);
        const uint32_t sign = (f >> 16) & 0x8000;
        const int exp = static_cast<int>((f >> 23) & 0xff) - 127 + 15;
        const uint16_t half = exp <= 0
                                  ? static_cast<uint16_t>(sign)
                                  : static_cast<uint16_t>(sign | (exp << 10) | ((f >> 13) & 0x3ff));
        bytes.append(reinterpret_cast<const char*>(&half), 2);
      }
      b.Tensor(name, {in, out}, 1, bytes);
    } else {
      b.TensorF32(name, {in, out}, w);
    }
  };
  b.TensorF32("token_embd.weight", {d, vocab}, values(d * vocab));
  b.TensorF32("output_norm.weight", {d}, values(d));
  b.TensorF32("blk.0.attn_norm.weight", {d}, values(d));
  b.TensorF32("blk.0.ffn_norm.weight", {d}, values(d));
  mat("blk.0.attn_q.weight", d, d);
  mat("blk.0.attn_k.weight", d, kv);
  mat("blk.0.attn_v.weight", d, kv);
  mat("blk.0.attn_output.weight", d, d);
  mat("blk.0.ffn_gate.weight", d, h);
  mat("blk.0.ffn_up.weight", d, h);
  mat("blk.0.ffn_down.weight", h, d);
  return b.Build();
}

void WriteGguf(const fs::path& corpus) {
  const std::string f32 = TinyLlama(0), f16 = TinyLlama(1);
  Write(corpus / "gguf" / "tiny-llama-f32.gguf", f32.data(), f32.size());
  Write(corpus / "gguf" / "tiny-llama-f16.gguf", f16.data(), f16.size());
  kvd::llama::testing::GgufBuilder meta;  // metadata of every value type, no tensors
  meta.KvU8("u8", 1);
  meta.KvI8("i8", -1);
  meta.KvU16("u16", 2);
  meta.KvI16("i16", -2);
  meta.KvU32("u32", 3);
  meta.KvI32("i32", -3);
  meta.KvU64("u64", 4);
  meta.KvI64("i64", -4);
  meta.KvF32("f32", 0.5f);
  meta.KvF64("f64", 0.25);
  meta.KvBool("bool", true);
  meta.KvStr("str", "text");
  meta.KvStrArray("strs", {"a", "b"});
  meta.KvI32Array("ints", {1, 2, 3});
  const std::string m = meta.Build();
  Write(corpus / "gguf" / "metadata.gguf", m.data(), m.size());
}

// Saved VECTOR calibration: a checkpoint (empty and fed a few tokens) and the weights solved from
// it, linear and affine.
void WriteVectorCalibration(const fs::path& corpus) {
  namespace kk = kvd::kernels;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const auto& [layers, heads, d] : {std::tuple{1, 1, 2}, std::tuple{2, 2, 4}}) {
    auto cal = kk::VectorCalibrator::Create(layers, heads, d);
    if (!cal.ok()) std::exit(1);
    const std::string shape =
        std::to_string(layers) + "x" + std::to_string(heads) + "x" + std::to_string(d);
    const std::vector<uint8_t> empty = cal->Serialize();
    Write(corpus / "vector_calibration" / ("checkpoint-empty-" + shape), empty.data(),
          empty.size());
    kk::Matrix kpre(4 * d, d), values(4 * d, d);
    for (float& x : kpre.values) x = normal(rng);
    for (float& x : values.values) x = normal(rng);
    for (int l = 0; l < layers; ++l) {
      for (int h = 0; h < heads; ++h) {
        if (!cal->Add(l, h, kpre.View(), values.View()).ok()) std::exit(1);
      }
    }
    const std::vector<uint8_t> checkpoint = cal->Serialize();
    Write(corpus / "vector_calibration" / ("checkpoint-" + shape), checkpoint.data(),
          checkpoint.size());
    auto weights = cal->Solve();
    if (!weights.ok()) std::exit(1);
    const std::vector<uint8_t> w = weights->Serialize();
    Write(corpus / "vector_calibration" / ("weights-" + shape), w.data(), w.size());
    kk::VectorSolveOptions affine;
    affine.affine = true;
    auto affine_weights = cal->Solve(affine);  // format version 2: a bias per head
    if (!affine_weights.ok()) std::exit(1);
    const std::vector<uint8_t> a = affine_weights->Serialize();
    Write(corpus / "vector_calibration" / ("weights-affine-" + shape), a.data(), a.size());
  }
}

// Disk tier records: [u16 key length][chunk key][metadata record].
void WriteDiskRecords(const fs::path& corpus) {
  namespace codec = kvd::storage::codec;
  int n = 0;
  for (const auto& [ns, model] : {std::pair{"", "m"}, std::pair{"tenant-a", "llama-3-8b"}}) {
    kvd::storage::ChunkKey key;
    key.name_space = ns;
    key.model = model;
    key.layout_digest = 0x1234567890abcdefull;
    key.codec_id = n;
    key.chain_hash = kvd::Hash128{0xfeedull + n, 0xbeefull * (n + 1)};
    const std::string k = codec::EncodeKey(key);
    const std::string m = codec::EncodeMeta({.tokens = 256, .size_bytes = 131072, .checksum = 7});
    const auto len = static_cast<uint16_t>(k.size());
    std::string record(reinterpret_cast<const char*>(&len), 2);
    record += k + m;
    Write(corpus / "disk_record" / ("record-" + std::to_string(n++)), record.data(), record.size());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus folder>\n", argv[0]);
    return 2;
  }
  const fs::path corpus = argv[1];
  auto config = kvd::daemon::ParseConfigYaml(kvd::daemon::EmbeddedDefaultConfigYaml(), "default");
  if (!config.ok()) {
    std::fprintf(stderr, "default config: %s\n", config.status().ToString().c_str());
    return 1;
  }
  WriteMessages(corpus, *config);
  WriteCompactChunks(corpus);
  WriteGguf(corpus);
  WriteVectorCalibration(corpus);
  WriteDiskRecords(corpus);
  std::printf("seeds written under %s\n", corpus.c_str());
  return 0;
}
