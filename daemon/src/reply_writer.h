// The replies of one control connection, written in request order. Private to daemon/.
//
// Every request (and every unsolicited frame, such as an event batch) takes a sequence number
// (NextSeq); its handler completes it with a frame (Add, AddWithFd) whenever it finishes. Frames
// go out strictly by sequence number: one finishing early waits for those before it.
//
// Two ways out: the reader, after a batch of requests, writes what is ready with one
// non-blocking send (Flush); the writer coroutine (Run) writes the rest, and alone sends a frame
// carrying a file descriptor (SCM_RIGHTS, unix socket) and the frame after which the connection
// closes (CloseAfter).
//
// Threading: io_context thread only. The socket is the caller's; it must outlive the writer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "asio_util.h"

namespace kvd::daemon {

using Frame = std::vector<uint8_t>;

class ReplyWriter {
 public:
  using Socket = asio::generic::stream_protocol::socket;

  // `frames_out` (may be null) counts every frame taken for writing. `on_sent` runs whenever
  // frames went out (pipelining slots and event batches may move on). `log_id` names the
  // connection in logs.
  ReplyWriter(asio::io_context& io, Socket& socket, uint64_t log_id, uint64_t* frames_out,
              std::function<void()> on_sent);

  // The sequence number of the next request (or unsolicited frame).
  uint64_t NextSeq() { return next_seq_++; }
  // Stores the frame of `seq`; it goes out in order. Dropped once the writer finished.
  void Add(uint64_t seq, Frame frame);
  // The same, and the frame's first byte carries `fd`. Takes the fd: closed once sent, or when
  // the frame is dropped.
  void AddWithFd(uint64_t seq, Frame frame, int fd);
  // The connection closes once the frame of `seq` (or of an earlier seq, if one was named
  // before) is written; later frames are dropped.
  void CloseAfter(uint64_t seq);
  // While set (the reader handles a batch of requests), Add does not wake the writer: the reader
  // flushes the batch's replies itself.
  void SetBatching(bool batching) { batching_ = batching; }
  // Writes the frames that are ready, next in order and plain (no fd, not the closing one) with
  // one non-blocking send, when the writer is idle; what could not go is the writer's to send
  // first, and the writer is woken.
  void Flush();
  // Stops writing (the socket is closing): the writer sends nothing more and finishes.
  void Stop();
  // Wakes the writer to look again (at `finished`, too).
  void Wake() { wake_.Notify(); }

  // The writer loop. Returns once the closing frame is written (true), on a write error, after
  // Stop, or when `finished()` (no more requests will come) and every seq is written (false).
  // On return every frame left is dropped and done() is true.
  asio::awaitable<bool> Run(std::function<bool()> finished);

  // Sequence numbers taken whose frame is not written yet.
  uint64_t pending() const { return next_seq_ - next_write_seq_; }
  // True once the frame of `seq` was written (or dropped).
  bool written(uint64_t seq) const { return seq < next_write_seq_; }
  bool done() const { return done_; }

 private:
  // Moves the frames that are next in order to `batch` (counting them). With `fd` null it stops
  // before a frame carrying an fd; otherwise such a frame is taken alone (its fd into *fd). With
  // `close_now` null it stops before the closing frame; otherwise that frame ends the batch and
  // sets *close_now. Returns how many.
  size_t TakeReady(Frame* batch, int* fd, bool* close_now);
  // Sends one whole frame whose first byte carries `fd`.
  asio::awaitable<boost::system::error_code> WriteWithFd(const Frame& frame, int fd);
  void DropAll();

  Socket& socket_;
  const uint64_t log_id_;
  uint64_t* frames_out_;
  std::function<void()> on_sent_;
  Event wake_;
  uint64_t next_seq_ = 0;        // seq of the next request
  uint64_t next_write_seq_ = 0;  // seq of the next frame to write
  std::map<uint64_t, Frame> ready_;
  std::map<uint64_t, int> ready_fds_;  // seq -> fd its frame carries
  // Bytes Flush took but could not write at once: the writer sends them first.
  Frame unsent_;
  std::optional<uint64_t> close_after_seq_;
  bool busy_ = false;      // Run is between taking frames and having written them
  bool batching_ = false;  // SetBatching
  bool stopped_ = false;   // Stop
  bool done_ = false;      // Run returned
};

}  // namespace kvd::daemon
