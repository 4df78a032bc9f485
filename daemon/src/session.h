// One control connection (TCP or unix socket). Private to daemon/.
//
// Requests are dispatched in arrival order on the io_context thread. Most complete at once; the
// ones that wait for a transfer (Commit, Get, Abort) continue in a coroutine of their own while
// the connection keeps reading (pipelining, at most limits.max_inflight_per_session at once).
// Replies are written strictly in request order, whatever order their handlers finish in.
//
// Teardown (client gone, transport peer failed, Bye, refused Hello, bad frame, shutdown): stop
// reading, cancel this connection's transfers, wait for its handlers, close its transport
// endpoint (off the io_context thread), release its transfer handles, then reclaim its
// reservations, leases and reads in the host tier (HostTier::ReclaimOwner with owner = session
// id). Buffers a posted transfer may still write are never returned to the arena before the
// transport says the transfer ended.
//
// Threading: every method runs on the io_context thread.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "asio_util.h"
#include "bulk_link.h"
#include "event_hub.h"
#include "get_request.h"
#include "hello_check.h"
#include "idle_watch.h"
#include "peer_fetch.h"
#include "put_ledger.h"
#include "read_buffer.h"
#include "reply_writer.h"
#include "kvd/common/layout.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "kvd/transport/types.h"
#include "server_impl.h"
#include "session_services.h"

namespace kvd::daemon {

class Session : public std::enable_shared_from_this<Session> {
 public:
  using Socket = asio::generic::stream_protocol::socket;

  Session(Server::Impl* server, uint64_t id, Socket socket, std::string peer);
  // How the connection arrived (before Start): the handshake's authentication uses it.
  void SetPeerInfo(PeerInfo info) { peer_info_ = info; }
  ~Session();

  // Spawns the read and write loops.
  void Start();
  // Closes the connection now (shutdown): teardown follows as described above.
  void Close(const std::string& reason);
  // Admission made room for a newcomer by closing this connection (no Hello yet): it gets `why`
  // as an Error, then the connection closes.
  void Displace(const Status& why);
  // Expires this connection's reservations whose deadline (Clock ns) passed and that no
  // Commit/Abort is working on: receive cancelled, space returned, late Commit gets ABORTED.
  void ExpireReservations(int64_t now_ns);

  uint64_t id() const { return id_; }

 private:
  // A chunk as a put describes it (Reserve, InlinePut, Commit.chunk).
  struct PutShape {
    Hash128 hash;
    uint32_t tokens = 0;
    uint64_t bytes = 0;
    uint64_t first_position = 0;
    uint32_t window = 0;  // window-query tokens after the K/V bytes
  };
  static PutShape ShapeOf(proto::Reserve::Reader chunk);
  // A put's checks passed and its space is reserved (or the chunk exists already).
  struct ReservedPut {
    bool already_stored = false;  // dedup: nothing reserved
    storage::Reservation reservation;
    PendingPut put;  // not yet in the ledger
  };

