// Public entry of observation.h: validation and the one backend switch.
#include "kvd/kernels/observation.h"

#include <cmath>
#include <string>

#include "backend_a.h"

namespace kvd::kernels {

Status ObservationOptions::Validate() const {
  if (group_size < 1) {
    return Status::InvalidArgument("observation: group_size must be >= 1, got " +
                                   std::to_string(group_size));
  }
  if (!(scale >= 0.0f) || !std::isfinite(scale)) {
    return Status::InvalidArgument("observation: scale must be finite and >= 0 (0 = 1/sqrt(d))");
  }
  if (mask != MaskKind::kNone && mask != MaskKind::kCausalWindow && mask != MaskKind::kByPosition) {
    return Status::InvalidArgument("observation: unknown mask kind");
  }
  return Status::Ok();
}

namespace {

Status ValidateHead(const ObservationHead& head, const ObservationOptions& options,
                    size_t mass_size) {
  const ConstMatrixView& q = head.queries;
  const ConstMatrixView& k = head.keys;
  KVD_RETURN_IF_ERROR(CheckHeadDim(k.cols).WithContext("observation: keys"));
  if (q.cols != k.cols) {
    return Status::InvalidArgument("observation: queries have d=" + std::to_string(q.cols) +
                                   " but keys d=" + std::to_string(k.cols));
  }
  if (q.rows < 1) return Status::InvalidArgument("observation: no observation queries (W*G = 0)");
  if (q.rows % options.group_size != 0) {
    return Status::InvalidArgument("observation: " + std::to_string(q.rows) +
                                   " query rows is not a multiple of group_size " +
                                   std::to_string(options.group_size));
  }
  if (k.rows < 1) return Status::InvalidArgument("observation: no keys (N = 0)");
  if ((q.data == nullptr) || (k.data == nullptr) || q.ld < q.cols || k.ld < k.cols) {
    return Status::InvalidArgument("observation: null or badly strided view");
  }
  if (mass_size != static_cast<size_t>(k.rows)) {
    return Status::InvalidArgument("observation: mass has " + std::to_string(mass_size) +
                                   " entries for N=" + std::to_string(k.rows) + " keys");
  }
  if (!head.key_bias.empty() && head.key_bias.size() != static_cast<size_t>(k.rows)) {
    return Status::InvalidArgument("observation: bias has " + std::to_string(head.key_bias.size()) +
                                   " entries for N=" + std::to_string(k.rows) + " keys");
  }
  const int64_t w = q.rows / options.group_size;
  if (options.mask == MaskKind::kCausalWindow && w > k.rows) {
    return Status::InvalidArgument("observation: window larger than keys: W=" + std::to_string(w) +
                                   " > N=" + std::to_string(k.rows) +
                                   " (N smaller than the window)");
  }
  if (options.mask == MaskKind::kByPosition &&
      (head.query_positions.size() != static_cast<size_t>(w) ||
       head.key_positions.size() != static_cast<size_t>(k.rows))) {
    return Status::InvalidArgument("observation: kByPosition needs W=" + std::to_string(w) +
                                   " query positions and N=" + std::to_string(k.rows) +
                                   " key positions, got " +
                                   std::to_string(head.query_positions.size()) + " and " +
                                   std::to_string(head.key_positions.size()));
  }
  KVD_RETURN_IF_ERROR(CheckFinite(q, "observation: queries"));
  KVD_RETURN_IF_ERROR(CheckFinite(k, "observation: keys"));
  if (!head.key_bias.empty()) {
    KVD_RETURN_IF_ERROR(CheckFiniteSpan(
        head.key_bias.data(), static_cast<int64_t>(head.key_bias.size()), "observation: bias"));
  }
  return Status::Ok();
}

Status DispatchOne(const ObservationHead& head, const ObservationOptions& options, float* mass,
                   const ExecOptions& exec) {
  switch (exec.backend) {
    case Backend::kCpu:
      cpu::AttentionMass(head, options, mass);
      return Status::Ok();
    case Backend::kCuda: {
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("ComputeAttentionMass"));
      return cuda::AttentionMass(head, options, mass, exec.cuda_stream);
#else
      return CheckCudaBackend("ComputeAttentionMass");
#endif
    }
    default:
      return Status::InvalidArgument("ComputeAttentionMass: unknown backend");
  }
}

}  // namespace

Status ComputeAttentionMass(const ObservationHead& head, const ObservationOptions& options,
                            std::span<float> mass, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(options.Validate());
  KVD_RETURN_IF_ERROR(ValidateHead(head, options, mass.size()));
  return DispatchOne(head, options, mass.data(), exec);
}

Status ComputeAttentionMass(std::span<const ObservationHead> heads,
                            const ObservationOptions& options,
                            std::vector<std::vector<float>>* masses, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (masses == nullptr) return Status::InvalidArgument("observation: null output");
  masses->resize(heads.size());
  for (size_t h = 0; h < heads.size(); ++h) {
    (*masses)[h].assign(static_cast<size_t>(std::max<int64_t>(heads[h].keys.rows, 0)), 0.0f);
    Status s = ValidateHead(heads[h], options, (*masses)[h].size());
    if (!s.ok()) return s.WithContext("head " + std::to_string(h));
  }
  if (exec.backend == Backend::kCuda) {
    for (size_t h = 0; h < heads.size(); ++h) {
      KVD_RETURN_IF_ERROR(DispatchOne(heads[h], options, (*masses)[h].data(), exec));
    }
    return Status::Ok();
  }
  ParallelFor(static_cast<int64_t>(heads.size()), exec.num_threads,
              [&](int64_t h) { cpu::AttentionMass(heads[h], options, (*masses)[h].data()); });
  return Status::Ok();
}

}  // namespace kvd::kernels
