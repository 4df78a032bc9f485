// VECTOR public entries: validation, backend dispatch, calibration solve, serialisation.
// Routing lives in vector_routing.cc.
#include "kvd/kernels/vector.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "byte_io.h"
#include "cpu/blas.h"
#include "kvd/common/hash.h"
#include "vector_backend.h"

namespace kvd::kernels {
namespace {

constexpr uint32_t kCalibrationMagic = 0x41435656;  // "VVCA" little-endian: VECTOR accumulators
constexpr uint32_t kWeightsMagic = 0x57565656;      // "VVVW" little-endian: VECTOR weights
// Accumulators: version 1 had no key sums, version 2 (written now) adds them.
constexpr uint16_t kCalibrationVersion = 2;
// Weights: version 1 = linear W (written for linear weights), version 2 = W plus an intercept.
constexpr uint16_t kWeightsVersionLinear = 1;
constexpr uint16_t kWeightsVersionAffine = 2;
constexpr int kMaxCalibrationHeadDim = 1024;

std::string HeadName(int layer, int head) {
  return "layer " + std::to_string(layer) + " head " + std::to_string(head);
}

template <typename T>
bool AllFinite(const std::vector<T>& values) {
  return std::all_of(values.begin(), values.end(), [](T x) { return std::isfinite(x); });
}

Status CheckView(ConstMatrixView m, int64_t rows, int64_t cols, const char* what) {
  if (m.rows != rows || m.cols != cols) {
    return Status::InvalidArgument(std::string(what) + ": shape [" + std::to_string(m.rows) + ", " +
                                   std::to_string(m.cols) + "], expected [" + std::to_string(rows) +
                                   ", " + std::to_string(cols) + "]");
  }
  if (m.ld < m.cols) return Status::InvalidArgument(std::string(what) + ": ld < cols");
  if (m.rows > 0 && m.data == nullptr) {
    return Status::InvalidArgument(std::string(what) + ": null data");
  }
  return Status::Ok();
}

// Appends the checksum trailer: xxh3-64 of every byte before it.
void AppendChecksum(std::vector<uint8_t>* out) {
  const uint64_t sum = Checksum64(out->data(), out->size());
  internal::ByteWriter(out).Put(sum);
}

// Common prefix check of both formats: size, magic, version in [1, max_version], checksum.
Status CheckEnvelope(std::span<const uint8_t> bytes, uint32_t magic, const char* what,
                     uint16_t max_version) {
  constexpr size_t kMin = 4 + 2 + 2 + 8;
  if (bytes.size() < kMin) {
    return Status::DataLoss(std::string(what) + ": truncated (" + std::to_string(bytes.size()) +
                            " bytes)");
  }
  uint32_t got_magic;
  uint16_t version;
  std::memcpy(&got_magic, bytes.data(), 4);
  std::memcpy(&version, bytes.data() + 4, 2);
  if (got_magic != magic) return Status::InvalidArgument(std::string(what) + ": bad magic");
  if (version < 1 || version > max_version) {
    return Status::InvalidArgument(std::string(what) + ": unsupported version " +
                                   std::to_string(version));
  }
  uint64_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 8, 8);
  if (Checksum64(bytes.data(), bytes.size() - 8) != stored) {
    return Status::DataLoss(std::string(what) + ": checksum mismatch");
  }
  return Status::Ok();
}

// In-place Cholesky A = L L^T (lower triangle of `a` [d, d] overwritten by L). Returns the index
// of the first pivot <= tol, or -1 when A is positive definite.
int Cholesky(std::vector<double>* a, int d, double tol) {
  double* m = a->data();
  for (int j = 0; j < d; ++j) {
    double diag = m[j * d + j];
    for (int k = 0; k < j; ++k) diag -= m[j * d + k] * m[j * d + k];
    if (!(diag > tol)) return j;
    const double ljj = std::sqrt(diag);
    m[j * d + j] = ljj;
    for (int i = j + 1; i < d; ++i) {
      double s = m[i * d + j];
      for (int k = 0; k < j; ++k) s -= m[i * d + k] * m[j * d + k];
      m[i * d + j] = s / ljj;
    }
  }
  return -1;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Status VectorSolveOptions::Validate() const {
  if (!std::isfinite(ridge) || ridge < 0.0) {
    return Status::InvalidArgument("VectorSolveOptions.ridge must be finite and >= 0, got " +
                                   std::to_string(ridge));
  }
  if (min_tokens < 1) return Status::InvalidArgument("VectorSolveOptions.min_tokens must be >= 1");
  return Status::Ok();
}

VectorCalibrator::VectorCalibrator(int num_layers, int num_kv_heads, int head_dim)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {
  const size_t dd = static_cast<size_t>(head_dim) * head_dim;
  heads_.resize(static_cast<size_t>(num_layers) * num_kv_heads);
  for (VectorHeadStats& h : heads_) {
    h.gram.assign(dd, 0.0);
    h.cross.assign(dd, 0.0);
    h.value_sum.assign(static_cast<size_t>(head_dim), 0.0);
    h.key_sum.assign(static_cast<size_t>(head_dim), 0.0);
  }
}

StatusOr<VectorCalibrator> VectorCalibrator::Create(int num_layers, int num_kv_heads,
                                                    int head_dim) {
  if (num_layers < 1 || num_kv_heads < 1) {
    return Status::InvalidArgument("VectorCalibrator: num_layers and num_kv_heads must be >= 1");
  }
  if (head_dim < 1 || head_dim > kMaxCalibrationHeadDim) {
    return Status::InvalidArgument("VectorCalibrator: head_dim " + std::to_string(head_dim) +
                                   " not in [1, 1024]");
  }
  return VectorCalibrator(num_layers, num_kv_heads, head_dim);
}

Status VectorCalibrator::Add(int layer, int head, ConstMatrixView kpre, ConstMatrixView values,
                             const ExecOptions& exec) {
  if (layer < 0 || layer >= num_layers_ || head < 0 || head >= num_kv_heads_) {
    return Status::InvalidArgument("VectorCalibrator::Add: " + HeadName(layer, head) +
                                   " out of range");
  }
  KVD_RETURN_IF_ERROR(CheckView(kpre, kpre.rows, head_dim_, "kpre"));
  KVD_RETURN_IF_ERROR(CheckView(values, kpre.rows, head_dim_, "values"));
  KVD_RETURN_IF_ERROR(CheckFinite(kpre, "kpre"));
  KVD_RETURN_IF_ERROR(CheckFinite(values, "values"));
  VectorHeadStats* stats = &heads_[layer * num_kv_heads_ + head];
  if (exec.backend == Backend::kCuda) {
#ifdef KVD_HAVE_CUDA
    KVD_RETURN_IF_ERROR(CudaBackendReady("VectorCalibrator::Add"));
    KVD_RETURN_IF_ERROR(cuda::AccumulateVectorStats(kpre, values, stats, exec.cuda_stream));
#else
    return CudaBackendReady("VectorCalibrator::Add");
#endif
  } else {
    cpu::AccumulateVectorStats(kpre, values, stats);
  }
  // Key sums (host float64, both backends: the views are host memory): O(n d), for the affine
  // solve.
  for (int64_t i = 0; i < kpre.rows; ++i) {
    const float* k = kpre.Row(i);
    for (int c = 0; c < head_dim_; ++c) stats->key_sum[c] += k[c];
  }
  return Status::Ok();
}

Status VectorCalibrator::Merge(const VectorCalibrator& other) {
  if (other.num_layers_ != num_layers_ || other.num_kv_heads_ != num_kv_heads_ ||
      other.head_dim_ != head_dim_) {
    return Status::FailedPrecondition("VectorCalibrator::Merge: shape mismatch");
  }
  for (size_t i = 0; i < heads_.size(); ++i) {
    VectorHeadStats& a = heads_[i];
    const VectorHeadStats& b = other.heads_[i];
    for (size_t j = 0; j < a.gram.size(); ++j) a.gram[j] += b.gram[j];
    for (size_t j = 0; j < a.cross.size(); ++j) a.cross[j] += b.cross[j];
    for (size_t j = 0; j < a.value_sum.size(); ++j) a.value_sum[j] += b.value_sum[j];
    for (size_t j = 0; j < a.key_sum.size(); ++j) a.key_sum[j] += b.key_sum[j];
    a.value_sq_sum += b.value_sq_sum;
    a.count += b.count;
  }
  key_sums_known_ = key_sums_known_ && other.key_sums_known_;
  return Status::Ok();
}

namespace {

// Solves L L^T B = B in place, column by column (forward then backward substitution); `l` holds
// the Cholesky factor in its lower triangle (Cholesky above), b is [d, d] row-major.
void CholeskySolveColumns(const std::vector<double>& l, int d, std::vector<double>* b) {
  std::vector<double>& x = *b;
  for (int c = 0; c < d; ++c) {
    for (int i = 0; i < d; ++i) {
      double v = x[i * d + c];
      for (int k = 0; k < i; ++k) v -= l[i * d + k] * x[k * d + c];
      x[i * d + c] = v / l[i * d + i];
    }
    for (int i = d - 1; i >= 0; --i) {
      double v = x[i * d + c];
      for (int k = i + 1; k < d; ++k) v -= l[k * d + i] * x[k * d + c];
      x[i * d + c] = v / l[i * d + i];
    }
  }
}

// The [d, d] float64 scratch of one head's solve, reused over the heads.
struct SolveScratch {
  explicit SolveScratch(int d)
      : a(static_cast<size_t>(d) * d), b(a.size()), gb(a.size()), gram(a.size()), cross(a.size()) {}
  std::vector<double> a;      // G + ridge I, then its Cholesky factor
  std::vector<double> b;      // B = W^T = (G + ridge I)^-1 C
  std::vector<double> gb;     // G B
  std::vector<double> gram;   // G (centred for the affine fit)
  std::vector<double> cross;  // C (centred for the affine fit)
};

// The fit of one head from its accumulators: W (and the bias when affine) and R^2.
Status SolveHead(const VectorHeadStats& s, const VectorSolveOptions& options, int d,
                 const std::string& name, SolveScratch* w, VectorHeadFit* fit) {
  const double n = static_cast<double>(s.count);
  w->gram = s.gram;
  w->cross = s.cross;
  double mean_sq = 0.0;
  for (int c = 0; c < d; ++c) mean_sq += s.value_sum[c] * s.value_sum[c];
  const double sst = s.value_sq_sum - mean_sq / n;
  // Explained part of SSE = S_vv - 2 tr(B^T C) + tr(B^T G B); centred: SST - 2 tr(B^T Cc) + ...
  double s_vv = s.value_sq_sum;
  if (options.affine) {
    for (int r = 0; r < d; ++r) {
      for (int c = 0; c < d; ++c) {
        w->gram[r * d + c] -= s.key_sum[r] * s.key_sum[c] / n;
        w->cross[r * d + c] -= s.key_sum[r] * s.value_sum[c] / n;
      }
    }
    s_vv = sst;
  }
  double trace = 0.0;
  double max_diag = 0.0;
  for (int i = 0; i < d; ++i) {
    trace += w->gram[i * d + i];
    max_diag = std::max(max_diag, w->gram[i * d + i]);
  }
  const double ridge = options.ridge_relative ? options.ridge * trace / d : options.ridge;
  w->a = w->gram;
  for (int i = 0; i < d; ++i) w->a[i * d + i] += ridge;
  // A pivot this small relative to the largest diagonal is a rank deficiency up to rounding
  // (d * 2^-52 ~ 3e-14 for d = 128), not information.
  const double tol = 1e-12 * std::max(max_diag + ridge, 1e-300);
  const int bad = Cholesky(&w->a, d, tol);
  if (bad >= 0) {
    return Status::FailedPrecondition("VECTOR solve: Gram of " + name + " is singular (pivot " +
                                      std::to_string(bad) +
                                      "); add a ridge or more diverse tokens");
  }
  w->b = w->cross;
  CholeskySolveColumns(w->a, d, &w->b);
  const std::vector<double>& b = w->b;
  // R^2 from the accumulators: SSE = S_vv - 2 tr(B^T C) + tr(B^T G B).
  cpu::Cblas().dsymm(CblasRowMajor, CblasLeft, CblasUpper, d, d, 1.0, w->gram.data(), d, b.data(),
                     d, 0.0, w->gb.data(), d);
  double tr_bc = 0.0;
  double tr_bgb = 0.0;
  for (size_t j = 0; j < b.size(); ++j) {
    tr_bc += b[j] * w->cross[j];
    tr_bgb += b[j] * w->gb[j];
  }
  const double sse = std::max(0.0, s_vv - 2.0 * tr_bc + tr_bgb);
  fit->count = s.count;
  if (sst > 1e-12 * std::max(s.value_sq_sum, 1e-300)) {
    fit->r2 = 1.0 - sse / sst;
  } else {
    fit->r2 = sse <= 1e-12 * std::max(s.value_sq_sum, 1e-300) ? 1.0 : 0.0;
  }
  fit->w = Matrix(d, d);
  for (int r = 0; r < d; ++r) {
    for (int c = 0; c < d; ++c) fit->w.values[r * d + c] = static_cast<float>(b[c * d + r]);
  }
  if (options.affine) {
    // b = (s_v - W s_k) / n with the float64 W.
    fit->bias.resize(static_cast<size_t>(d));
    for (int r = 0; r < d; ++r) {
      double wk = 0.0;
      for (int c = 0; c < d; ++c) wk += b[c * d + r] * s.key_sum[c];
      fit->bias[r] = static_cast<float>((s.value_sum[r] - wk) / n);
    }
  }
  if (!AllFinite(fit->w.values) || !AllFinite(fit->bias) || !std::isfinite(fit->r2)) {
    return Status::FailedPrecondition("VECTOR solve: the fit of " + name +
                                      " is not finite in float32 (accumulators out of range)");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<VectorWeights> VectorCalibrator::Solve(const VectorSolveOptions& options) const {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (options.affine && !key_sums_known_) {
    return Status::FailedPrecondition(
        "VECTOR solve: the affine fit needs key sums, which accumulators restored from format "
        "version 1 lack; recalibrate");
  }
  VectorWeights out;
  out.num_layers = num_layers_;
  out.num_kv_heads = num_kv_heads_;
  out.head_dim = head_dim_;
  out.heads.resize(heads_.size());
  SolveScratch scratch(head_dim_);
  for (size_t idx = 0; idx < heads_.size(); ++idx) {
    const std::string name =
        HeadName(static_cast<int>(idx) / num_kv_heads_, static_cast<int>(idx) % num_kv_heads_);
    const VectorHeadStats& s = heads_[idx];
    if (s.count < options.min_tokens) {
      return Status::FailedPrecondition("VECTOR solve: " + name + " has " +
                                        std::to_string(s.count) + " tokens, needs " +
                                        std::to_string(options.min_tokens));
    }
    KVD_RETURN_IF_ERROR(SolveHead(s, options, head_dim_, name, &scratch, &out.heads[idx]));
  }
  out.version = out.ComputeVersion();
  return out;
}

std::vector<uint8_t> VectorCalibrator::Serialize() const {
  std::vector<uint8_t> out;
  internal::ByteWriter w(&out);
  w.Put(kCalibrationMagic);
  w.Put(kCalibrationVersion);
  w.Put(uint16_t{0});
  w.Put(static_cast<uint32_t>(num_layers_));
  w.Put(static_cast<uint32_t>(num_kv_heads_));
  w.Put(static_cast<uint32_t>(head_dim_));
  w.Put(uint32_t{0});
  for (const VectorHeadStats& h : heads_) {
    w.Put(h.count);
    w.Put(h.value_sq_sum);
    w.PutBytes(h.value_sum.data(), h.value_sum.size() * 8);
    w.PutBytes(h.key_sum.data(), h.key_sum.size() * 8);
    w.PutBytes(h.gram.data(), h.gram.size() * 8);
    w.PutBytes(h.cross.data(), h.cross.size() * 8);
  }
  AppendChecksum(&out);
  return out;
}

StatusOr<VectorCalibrator> VectorCalibrator::Deserialize(std::span<const uint8_t> bytes) {
  KVD_RETURN_IF_ERROR(
      CheckEnvelope(bytes, kCalibrationMagic, "VECTOR calibration", kCalibrationVersion));
  internal::ByteReader r(bytes.first(bytes.size() - 8));
  uint32_t magic, layers, heads, d, reserved32;
  uint16_t version, reserved16;
  r.Get(&magic), r.Get(&version), r.Get(&reserved16);
  r.Get(&layers), r.Get(&heads), r.Get(&d), r.Get(&reserved32);
  if (r.failed()) return Status::DataLoss("VECTOR calibration: truncated header");
  if (layers < 1 || heads < 1 || d < 1 || d > kMaxCalibrationHeadDim || layers > 4096 ||
      heads > 4096) {
    return Status::DataLoss("VECTOR calibration: implausible shape in header");
  }
  const bool with_key_sums = version >= 2;
  const uint64_t per_head = 16 + (with_key_sums ? 16ull : 8ull) * d + 16ull * d * d;
  if (r.remaining() != per_head * layers * heads) {
    return Status::DataLoss("VECTOR calibration: body size " + std::to_string(r.remaining()) +
                            " does not match the header shape");
  }
  VectorCalibrator cal(static_cast<int>(layers), static_cast<int>(heads), static_cast<int>(d));
  cal.key_sums_known_ = with_key_sums;
  for (VectorHeadStats& h : cal.heads_) {
    r.Get(&h.count);
    r.Get(&h.value_sq_sum);
    r.GetBytes(h.value_sum.data(), h.value_sum.size() * 8);
    if (with_key_sums) r.GetBytes(h.key_sum.data(), h.key_sum.size() * 8);
    r.GetBytes(h.gram.data(), h.gram.size() * 8);
    r.GetBytes(h.cross.data(), h.cross.size() * 8);
    if (h.count < 0) return Status::DataLoss("VECTOR calibration: negative token count");
    // Add() refuses NaN/Inf and float32 products cannot overflow float64 sums.
    if (!std::isfinite(h.value_sq_sum) || !AllFinite(h.value_sum) || !AllFinite(h.key_sum) ||
        !AllFinite(h.gram) || !AllFinite(h.cross)) {
      return Status::DataLoss("VECTOR calibration: non-finite accumulator");
    }
  }
  if (r.failed()) return Status::DataLoss("VECTOR calibration: truncated body");
  return cal;
}

// ---------------------------------------------------------------------------------------------

uint64_t VectorWeights::ComputeVersion() const {
  Checksum64Stream stream;
  for (const VectorHeadFit& h : heads) {
    stream.Update(h.w.values.data(), h.w.values.size() * sizeof(float));
    if (!h.bias.empty()) stream.Update(h.bias.data(), h.bias.size() * sizeof(float));
  }
  return stream.Digest();
}

bool VectorWeights::affine() const {
  if (heads.empty()) return false;
  for (const VectorHeadFit& h : heads) {
    if (h.bias.size() != static_cast<size_t>(head_dim)) return false;
  }
  return true;
}

std::vector<uint8_t> VectorWeights::Serialize() const {
  std::vector<uint8_t> out;
  internal::ByteWriter w(&out);
  const bool with_bias = affine();
  w.Put(kWeightsMagic);
  w.Put(with_bias ? kWeightsVersionAffine : kWeightsVersionLinear);
  w.Put(uint16_t{0});
  w.Put(static_cast<uint32_t>(num_layers));
  w.Put(static_cast<uint32_t>(num_kv_heads));
  w.Put(static_cast<uint32_t>(head_dim));
  w.Put(uint32_t{0});
  w.Put(version);
  for (const VectorHeadFit& h : heads) {
    w.Put(h.count);
    w.Put(h.r2);
    w.PutBytes(h.w.values.data(), h.w.values.size() * sizeof(float));
    if (with_bias) w.PutBytes(h.bias.data(), h.bias.size() * sizeof(float));
  }
  AppendChecksum(&out);
  return out;
}

StatusOr<VectorWeights> VectorWeights::Deserialize(std::span<const uint8_t> bytes) {
  KVD_RETURN_IF_ERROR(CheckEnvelope(bytes, kWeightsMagic, "VECTOR weights", kWeightsVersionAffine));
  internal::ByteReader r(bytes.first(bytes.size() - 8));
  uint32_t magic, layers, heads, d, reserved32;
  uint16_t version, reserved16;
  VectorWeights out;
  r.Get(&magic), r.Get(&version), r.Get(&reserved16);
  r.Get(&layers), r.Get(&heads), r.Get(&d), r.Get(&reserved32), r.Get(&out.version);
  if (r.failed()) return Status::DataLoss("VECTOR weights: truncated header");
  if (layers < 1 || heads < 1 || d < 1 || d > kMaxCalibrationHeadDim || layers > 4096 ||
      heads > 4096) {
    return Status::DataLoss("VECTOR weights: implausible shape in header");
  }
  const bool with_bias = version == kWeightsVersionAffine;
  const uint64_t per_head = 16 + 4ull * d * d + (with_bias ? 4ull * d : 0ull);
  if (r.remaining() != per_head * layers * heads) {
    return Status::DataLoss("VECTOR weights: body size does not match the header shape");
  }
  out.num_layers = static_cast<int>(layers);
  out.num_kv_heads = static_cast<int>(heads);
  out.head_dim = static_cast<int>(d);
  out.heads.resize(static_cast<size_t>(layers) * heads);
  for (size_t idx = 0; idx < out.heads.size(); ++idx) {
    VectorHeadFit& h = out.heads[idx];
    r.Get(&h.count);
    r.Get(&h.r2);
    h.w = Matrix(d, d);
    r.GetBytes(h.w.values.data(), h.w.values.size() * sizeof(float));
    if (with_bias) {
      h.bias.resize(d);
      r.GetBytes(h.bias.data(), h.bias.size() * sizeof(float));
    }
    if (r.failed()) break;
    const std::string head = HeadName(static_cast<int>(idx / heads), static_cast<int>(idx % heads));
    if (h.count < 0) return Status::DataLoss("VECTOR weights: negative token count in " + head);
    // Solve never writes these: a W (or b) entry that is not finite would make every rebuild of
    // a routed value fail at serve time instead of calibrating again.
    if (!AllFinite(h.w.values) || !AllFinite(h.bias)) {
      return Status::DataLoss("VECTOR weights: non-finite W or bias entry in " + head);
    }
    if (!std::isfinite(h.r2)) return Status::DataLoss("VECTOR weights: non-finite R^2 in " + head);
  }
  if (r.failed()) return Status::DataLoss("VECTOR weights: truncated body");
  if (out.ComputeVersion() != out.version) {
    return Status::DataLoss("VECTOR weights: version digest does not match the W bytes");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                       std::span<float> residuals, const ExecOptions& exec) {
  const int64_t d = kpre.cols;
  if (d < 1) return Status::InvalidArgument("VectorResiduals: head_dim must be >= 1");
  KVD_RETURN_IF_ERROR(CheckView(w, d, d, "w"));
  KVD_RETURN_IF_ERROR(CheckView(kpre, kpre.rows, d, "kpre"));
  KVD_RETURN_IF_ERROR(CheckView(values, kpre.rows, d, "values"));
  if (static_cast<int64_t>(residuals.size()) != kpre.rows) {
    return Status::InvalidArgument("VectorResiduals: residuals has " +
                                   std::to_string(residuals.size()) + " entries, expected " +
                                   std::to_string(kpre.rows));
  }
  KVD_RETURN_IF_ERROR(CheckFinite(kpre, "kpre"));
  KVD_RETURN_IF_ERROR(CheckFinite(values, "values"));
  KVD_RETURN_IF_ERROR(CheckFinite(w, "w"));
  if (kpre.rows == 0) return Status::Ok();
  if (exec.backend == Backend::kCuda) {
#ifdef KVD_HAVE_CUDA
    KVD_RETURN_IF_ERROR(CudaBackendReady("VectorResiduals"));
    return cuda::VectorResiduals(kpre, values, w, residuals.data(), exec.cuda_stream);
#else
    return CudaBackendReady("VectorResiduals");
#endif
  }
  cpu::VectorResiduals(kpre, values, w, residuals.data());
  return Status::Ok();
}

Status RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out,
                     const ExecOptions& exec) {
  const int64_t d = kpre.cols;
  if (d < 1) return Status::InvalidArgument("RebuildValues: head_dim must be >= 1");
  KVD_RETURN_IF_ERROR(CheckView(w, d, d, "w"));
  KVD_RETURN_IF_ERROR(CheckView(kpre, kpre.rows, d, "kpre"));
  KVD_RETURN_IF_ERROR(CheckView(out, kpre.rows, d, "out"));
  KVD_RETURN_IF_ERROR(CheckFinite(kpre, "kpre"));
  KVD_RETURN_IF_ERROR(CheckFinite(w, "w"));
  if (kpre.rows == 0) return Status::Ok();
  if (exec.backend == Backend::kCuda) {
#ifdef KVD_HAVE_CUDA
    KVD_RETURN_IF_ERROR(CudaBackendReady("RebuildValues"));
    return cuda::RebuildValues(kpre, w, out, exec.cuda_stream);
#else
    return CudaBackendReady("RebuildValues");
#endif
  }
  cpu::RebuildValues(kpre, w, out);
  return Status::Ok();
}

namespace {

Status CheckBias(const VectorHeadFit& fit, int64_t d, const char* op) {
  if (!fit.bias.empty() && static_cast<int64_t>(fit.bias.size()) != d) {
    return Status::InvalidArgument(std::string(op) + ": bias has " +
                                   std::to_string(fit.bias.size()) + " entries, expected 0 or " +
                                   std::to_string(d));
  }
  for (float b : fit.bias) {
    if (!std::isfinite(b)) return Status::InvalidArgument(std::string(op) + ": non-finite bias");
  }
  return Status::Ok();
}

}  // namespace

Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, const VectorHeadFit& fit,
                       std::span<float> residuals, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(CheckBias(fit, kpre.cols, "VectorResiduals"));
  if (fit.bias.empty()) return VectorResiduals(kpre, values, fit.w.View(), residuals, exec);
  KVD_RETURN_IF_ERROR(CheckView(values, kpre.rows, kpre.cols, "values"));
  // |v - W k - b|^2 = |(v - b) - W k|^2: shift the values on the host, then the linear op.
  Matrix shifted(values.rows, values.cols);
  for (int64_t i = 0; i < values.rows; ++i) {
    for (int64_t c = 0; c < values.cols; ++c) {
      shifted.Row(i)[c] = values.Row(i)[c] - fit.bias[c];
    }
  }
  return VectorResiduals(kpre, shifted.View(), fit.w.View(), residuals, exec);
}

Status RebuildValues(ConstMatrixView kpre, const VectorHeadFit& fit, MatrixView out,
                     const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(CheckBias(fit, kpre.cols, "RebuildValues"));
  KVD_RETURN_IF_ERROR(RebuildValues(kpre, fit.w.View(), out, exec));
  if (fit.bias.empty()) return Status::Ok();
  for (int64_t i = 0; i < out.rows; ++i) {
    for (int64_t c = 0; c < out.cols; ++c) out.Row(i)[c] += fit.bias[c];
  }
  return Status::Ok();
}

}  // namespace kvd::kernels