  // ---- I/O (session.cc) ----
  asio::awaitable<void> ReadLoop();
  // What ReadLoop has read: unhandled bytes are buffer[begin, end).
  struct Inbox {
    ReadBuffer buffer;
    size_t begin = 0;
    size_t end = 0;
    bool frame_deadline_armed = false;  // armed for the partial frame at buffer[begin]
  };
  // The payload length a frame header announces, within limits.max_frame_bytes (before Hello:
  // limits.max_frame_bytes_before_hello too, OUT_OF_RANGE saying so).
  StatusOr<uint32_t> FrameLength(const uint8_t* header) const;
  // True when limits.max_inflight_per_session replies are pending.
  bool AtInflightLimit() const;
  // Handles the complete frames in `in`, stopping at the pipelining limit (returns true: a header
  // or more is still buffered) or at a bad header (an error reply, then close).
  bool HandleBufferedFrames(Inbox& in);
  // Moves the partial frame to the front of `in`, shrinks a large buffer no longer needed, and
  // grows it for a frame larger than it (within the frame budget). False when the budget refuses
  // the frame: an error reply, then close.
  bool MakeRoomToRead(Inbox& in);
  // Logs why reading ended (a truncated frame is a bad frame).
  void LogReadEnd(const boost::system::error_code& ec, size_t buffered);
  asio::awaitable<void> WriteLoop();
  asio::awaitable<void> Teardown();
  // Teardown's steps: cancels every transfer of this connection (puts' receives, Gets' sends);
  // closes the session's peer on `link` off the io_context thread, if it has one; ends every open put in the ledger (kReclaimed), waiting
  // for its receive to end, and returns how many did not (their space must not be reused).
  void CancelTransfers();
  asio::awaitable<void> DisconnectPeer(BulkLink link);
  asio::awaitable<uint64_t> EndOpenPuts();
  void HandleFrame(std::unique_ptr<proto::DecodedMessage> message);
  // Observes the latency of request `seq` if it is timed (Lookup, Commit, InlinePut, Get).
  void ObserveLatency(uint64_t seq);
  // Stores the reply of request `seq` (ReplyWriter::Add) and observes its latency if timed.
  void Complete(uint64_t seq, Frame frame);
  // The same, and the frame's first byte carries `fd` (ReplyWriter::AddWithFd; takes the fd).
  void CompleteWithFd(uint64_t seq, Frame frame, int fd);
  void CompleteError(uint64_t seq, uint64_t request_id, const Status& status);
  // Close the connection once the reply of `seq` is written; stop reading now.
  void CloseAfter(uint64_t seq);
  // Runs `body` as a handler coroutine (counted, so teardown waits for it).
  void SpawnHandler(asio::awaitable<void> body);
  // Waits for a transfer of `link` (on its progress thread) up to `timeout_ms`.
  asio::awaitable<transport::TransferStatus> AwaitTransfer(transport::TransferHandle h,
                                                           int64_t timeout_ms, BulkLink link);
  // Cancels a transfer and waits until the transport confirms it ended (up to the transport's
  // close timeout); releases the handle if it did. Returns false if it is still in flight.
  asio::awaitable<bool> CancelAndRelease(transport::TransferHandle h, BulkLink link);
  // The daemon's transport and progress loop of `link`.
  transport::Transport* Bulk(BulkLink link);
  ProgressLoop& BulkProgress(BulkLink link);

  // A shared-memory slot (PrepareShm): segment, offset in it, generation, and the segment's memfd
  // when the client has not got this generation yet (fd -1 otherwise).
  struct ShmRef {
    uint32_t segment = 0;
    uint64_t offset = 0;
    uint64_t generation = 0;
    int fd = -1;
  };

