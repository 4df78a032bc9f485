// The Transport contract: moves bulk bytes between processes, NIXL-style.
//
//   auto t = kvd::transport::CreateTransport(options);            // "ucx" or "loopback"
//   std::string me = t->LocalAddress().value();                   // send over the control plane
//   PeerHandle peer = t->Connect(peer_address_bytes).value();     // bytes from the other side
//   Region arena = t->AllocateRegistered(1 << 30).value();        // RMA-able host memory
//   TransferHandle h = t->PostRecv(peer, /*tag=*/reservation_id, arena.data + off, len).value();
//   Status s = t->Wait(h, std::chrono::milliseconds(5000));       // every wait has a timeout
//   t->Release(h);
//
// Bulk bytes travel only through a Transport; control messages carry addresses, tags and region
// export bytes. Both directions work over one pair of Connects: each side Connects to the other's
// LocalAddress (a daemon serving N clients holds N peers). Connect both ways: the UCX backend's
// same-host bulk path (TransportOptions::cma_threshold_bytes) acks on the receiver's endpoint,
// and its receive completes only once that ack has left, so a receiver may stop progressing as
// soon as its receive is done.
//
// BACKENDS: "ucx" (src/ucx/): tag messages over UCX; on one host, sends of >= 64 KiB to a peer
// move by one process_vm_readv in the receiver (UCX 1.13 with peer error handling otherwise
// carries everything over tcp); RMA on ucp_mem_map regions when TransportOptions::enable_rma
// (off by default: with it, any peer can read and write this process's memory). "loopback"
// (src/loopback/): memcpy between Transports of one process, same contract, for unit tests.
// FaultInjectingTransport (fault_injection.h) wraps either. A new backend registers with
// RegisterTransportBackend (registry.h: with its own topology keys).
//
// TAGS: callers use tags <= kMaxTag (2^62 - 1); the two top bits belong to the backends.
//
// THREAD SAFETY: every method of Transport is thread-safe. Backends serialize on one internal
// mutex per Transport (the UCX worker is created UCS_THREAD_MODE_SERIALIZED and only touched
// under that mutex) rather than UCS_THREAD_MODE_MULTI: the cost is one uncontended lock per call
// (~20-50 ns) and, under contention, posters waiting for at most one ucp_worker_progress pass of
// the progress thread. The intended daemon shape: one progress thread loops
// { Progress(); if (nothing progressed) WaitForEvents(timeout); } while any thread (Asio) posts,
// checks and releases. Wait() progresses by itself, so a program without a progress thread works.
//
// ERRORS: no exception leaves a Transport. UCX status codes are converted in one place
// (ucx_status.cc) into kvd::Status codes with messages that name the UCX setting to change.
// Unknown handle: NOT_FOUND. Invalid (0) handle, null buffer, bad length: INVALID_ARGUMENT.
// An operation the backend lacks (see Capabilities): UNIMPLEMENTED.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/transport/options.h"
#include "kvd/transport/types.h"

namespace kvd::transport {

// Every AllocateRegistered region starts on a multiple of this many bytes (a cache line).
inline constexpr size_t kRegisteredAlignment = 64;

// What Transport::PostRecv asks of the backend beyond the bytes (TransferRequest's kRecv fields).
struct RecvOptions {
  // TransferRequest::want_checksum: Checksum64 of the received bytes in TransferStatus where the
  // backend copies them itself (the daemon's receive of a put asks for it). Default false.
  bool want_checksum = false;
};

// A registered local region. `data` stays valid until DeregisterMemory (or the Transport's
// destruction); for AllocateRegistered the Transport owns the bytes.
struct Region {
  RegionHandle handle;
  void* data = nullptr;
  size_t size = 0;
  MemoryType memory_type = MemoryType::kHost;
};

class Transport {
 public:
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // ---- identity and capabilities ----
  virtual const Capabilities& capabilities() const = 0;

  // Opaque bytes another Transport of the same backend passes to Connect to reach this one.
  // Stable for the life of the Transport. Carry them over the control connection as bytes.
  virtual StatusOr<std::string> LocalAddress() = 0;

