#include "nccl/nccl_bootstrap.h"

#include <cstring>

namespace kvd::transport::nccl {
namespace {

constexpr uint32_t kAddressVersion = 1;
// magic, version u32, device i32, uuid u64, host_id u64, host length u8, host bytes.
constexpr size_t kAddressFixed = 8 + 4 + 4 + 8 + 8 + 1;
constexpr size_t kBootstrapSize = 8 + 8 + 8 + 2 * kUniqueIdBytes;

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
T Get(std::string_view in, size_t off) {
  T v;
  std::memcpy(&v, in.data() + off, sizeof(v));
  return v;
}

}  // namespace

std::string EncodeAddress(const NcclAddress& a) {
  std::string out(kAddressMagic);
  Put<uint32_t>(out, kAddressVersion);
  Put<int32_t>(out, a.device);
  Put<uint64_t>(out, a.uuid);
  Put<uint64_t>(out, a.host_id);
  const std::string host = a.host.substr(0, 255);
  Put<uint8_t>(out, static_cast<uint8_t>(host.size()));
  out += host;
  return out;
}

StatusOr<NcclAddress> DecodeAddress(std::string_view bytes) {
  if (bytes.substr(0, kAddressMagic.size()) != kAddressMagic) {
    return Status::InvalidArgument("not an NCCL transport address (" +
                                   std::to_string(bytes.size()) + " bytes without the " +
                                   std::string(kAddressMagic) + " prefix)");
  }
  if (bytes.size() < kAddressFixed) {
    return Status::InvalidArgument(
        "NCCL transport address truncated: " + std::to_string(bytes.size()) + " bytes, at least " +
        std::to_string(kAddressFixed) + " expected");
  }
  if (uint32_t v = Get<uint32_t>(bytes, 8); v != kAddressVersion) {
    return Status::InvalidArgument("NCCL transport address version " + std::to_string(v) +
                                   ", this build speaks " + std::to_string(kAddressVersion));
  }
  NcclAddress a;
  a.device = Get<int32_t>(bytes, 12);
  a.uuid = Get<uint64_t>(bytes, 16);
  a.host_id = Get<uint64_t>(bytes, 24);
  const size_t host_len = Get<uint8_t>(bytes, 32);
  if (a.device < 0) {
    return Status::InvalidArgument("NCCL transport address with device " +
                                   std::to_string(a.device));
  }
  if (a.uuid == 0) return Status::InvalidArgument("NCCL transport address with uuid 0");
  if (bytes.size() != kAddressFixed + host_len) {
    return Status::InvalidArgument("NCCL transport address of " + std::to_string(bytes.size()) +
                                   " bytes, its host name says " +
                                   std::to_string(kAddressFixed + host_len));
  }
  a.host = std::string(bytes.substr(kAddressFixed, host_len));
  return a;
}

std::string EncodeBootstrap(const NcclBootstrap& b) {
  std::string out(kBootstrapMagic);
  Put<uint64_t>(out, b.from_uuid);
  Put<uint64_t>(out, b.to_uuid);
  out.append(b.forward.data(), kUniqueIdBytes);
  out.append(b.backward.data(), kUniqueIdBytes);
  return out;
}

StatusOr<NcclBootstrap> DecodeBootstrap(std::string_view bytes) {
  if (bytes.substr(0, kBootstrapMagic.size()) != kBootstrapMagic) {
    return Status::InvalidArgument("not NCCL bootstrap bytes (no " + std::string(kBootstrapMagic) +
                                   " prefix)");
  }
  if (bytes.size() != kBootstrapSize) {
    return Status::InvalidArgument("NCCL bootstrap of " + std::to_string(bytes.size()) +
                                   " bytes, expected " + std::to_string(kBootstrapSize));
  }
  NcclBootstrap b;
  b.from_uuid = Get<uint64_t>(bytes, 8);
  b.to_uuid = Get<uint64_t>(bytes, 16);
  if (b.from_uuid == 0 || b.to_uuid == 0) {
    return Status::InvalidArgument("NCCL bootstrap with a zero transport uuid");
  }
  std::memcpy(b.forward.data(), bytes.data() + 24, kUniqueIdBytes);
  std::memcpy(b.backward.data(), bytes.data() + 24 + kUniqueIdBytes, kUniqueIdBytes);
  return b;
}

}  // namespace kvd::transport::nccl