  // ---- requests: dispatch and Hello (session_dispatch.cc), lookup and leases
  // (session_lookup.cc), put (session_put.cc, session_commit.cc), get (session_get.cc),
  // shared memory (session_shm.cc) ----
  // Refuses anything before Hello, applies the releases a request carries, refuses a switched-off
  // kind, starts the latency timer of a timed one, then HandleRequest.
  Status Dispatch(uint64_t seq, proto::Request::Reader request);
  // Request.releaseReads / releaseLeases, where the protocol options take them.
  void ReleasePiggybacked(proto::Request::Reader request);
  // Calls the handler of the request's kind (INVALID_ARGUMENT for a kind this daemon lacks).
  void HandleRequest(uint64_t seq, uint64_t rid, proto::Request::Reader request);
  // CheckHello (hello_check.h), then AnswerHello, or the refusal and close.
  void HandleHello(uint64_t seq, uint64_t rid, proto::Hello::Reader hello);
  // Applies a Hello's grant to this session and answers with HelloReply.
  void AnswerHello(uint64_t seq, uint64_t rid, Grant grant);
  void HandleLookup(uint64_t seq, uint64_t rid, proto::Lookup::Reader lookup);
  // `peers`: a cluster-scope lookup's answers of the other members (null: local scope).
  void CompleteLookup(uint64_t seq, uint64_t rid, const StatusOr<storage::LookupResult>& result,
                      int64_t ttl, const PeerLookupOutcome* peers = nullptr);
  asio::awaitable<void> FinishLookup(uint64_t seq, uint64_t rid,
                                     std::shared_ptr<const storage::LookupRequest> request,
                                     int64_t ttl);
  // A cluster-scope lookup (peer_fetch.h) on the worker pool: the local lookup, the peers' answers
  // and fetch, then the local lookup again when chunks were fetched.
  asio::awaitable<void> FinishClusterLookup(uint64_t seq, uint64_t rid,
                                            std::shared_ptr<const storage::LookupRequest> request,
                                            int64_t ttl);
  // Placement (cluster_placement.h): answered inline from the member list.
  void HandlePlacement(uint64_t seq, uint64_t rid, proto::Placement::Reader placement);
  // The checks of a put (Reserve, InlinePut; `op` names it in errors): engine role, tokens, window
  // and the policy's needs, bytes == layout.ChunkBytes(tokens) + window queries, max_chunk_bytes;
  // then the ingest admission (compressing model) and the host-tier reservation (capacity,
  // namespace quota). A dedup is counted and returned as already_stored.
  StatusOr<ReservedPut> ReservePut(const char* op, const PutShape& shape);
  // The tier TTL of this session's reservations: a backstop well after limits.reservation_ttl_ms.
  std::chrono::milliseconds TierReservationTtl() const;
  // The shape checks of ReservePut: tokens, window and the policy's needs, bytes, max_chunk_bytes.
  Status CheckPutShape(uint32_t tokens, uint64_t bytes, uint32_t window) const;
  // ---- reserve-ahead (HelloReply.reserveAhead; kvd.capnp, Commit) ----
  // True when this session may hold a slot ahead: protocol.reserve_ahead, shared memory, a
  // writing session, a model without a compression policy.
  bool ReservesAhead() const;
  // A slot of `bytes` for this session's next put, not yet for a chunk (HostTier::ReserveAhead),
  // held in the put ledger like a Reserve's: its reservation and where it lies. Declined (nullopt,
  // counted) for a size no chunk of the model has, or without headroom.
  struct HeldSlot {
    uint64_t reservation = 0;
    ShmRef ref;
  };
  std::optional<HeldSlot> ReserveAheadFor(uint64_t bytes);
  // Commit.chunk of a put into a held slot: checks the chunk's shape (bytes must be the slot's)
  // and names the reservation in the tier. On an error the caller aborts the slot.
  Status NameHeldPut(uint64_t reservation, proto::Reserve::Reader chunk);
  // Reserve.abortFirst: aborts `reservation` if it is a slot this session holds ahead and no
  // request owns it (else skipped).
  void AbortHeldSlot(uint64_t reservation);
  void HandleReserve(uint64_t seq, uint64_t rid, proto::Reserve::Reader reserve);
  // Posts the receive of a reserved put's bytes (`put->bytes`, tagged `tag`): over the NCCL link
  // into device staging (put->link, put->staging set), else over the transport straight into
  // `reservation` (with the landed bytes' checksum). The caller aborts the reservation on an
  // error (UNAVAILABLE and others, with context).
  StatusOr<transport::TransferHandle> PostPutReceive(const storage::Reservation& reservation,
                                                     uint64_t tag, BulkLink link,
                                                     PendingPut* put);
  // One-exchange put of a small chunk: ReservePut, copy the frame's bytes into the reservation,
  // then the Commit path (FinishCommit) with the given checksum; answered with CommitReply.
  void HandleInlinePut(uint64_t seq, uint64_t rid, proto::InlinePut::Reader put);
  void HandleCommit(uint64_t seq, uint64_t rid, proto::Commit::Reader commit);
  void HandleAbort(uint64_t seq, uint64_t rid, proto::Abort::Reader abort);
  // Get (session_get.cc): OpenGet, then over the NCCL link (FinishNcclGet), from shared memory
  // (ServeShmGet) or sent over the transport (SendGet, FinishGet).
  void HandleGet(uint64_t seq, uint64_t rid, proto::Get::Reader get);
  // The read a Get asks for, pinned: role, NCCL link, lease, CheckGetOf (get_request.h), and for
  // bytes leaving host memory the tier manager's check that they are still the committed ones
  // (DATA_LOSS, the chunk dropped). On an error nothing stays pinned.
  StatusOr<storage::ReadView> OpenGet(const GetAsk& ask, BulkLink link);
  // Answers with the slot of `view` in the arena; the read stays pinned until ReleaseRead.
  void ServeShmGet(uint64_t seq, uint64_t rid, const storage::ReadView& view);
  // Posts the send of `view` with the client's `tag` and waits for it in FinishGet.
  void SendGet(uint64_t seq, uint64_t rid, const storage::ReadView& view, uint64_t tag);
  // Counts a Get served (gets, get_bytes).
  void CountGet(uint64_t bytes);
  // NCCL link (session_nccl.cc): joins the daemon's NCCL transport with the client's.
  void HandleNcclConnect(uint64_t seq, uint64_t rid, proto::NcclConnect::Reader connect);
  // A Get over the link: stages the chunk in device memory (off the io_context thread), sends it
  // from there, then completes like FinishGet.
  asio::awaitable<void> FinishNcclGet(uint64_t seq, uint64_t rid, storage::ReadView view,
                                      uint64_t tag);
  // Gives a staging buffer back to the link (nullptr: nothing).
  void FreeStaging(void* staging);
  void HandleReleaseLease(uint64_t seq, uint64_t rid, proto::ReleaseLease::Reader release);
  // The end of a put (session_commit.cc): waits for its bytes, runs its commit route
  // (commit_route.h), ends it in the ledger with the outcome and answers CommitReply.
  // `reserve_next` > 0: on success, also reserve that many bytes ahead (Commit.reserveNext) and
  // answer the held slot in CommitReply.next.
  asio::awaitable<void> FinishCommit(uint64_t seq, uint64_t rid, uint64_t reservation,
                                     uint64_t checksum, uint64_t reserve_next = 0);
  // A successful put's CommitReply.
  struct CommitAnswer {
    uint64_t bytes = 0;         // the put's bytes
    uint64_t stored_bytes = 0;  // what the tiers hold (compact bytes for a compressed put)
    uint32_t codec_id = 0;
    bool already_stored = false;  // a slot held ahead whose chunk was already stored
  };
  // Answers `seq` with `answer`, after reserving `reserve_next` bytes ahead (ReserveAheadFor)
  // when > 0: a held slot goes out in CommitReply.next (with its memfd if the client lacks it).
  void AnswerCommit(uint64_t seq, uint64_t rid, const CommitAnswer& answer,
                    uint64_t reserve_next);
  // The codec id lookups and gets of this session use now (0 = raw).
  uint32_t ServedCodecId() const;
  asio::awaitable<void> FinishAbort(uint64_t seq, uint64_t rid, uint64_t reservation);
  asio::awaitable<void> FinishGet(uint64_t seq, uint64_t rid, storage::ReadView view,
                                  transport::TransferHandle send, BulkLink link,
                                  void* staging = nullptr);
  asio::awaitable<void> ExpirePut(uint64_t reservation);
  // Shared-memory sessions: where region offset `offset` lies (segment, offset in it,
  // generation), and the segment's memfd if this client has not got its current generation yet
  // (fd -1 otherwise). INTERNAL if the segment does not belong to this session's namespace.
  StatusOr<ShmRef> PrepareShm(uint64_t offset);
  // Hands reservation `id` (at region offset `offset`) to this session's client to write in
  // place: files `put` (written_in_place) and registers the reservation; returns the slot's
  // PrepareShm reference. On its error the reservation is aborted and nothing is filed.
  StatusOr<ShmRef> HoldShmSlot(uint64_t id, uint64_t offset, PendingPut put);
  // Sets a reply's ShmSlot to `ref` (fdAttached: ref.fd is set).
  static void SetShmSlot(const ShmRef& ref, proto::ShmSlot::Builder slot);
  // Completes `seq` with `frame`, attaching ref.fd if set (and remembering what the client has).
  void CompleteShm(uint64_t seq, Frame frame, const ShmRef& ref);
  void HandleReleaseRead(uint64_t seq, uint64_t rid, proto::ReleaseRead::Reader release);
  // Request.releaseReads: ends those of `reads` that are open shared-memory reads of this
  // connection (no reply of their own).
  void ReleaseReadsOf(capnp::List<uint64_t>::Reader reads);
  // Request.releaseLeases: ends those of `leases` that are live leases of this connection (no
  // reply of their own).
  void ReleaseLeasesOf(capnp::List<uint64_t>::Reader leases);
  // FAILED_PRECONDITION unless Hello (engine role) succeeded.
  Status RequireEngine(const char* op) const;
  // The client's transport endpoint, Connecting it first if this session has none yet
  // (UNAVAILABLE with the reason when the client's address cannot be reached).
  StatusOr<transport::PeerHandle> TransportPeer();
  // Admin requests (List, Evict) need the admin role.
  Status RequireAdmin(const char* op) const;

