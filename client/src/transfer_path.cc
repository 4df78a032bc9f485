// Bulk paths over a transport (transfer_path.h).
#include "transfer_path.h"

#include <algorithm>
#include <string>

#include "path_context.h"
#include "kvd/common/hash.h"

namespace kvd::client::internal {

using transport::TransferHandle;
using transport::TransferOp;
using transport::TransferState;

TransferPath::TransferPath(PathContext& client, std::unique_ptr<transport::Transport> transport,
                           const char* context, bool over_nccl)
    : client_(client), transport_(std::move(transport)), context_(context), over_nccl_(over_nccl) {}

TransferPath::~TransferPath() {
  if (peer_.valid()) transport_->Disconnect(peer_).IgnoreError();
}

void TransferPath::Drop(TransferHandle transfer) {
  transport_->Cancel(transfer).IgnoreError();
  transport_->Wait(transfer, std::chrono::milliseconds(client_.options().transport.close_timeout_ms))
      .IgnoreError();
  transport_->Release(transfer).IgnoreError();
}

Status TransferPath::Finish(TransferHandle transfer) {
  const int64_t timeout_ms = client_.options().transfer_timeout_ms;
  auto deadline = DeadlineIn(timeout_ms);
  while (true) {
    Status s = transport_->Wait(transfer, std::chrono::milliseconds(2));
    if (s.ok()) {
      transport_->Release(transfer).IgnoreError();
      return s;
    }
    if (s.code() != StatusCode::kDeadlineExceeded) {
      transport_->Release(transfer).IgnoreError();
      return s.WithContext(context_);
    }
    Status c = client_.channel().Pump();  // a dead daemon shows on the control socket first
    if (!c.ok() || Clock::now() > deadline) {
      Drop(transfer);
      return c.ok() ? Status::DeadlineExceeded("bulk transfer did not finish within " +
                                               std::to_string(timeout_ms) + " ms")
                    : c;
    }
  }
}

// ---- put ----

StatusOr<std::vector<PutResult>> TransferPath::PutWindow(std::span<const PutItem> items) {
  KVD_RETURN_IF_ERROR(EnsurePeer());
  const size_t n = items.size();
  KVD_ASSIGN_OR_RETURN(const std::vector<uint64_t> req,
                       client_.SendReservesLocked(items, {.over_nccl = over_nccl_}));
  std::vector<PutResult> out(n);
  std::vector<uint64_t> reservation(n, 0), tag(n, 0);
  std::vector<uint64_t> to_abort;
  Status first_error;
  for (size_t i = 0; i < n; ++i) {
    auto rv = client_.AwaitReserveLocked(req[i], items[i], &out[i]);
    if (!rv.ok()) {
      if (first_error.ok()) first_error = rv.status();
      continue;
    }
    reservation[i] = rv->id;
    tag[i] = rv->tag;
    if (!out[i].already_stored) to_abort.push_back(reservation[i]);
  }
  std::vector<TransferHandle> sends(n);
  std::vector<uint64_t> checksum(n, 0);
  if (first_error.ok()) first_error = PostSends(items, out, tag, sends, checksum);
  if (!first_error.ok()) {
    FinishSends(sends, &first_error);  // drops them
    client_.AbortReservationsLocked(to_abort);
    return first_error;
  }
  // Phase 3: commit with checksums (pipelined). The commits go out while the bytes still move:
  // the daemon's commit waits for its receive to end, so the client does not wait for each
  // send's completion first (that would add a transport ack and a control round trip per
  // window). With TestHooks::before_commit set, the sends finish before the hook and the commits.
  const bool commit_early = !client_.hooks().before_commit;
  if (!commit_early) {
    FinishSends(sends, &first_error);
    if (!first_error.ok()) {
      client_.AbortReservationsLocked(to_abort);
      return first_error;
    }
    client_.hooks().before_commit();
  }
  auto commit_req = client_.SendCommitsLocked(out, reservation, checksum, /*named=*/nullptr,
                                              /*reserve_next=*/0);
  if (!commit_req.ok()) {
    Status dropped = commit_req.status();
    FinishSends(sends, &dropped);
    return commit_req.status();
  }
  // A failed send fails its commit at the daemon too (its receive errs or times out), so every
  // commit reply is still awaited; the send's own error is the one returned.
  if (commit_early) FinishSends(sends, &first_error);
  client_.AwaitCommitsLocked(*commit_req, out, &first_error, /*offered=*/nullptr);
  if (!first_error.ok()) return first_error;
  return out;
}

Status TransferPath::PostSends(std::span<const PutItem> items, const std::vector<PutResult>& out,
                               const std::vector<uint64_t>& tag, std::vector<TransferHandle>& sends,
                               std::vector<uint64_t>& checksum) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (out[i].already_stored) continue;
    // A send only reads its buffer.
    auto h = Post(TransferOp::kSend, tag[i], const_cast<void*>(items[i].data), items[i].bytes);
    if (!h.ok()) return h.status().WithContext("sending chunk bytes");
    sends[i] = *h;
    // Computed while the bytes move (both only read the buffer).
    KVD_ASSIGN_OR_RETURN(checksum[i], SentChecksum(i, items[i]));
  }
  return Status::Ok();
}