  // ---- peers ----
  // Creates an endpoint to the Transport whose LocalAddress() is `peer_address`.
  // INVALID_ARGUMENT: empty or malformed bytes (or of another backend). UNAVAILABLE: the peer
  // cannot be reached (UCX: no common transport; the message says which UCX_TLS to set).
  // Connecting twice to one address gives two independent peers.
  virtual StatusOr<PeerHandle> Connect(std::string_view peer_address) = 0;

  // Fails the peer's in-flight transfers with CANCELLED (receives posted with kAnyPeer are not
  // touched), closes the endpoint (UCX: a forced close, waiting at most
  // options.close_timeout_ms; bytes not yet delivered are dropped, and the peer may see this side
  // vanish) and forgets the handle. Transfer handles stay valid until Released. Disconnect only
  // after the peer confirmed (over the control plane) what it needed. NOT_FOUND for an unknown
  // peer.
  virtual Status Disconnect(PeerHandle peer) = 0;

  // OK while the peer is usable; UNAVAILABLE once the backend saw it vanish (its transfers have
  // then failed with UNAVAILABLE); NOT_FOUND for an unknown peer.
  virtual Status PeerStatus(PeerHandle peer) = 0;

  // How many peers are open, and how many were connected, disconnected and lost so far. A
  // Disconnected peer is gone for good: the backend makes no further attempt to reach it.
  virtual PeerCounts peer_counts() = 0;

  // ---- memory ----
  // Allocates `bytes` of memory registered for transfers (UCX: ucp_mem_map with
  // UCP_MEM_MAP_ALLOCATE, the only kind one-sided RMA is fast on) and owned by the Transport.
  // INVALID_ARGUMENT for 0 bytes; UNIMPLEMENTED for a memory type the backend lacks;
  // RESOURCE_EXHAUSTED if the allocation fails. The bytes start on a kRegisteredAlignment
  // (64-byte) boundary in every backend (UCX: page-aligned mmap; loopback: aligned_alloc).
  virtual StatusOr<Region> AllocateRegistered(size_t bytes,
                                              MemoryType type = MemoryType::kHost) = 0;

  // Registers caller-owned memory (the caller keeps it alive until DeregisterMemory).
  // INVALID_ARGUMENT for a null pointer or 0 bytes; UNIMPLEMENTED for a memory type it lacks.
  virtual StatusOr<Region> RegisterMemory(void* data, size_t bytes,
                                          MemoryType type = MemoryType::kHost) = 0;

  // Unregisters (and for AllocateRegistered frees) a region. REQUIRES: no in-flight transfer uses
  // it, and imported copies on peers are no longer used. NOT_FOUND for an unknown region.
  virtual Status DeregisterMemory(RegionHandle region) = 0;

  // Bytes the OTHER side of `peer` must pass to its Connect to finish the pair, sent over the
  // control connection; empty when the backend needs none (ucx, loopback: both sides Connect to
  // each other's LocalAddress). nccl: after Connect(peer's LocalAddress) this side returns the
  // communicators' unique ids ("KVDNCCLB..."), and the other side Connects with those bytes
  // instead of an address. NOT_FOUND for an unknown peer (in backends that need bytes).
  virtual StatusOr<std::string> PeerBootstrap(PeerHandle peer);

  // ---- one-sided access (optional: Capabilities::rma; else UNIMPLEMENTED) ----
  // Opaque bytes (address, length, remote key) a peer passes to ImportRegion to Read/Write
  // [0, size) of the region.
  virtual StatusOr<std::string> ExportRegion(RegionHandle region);
  // Binds a peer's exported region to `peer` for kRead/kWrite transfers.
  virtual StatusOr<RemoteRegionHandle> ImportRegion(PeerHandle peer, std::string_view exported);
  virtual Status ReleaseRemoteRegion(RemoteRegionHandle remote);

  // ---- transfers ----
  // Starts one transfer and returns at once (it may already be done). The caller must Release
  // the handle exactly once. Errors here mean nothing was started: INVALID_ARGUMENT (null
  // buffer with length > 0, length 0 for kRead/kWrite, invalid peer for kSend), NOT_FOUND
  // (unknown peer or remote region), UNAVAILABLE (peer already known to have vanished),
  // OUT_OF_RANGE (remote_offset + length beyond the remote region, length > max_message_bytes),
  // UNIMPLEMENTED (op or memory type the backend lacks).
  virtual StatusOr<TransferHandle> Post(const TransferRequest& request) = 0;

