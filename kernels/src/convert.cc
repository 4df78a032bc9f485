// Public entry of convert.h: validation and the one backend switch.
#include "kvd/kernels/convert.h"

#include <string>

#include "backend_a.h"

namespace kvd::kernels {
namespace {

template <typename View>
Status CheckHeadViews(const EngineTensorShape& shape, std::span<const View> heads) {
  if (static_cast<int64_t>(heads.size()) != shape.num_heads) {
    return Status::InvalidArgument("convert: expected " + std::to_string(shape.num_heads) +
                                   " head views, got " + std::to_string(heads.size()));
  }
  for (size_t h = 0; h < heads.size(); ++h) {
    const View& v = heads[h];
    if (v.rows != shape.tokens || v.cols != shape.head_dim || v.ld < v.cols ||
        (v.data == nullptr && shape.tokens > 0)) {
      return Status::InvalidArgument(
          "convert: head " + std::to_string(h) + " view is [" + std::to_string(v.rows) + ", " +
          std::to_string(v.cols) + "] ld " + std::to_string(v.ld) + ", expected [" +
          std::to_string(shape.tokens) + ", " + std::to_string(shape.head_dim) + "]");
    }
  }
  return Status::Ok();
}

}  // namespace

Status EngineTensorShape::Validate() const {
  if (tokens < 0) {
    return Status::InvalidArgument("convert: negative token count " + std::to_string(tokens));
  }
  if (num_heads < 1) {
    return Status::InvalidArgument("convert: num_heads must be >= 1, got " +
                                   std::to_string(num_heads));
  }
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return Status::InvalidArgument("convert: unknown dtype " +
                                   std::to_string(static_cast<int>(dtype)));
  }
  return CheckHeadDim(head_dim).WithContext("convert");
}

Status GatherHeads(const EngineTensorShape& shape, const void* src,
                   std::span<const MatrixView> heads, const ExecOptions& exec, bool check_finite) {
  KVD_RETURN_IF_ERROR(shape.Validate());
  if (src == nullptr && shape.tokens > 0) {
    return Status::InvalidArgument("convert: null source tensor");
  }
  KVD_RETURN_IF_ERROR(CheckHeadViews(shape, heads));
  switch (exec.backend) {
    case Backend::kCpu:
      cpu::GatherHeads(shape, src, heads, exec.num_threads);
      break;
    case Backend::kCuda: {
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("GatherHeads"));
      KVD_RETURN_IF_ERROR(cuda::GatherHeads(shape, src, heads, exec.cuda_stream));
      break;
#else
      return CheckCudaBackend("GatherHeads");
#endif
    }
    default:
      return Status::InvalidArgument("GatherHeads: unknown backend");
  }
  if (check_finite) {
    for (size_t h = 0; h < heads.size(); ++h) {
      Status s = CheckFinite(heads[h], "convert: gathered keys/values");
      if (!s.ok()) return s.WithContext("head " + std::to_string(h));
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<Matrix>> GatherHeads(const EngineTensorShape& shape, const void* src,
                                          const ExecOptions& exec, bool check_finite) {
  KVD_RETURN_IF_ERROR(shape.Validate());
  std::vector<Matrix> out;
  std::vector<MatrixView> views;
  out.reserve(static_cast<size_t>(shape.num_heads));
  for (int64_t h = 0; h < shape.num_heads; ++h) {
    out.emplace_back(shape.tokens, shape.head_dim);
    views.push_back(out.back().View());
  }
  KVD_RETURN_IF_ERROR(GatherHeads(shape, src, views, exec, check_finite));
  return out;
}

Status ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads,
                    void* dst, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(shape.Validate());
  if (dst == nullptr && shape.tokens > 0) {
    return Status::InvalidArgument("convert: null destination tensor");
  }
  KVD_RETURN_IF_ERROR(CheckHeadViews(shape, heads));
  switch (exec.backend) {
    case Backend::kCpu:
      cpu::ScatterHeads(shape, heads, dst, exec.num_threads);
      return Status::Ok();
    case Backend::kCuda: {
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("ScatterHeads"));
      return cuda::ScatterHeads(shape, heads, dst, exec.cuda_stream);
#else
      return CheckCudaBackend("ScatterHeads");
#endif
    }
    default:
      return Status::InvalidArgument("ScatterHeads: unknown backend");
  }
}

}  // namespace kvd::kernels
