// The UCX backend: one ucp_context and one ucp_worker per Transport; tag messages for bulk,
// optional RMA on regions from ucp_mem_map. See kvd/transport/transport.h for the contract.
//
// Internals: every UCX call happens under mu_ (worker is UCS_THREAD_MODE_SERIALIZED). UCX
// callbacks run inside ucp_worker_progress / ucp_request_cancel, hence also under mu_; they
// find their transfer by the id passed as user_data, so a Released transfer whose UCX request
// completes later is simply ignored.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvd/transport/transport.h"
#include "kvd/transport/ucx_options.h"
#include "ucx/ucx_status.h"

namespace kvd::transport::ucx {

// The transfer id kept in the user area of a UCX request (ucp_params_t::request_size). 0 until
// assigned after the posting call returns; callbacks reset it to 0 before freeing the request
// (UCX recycles requests, and its request_init runs only once per allocation).
inline uint64_t& RequestId(void* request) { return *static_cast<uint64_t*>(request); }

// Tag space. Callers use tags <= kMaxTag (bits 62, 63 clear). A caller's receive of tag T uses
// mask ~kInternalTagBit, so it matches an inline message (tag T) and a cma descriptor
// (kInternalTagBit | T); acks (kInternalTagBit | kAckTagBit | seq) never match a caller's receive.
inline constexpr uint64_t kInternalTagBit = uint64_t{1} << 63;
inline constexpr uint64_t kAckTagBit = uint64_t{1} << 62;

// What a cma send puts on the wire instead of its bytes (48 bytes, host byte order: same host).
struct CmaDescriptor {
  uint64_t magic;        // kCmaMagic
  uint64_t sender_uuid;  // to find the endpoint back to the sender for the ack
  uint64_t seq;          // the sender's transfer id: the ack's tag
  uint64_t address;      // the sender's buffer
  uint64_t length;       // bytes
  uint64_t pid;          // the sender process
  uint64_t proof;        // address in the sender of a copy of the receiver's secret nonce
};
inline constexpr uint64_t kCmaMagic = 0x31414D4344564BULL;  // "KVDCMA1"
inline constexpr size_t kDescriptorSize = sizeof(CmaDescriptor);

// Between the "KVDUCX1:" magic and the worker address: uuid, host id, pid, flags, probe address,
// nonce[0], nonce[1] (7 x uint64, host byte order).
//
// Trust: a receiver reads only a process that proves it holds this transport's nonce (a random
// secret handed out only inside LocalAddress, i.e. to peers over the control plane): the sender
// copies the nonce into its own memory at Connect, and each descriptor names that copy
// (`proof`), which the receiver reads and compares before it reads the payload. So a peer
// cannot point the receiver at some other process's memory.
inline constexpr size_t kAddressHeaderSize = 56;
inline constexpr uint64_t kAddressFlagCma = 1;
// A hash of the kernel boot id (equal for processes on one host), or 0 if unreadable.
uint64_t HostId();

class UcxTransport final : public Transport {
 public:
  static StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options);
  ~UcxTransport() override;

  const Capabilities& capabilities() const override { return caps_; }
  StatusOr<std::string> LocalAddress() override;
  StatusOr<PeerHandle> Connect(std::string_view peer_address) override;
  Status Disconnect(PeerHandle peer) override;
  Status PeerStatus(PeerHandle peer) override;
  PeerCounts peer_counts() override;
  StatusOr<Region> AllocateRegistered(size_t bytes, MemoryType type) override;
  StatusOr<Region> RegisterMemory(void* data, size_t bytes, MemoryType type) override;
  Status DeregisterMemory(RegionHandle region) override;
  StatusOr<std::string> ExportRegion(RegionHandle region) override;
  StatusOr<RemoteRegionHandle> ImportRegion(PeerHandle peer, std::string_view exported) override;
  Status ReleaseRemoteRegion(RemoteRegionHandle remote) override;
  StatusOr<TransferHandle> Post(const TransferRequest& request) override;
  TransferStatus Check(TransferHandle transfer) override;
  Status Wait(TransferHandle transfer, std::chrono::milliseconds timeout) override;
  Status Cancel(TransferHandle transfer) override;
  Status Release(TransferHandle transfer) override;
  int Progress() override;
  Status WaitForEvents(std::chrono::milliseconds timeout) override;
  void Wakeup() override;

