#include "kvd/llama/engine.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "parallel.h"

// OpenBLAS's thread control; weak so that another CBLAS still links (then BLAS threads are its
// own).
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));

namespace kvd::llama {
namespace {

// y[M, N] = x[M, K] * W[N, K]^T  (W row-major [out, in]). One row (decode) goes through sgemv:
// OpenBLAS's sgemm with M = 1 packs W like a full matrix product and is several times slower
// than the matrix-vector kernel on the same data (docs/benchmarks.md, reference engine decode).
void MatMulWt(const float* x, const float* w, float* y, int M, int N, int K) {
  if (M == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, w, K, x, 1, 0.0f, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);
}

void RmsNorm(const float* x, const float* w, float* out, int T, int dim, float eps) {
  for (int t = 0; t < T; ++t) {
    const float* xr = x + static_cast<size_t>(t) * dim;
    float* o = out + static_cast<size_t>(t) * dim;
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// In-place softmax of row[0, n) after adding bias (may be null); returns nothing.
void SoftmaxRow(float* row, const float* bias, int n) {
  if (bias != nullptr) {
    for (int j = 0; j < n; ++j) row[j] += bias[j];
  }
  float mx = -INFINITY;
  for (int j = 0; j < n; ++j) mx = std::max(mx, row[j]);
  double sum = 0;
  for (int j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int j = 0; j < n; ++j) row[j] *= inv;
}

}  // namespace

Status SessionOptions::Validate() const {
  if (threads < 0) return Status::InvalidArgument("threads must be >= 0");
  return Status::Ok();
}

LlamaSession::LlamaSession(const LlamaModel& model, SessionOptions options)
    : model_(model), cfg_(model.config()), options_(options) {
  threads_ = options_.threads > 0
                 ? options_.threads
                 : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(threads_);
  const int rot = cfg_.rope.rotary_dim > 0 ? cfg_.rope.rotary_dim : cfg_.head_dim;
  inv_freq_.resize(rot / 2);
  const auto& ff = model.rope_freq_factors();
  for (int i = 0; i < rot / 2; ++i) {
    double f = std::pow(cfg_.rope.theta, -2.0 * i / rot);
    if (!ff.empty()) f /= ff[i];
    if (cfg_.rope.scaling == RopeScaling::kLinear) f /= cfg_.rope.factor;
    inv_freq_[i] = f;
  }
  Reset();
}

void LlamaSession::Reset() {
  position_ = 0;
  dense_ = true;
  positions_.clear();
  cache_.assign(cfg_.num_layers, std::vector<HeadCache>(cfg_.num_kv_heads));
  captured_q_.clear();
  captured_att_.clear();
  captured_count_ = 0;
}

int LlamaSession::num_slots(int layer, int kv_head) const {
  return static_cast<int>(cache_[layer][kv_head].k.size() / cfg_.head_dim);
}

void LlamaSession::ApplyRope(float* x, int num_heads, int pos) const {
  const int d = cfg_.head_dim;
  const int half = static_cast<int>(inv_freq_.size());
  const bool interleaved = cfg_.rope.pairing == RopePairing::kInterleaved;
  for (int i = 0; i < half; ++i) {
    const double angle = pos * inv_freq_[i];
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    for (int h = 0; h < num_heads; ++h) {
      float* v = x + static_cast<size_t>(h) * d;
      const int a = interleaved ? 2 * i : i;
      const int b = interleaved ? 2 * i + 1 : i + half;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * c - x1 * s;
      v[b] = x0 * s + x1 * c;
    }
  }
}

Status LlamaSession::CheckTokens(std::span<const int32_t> tokens) const {
  if (tokens.empty()) return Status::InvalidArgument("Forward needs at least one token");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size) {
      return Status::InvalidArgument("token " + std::to_string(i) + " has id " +
                                     std::to_string(tokens[i]) + " outside the vocabulary of " +
                                     std::to_string(cfg_.vocab_size));
    }
  }
  if (static_cast<int64_t>(position_) + static_cast<int64_t>(tokens.size()) > cfg_.context_length) {
    return Status::OutOfRange(std::to_string(tokens.size()) + " tokens at position " +
                              std::to_string(position_) + " exceed the model's context length " +
                              std::to_string(cfg_.context_length));
  }
  return Status::Ok();
}

void LlamaSession::Attention(int layer, const float* q, int T, float* out) {
  const int d = cfg_.head_dim, nq = cfg_.num_q_heads, group = nq / cfg_.num_kv_heads;
  const int qd = nq * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<HeadCache>& heads = cache_[layer];
  if (T < 8) {
    // Decode: one (query head, token) pair per task.
    internal::ParallelFor(nq * T, threads_, [&](int task) {
      const int h = task % nq, t = task / nq;
      const HeadCache& hc = heads[h / group];
      const int S = static_cast<int>(hc.k.size() / d);
      const int visible = S - T + t + 1;
      const float* qv = q + static_cast<size_t>(t) * qd + static_cast<size_t>(h) * d;
      std::vector<float> p(visible);
      for (int j = 0; j < visible; ++j) {
        const float* kv = hc.k.data() + static_cast<size_t>(j) * d;
        float s = 0;
        for (int i = 0; i < d; ++i) s += qv[i] * kv[i];
        p[j] = s * scale;
      }
      SoftmaxRow(p.data(), hc.bias.empty() ? nullptr : hc.bias.data(), visible);
      float* o = out + static_cast<size_t>(t) * qd + static_cast<size_t>(h) * d;
      std::fill(o, o + d, 0.0f);
      for (int j = 0; j < visible; ++j) {
        const float* vv = hc.v.data() + static_cast<size_t>(j) * d;
        const float pj = p[j];
        for (int i = 0; i < d; ++i) o[i] += pj * vv[i];
      }
    });
    return;
  }
  // Prefill: per query head and block of query rows, scores = Q_h K^T through sgemm over the
  // keys the block can see (causal), softmax, then P V. Blocks skip most of the masked triangle.
  constexpr int kRowBlock = 256;
  std::vector<float> scores;
  for (int h = 0; h < nq; ++h) {
    const HeadCache& hc = heads[h / group];
    const int S = static_cast<int>(hc.k.size() / d);
    const int past = S - T;
    for (int t0 = 0; t0 < T; t0 += kRowBlock) {
      const int rows = std::min(kRowBlock, T - t0);
      const int cols = past + t0 + rows;  // keys visible to the block's last row
      scores.resize(static_cast<size_t>(rows) * cols);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d, scale,
                  q + static_cast<size_t>(t0) * qd + static_cast<size_t>(h) * d, qd, hc.k.data(), d,
                  0.0f, scores.data(), cols);
      internal::ParallelFor(rows, threads_, [&](int r) {
        float* row = scores.data() + static_cast<size_t>(r) * cols;
        const int visible = past + t0 + r + 1;
        SoftmaxRow(row, hc.bias.empty() ? nullptr : hc.bias.data(), visible);
        std::fill(row + visible, row + cols, 0.0f);
      });
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, cols, 1.0f, scores.data(),
                  cols, hc.v.data(), d, 0.0f,
                  out + static_cast<size_t>(t0) * qd + static_cast<size_t>(h) * d, qd);
    }
  }
}

