// CPU twins of the VECTOR ops: OpenBLAS GEMMs (loaded on first use, blas.h) plus vectorisable row
// loops.
#include <algorithm>
#include <vector>

#include "blas.h"
#include "vector_backend.h"

namespace kvd::kernels::cpu {
namespace {

// Rows per GEMM block: keeps a block of predictions (kBlock x d floats) in L2.
constexpr int64_t kBlock = 256;
// Rows per float64 calibration block: larger K dimension for dsyrk/dgemm efficiency
// (2 x 1024 x d doubles = 2 MiB at d = 128).
constexpr int64_t kCalibrationBlock = 1024;

}  // namespace

void AccumulateVectorStats(ConstMatrixView kpre, ConstMatrixView values, VectorHeadStats* stats) {
  const int64_t n = kpre.rows;
  const int64_t d = kpre.cols;
  if (n == 0) return;
  // Converted blocks: products and sums are both float64, so the statistics are exact to float64
  // rounding whatever the batch split (Merge of partial calibrations equals one calibration).
  std::vector<double> kd(static_cast<size_t>(std::min(n, kCalibrationBlock) * d));
  std::vector<double> vd(kd.size());
  for (int64_t start = 0; start < n; start += kCalibrationBlock) {
    const int64_t rows = std::min(kCalibrationBlock, n - start);
    for (int64_t i = 0; i < rows; ++i) {
      const float* k = kpre.Row(start + i);
      const float* v = values.Row(start + i);
      double* kr = kd.data() + i * d;
      double* vr = vd.data() + i * d;
      double sq = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        kr[c] = k[c];
        vr[c] = v[c];
        sq += vr[c] * vr[c];
        stats->value_sum[c] += vr[c];
      }
      stats->value_sq_sum += sq;
    }
    // upper(gram) += Kb^T Kb (syrk: half the work of a GEMM) ; cross += Kb^T Vb
    // (Kb, Vb: [rows, d] row-major). The lower triangle is mirrored once per call below.
    Cblas().dsyrk(CblasRowMajor, CblasUpper, CblasTrans, static_cast<int>(d),
                  static_cast<int>(rows), 1.0, kd.data(), static_cast<int>(d), 1.0,
                  stats->gram.data(), static_cast<int>(d));
    Cblas().dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(d), static_cast<int>(d),
                  static_cast<int>(rows), 1.0, kd.data(), static_cast<int>(d), vd.data(),
                  static_cast<int>(d), 1.0, stats->cross.data(), static_cast<int>(d));
  }
  for (int64_t r = 1; r < d; ++r) {
    for (int64_t c = 0; c < r; ++c) stats->gram[r * d + c] = stats->gram[c * d + r];
  }
  stats->count += n;
}

void VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                     float* residuals) {
  const int64_t n = kpre.rows;
  const int64_t d = kpre.cols;
  std::vector<float> pred(static_cast<size_t>(std::min(n, kBlock) * d));
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t rows = std::min(kBlock, n - start);
    // pred = Kb W^T  ([rows, d] x [d, d]^T)
    Cblas().sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                  static_cast<int>(d), static_cast<int>(d), 1.0f, kpre.Row(start),
                  static_cast<int>(kpre.ld), w.data, static_cast<int>(w.ld), 0.0f, pred.data(),
                  static_cast<int>(d));
    for (int64_t i = 0; i < rows; ++i) {
      const float* v = values.Row(start + i);
      const float* p = pred.data() + i * d;
      float sum = 0.0f;
      for (int64_t c = 0; c < d; ++c) {
        const float diff = v[c] - p[c];
        sum += diff * diff;
      }
      residuals[start + i] = sum;
    }
  }
}

void RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out) {
  if (kpre.rows == 0) return;
  // out = Kpre W^T
  Cblas().sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(kpre.rows),
                static_cast<int>(w.rows), static_cast<int>(kpre.cols), 1.0f, kpre.data,
                static_cast<int>(kpre.ld), w.data, static_cast<int>(w.ld), 0.0f, out.data,
                static_cast<int>(out.ld));
}

}  // namespace kvd::kernels::cpu