 private:
  struct Peer {
    ucp_ep_h ep = nullptr;
    Status failure;                     // not OK once the peer vanished
    std::set<uint64_t> transfers;       // in-flight transfer ids with this peer
    uint64_t uuid = 0;                  // the peer transport's uuid (from its address)
    bool cma = false;                   // large sends to it take the same-host cma path
    std::unique_ptr<uint64_t[]> proof;  // cma: our copy of the peer's nonce (2 words)
  };
  struct RegionState {
    ucp_mem_h memh = nullptr;
    void* data = nullptr;
    size_t size = 0;
    bool owned = false;
  };
  struct RemoteRegion {
    uint64_t peer = 0;
    ucp_rkey_h rkey = nullptr;
    uint64_t base = 0;
    uint64_t size = 0;
  };
  struct Transfer {
    TransferOp op = TransferOp::kSend;
    uint64_t peer = 0;                  // 0 for kAnyPeer receives
    void* request = nullptr;            // the UCX request while in flight, else nullptr
    bool recv_request = false;          // request is a tag receive (cancellable)
    void* buffer = nullptr;             // the caller's buffer
    size_t capacity = 0;                // its length
    std::unique_ptr<uint8_t[]> bounce;  // small receives land here (room for a descriptor)
    uint64_t ack[2] = {0, 0};           // cma send: the receiver's ack {status code, bytes}
    bool callback_ran = false;   // a UCX callback ran inside the posting call (request freed)
    bool copying = false;        // a cma copy into buffer is queued or running (see CopyJob)
    bool want_checksum = false;  // receive: hash the bytes in the cma copy (RunCopies)
    TransferStatus status;
  };

  explicit UcxTransport(const TransportOptions& options);
  // Init's steps, in order: the UCP context (UCX's configuration with this transport's options
  // applied), the worker and this transport's address, the wake-up epoll set (enable_wakeup),
  // the capabilities.
  Status Init();
  Status CreateContext();
  Status ApplyOptions(ucp_config_t* config) const;
  Status CreateWorker();
  Status SetUpWakeup();
  void FillCapabilities();
  // Checks a descriptor's proof (its pid holds nonce_ at its proof address). Not cached: a
  // 16-byte read per descriptor, so a recycled pid cannot inherit a verdict.
  Status VerifyCmaSenderLocked(const CmaDescriptor& d);
  Status Err(ucs_status_t s, std::string_view what) const { return UcxToStatus(s, what, env_); }

  // All REQUIRE mu_ held.
  void FinishLocked(uint64_t id, ucs_status_t status, size_t bytes);
  void CompleteLocked(uint64_t id, Status status, size_t bytes);
  void FailPeerLocked(uint64_t peer_id, const Status& why);
  Status PostTagLocked(uint64_t id, Transfer& t, const TransferRequest& r);
  Status PostRmaLocked(uint64_t id, Transfer& t, const TransferRequest& r);
  Status CloseEndpointLocked(ucp_ep_h ep, bool force, std::unique_lock<std::mutex>& lock);
  Status SleepOnEventFd(std::chrono::milliseconds timeout, std::unique_lock<std::mutex>& lock);

