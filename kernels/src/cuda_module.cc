// Loading the CUDA kernels module, and the host's cuda:: entry points as calls through its table
// (cuda_module.h).
#include "cuda_module.h"

#if KVD_HAVE_CUDA
#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "kvd/common/shared_library.h"

namespace kvd::kernels {
namespace {

constexpr const char* kModuleFile = "libkvd_kernels_cuda.so";

// The module beside the binary that holds this code: <dir>/kvd/ (libkvd_client in <libdir>),
// <dir>/../<libdir>/kvd/ (a program in <prefix>/bin).
std::vector<std::string> Defaults() {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&LoadCudaKernels), &info) != 0 && info.dli_fname != nullptr &&
      std::string_view(info.dli_fname).find('/') != std::string_view::npos) {
    std::error_code ec;
    fs::path self = fs::canonical(info.dli_fname, ec);
    if (!ec) dirs.push_back(self.parent_path());
  }
  std::error_code ec;
  fs::path exe = fs::canonical("/proc/self/exe", ec);  // the program, when these are linked in it
  if (!ec) dirs.push_back(exe.parent_path());
  std::vector<std::string> out;
  for (const fs::path& dir : dirs) {
    for (const fs::path& p : {dir / "kvd" / kModuleFile,
                              dir / ".." / KVD_INSTALL_LIBDIR / "kvd" / kModuleFile,
                              dir / ".." / "lib" / "kvd" / kModuleFile}) {
      std::string s = p.lexically_normal().string();
      bool seen = false;
      for (const std::string& o : out) seen |= o == s;
      if (!seen) out.push_back(std::move(s));
    }
  }
  return out;
}

StatusOr<const CudaKernelsApi*> Load() {
  const std::vector<std::string> defaults = Defaults();
  KVD_ASSIGN_OR_RETURN(SharedLibrary lib,
                       SharedLibrary::OpenChosen("KVD_KERNELS_CUDA_MODULE", defaults,
                                                 "CUDA kernels module not loaded"));
  const CudaKernelsApi* (*entry)() = nullptr;
  KVD_RETURN_IF_ERROR(lib.Resolve("kvd_kernels_cuda_module", &entry));
  const CudaKernelsApi* api = entry();
  if (api == nullptr || api->version != kCudaKernelsApiVersion) {
    return Status::FailedPrecondition(
        lib.name() + ": a CUDA kernels module of another build (table version " +
        std::to_string(api == nullptr ? -1 : api->version) + ", this library needs " +
        std::to_string(kCudaKernelsApiVersion) + ")");
  }
  lib.Leak();  // the kernels are called until exit
  return api;
}

}  // namespace

StatusOr<const CudaKernelsApi*> LoadCudaKernels() {
  static const StatusOr<const CudaKernelsApi*> api = Load();
  return api;
}

std::string CudaKernelsUnavailable(int device) {
  auto api = LoadCudaKernels();
  if (!api.ok()) return api.status().message();
  static const std::pair<int, std::string> count = [&] {
    std::string error;
    int n = (*api)->DeviceCount(&error);
    return std::make_pair(n, std::move(error));
  }();
  if (count.first < 0) return "no CUDA device (cudaGetDeviceCount: " + count.second + ")";
  if (count.first == 0) return "no CUDA device (cudaGetDeviceCount: 0)";
  if (device >= count.first || device < -1) {
    return "no CUDA device " + std::to_string(device) + " (this machine has " +
           std::to_string(count.first) + ")";
  }
  return "";
}