StatusOr<std::vector<float>> LlamaSession::Forward(std::span<const int32_t> tokens,
                                                   ForwardOptions opts) {
  KVD_RETURN_IF_ERROR(CheckTokens(tokens));
  if (opts.capture_queries < 0) return Status::InvalidArgument("capture_queries must be >= 0");
  const int T = static_cast<int>(tokens.size());
  const int dim = cfg_.dim, d = cfg_.head_dim, hid = cfg_.hidden_dim;
  const int nq = cfg_.num_q_heads, nkv = cfg_.num_kv_heads;
  const int qd = nq * d, kvd = nkv * d;
  const size_t Tz = static_cast<size_t>(T);

  std::vector<float> x(Tz * dim), xn(Tz * dim), q(Tz * qd), k(Tz * kvd), v(Tz * kvd), att(Tz * qd),
      tmp(Tz * dim), gate(Tz * hid), up(Tz * hid);
  const std::vector<float>& emb = model_.token_embedding();
  for (int t = 0; t < T; ++t) {
    std::memcpy(&x[t * static_cast<size_t>(dim)], &emb[static_cast<size_t>(tokens[t]) * dim],
                dim * sizeof(float));
  }
  const int W = std::min(opts.capture_queries, T);
  captured_count_ = W;
  captured_q_.assign(W > 0 ? cfg_.num_layers : 0, {});
  captured_att_.assign(opts.capture_attention ? cfg_.num_layers : 0, {});

  for (int l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& w = model_.layers()[l];
    RmsNorm(x.data(), w.attn_norm.data(), xn.data(), T, dim, cfg_.norm_eps);
    MatMulWt(xn.data(), w.wq.data(), q.data(), T, qd, dim);
    MatMulWt(xn.data(), w.wk.data(), k.data(), T, kvd, dim);
    MatMulWt(xn.data(), w.wv.data(), v.data(), T, kvd, dim);
    internal::ParallelFor(T, threads_, [&](int t) {
      ApplyRope(&q[t * static_cast<size_t>(qd)], nq, position_ + t);
      ApplyRope(&k[t * static_cast<size_t>(kvd)], nkv, position_ + t);
    });
    for (int h = 0; h < nkv; ++h) {
      HeadCache& hc = cache_[l][h];
      for (int t = 0; t < T; ++t) {
        const float* kr = &k[t * static_cast<size_t>(kvd) + static_cast<size_t>(h) * d];
        const float* vr = &v[t * static_cast<size_t>(kvd) + static_cast<size_t>(h) * d];
        hc.k.insert(hc.k.end(), kr, kr + d);
        hc.v.insert(hc.v.end(), vr, vr + d);
      }
      if (!hc.bias.empty()) hc.bias.resize(hc.bias.size() + T, 0.0f);
    }
    if (W > 0) captured_q_[l].assign(q.end() - static_cast<ptrdiff_t>(W) * qd, q.end());
    Attention(l, q.data(), T, att.data());
    if (opts.capture_attention) captured_att_[l] = att;
    MatMulWt(att.data(), w.wo.data(), tmp.data(), T, dim, qd);
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];

    RmsNorm(x.data(), w.ffn_norm.data(), xn.data(), T, dim, cfg_.norm_eps);
    MatMulWt(xn.data(), w.w_gate.data(), gate.data(), T, hid, dim);
    MatMulWt(xn.data(), w.w_up.data(), up.data(), T, hid, dim);
    for (size_t i = 0; i < gate.size(); ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];  // SwiGLU: silu(gate) * up
    }
    MatMulWt(gate.data(), w.w_down.data(), tmp.data(), T, dim, hid);
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
  }
  if (dense_) {
    for (int t = 0; t < T; ++t) positions_.push_back(position_ + t);
  }
  position_ += T;

  const int rows = opts.all_logits ? T : 1;
  const float* last = x.data() + (opts.all_logits ? 0 : (Tz - 1) * dim);
  RmsNorm(last, model_.output_norm().data(), xn.data(), rows, dim, cfg_.norm_eps);
  std::vector<float> logits(static_cast<size_t>(rows) * cfg_.vocab_size);
  MatMulWt(xn.data(), model_.output().data(), logits.data(), rows, cfg_.vocab_size, dim);
  return logits;
}