  // A verified cma receive whose payload copy runs outside mu_ (RunCopies).
  struct CopyJob {
    uint64_t id = 0;
    CmaDescriptor descriptor{};
    void* buffer = nullptr;
    bool want_checksum = false;  // copy in blocks and hash each one while it is in the cache
    Status result;
    size_t moved = 0;
    uint64_t checksum = 0;  // Checksum64 of the moved bytes (want_checksum and a whole copy)
  };
  // Runs the queued copies with mu_ released, then acks and completes them. Returns how many.
  // REQUIRES: lock holds mu_ (held again on return).
  int RunCopies(std::unique_lock<std::mutex>& lock);
  // Acks a cma receive (job.result, the bytes moved) to its sender, and completes the receive
  // once the ack has left this process: at once where UCX sends it inline, else in AckSent. The
  // sender answers its own caller only on the ack, so a receiver that stops progressing when its
  // receive completes must not leave the ack queued (UCX queues it while the path back to the
  // sender is backed up or still wiring up). REQUIRES mu_ held.
  void AckThenCompleteLocked(CopyJob job);
  // Completes a cma receive with its copy's outcome (and checksum). REQUIRES mu_ held.
  void CompleteCopyLocked(CopyJob& job);

  // Same-host cma path (ucx_cma.cc). REQUIRE mu_ held.
  Status PostCmaSendLocked(uint64_t id, Transfer& t, const TransferRequest& r);
  void OnRecvDoneLocked(uint64_t id, ucs_status_t status, const ucp_tag_recv_info_t& info);
  void ProbeCmaLocked(Peer& peer, std::string_view header);
  std::string AddressHeader() const;

  // The transfer id of a request in a callback: its RequestId, or posting_id_ when UCX calls back
  // inside the posting call (UCX 1.13 does for a receive matching an unexpected message with
  // NO_IMM_CMPL). Resets the RequestId and marks the transfer's callback_ran.
  uint64_t TakeRequestId(void* request);

  static void SendCallback(void* request, ucs_status_t status, void* user_data);
  static void AckCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                          void* user_data);
  static void FreeOnSendDone(void* request, ucs_status_t status, void* user_data);
  static void AckSent(void* request, ucs_status_t status, void* user_data);
  static void RecvCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data);
  static void ErrorHandler(void* arg, ucp_ep_h ep, ucs_status_t status);

  const int64_t close_timeout_ms_;  // TransportOptions::close_timeout_ms
  const UcxOptions options_;
  UcxEnvironment env_;
  Capabilities caps_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;         // "KVDUCX1:" + AddressHeader() + worker address bytes
  uint64_t uuid_ = 0;           // random; identifies this transport in descriptors and acks
  uint64_t host_id_ = 0;        // hash of the boot id: equal on the same host
  uint64_t probe_word_ = 0;     // = uuid_; peers read it to test process_vm_readv
  uint64_t nonce_[2] = {0, 0};  // secret; cma senders must prove they hold it
  int event_fd_ = -1;           // -1: no wakeup support, WaitForEvents sleeps briefly
  int wake_fd_ = -1;            // eventfd written by Wakeup (and Post while someone sleeps)
  int epoll_fd_ = -1;           // epoll over event_fd_ and wake_fd_

  std::mutex mu_;
  uint64_t next_id_ = 1;                                // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, Peer> peers_;            // GUARDED_BY(mu_)
  std::unordered_map<ucp_ep_h, uint64_t> peer_by_ep_;   // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, RegionState> regions_;   // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, RemoteRegion> remotes_;  // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, Transfer> transfers_;    // GUARDED_BY(mu_)
  std::vector<void*> closing_;      // ep close requests not yet done; GUARDED_BY(mu_)
  std::atomic<int> sleepers_{0};    // threads blocked on event_fd_
  uint64_t posting_id_ = 0;         // the transfer being posted; GUARDED_BY(mu_)
  std::vector<CopyJob> copy_jobs_;  // verified cma receives to copy; GUARDED_BY(mu_)
  bool work_posted_ = false;        // a Post since the last WaitForEvents; GUARDED_BY(mu_)
  PeerCounts peer_totals_;          // connects, disconnects, vanished; GUARDED_BY(mu_)
  // Copied (or refused) cma receives whose ack is still queued in UCX, by transfer id: each
  // completes in AckSent. GUARDED_BY(mu_)
  std::unordered_map<uint64_t, CopyJob> acking_;
};

}  // namespace kvd::transport::ucx