void TransferPath::FinishSends(std::vector<TransferHandle>& sends, Status* first_error) {
  for (TransferHandle& h : sends) {
    if (!h.valid()) continue;
    if (!first_error->ok()) {
      Drop(h);
    } else if (Status s = Finish(h); !s.ok()) {
      *first_error = s.WithContext("sending chunk bytes");
    }
    h = {};
  }
}

// ---- get ----

struct TransferPath::PendingGet {
  TransferHandle recv;
  uint64_t request = 0;
  bool transfer_done = false;
  size_t received = 0;
  uint64_t checksum = 0;  // of the received bytes, computed while the reply is on its way
  std::unique_ptr<proto::DecodedMessage> reply;
  bool finished = false;
  Status status;
};

StatusOr<std::vector<GetResult>> TransferPath::GetWindow(uint64_t lease_id,
                                                         std::span<const GetItem> items) {
  KVD_RETURN_IF_ERROR(EnsurePeer());
  std::vector<PendingGet> gets(items.size());
  KVD_RETURN_IF_ERROR(PostGets(lease_id, items, gets));
  AwaitGets(items, gets);
  return FinishGets(lease_id, items, gets);
}

Status TransferPath::PostGets(uint64_t lease_id, std::span<const GetItem> items,
                              std::vector<PendingGet>& gets) {
  // Every receive is posted before its Get: the daemon sends into posted buffers.
  Status error;
  for (size_t i = 0; i < items.size() && error.ok(); ++i) {
    const GetItem& item = items[i];
    if (item.out == nullptr && item.capacity > 0) {
      error = Status::InvalidArgument("get: null output buffer");
      break;
    }
    const uint64_t tag = client_.NextTag();
    auto h = Post(TransferOp::kRecv, tag, item.out, item.capacity);
    if (!h.ok()) {
      error = h.status().WithContext("posting a receive");
      break;
    }
    gets[i].recv = *h;
    auto id = client_.channel().Send([&](proto::Request::Builder r) {
      auto g = r.initGet();
      g.setLeaseId(lease_id);
      g.setChunkIndex(item.chunk_index);
      g.setTag(tag);
      g.setBufferBytes(item.capacity);
      g.setForm(static_cast<proto::ChunkForm>(item.form));
      g.setOverNccl(over_nccl_);
    });
    if (!id.ok()) {
      error = id.status();
      break;
    }
    gets[i].request = *id;
  }
  if (!error.ok()) {
    for (PendingGet& g : gets) {
      if (g.recv.valid()) Drop(g.recv);
    }
  }
  return error;
}