  // The current state; does not progress the backend (call Progress or Wait for that).
  // NOT_FOUND (as status, state kError) for an unknown handle.
  virtual TransferStatus Check(TransferHandle transfer) = 0;

  // Progresses until the transfer finishes or `timeout` passes. Returns OK when done, the
  // transfer's error when it failed, DEADLINE_EXCEEDED (the transfer stays in flight: wait
  // again, or Cancel) on timeout, NOT_FOUND for an unknown handle. timeout 0 = one poll.
  virtual Status Wait(TransferHandle transfer, std::chrono::milliseconds timeout) = 0;

  // Asks the backend to stop the transfer. A receive no message has matched yet ends at once
  // with CANCELLED (e.g. a reservation expired). A receive already taking a message, and a send
  // (UCX cannot recall bytes handed to the wire; loopback cancels a send not yet matched), end
  // on their own with their real outcome: Wait for it, or Disconnect the peer to stop all of its
  // transfers. OK if the transfer already finished. NOT_FOUND for an unknown handle.
  virtual Status Cancel(TransferHandle transfer) = 0;

  // Forgets a finished transfer. FAILED_PRECONDITION if it is still kInProgress (Cancel and Wait
  // first: the backend may still touch the buffer). NOT_FOUND for an unknown handle.
  virtual Status Release(TransferHandle transfer) = 0;

  // ---- progress ----
  // Runs one non-blocking progress pass; returns how many events it handled (0 = idle).
  virtual int Progress() = 0;

  // Blocks until the backend may have work for Progress, or `timeout` passes (then OK too).
  // Call after Progress() returned 0. Returns early when another thread posts or calls Wakeup.
  // Never blocks longer than timeout. A progress thread with nothing in flight may pass a long
  // timeout: the call sleeps in the kernel (UCX: ucp_worker_arm + epoll on the worker's event
  // fd and a wake-up eventfd), costing no CPU while idle.
  virtual Status WaitForEvents(std::chrono::milliseconds timeout) = 0;

  // Makes the current (or, if none is sleeping, the next) WaitForEvents return at once, from any
  // thread: a progress loop calls it when it is handed new work that is not a Post (a task, a
  // watch). Wake-ups do not accumulate beyond one. The default does nothing (a backend without
  // it makes its callers wait up to their timeout).
  virtual void Wakeup() {}

  // ---- conveniences (non-virtual; build a TransferRequest and Post it) ----
  StatusOr<TransferHandle> PostSend(PeerHandle peer, uint64_t tag, const void* data, size_t length);
  StatusOr<TransferHandle> PostRecv(PeerHandle peer, uint64_t tag, void* data, size_t length,
                                    RecvOptions options = {});
  // Post + Wait + (Cancel + Wait on timeout) + Release: the blocking form, for tools and tests.
  Status SendBlocking(PeerHandle peer, uint64_t tag, const void* data, size_t length,
                      std::chrono::milliseconds timeout);
  // On success *received (if not null) holds the message length.
  Status RecvBlocking(PeerHandle peer, uint64_t tag, void* data, size_t length,
                      std::chrono::milliseconds timeout, size_t* received = nullptr);

 protected:
  Transport() = default;
};

// ---- backend registry ----
// A factory builds a Transport from validated options; it returns a Status, never throws.
using TransportFactory =
    std::function<StatusOr<std::unique_ptr<Transport>>(const TransportOptions& options)>;

// Validates options and builds the named backend. INVALID_ARGUMENT for bad options;
// NOT_FOUND (listing the registered names) for an unknown backend; the backend's own error
// (UCX: UNAVAILABLE with a hint about UCX_TLS/UCX_NET_DEVICES) if it cannot start.
StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

// Adds a backend that binds no topology keys of its own (registry.h registers one with keys).
// ALREADY_EXISTS if the name is taken. Thread-safe. The built-in "ucx", "loopback", "none" and
// "nccl" are always registered.
Status RegisterTransportBackend(const std::string& name, TransportFactory factory);

// Registered backend names, sorted. Thread-safe.
std::vector<std::string> RegisteredTransportBackends();

}  // namespace kvd::transport
