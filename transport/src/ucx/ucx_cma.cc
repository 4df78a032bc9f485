// UcxTransport: the same-host bulk path. A large send posts a receive for the ack and sends a
// CmaDescriptor; the receiver's matching receive gets the descriptor, pulls the bytes with
// process_vm_readv straight into the caller's buffer, and acks. See options.h
// (cma_threshold_bytes) for why and when.
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <string>

#include "kvd/common/hash.h"
#include "kvd/common/logging.h"
#include "ucx/ucx_transport.h"

namespace kvd::transport::ucx {
namespace {

void PutU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
uint64_t GetU64(std::string_view in, size_t index) {
  uint64_t v = 0;
  std::memcpy(&v, in.data() + index * 8, 8);
  return v;
}

// Copies `length` bytes at `remote` in process `pid` to `local`; returns bytes copied and sets
// *err to errno on failure.
size_t ReadRemote(pid_t pid, void* local, uint64_t remote, size_t length, int* err) {
  size_t done = 0;
  *err = 0;
  while (done < length) {
    iovec l{static_cast<char*>(local) + done, length - done};
    iovec r{reinterpret_cast<void*>(remote + done), length - done};
    ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return done;
    }
    if (n == 0) {
      *err = EFAULT;
      return done;
    }
    done += static_cast<size_t>(n);
  }
  return done;
}

// ReadRemote in blocks that stay in the cache, each hashed into *checksum right after it lands:
// the receiver's verify costs no second pass over memory. Same errors as ReadRemote; *checksum
// is meaningful only when all `length` bytes moved.
size_t ReadRemoteHashed(pid_t pid, void* local, uint64_t remote, size_t length, int* err,
                        uint64_t* checksum) {
  // Small enough for the L2 of current x86 cores next to the kernel's copy; large enough that
  // the syscall per block (~1 us) is a few percent of the block's copy.
  constexpr size_t kBlock = 256 * 1024;
  Checksum64Stream hash;
  size_t done = 0;
  *err = 0;
  while (done < length) {
    const size_t n = std::min(kBlock, length - done);
    auto* block = static_cast<char*>(local) + done;
    const size_t got = ReadRemote(pid, block, remote + done, n, err);
    done += got;
    if (*err != 0) return done;
    hash.Update(block, got);
  }
  *checksum = hash.Digest();
  return done;
}

}  // namespace

uint64_t HostId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(f >> id) || id.empty()) return 0;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : id) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h == 0 ? 1 : h;
}

std::string UcxTransport::AddressHeader() const {
  std::string h;
  PutU64(h, uuid_);
  PutU64(h, host_id_);
  PutU64(h, static_cast<uint64_t>(getpid()));
  PutU64(h, options_.cma_threshold_bytes > 0 ? kAddressFlagCma : 0);
  PutU64(h, reinterpret_cast<uint64_t>(&probe_word_));
  PutU64(h, nonce_[0]);
  PutU64(h, nonce_[1]);
  return h;
}

void UcxTransport::ProbeCmaLocked(Peer& peer, std::string_view header) {
  peer.uuid = GetU64(header, 0);
  const uint64_t host = GetU64(header, 1);
  const auto pid = static_cast<pid_t>(GetU64(header, 2));
  const uint64_t flags = GetU64(header, 3);
  const uint64_t probe = GetU64(header, 4);
  peer.cma = false;
  if (options_.cma_threshold_bytes <= 0 || (flags & kAddressFlagCma) == 0 || host == 0 ||
      host != host_id_) {
    return;
  }
  uint64_t value = 0;
  int err = 0;
  if (ReadRemote(pid, &value, probe, sizeof(value), &err) == sizeof(value) && value == peer.uuid) {
    peer.cma = true;
    peer.proof.reset(new uint64_t[2]{GetU64(header, 5), GetU64(header, 6)});
  } else {
    KVD_LOG(INFO) << "same-host peer but process_vm_readv is not allowed; large sends go "
                     "through UCX"
                  << Kv("peer_pid", pid) << Kv("errno", std::strerror(err));
  }
}