StatusOr<DenseKvCache> LlamaSession::ExportDense() const {
  if (!dense_) {
    return Status::FailedPrecondition("the session holds a compact cache; it has no dense form");
  }
  DenseKvCache c;
  c.num_tokens = static_cast<int>(positions_.size());
  c.positions = positions_;
  c.next_position = position_;
  c.layers.resize(cfg_.num_layers);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    c.layers[l].k = LayerKeys(l);
    c.layers[l].v = LayerValues(l);
  }
  return c;
}

std::vector<float> LlamaSession::InterleaveHeads(const std::vector<HeadCache>& heads,
                                                 int num_tokens, int d,
                                                 std::vector<float> HeadCache::*rows) {
  const int nkv = static_cast<int>(heads.size());
  std::vector<float> out(static_cast<size_t>(num_tokens) * nkv * d);
  for (int h = 0; h < nkv; ++h) {
    const std::vector<float>& src = heads[h].*rows;
    for (int t = 0; t < num_tokens; ++t) {
      std::memcpy(&out[(static_cast<size_t>(t) * nkv + h) * d], &src[static_cast<size_t>(t) * d],
                  d * sizeof(float));
    }
  }
  return out;
}

std::vector<float> LlamaSession::LayerKeys(int layer) const {
  if (!dense_) return {};
  return InterleaveHeads(cache_[layer], num_slots(layer, 0), cfg_.head_dim, &HeadCache::k);
}