void TransferPath::AwaitGets(std::span<const GetItem> items, std::vector<PendingGet>& gets) {
  // Transfers and replies are driven together: an error reply (NOT_FOUND, ...) means no bytes
  // come, so the receive is cancelled at once instead of waiting for its timeout.
  Channel& channel = client_.channel();
  const int64_t timeout_ms = client_.options().transfer_timeout_ms;
  auto deadline = DeadlineIn(timeout_ms);
  size_t remaining = gets.size();
  while (remaining > 0) {
    auto open = std::find_if(gets.begin(), gets.end(),
                             [](const PendingGet& g) { return !g.finished && !g.transfer_done; });
    if (open != gets.end()) {
      transport_->Wait(open->recv, std::chrono::milliseconds(1)).IgnoreError();
    } else {
      // Every transfer is over: sleep on the control socket until a reply arrives (no spinning,
      // which would steal the CPU the daemon needs to answer).
      bool buffered = false;
      for (const PendingGet& g : gets) buffered |= !g.finished && channel.HasReply(g.request);
      if (!buffered) channel.connection()->Readable(std::min(deadline, DeadlineIn(50)));
    }
    for (size_t i = 0; i < gets.size(); ++i) {
      if (!gets[i].finished && StepGet(items[i], gets[i])) --remaining;
    }
    if (remaining > 0 && Clock::now() > deadline) {
      for (PendingGet& g : gets) {
        if (g.finished) continue;
        g.status = Status::DeadlineExceeded("get: no bytes or reply from kvd within " +
                                            std::to_string(timeout_ms) + " ms");
        if (!g.transfer_done) channel.Break(g.status).IgnoreError();
      }
      return;
    }
  }
}

bool TransferPath::StepGet(const GetItem& item, PendingGet& g) {
  if (!g.transfer_done) {
    auto st = transport_->Check(g.recv);
    if (st.state == TransferState::kDone) {
      g.transfer_done = true;
      g.received = st.bytes;
      // The daemon answers only after it sees the transfer end: checksum meanwhile.
      auto sum = ReceivedChecksum(item, st);
      if (sum.ok()) g.checksum = *sum;
      g.status = sum.status();
    } else if (st.state == TransferState::kError) {
      g.transfer_done = true;
      g.status = st.status.WithContext("receiving chunk bytes");
    }
  }
  if (!g.reply) {
    auto r = client_.channel().Poll(g.request);
    if (!r.ok()) {
      g.status = r.status();
      if (!g.transfer_done) {
        Drop(g.recv);  // no bytes will come for a failed Get
        g.transfer_done = true;
        g.recv = {};
      }
      g.finished = true;
      return true;
    }
    g.reply = std::move(r).value();
  }
  g.finished = g.reply && g.transfer_done;
  return g.finished;
}

StatusOr<std::vector<GetResult>> TransferPath::FinishGets(uint64_t lease_id,
                                                          std::span<const GetItem> items,
                                                          std::vector<PendingGet>& gets) {
  std::vector<GetResult> out(items.size());
  Status first_error;
  for (size_t i = 0; i < items.size(); ++i) {
    PendingGet& g = gets[i];
    if (g.recv.valid()) {
      if (g.transfer_done) {
        transport_->Release(g.recv).IgnoreError();
      } else {
        Drop(g.recv);
      }
    }
    if (!g.status.ok()) {
      if (first_error.ok()) first_error = g.status;
      continue;
    }
    GetReply got;
    Status st = ReadGetReply(*g.reply, &got);
    out[i] = got.result;
    if (st.ok() && out[i].bytes != g.received) {
      st = Status::DataLoss("get: kvd announced " + std::to_string(out[i].bytes) + " bytes but " +
                            std::to_string(g.received) + " arrived");
    }
    if (st.ok()) st = VerifyGet("get", out[i], g.checksum, lease_id, items[i].chunk_index);
    if (!st.ok() && first_error.ok()) first_error = st;
  }
  if (!first_error.ok()) return first_error;
  return out;
}

