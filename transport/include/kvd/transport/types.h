// Value types of the transport contract: handles, capabilities, transfer requests and states.
//
// Handles are small opaque values (an id; 0 means "none"). They name backend state that lives in
// the Transport that issued them; passing a handle to another Transport gives NOT_FOUND.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvd/common/status.h"

namespace kvd::transport {

// A connected peer (an endpoint to another Transport). From Transport::Connect.
struct PeerHandle {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
  bool operator==(const PeerHandle&) const = default;
};
// "Any sender": only for receives. A receive posted with it is not failed when a peer vanishes;
// only its timeout or Cancel ends it if no sender comes.
inline constexpr PeerHandle kAnyPeer{};

// A local memory region registered with the transport. From RegisterMemory / AllocateRegistered.
struct RegionHandle {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
  bool operator==(const RegionHandle&) const = default;
};

// A peer's region imported from its ExportRegion bytes, for one-sided Read/Write (RMA).
struct RemoteRegionHandle {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
  bool operator==(const RemoteRegionHandle&) const = default;
};

// One posted transfer. From Transport::Post; must be given back with Transport::Release.
struct TransferHandle {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
  bool operator==(const TransferHandle&) const = default;
};

enum class MemoryType : int {
  kHost = 0,  // CPU memory (pageable or pinned)
  kCuda = 1,  // CUDA device memory (only where Capabilities::cuda_memory)
};
std::string_view MemoryTypeName(MemoryType type);

// A Transport's peers, for stats and tests (Transport::peer_counts). Invariant: open ==
// connects - disconnects.
struct PeerCounts {
  uint64_t open = 0;         // peers Connected and not yet Disconnected (vanished ones included)
  uint64_t connects = 0;     // successful Connects since the Transport was created
  uint64_t disconnects = 0;  // Disconnects since then (each closed its endpoint for good)
  uint64_t vanished = 0;     // peers the backend saw vanish (PeerStatus turned UNAVAILABLE)
};

// What a backend can do. Constant for the life of a Transport.
struct Capabilities {
  std::string backend;                  // registry name, e.g. "ucx", "loopback"
  bool host_memory = true;              // buffers may be host memory
  bool cuda_memory = false;             // buffers may be CUDA device pointers (no staging needed)
  bool tag_messages = true;             // kSend / kRecv
  bool rma = false;                     // kRead / kWrite + ExportRegion / ImportRegion
  bool cancel_recv = true;              // Cancel() can end an unmatched receive
  bool peer_failure_detection = false;  // a vanished peer fails its transfers with UNAVAILABLE
  uint64_t max_message_bytes = 0;       // largest single transfer length
  std::string transports;               // what actually carries bytes, e.g. "posix,sysv,tcp" (info)
  std::string library;                  // the library under the backend, e.g. "UCX 1.22.0" (info)
};

// The largest tag a caller may use (62 bits).
inline constexpr uint64_t kMaxTag = (uint64_t{1} << 62) - 1;

enum class TransferOp : int {
  kSend = 0,   // tagged two-sided send of [buffer, buffer+length) to `peer`
  kRecv = 1,   // tagged two-sided receive into [buffer, buffer+length)
  kRead = 2,   // one-sided: remote[offset, offset+length) -> local buffer   (REQUIRES rma)
  kWrite = 3,  // one-sided: local buffer -> remote[offset, offset+length)   (REQUIRES rma)
};
std::string_view TransferOpName(TransferOp op);

// One transfer to post. The buffer is borrowed: the caller keeps it alive and (for kRecv/kRead)
// does not read it, and (for kSend/kWrite) does not modify it, until the transfer is no longer
// kInProgress (Check/Wait says so) or Release returned.
struct TransferRequest {
  TransferOp op = TransferOp::kSend;
  // kSend/kRead/kWrite: the destination/source peer (REQUIRES valid()).
  // kRecv: the expected sender (its loss fails the receive with UNAVAILABLE), or kAnyPeer.
  PeerHandle peer;
  // kSend/kRecv: the tag, REQUIRES tag <= kMaxTag (INVALID_ARGUMENT otherwise; the top two
  // bits are the backends' own). A receive matches the first send with an equal tag arriving at
  // this Transport, from any peer (the UCX backend matches on tag only). Callers keep the tags
  // of outstanding receives unique per Transport (e.g. reservation id or request id).
  uint64_t tag = 0;
  // Local bytes. Any host memory works; memory inside a registered region may move faster.
  // REQUIRES: buffer != nullptr when length > 0.
  void* buffer = nullptr;
  // Bytes. kSend/kRecv: 0 is allowed (an empty message). kRead/kWrite: REQUIRES > 0.
  // kRecv: the capacity of buffer; a longer message fails the receive with OUT_OF_RANGE.
  size_t length = 0;
  // Where `buffer` lives. kCuda REQUIRES Capabilities::cuda_memory (else UNIMPLEMENTED: stage
  // through host memory). UCX: cuda_memory is true only with a UCX built with CUDA (the
  // libucx-cu1x wheel, KVD_UCX=wheel; Debian's 1.13 has none) whose CUDA module loaded (it
  // needs the driver's libcuda.so.1); same node moves over cuda_ipc / cuda_copy, across nodes
  // over GPUDirect RDMA where the fabric has it. A kCuda receive matches only messages UCX
  // carries itself: a same-host host-memory send of >= cma_threshold_bytes travels as a
  // descriptor that only a host receive can take, so a peer receiving into CUDA memory gets
  // such bytes from CUDA-memory sends, or from a sender with cma_threshold_bytes = 0.
  MemoryType memory_type = MemoryType::kHost;
  // kRead/kWrite only: the remote region and the byte offset in it.
  RemoteRegionHandle remote;
  uint64_t remote_offset = 0;
  // kRecv into host memory only: asks for Checksum64 (kvd/common/hash.h) of the received bytes,
  // computed by the backend while they are in the cache from its own copy. A backend that does
  // not copy the bytes itself leaves TransferStatus::checksum_valid false and the caller hashes
  // the buffer. UCX: set for the same-host path (a send of >= cma_threshold_bytes from a
  // same-host peer: the receiver copies in blocks and hashes each block after it lands); not set
  // for bytes UCX carries itself. Ignored for other ops. Costs nothing when not set.
  bool want_checksum = false;
};

enum class TransferState : int {
  kInProgress = 0,  // posted, not finished: the buffer is still borrowed
  kDone = 1,        // finished; `bytes` says how many bytes moved
  kError = 2,       // finished with an error (`status`); the buffer is no longer touched
};

struct TransferStatus {
  TransferState state = TransferState::kInProgress;
  // OK unless kError. Codes: UNAVAILABLE (peer vanished / unreachable), CANCELLED (Cancel or
  // Disconnect), OUT_OF_RANGE (message longer than the receive buffer), INTERNAL (backend bug).
  Status status;
  // kDone: bytes moved (for kRecv, the received message length <= request length).
  size_t bytes = 0;
  // kDone receive posted with want_checksum: true when `checksum` holds Checksum64 of the `bytes`
  // received bytes, as they were written into the buffer (see TransferRequest::want_checksum).
  bool checksum_valid = false;
  uint64_t checksum = 0;
};

}  // namespace kvd::transport