Status UcxTransport::PostCmaSendLocked(uint64_t id, Transfer& t, const TransferRequest& r) {
  // 1. The receive for the ack (so the ack can never arrive unexpected).
  ucp_request_param_t ack_param{};
  ack_param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  ack_param.user_data = this;
  ack_param.cb.recv = &UcxTransport::AckCallback;
  ucs_status_ptr_t ack = ucp_tag_recv_nbx(
      worker_, t.ack, sizeof(t.ack), kInternalTagBit | kAckTagBit | id, ~ucp_tag_t{0}, &ack_param);
  if (UCS_PTR_IS_ERR(ack)) return Err(UCS_PTR_STATUS(ack), "ack receive post");
  if (ack == nullptr || t.callback_ran) {
    return Status::Internal("cma ack completed before its descriptor was sent");
  }
  RequestId(ack) = id;
  t.request = ack;
  t.recv_request = true;

  // 2. The descriptor (heap: it must outlive this call if UCX queues it).
  auto* d = new (::operator new(sizeof(CmaDescriptor)))
      CmaDescriptor{kCmaMagic,
                    uuid_,
                    id,
                    reinterpret_cast<uint64_t>(r.buffer),
                    r.length,
                    static_cast<uint64_t>(getpid()),
                    reinterpret_cast<uint64_t>(peers_[r.peer.id].proof.get())};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = d;
  param.cb.send = &UcxTransport::FreeOnSendDone;
  ucs_status_ptr_t req =
      ucp_tag_send_nbx(peers_[r.peer.id].ep, d, sizeof(*d), kInternalTagBit | r.tag, &param);
  if (req == nullptr) {
    ::operator delete(d);
  } else if (UCS_PTR_IS_ERR(req)) {
    ::operator delete(d);
    t.request = nullptr;
    ucp_request_cancel(worker_, ack);  // its callback finds the transfer gone (Post erases it)
    return Err(UCS_PTR_STATUS(req), "cma descriptor send");
  }
  return Status::Ok();
}

void UcxTransport::FreeOnSendDone(void* request, ucs_status_t, void* user_data) {
  // user_data is a CmaDescriptor (trivially destructible).
  ::operator delete(user_data);
  ucp_request_free(request);
}

void UcxTransport::AckCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t*,
                               void* user_data) {
  auto* self = static_cast<UcxTransport*>(user_data);
  const uint64_t id = self->TakeRequestId(request);
  ucp_request_free(request);
  auto it = self->transfers_.find(id);
  if (it == self->transfers_.end()) return;
  Transfer& t = it->second;
  if (status != UCS_OK) {
    self->FinishLocked(id, status, 0);
    return;
  }
  const auto code = static_cast<StatusCode>(t.ack[0]);
  if (code == StatusCode::kOk) {
    self->CompleteLocked(id, Status::Ok(), t.capacity);
  } else {
    self->CompleteLocked(id,
                         Status(code, "send transfer " + std::to_string(id) +
                                          ": the receiver could not take the bytes (" +
                                          std::string(StatusCodeName(code)) + ")"),
                         0);
  }
}

namespace {

// An ack on its way back to a cma sender: its payload {status code, bytes} and the receive that
// completes once it has left (AckSent).
struct AckSend {
  uint64_t payload[2];
  UcxTransport* transport;
  uint64_t recv_id;
};

}  // namespace