  // ---- admin (session_admin.cc) ----
  void HandleStats(uint64_t seq, uint64_t rid);
  void HandleList(uint64_t seq, uint64_t rid, proto::ListRequest::Reader list);
  void HandleEvict(uint64_t seq, uint64_t rid, proto::EvictRequest::Reader evict);
  void HandleHealth(uint64_t seq, uint64_t rid);
  void HandleCalibration(uint64_t seq, uint64_t rid, proto::CalibrationRequest::Reader request);
  void HandleWeights(uint64_t seq, uint64_t rid, proto::WeightsRequest::Reader request);

  // ---- events (session_events.cc) ----
  // Starts this connection's event subscription (SubscribeRequest) and its pump.
  void HandleSubscribe(uint64_t seq, uint64_t rid, proto::SubscribeRequest::Reader request);
  // Sends the subscription's queued events as `events` responses with request id `rid`, one
  // batch at a time (the next is taken once the writer wrote the previous one), until the
  // connection ends.
  asio::awaitable<void> PumpEvents(uint64_t rid);

  Server::Impl* server_;
  // What the put path (session_put.cc, session_commit.cc) and the read path (session_lookup.cc,
  // session_get.cc) use of the daemon: the server, seen through session_services.h.
  PutServices* const put_services_;
  SessionServices* const get_services_;
  const uint64_t id_;
  Socket socket_;
  const std::string peer_;  // remote socket address, for logs
  PeerInfo peer_info_;
  bool handshake_deadline_done_ = false;  // the handshake deadline was cancelled (Hello done)

