// Zero-copy access to kvd's shared-memory arena: ChunkView (Client::ReadInPlace) and PutSlot
// (Client::ReservePut / CommitPut), with their options (part of client.h; include that).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvd/client/types.h"
#include "kvd/common/hash.h"
#include "kvd/common/status.h"

namespace kvd::client {

namespace internal {
class ClientImpl;
}

// ---- zero-copy access to the shared-memory arena (Client::ReadInPlace / ReservePut) ----

struct ReadInPlaceOptions {
  // The form wanted, as GetItem::form (default: as stored).
  ChunkForm form = ChunkForm::kAsStored;
  // Verify the chunk's checksum before the view is returned (default true): one hashing pass
  // over the slot, no copy, DATA_LOSS on a mismatch. false hands out the view unverified: for an
  // engine that verifies elsewhere (its own checksum, or ChunkView::Verify() later, e.g. overlapped
  // with its DMA), or that accepts the risk. The daemon does not verify what it hands a
  // shared-memory reader, so without this nothing checks the bytes against the writer's
  // checksum on the way to the engine: a chunk damaged in memory (a wild write through another
  // process's writable view of the namespace) would reach the model undetected.
  bool verify_checksum = true;
  // Page-lock the chunk's segment for device DMA (cudaHostRegister through device.h's ops,
  // once per segment, best effort; default false): an engine that copies the view to its GPU
  // with cudaMemcpyAsync then gets a true asynchronous DMA instead of a staged copy. No effect
  // in a build without CUDA (ChunkView::device_pinned() says false).
  bool pin_for_device = false;
};

// A committed chunk where it lies in the daemon's shared-memory arena, read in place
// (Client::ReadInPlace). Move-only. While it lives the chunk is pinned: kvd neither evicts it
// nor reuses its slot (admin evict skips it, capacity pressure cannot take it), exactly like the
// read a copying Get holds while it copies. Destroying the view (or Release()) ends the read:
// the end goes to kvd with the client's next request (Request.releaseReads), or at once with
// its own exchange when 16 ended reads are queued or the daemon predates releaseReads; a
// destructor may therefore wait for a call in progress on the same Client.
//
// LIMITS: the pin lasts at most the daemon's read TTL (tiers.host.read_ttl_ms, default 60 s;
// pinned_until() says when) and the Client's connection: end views before either. After that
// the bytes stay mapped (reading them never faults) but kvd may reuse the slot for another chunk
// of the namespace. Destroy views before their Client (after it, they end nothing: the closed
// connection ended their reads). The bytes are read-only: a store through data() faults
// (SIGSEGV). Pinned chunks count against the host tier's capacity (stats: pinned_bytes):
// holding many views makes puts fail with RESOURCE_EXHAUSTED once nothing else can be evicted.
// NOT thread-safe itself (one owner); views of one Client may live on different threads.
class ChunkView {
 public:
  ChunkView();
  ChunkView(ChunkView&& other) noexcept;
  ChunkView& operator=(ChunkView&& other) noexcept;
  ~ChunkView();
  ChunkView(const ChunkView&) = delete;
  ChunkView& operator=(const ChunkView&) = delete;

  bool valid() const { return data_ != nullptr; }
  // [data(), data() + size()): the chunk's bytes, read-only. Null / 0 once released.
  const std::byte* data() const { return data_; }
  size_t size() const { return static_cast<size_t>(result_.bytes); }
  // Bytes, checksum (the writer's), tokens, codec id and form, as a Get reports them.
  const GetResult& result() const { return result_; }
  // The checksum was verified against the bytes (ReadInPlaceOptions::verify_checksum, Verify).
  bool verified() const { return verified_; }
  // The segment is page-locked for device DMA (ReadInPlaceOptions::pin_for_device).
  bool device_pinned() const { return device_pinned_; }
  // When kvd's read TTL ends the pin (measured from when the Get was sent); the epoch for a
  // daemon that does not say (older than GetReply.readTtlMs).
  std::chrono::steady_clock::time_point pinned_until() const { return pinned_until_; }
  // Hashes the bytes now: OK, DATA_LOSS on a mismatch, FAILED_PRECONDITION for a released view.
  Status Verify();
  // Ends the read now (as the destructor does). The view is then empty.
  void Release();

 private:
  friend class internal::ClientImpl;
  struct Hold;  // the mapping kept alive, and the way back to the Client
  std::unique_ptr<Hold> hold_;
  const std::byte* data_ = nullptr;
  GetResult result_;
  bool verified_ = false;
  bool device_pinned_ = false;
  std::chrono::steady_clock::time_point pinned_until_{};
};

struct ReservePutOptions {
  // Page-lock the slot's segment for device DMA into data() (as ReadInPlaceOptions; default
  // false).
  bool pin_for_device = false;
};

// A reserved slot of the shared-memory arena that the engine writes a raw chunk into itself
// (Client::ReservePut), then publishes with Client::CommitPut. Move-only. Until the commit the
// chunk is invisible to everyone. Destroying an uncommitted slot (or Abort()) aborts the
// reservation (one exchange with kvd; it may wait for a call in progress on the same Client);
// a client that dies first has it reclaimed by kvd with its connection, and one that holds it
// past limits.reservation_ttl_ms gets ABORTED at CommitPut.
// data() is this process's writable view of the slot only (ClientOptions::shm_writable_view; or,
// with that off, the slot's pages of the read-only mapping opened until the commit). Write
// exactly size() bytes in the raw chunk layout (common/layout.h); never write after CommitPut.
class PutSlot {
 public:
  PutSlot();
  PutSlot(PutSlot&& other) noexcept;
  PutSlot& operator=(PutSlot&& other) noexcept;
  ~PutSlot();
  PutSlot(const PutSlot&) = delete;
  PutSlot& operator=(const PutSlot&) = delete;

  // kvd already holds this chunk: nothing to write (data() is null); CommitPut returns at once
  // with PutResult::already_stored.
  bool already_stored() const { return already_stored_; }
  // False once committed, aborted or moved from.
  bool valid() const { return hold_ != nullptr; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const Hash128& hash() const { return hash_; }
  int tokens() const { return tokens_; }
  bool device_pinned() const { return device_pinned_; }
  // Aborts the reservation now: OK, or the daemon's / connection's error. The slot is then empty.
  Status Abort();

 private:
  friend class internal::ClientImpl;
  struct Hold;
  std::unique_ptr<Hold> hold_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  Hash128 hash_;
  int tokens_ = 0;
  bool already_stored_ = false;
  bool device_pinned_ = false;
};

}  // namespace kvd::client