std::vector<float> LlamaSession::LayerValues(int layer) const {
  if (!dense_) return {};
  return InterleaveHeads(cache_[layer], num_slots(layer, 0), cfg_.head_dim, &HeadCache::v);
}

Status LlamaSession::LoadDense(const DenseKvCache& cache) {
  KVD_RETURN_IF_ERROR(cache.Validate(cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim));
  if (cache.next_position > cfg_.context_length) {
    return Status::OutOfRange("dense cache next_position " + std::to_string(cache.next_position) +
                              " exceeds the context length " + std::to_string(cfg_.context_length));
  }
  Reset();
  const int d = cfg_.head_dim, nkv = cfg_.num_kv_heads, N = cache.num_tokens;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (int h = 0; h < nkv; ++h) {
      HeadCache& hc = cache_[l][h];
      hc.k.resize(static_cast<size_t>(N) * d);
      hc.v.resize(static_cast<size_t>(N) * d);
      for (int t = 0; t < N; ++t) {
        const size_t src = (static_cast<size_t>(t) * nkv + h) * d;
        std::memcpy(&hc.k[static_cast<size_t>(t) * d], &cache.layers[l].k[src], d * sizeof(float));
        std::memcpy(&hc.v[static_cast<size_t>(t) * d], &cache.layers[l].v[src], d * sizeof(float));
      }
    }
  }
  positions_ = cache.positions;
  position_ = cache.next_position;
  return Status::Ok();
}

Status LlamaSession::LoadCompact(const CompactKvCache& cache) {
  KVD_RETURN_IF_ERROR(cache.Validate(cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim));
  if (cache.next_position > cfg_.context_length) {
    return Status::OutOfRange("compact cache next_position " + std::to_string(cache.next_position) +
                              " exceeds the context length " + std::to_string(cfg_.context_length));
  }
  Reset();
  dense_ = false;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (int h = 0; h < cfg_.num_kv_heads; ++h) {
      const CompactHeadKv& src = cache.layers[l][h];
      HeadCache& hc = cache_[l][h];
      hc.k = src.k;
      hc.v = src.v;
      hc.bias = src.bias;
      // An empty bias vector means "all zero" internally; keep it non-empty so new tokens append
      // zeros consistently.
    }
  }
  position_ = cache.next_position;
  return Status::Ok();
}

int32_t Argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

double NegLogLikelihood(std::span<const float> logits, int32_t target) {
  double mx = -INFINITY;
  for (float v : logits) mx = std::max(mx, static_cast<double>(v));
  double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  return std::log(sum) + mx - static_cast<double>(logits[target]);
}

}  // namespace kvd::llama