  // Handshake state.
  bool hello_done_ = false;
  bool engine_ = false;
  std::string client_id_;
  std::string name_space_ = "default";
  const ModelConfig* model_ = nullptr;
  uint64_t layout_digest_ = 0;
  ChunkCodec* codec_ = nullptr;  // the model's codec when it has a compression policy
  // Per link: the session's peer and the sends of its Gets in flight (cancelled at teardown).
  // The transport's peer is Connected to client_transport_address_ on the session's first
  // transport transfer (TransportPeer), so a shared-memory session never has one; the NCCL
  // link's comes from NcclConnect. Disconnected for good when the session ends.
  struct LinkState {
    transport::PeerHandle peer;
    std::set<uint64_t> active_sends;
  };
  std::array<LinkState, kBulkLinks> links_;
  LinkState& Link(BulkLink link) { return links_[static_cast<size_t>(link)]; }
  std::string client_transport_address_;  // Hello.workerAddress
  // Shared-memory path (Hello asked for it on a unix socket and the daemon has a ShmArena).
  bool shm_ = false;
  // Hello.readOnly: puts are refused, and arena memfds go out as read-only descriptors.
  bool read_only_ = false;
  std::map<uint32_t, uint64_t> shm_sent_;  // segment -> generation whose memfd the client got
  std::set<uint64_t> shm_reads_;           // reads of shared-memory Gets not yet released

  // Puts between Reserve and their end (put_ledger.h).
  PutLedger puts_;
  uint64_t next_tag_ = 1;

  // Request sequencing and the ordered replies.
  ReplyWriter writer_;
  // Lookup / Commit / Get requests in progress: seq -> (op, steady-clock start in ns), observed
  // into the latency histograms when their reply is completed.
  std::map<uint64_t, std::pair<int, int64_t>> timed_;
  int handlers_running_ = 0;
  bool read_closed_ = false;
  bool closed_ = false;
  // Closes the connection when a deadline passes: the handshake (no Hello within
  // limits.handshake_timeout_ms) and a frame's payload (limits.frame_timeout_ms after its
  // header). Re-armed / cancelled by ReadLoop.
  asio::steady_timer read_deadline_;
  void ArmReadDeadline(int64_t ms, const char* why);
  // limits.idle_timeout_ms after Hello, unless the Hello asked to be kept (Hello.keepIdle).
  bool keep_idle_ = false;
  IdleWatch idle_;
  void StartIdleWatch();
  // A frame refused by the frame budget: a WARNING, at most one per 10 s for all sessions.
  void LogFrameRefused(const Status& why);
  Event reader_event_;
  Event idle_event_;
  // The event subscription (null until Subscribe) and the pump's wake-up (the hub, the writer).
  std::shared_ptr<EventHub::Subscription> subscription_;
  Event events_event_;
};

}  // namespace kvd::daemon
