// What a bulk path (bulk_path.h) drives of the client that owns it: the control channel, the
// arena's mapped segments, and the messages of a put or get window. ClientImpl implements it;
// a path sees its client only through this. Every call runs under the client's mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "connection.h"
#include "get_reply.h"
#include "kvd/client/client.h"
#include "reservation.h"
#include "segment_table.h"
#include "testing/test_hooks.h"

namespace kvd::client::internal {

// True for CUDA device memory (device.h; the entry points have refused what cannot be used).
bool IsDevice(const void* p);

// Bytes a put sends: the raw chunk (plus any queries already appended to it) plus the window
// queries still held apart (shared-memory path; the transport path staged them).
inline size_t PutBytes(const PutItem& it) {
  return it.bytes + it.window_queries.size() * sizeof(float);
}

class PathContext {
 public:
  virtual ~PathContext() = default;

  virtual const ClientOptions& options() const = 0;
  virtual const TestHooks& hooks() const = 0;
  virtual const SessionInfo& session() const = 0;
  virtual Channel& channel() = 0;
  // The arena segments mapped (shared memory).
  virtual SegmentTable& segments() = 0;
  // A tag for one transfer, unique among this client's transfers on every transport.
  virtual uint64_t NextTag() = 0;

  // INVALID_ARGUMENT for a put item the daemon would refuse for its shape (null data, window
  // < 0, and with verify_locally a byte count the layout does not give).
  virtual Status CheckPutItem(const PutItem& it) const = 0;
  // Phase 1 of a put window, shared by every bulk path: checks every item (INVALID_ARGUMENT
  // for null data or a raw byte count the layout does not give) and sends one Reserve per item
  // without waiting. Returns the request ids, in item order.
  virtual StatusOr<std::vector<uint64_t>> SendReservesLocked(std::span<const PutItem> items,
                                                             const ReserveExtras& extras) = 0;
  // Waits for the reply to the Reserve `request_id` of `item` and fills out->already_stored and
  // out->bytes. Errors: the channel's (context "reserve"), the daemon's, INTERNAL for another
  // message.
  virtual StatusOr<Reservation> AwaitReserveLocked(uint64_t request_id, const PutItem& item,
                                                   PutResult* out) = 0;
  virtual void AbortReservationsLocked(const std::vector<uint64_t>& reservation_ids) = 0;
  // Phase 3 of a put window, shared by the transport and shared-memory paths: sends one Commit
  // (reservation and checksum) for every item not already stored, without waiting. Returns the
  // request ids in item order, 0 for an item already stored. On a send failure returns it
  // (the channel is then broken; what was sent is not awaited).
  // Reserve-ahead (shared-memory path): `named`, when set, is the chunk put into the held slot
  // `reservation[0]` (Commit.chunk names it); `reserve_next` > 0 asks, on the last commit sent,
  // for the next put's slot (Commit.reserveNext).
  virtual StatusOr<std::vector<uint64_t>> SendCommitsLocked(
      const std::vector<PutResult>& out, const std::vector<uint64_t>& reservation,
      const std::vector<uint64_t>& checksum, const PutItem* named, uint64_t reserve_next) = 0;
  // Awaits every commit of SendCommitsLocked and fills each item's bytes, stored_bytes,
  // codec_id (and already_stored for a put into a held slot that found its chunk stored); the
  // first failure goes to `*first_error` (left as it is if already set). A slot a reply holds
  // ahead (CommitReply.next, when a commit asked for one) goes to `*offered`; without
  // `offered` it is aborted.
  virtual void AwaitCommitsLocked(const std::vector<uint64_t>& commit_req,
                                  std::vector<PutResult>& out, Status* first_error,
                                  OfferedSlot* offered) = 0;

  // Sends a shared-memory Get (no tag) without waiting; returns its request id.
  virtual StatusOr<uint64_t> SendShmGetLocked(uint64_t lease_id, uint32_t chunk_index,
                                              uint64_t capacity, ChunkForm form) = 0;
  // Awaits and reads the reply of SendShmGetLocked. Errors: the daemon's, INTERNAL for another
  // message or no slot, OUT_OF_RANGE for a chunk larger than `capacity` (a memfd that came with
  // a refused reply is closed).
  virtual Status AwaitShmGetLocked(uint64_t request_id, uint64_t capacity, GetReply* got) = 0;
  // The address of `bytes` at a slot of a reply to `request_id`, mapping the segment's memfd
  // first if the reply carried one (SegmentTable::Map, then Slot). INTERNAL for an announced
  // memfd that did not arrive, and SegmentTable's errors.
  virtual StatusOr<std::byte*> SlotLocked(uint64_t request_id, const ArenaSlot& slot,
                                          uint64_t bytes, bool populate) = 0;
};

}  // namespace kvd::client::internal