void UcxTransport::AckThenCompleteLocked(CopyJob job) {
  const uint64_t sender = job.descriptor.sender_uuid;
  Peer* back = nullptr;
  for (auto& [pid, p] : peers_) {
    if (p.uuid == sender && p.failure.ok()) back = &p;
  }
  if (back == nullptr) {
    KVD_LOG(WARNING) << "cma receive from a peer this transport is not connected to: the sender "
                        "will time out (Connect to the sender's address)"
                     << Kv("seq", job.descriptor.seq);
    CompleteCopyLocked(job);
    return;
  }
  auto* ack = new AckSend{
      {static_cast<uint64_t>(job.result.code()), job.result.ok() ? job.moved : 0}, this, job.id};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = ack;
  param.cb.send = &UcxTransport::AckSent;
  ucs_status_ptr_t req =
      ucp_tag_send_nbx(back->ep, ack->payload, sizeof(ack->payload),
                       kInternalTagBit | kAckTagBit | job.descriptor.seq, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {  // sent inline, or failed (the sender times out)
    delete ack;
    CompleteCopyLocked(job);
    return;
  }
  // Queued: the receive stays in progress (and out of Disconnect's reach, as a running copy is)
  // so that whoever waits for it keeps progressing the worker until the ack has left.
  auto t = transfers_.find(job.id);
  if (t != transfers_.end()) t->second.copying = true;
  acking_.insert_or_assign(job.id, std::move(job));
}

void UcxTransport::AckSent(void* request, ucs_status_t, void* user_data) {
  // Runs inside ucp_worker_progress (or another UCX call), i.e. with mu_ held. Whether the ack
  // went out or its endpoint closed, the receive's own outcome is its copy's.
  auto* ack = static_cast<AckSend*>(user_data);
  UcxTransport* self = ack->transport;
  auto it = self->acking_.find(ack->recv_id);
  if (it != self->acking_.end()) {
    CopyJob job = std::move(it->second);
    self->acking_.erase(it);
    self->CompleteCopyLocked(job);
  }
  delete ack;
  ucp_request_free(request);
}

void UcxTransport::CompleteCopyLocked(CopyJob& job) {
  const size_t bytes = job.result.ok() ? job.moved : 0;
  auto it = transfers_.find(job.id);
  if (it != transfers_.end()) it->second.copying = false;
  const bool hashed = job.want_checksum && job.result.ok();
  CompleteLocked(job.id, std::move(job.result), bytes);
  if (hashed && it != transfers_.end() && it->second.status.state == TransferState::kDone) {
    it->second.status.checksum_valid = true;
    it->second.status.checksum = job.checksum;
  }
}

Status UcxTransport::VerifyCmaSenderLocked(const CmaDescriptor& d) {
  uint64_t proof[2] = {0, 0};
  int err = 0;
  const size_t got = ReadRemote(static_cast<pid_t>(d.pid), proof, d.proof, sizeof(proof), &err);
  if (err == ESRCH) {  // the sender died between its descriptor and our read
    return Status::Unavailable("cma sender process " + std::to_string(d.pid) + " vanished");
  }
  if (got != sizeof(proof) || proof[0] != nonce_[0] || proof[1] != nonce_[1]) {
    KVD_LOG(WARNING) << "refused a cma descriptor whose sender does not hold this transport's "
                        "nonce"
                     << Kv("pid", d.pid) << Kv("errno", err);
    return Status::FailedPrecondition(
        "cma descriptor refused: the sending process could not prove it connected to this "
        "transport");
  }
  return Status::Ok();
}

void UcxTransport::OnRecvDoneLocked(uint64_t id, ucs_status_t status,
                                    const ucp_tag_recv_info_t& info) {
  auto it = transfers_.find(id);
  if (it == transfers_.end()) return;  // released after a peer failure
  Transfer& t = it->second;
  t.request = nullptr;
  if (t.status.state != TransferState::kInProgress) return;
  if (status != UCS_OK) {
    FinishLocked(id, status, 0);
    return;
  }
  const uint8_t* landed = t.bounce ? t.bounce.get() : static_cast<const uint8_t*>(t.buffer);
  if ((info.sender_tag & kInternalTagBit) == 0) {  // an inline message
    if (t.bounce) {
      if (info.length > t.capacity) {
        FinishLocked(id, UCS_ERR_MESSAGE_TRUNCATED, 0);
        return;
      }
      if (info.length > 0) std::memcpy(t.buffer, landed, info.length);
    }
    CompleteLocked(id, Status::Ok(), info.length);
    return;
  }
  CmaDescriptor d{};
  if (info.length != kDescriptorSize) {
    CompleteLocked(id, Status::DataLoss("malformed cma descriptor"), 0);
    return;
  }
  std::memcpy(&d, landed, sizeof(d));
  if (d.magic != kCmaMagic) {
    CompleteLocked(id, Status::DataLoss("cma descriptor with a bad magic"), 0);
    return;
  }
  Status result = VerifyCmaSenderLocked(d);
  if (result.ok() && d.length > t.capacity) {
    result = Status::OutOfRange(
        "recv transfer " + std::to_string(id) + ": message of " + std::to_string(d.length) +
        " bytes is longer than the receive buffer of " + std::to_string(t.capacity));
  }
  if (!result.ok()) {
    AckThenCompleteLocked(CopyJob{id, d, t.buffer, false, std::move(result), 0, 0});
    return;
  }
  // The copy runs in RunCopies, outside mu_, so posting threads are not held up by it.
  t.copying = true;
  copy_jobs_.push_back(CopyJob{id, d, t.buffer, t.want_checksum, Status::Ok(), 0, 0});
}

int UcxTransport::RunCopies(std::unique_lock<std::mutex>& lock) {
  int done = 0;
  while (!copy_jobs_.empty()) {
    std::vector<CopyJob> jobs;
    jobs.swap(copy_jobs_);
    lock.unlock();
    for (CopyJob& job : jobs) {
      const CmaDescriptor& d = job.descriptor;
      int err = 0;
      job.moved = job.want_checksum ? ReadRemoteHashed(static_cast<pid_t>(d.pid), job.buffer,
                                                       d.address, d.length, &err, &job.checksum)
                                    : ReadRemote(static_cast<pid_t>(d.pid), job.buffer, d.address,
                                                 d.length, &err);
      if (err == ESRCH) {
        job.result =
            Status::Unavailable("recv transfer " + std::to_string(job.id) + ": sender process " +
                                std::to_string(d.pid) + " vanished during the copy");
      } else if (err == EPERM) {
        job.result = Status::FailedPrecondition(
            "process_vm_readv of the sender is not permitted (different user or ptrace "
            "restrictions): set TransportOptions.cma_threshold_bytes=0");
      } else if (err != 0) {
        job.result =
            Status::Unavailable("recv transfer " + std::to_string(job.id) +
                                ": reading the sender's buffer failed after " +
                                std::to_string(job.moved) + " bytes: " + std::strerror(err));
      }
    }
    lock.lock();
    for (CopyJob& job : jobs) {
      AckThenCompleteLocked(std::move(job));
      ++done;
    }
  }
  return done;
}

}  // namespace kvd::transport::ucx
