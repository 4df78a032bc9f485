#include "methods.h"

#include <algorithm>
#include <cmath>

namespace kvd::quality {
namespace {

class FullMethod : public CompressionMethod {
 public:
  std::string name() const override { return "full"; }
  StatusOr<CompressedPrefix> Compress(const PrefixCapture& p, double) override {
    // kvd stores an uncompressed chunk as its raw bytes.
    return CompressedPrefix{
        .cache = CompactFromDense(p.cache, p.config->num_kv_heads, p.config->head_dim),
        .stored_bytes_fraction = 1.0};
  }
};

// Keeps the first `sinks` tokens and the most recent ones, same set in every (layer, head).
class SinkRecentMethod : public CompressionMethod {
 public:
  static constexpr int kSinks = 4;
  std::string name() const override { return "sink_recent"; }
  StatusOr<CompressedPrefix> Compress(const PrefixCapture& p, double p_c) override {
    if (!(p_c >= 0 && p_c < 1)) return Status::InvalidArgument("p_c must be in [0, 1)");
    const int N = p.cache.num_tokens;
    const int keep = std::clamp(static_cast<int>(std::lround(N * (1.0 - p_c))), 1, N);
    // A chunk that does not start the sequence (chunk-wise mode) has no sinks.
    const bool first = !p.cache.positions.empty() && p.cache.positions.front() == 0;
    const int sinks = first ? std::min(kSinks, keep) : 0;
    const int recent = keep - sinks;
    llama::CompactKvCache full =
        CompactFromDense(p.cache, p.config->num_kv_heads, p.config->head_dim);
    const int d = p.config->head_dim;
    for (auto& layer : full.layers) {
      for (auto& h : layer) {
        // Erase [sinks, N - recent).
        const int a = sinks, b = N - recent;
        h.k.erase(h.k.begin() + static_cast<ptrdiff_t>(a) * d,
                  h.k.begin() + static_cast<ptrdiff_t>(b) * d);
        h.v.erase(h.v.begin() + static_cast<ptrdiff_t>(a) * d,
                  h.v.begin() + static_cast<ptrdiff_t>(b) * d);
        h.bias.erase(h.bias.begin() + a, h.bias.begin() + b);
        h.num_slots = keep;
      }
    }
    return CompressedPrefix{std::move(full)};
  }
};

}  // namespace

MethodRegistry& MethodRegistry::Global() {
  static MethodRegistry* r = [] {
    auto* reg = new MethodRegistry();
    reg->Register("full",
                  []() -> StatusOr<std::unique_ptr<CompressionMethod>> {
                    return std::unique_ptr<CompressionMethod>(new FullMethod());
                  })
        .IgnoreError();
    reg->Register("sink_recent",
                  []() -> StatusOr<std::unique_ptr<CompressionMethod>> {
                    return std::unique_ptr<CompressionMethod>(new SinkRecentMethod());
                  })
        .IgnoreError();
    return reg;
  }();
  return *r;
}

Status MethodRegistry::Register(const std::string& name, MethodFactory factory) {
  if (factories_.count(name) != 0)
    return Status::AlreadyExists("method " + name + " is registered");
  factories_[name] = std::move(factory);
  return Status::Ok();
}

StatusOr<std::unique_ptr<CompressionMethod>> MethodRegistry::Create(const std::string& name) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    std::string known;
    for (const auto& [n, f] : factories_) known += (known.empty() ? "" : ", ") + n;
    return Status::NotFound("unknown method '" + name + "' (known: " + known + ")");
  }
  return it->second();
}

std::vector<std::string> MethodRegistry::Names() const {
  std::vector<std::string> out;
  for (const auto& [n, f] : factories_) out.push_back(n);
  return out;
}

llama::CompactKvCache CompactFromDense(const llama::DenseKvCache& c, int nkv, int d) {
  llama::CompactKvCache out;
  out.next_position = c.next_position;
  out.layers.resize(c.layers.size());
  for (size_t l = 0; l < c.layers.size(); ++l) {
    out.layers[l].resize(nkv);
    for (int h = 0; h < nkv; ++h) {
      llama::CompactHeadKv& hk = out.layers[l][h];
      hk.num_slots = c.num_tokens;
      hk.k.resize(static_cast<size_t>(c.num_tokens) * d);
      hk.v.resize(static_cast<size_t>(c.num_tokens) * d);
      hk.bias.assign(c.num_tokens, 0.0f);
      for (int t = 0; t < c.num_tokens; ++t) {
        const size_t src = (static_cast<size_t>(t) * nkv + h) * d;
        std::copy_n(&c.layers[l].k[src], d, &hk.k[static_cast<size_t>(t) * d]);
        std::copy_n(&c.layers[l].v[src], d, &hk.v[static_cast<size_t>(t) * d]);
      }
    }
  }
  return out;
}

double AchievedCompression(const llama::CompactKvCache& cache, int num_tokens) {
  double slots = 0, raw = 0;
  for (const auto& layer : cache.layers) {
    for (const auto& h : layer) {
      slots += h.num_slots;
      raw += num_tokens;
    }
  }
  return raw > 0 ? 1.0 - slots / raw : 0.0;
}

}  // namespace kvd::quality
