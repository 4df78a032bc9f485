// The CPU twin of the device checksum, and the dispatch to the CUDA kernels.
#include "kvd/kernels/device_checksum.h"

#include <cstring>

#include "kvd/common/hash.h"
#include "kvd/kernels/types.h"
#include "xxh3_blocked.h"

#if KVD_HAVE_CUDA
#include "cuda_module.h"
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvd::kernels {

namespace {

xxh3::Secret DefaultSecret() {
  static_assert(sizeof(XXH3_kSecret) == xxh3::kSecretBytes, "xxh3's default secret size");
  xxh3::Secret s;
  std::memcpy(s.bytes, XXH3_kSecret, sizeof s.bytes);
  return s;
}

}  // namespace

uint64_t Checksum64Blocked(const void* data, size_t bytes) {
  if (bytes <= xxh3::kMidSizeMax) return Checksum64(data, bytes);  // the device does the same
  const auto* in = static_cast<const uint8_t*>(data);
  const xxh3::Secret secret = DefaultSecret();
  uint64_t acc[8];
  xxh3::InitAcc(acc);
  const size_t blocks = xxh3::FullBlocks(bytes);
  for (size_t b = 0; b < blocks; ++b) {
    // The block's lane sums first (what one CUDA block computes), then the fold.
    uint64_t sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t s = 0; s < xxh3::kStripesPerBlock; ++s) {
      for (int i = 0; i < 8; ++i) {
        const uint64_t value =
            xxh3::Read64(in + b * xxh3::kBlockBytes + s * xxh3::kStripeBytes + 8 * i);
        sum[i ^ 1] += value;
        sum[i] += xxh3::KeyProduct(value, xxh3::Read64(secret.bytes + 8 * s + 8 * i));
      }
    }
    for (int i = 0; i < 8; ++i) {
      acc[i] = xxh3::Scramble(acc[i] + sum[i], xxh3::Read64(secret.bytes + 128 + 8 * i));
    }
  }
  return xxh3::Finish(acc, in, bytes, secret.bytes);
}

StatusOr<uint64_t> DeviceChecksum64(const void* device_data, size_t bytes, void* cuda_stream) {
  if (bytes > 0 && device_data == nullptr) {
    return Status::InvalidArgument("DeviceChecksum64: null data for " + std::to_string(bytes) +
                                   " bytes");
  }
#if KVD_HAVE_CUDA
  if (!CudaDeviceAvailable()) {
    return Status::Unavailable("DeviceChecksum64: no CUDA device is visible");
  }
  if (bytes <= xxh3::kMidSizeMax) {
    uint8_t host[xxh3::kMidSizeMax];
    if (bytes > 0) {
      KVD_RETURN_IF_ERROR(cuda::CopyToHostSync(host, device_data, bytes, cuda_stream));
    }
    return Checksum64(host, bytes);
  }
  return cuda::LaunchChecksum64(device_data, bytes, DefaultSecret(), cuda_stream);
#else
  (void)cuda_stream;
  return Status::Unimplemented("DeviceChecksum64: this build has no CUDA kernels");
#endif
}

}  // namespace kvd::kernels