// The entry points the host code calls: the module's, once loaded.
namespace cuda {

#define KVD_CUDA_FORWARD(name, ...)                                         \
  KVD_ASSIGN_OR_RETURN(const CudaKernelsApi* kvd_cuda_api_, LoadCudaKernels()); \
  return kvd_cuda_api_->name(__VA_ARGS__)

Status GatherHeads(const EngineTensorShape& shape, const void* src,
                   std::span<const MatrixView> heads, void* stream) {
  KVD_CUDA_FORWARD(GatherHeads, shape, src, heads, stream);
}
Status ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads,
                    void* dst, void* stream) {
  KVD_CUDA_FORWARD(ScatterHeads, shape, heads, dst, stream);
}
Status ApplyRope(const RopeTable& table, RopeDirection direction, const int64_t* positions,
                 std::span<const MatrixView> heads, void* stream) {
  KVD_CUDA_FORWARD(ApplyRope, table, direction, positions, heads, stream);
}
Status AttentionMass(const ObservationHead& head, const ObservationOptions& options, float* mass,
                     void* stream) {
  KVD_CUDA_FORWARD(AttentionMass, head, options, mass, stream);
}
Status KeyDiffScores(ConstMatrixView keys, float* scores, bool* zero_norm, int64_t* bad_row,
                     void* stream) {
  KVD_CUDA_FORWARD(KeyDiffScores, keys, scores, zero_norm, bad_row, stream);
}
Status QuantizeBlock(const QuantBlock& block, const float* x, uint8_t* out, int64_t* bad_group,
                     void* stream) {
  KVD_CUDA_FORWARD(QuantizeBlock, block, x, out, bad_group, stream);
}
Status DequantizeBlock(const QuantBlock& block, const uint8_t* in, float* out, void* stream) {
  KVD_CUDA_FORWARD(DequantizeBlock, block, in, out, stream);
}
Status ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys,
                               ConstMatrixView values, float* scores, void* stream) {
  KVD_CUDA_FORWARD(ExpectedAttentionScores, q, keys, values, scores, stream);
}
Status ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position,
                   SlotSet* slots, void* stream) {
  KVD_CUDA_FORWARD(ApplyMerges, pairs, position, slots, stream);
}
Status ExpandDense(ConstMatrixView keys, ConstMatrixView values, const int64_t* offsets,
                   MatrixView keys_out, MatrixView values_out, void* stream) {
  KVD_CUDA_FORWARD(ExpandDense, keys, values, offsets, keys_out, values_out, stream);
}
Status AccumulateVectorStats(ConstMatrixView kpre, ConstMatrixView values, VectorHeadStats* stats,
                             void* stream) {
  KVD_CUDA_FORWARD(AccumulateVectorStats, kpre, values, stats, stream);
}
Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                       float* residuals, void* stream) {
  KVD_CUDA_FORWARD(VectorResiduals, kpre, values, w, residuals, stream);
}
Status RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out, void* stream) {
  KVD_CUDA_FORWARD(RebuildValues, kpre, w, out, stream);
}
StatusOr<std::unique_ptr<DevicePlan::State>> CreateDevicePlanState(
    const CompressionPlanOptions& options, const ModelLayout& layout, const RopeTable& rope,
    const VectorWeights* weights, const DevicePlanOptions& device) {
  KVD_CUDA_FORWARD(CreateDevicePlanState, options, layout, rope, weights, device);
}
StatusOr<bool> HasDeviceSteps(StageKind kind, uint8_t code) {
  KVD_CUDA_FORWARD(HasDeviceSteps, kind, code);
}
StatusOr<void*> AllocatePinned(size_t bytes) { KVD_CUDA_FORWARD(AllocatePinned, bytes); }
void FreePinned(void* p) {
  if (p == nullptr) return;
  if (auto api = LoadCudaKernels(); api.ok()) (*api)->FreePinned(p);
}
StatusOr<void*> UploadImage(const void* pinned, size_t bytes, void* stream) {
  KVD_CUDA_FORWARD(UploadImage, pinned, bytes, stream);
}
void FreeDevice(void* p) {
  if (p == nullptr) return;
  if (auto api = LoadCudaKernels(); api.ok()) (*api)->FreeDevice(p);
}
Status LaunchDenseHead(const uint8_t* image, const DeviceHeadLayout& h, int head_dim, DType dtype,
                       int64_t row_elems, int head, void* k, void* v, void* stream) {
  KVD_CUDA_FORWARD(LaunchDenseHead, image, h, head_dim, dtype, row_elems, head, k, v, stream);
}
Status LaunchCompactHead(const uint8_t* image, const DeviceHeadLayout& h, int head_dim, DType dtype,
                         float* keys, float* values, float* bias, int64_t* positions,
                         void* stream) {
  KVD_CUDA_FORWARD(LaunchCompactHead, image, h, head_dim, dtype, keys, values, bias, positions,
                   stream);
}
StatusOr<uint64_t> LaunchChecksum64(const void* device_data, size_t bytes,
                                    const xxh3::Secret& secret, void* stream) {
  KVD_CUDA_FORWARD(LaunchChecksum64, device_data, bytes, secret, stream);
}
Status CopyToHostSync(void* host, const void* device, size_t bytes, void* stream) {
  KVD_CUDA_FORWARD(CopyToHostSync, host, device, bytes, stream);
}

#undef KVD_CUDA_FORWARD

}  // namespace cuda
}  // namespace kvd::kernels

#endif  // KVD_HAVE_CUDA
