// The bytes the NCCL backend exchanges over the control connection (no NCCL types: the codec is
// unit-tested on machines without NCCL or a GPU).
//
// A pair of NCCL transports forms two 2-rank communicators, one per direction (each carries
// traffic one way only, so two sides sending at once cannot deadlock on one communicator's
// ordered queue):
//   1. B sends its LocalAddress (an NcclAddress) to A over the control plane;
//   2. A calls Connect(address): A becomes rank 0 of both communicators, makes their two unique
//      ids and starts joining them; Transport::PeerBootstrap(peer) gives the NcclBootstrap bytes;
//   3. A sends those bytes to B over the control plane; B calls Connect(bootstrap) and joins as
//      rank 1. Both joins complete (or time out: TransportOptions::nccl_init_timeout_ms) in the
//      background; transfers posted meanwhile wait for them.
// Byte order: little-endian (the only byte order kvd builds for).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::transport::nccl {

inline constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueIdBytes = std::array<char, kUniqueIdBytes>;

// What LocalAddress() returns: "KVDNCCL1" + version + device + uuid + host id + host name.
struct NcclAddress {
  uint64_t uuid = 0;     // random per transport
  uint64_t host_id = 0;  // hash of the boot id (equal on one host), 0 if unknown
  int32_t device = 0;    // CUDA device ordinal of that transport
  std::string host;      // host name, for messages
  bool operator==(const NcclAddress&) const = default;
};

// What PeerBootstrap() returns on the connecting side: "KVDNCCLB" + from + to + the two ids.
struct NcclBootstrap {
  uint64_t from_uuid = 0;    // the connecting transport (rank 0 of both communicators)
  uint64_t to_uuid = 0;      // the transport that must Connect with these bytes (rank 1)
  UniqueIdBytes forward{};   // communicator in which `from` sends and `to` receives
  UniqueIdBytes backward{};  // communicator in which `to` sends and `from` receives
  bool operator==(const NcclBootstrap&) const = default;
};

inline constexpr std::string_view kAddressMagic = "KVDNCCL1";
inline constexpr std::string_view kBootstrapMagic = "KVDNCCLB";

std::string EncodeAddress(const NcclAddress& a);
// INVALID_ARGUMENT naming what is wrong: not NCCL address bytes, truncated, bad version,
// negative device, host name over 255 bytes or past the end.
StatusOr<NcclAddress> DecodeAddress(std::string_view bytes);

std::string EncodeBootstrap(const NcclBootstrap& b);
// INVALID_ARGUMENT: not bootstrap bytes, wrong length, zero uuids.
StatusOr<NcclBootstrap> DecodeBootstrap(std::string_view bytes);

}  // namespace kvd::transport::nccl