// ---- UcxPath ----

StatusOr<std::unique_ptr<UcxPath>> UcxPath::Create(PathContext& client,
                                                   const transport::TransportOptions& options) {
  auto t = transport::CreateTransport(options);
  if (!t.ok()) return t.status().WithContext("creating the client transport");
  return std::unique_ptr<UcxPath>(
      new UcxPath(client, std::move(t).value(), "bulk transfer", /*over_nccl=*/false));
}

Status UcxPath::EnsurePeer() {
  if (peer_.valid()) return Status::Ok();
  auto peer = transport_->Connect(daemon_address_);
  if (!peer.ok()) return peer.status().WithContext("connecting the transport to kvd");
  peer_ = *peer;
  return Status::Ok();
}

StatusOr<std::vector<PutResult>> UcxPath::PutWindow(std::span<const PutItem> items) {
  std::vector<PutItem> staged(items.begin(), items.end());
  size_t used = 0;
  for (PutItem& it : staged) {
    const bool data_on_device = IsDevice(it.data);
    if (it.window_queries.empty() && !data_on_device) continue;
    if (used == put_staging_.size()) put_staging_.emplace_back();
    KVD_RETURN_IF_ERROR(Stage(it, data_on_device, put_staging_[used++]));
  }
  return TransferPath::PutWindow(staged);
}

Status UcxPath::Stage(PutItem& it, bool data_on_device, StagingBuffer& staging) {
  const size_t qbytes = it.window_queries.size() * sizeof(float);
  uint8_t* buf = staging.Reserve(it.bytes + qbytes,
                                 data_on_device || IsDevice(it.window_queries.data()));
  KVD_RETURN_IF_ERROR(CopyToHostFrom(buf, it.data, it.bytes, it.cuda_stream, "put data"));
  KVD_RETURN_IF_ERROR(CopyToHostFrom(buf + it.bytes, it.window_queries.data(), qbytes,
                                     it.cuda_stream, "put window queries"));
  it.data = buf;
  it.bytes += qbytes;
  it.window_queries = {};
  return Status::Ok();
}

StatusOr<std::vector<GetResult>> UcxPath::GetWindow(uint64_t lease_id,
                                                    std::span<const GetItem> items) {
  std::vector<GetItem> staged(items.begin(), items.end());
  if (get_staging_.size() < items.size()) get_staging_.resize(items.size());
  for (size_t i = 0; i < staged.size(); ++i) {
    if (IsDevice(staged[i].out)) {
      staged[i].out = get_staging_[i].Reserve(staged[i].capacity, true);
    }
  }
  KVD_ASSIGN_OR_RETURN(std::vector<GetResult> out, TransferPath::GetWindow(lease_id, staged));
  for (size_t i = 0; i < staged.size(); ++i) {
    if (staged[i].out == items[i].out) continue;
    KVD_RETURN_IF_ERROR(CopyFromHostTo(items[i].out, staged[i].out, out[i].bytes,
                                       items[i].cuda_stream, "get buffer"));
  }
  return out;
}

StatusOr<TransferHandle> UcxPath::Post(TransferOp op, uint64_t tag, void* buffer, size_t bytes) {
  if (op == TransferOp::kSend) return transport_->PostSend(peer_, tag, buffer, bytes);
  // Where the transport copies the bytes itself (same host), it also hashes them.
  return transport_->PostRecv(peer_, tag, buffer, bytes, {.want_checksum = true});
}

StatusOr<uint64_t> UcxPath::SentChecksum(size_t, const PutItem& item) {
  return Checksum64(item.data, item.bytes);
}

StatusOr<uint64_t> UcxPath::ReceivedChecksum(const GetItem& item,
                                             const transport::TransferStatus& done) {
  if (done.checksum_valid) return done.checksum;
  return Checksum64(item.out, done.bytes);
}

}  // namespace kvd::client::internal
