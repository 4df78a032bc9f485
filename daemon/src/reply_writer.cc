// The ordered reply writer of a control connection.
#include "reply_writer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kvd/common/logging.h"

namespace kvd::daemon {

ReplyWriter::ReplyWriter(asio::io_context& io, Socket& socket, uint64_t log_id,
                         uint64_t* frames_out, std::function<void()> on_sent)
    : socket_(socket),
      log_id_(log_id),
      frames_out_(frames_out),
      on_sent_(std::move(on_sent)),
      wake_(io) {}

void ReplyWriter::Add(uint64_t seq, Frame frame) {
  if (done_) return;  // the connection is gone: nobody will read the reply
  ready_[seq] = std::move(frame);
  // While the reader handles a batch of requests it flushes their replies itself (Flush).
  if (!batching_) wake_.Notify();
}

void ReplyWriter::AddWithFd(uint64_t seq, Frame frame, int fd) {
  if (done_) {
    ::close(fd);
    return;
  }
  ready_fds_[seq] = fd;
  Add(seq, std::move(frame));
}

void ReplyWriter::CloseAfter(uint64_t seq) {
  if (!close_after_seq_ || seq < *close_after_seq_) close_after_seq_ = seq;
  wake_.Notify();
}

void ReplyWriter::Stop() {
  stopped_ = true;
  wake_.Notify();
}

size_t ReplyWriter::TakeReady(Frame* batch, int* fd, bool* close_now) {
  size_t taken = 0;
  for (auto it = ready_.find(next_write_seq_); it != ready_.end();
       it = ready_.find(next_write_seq_)) {
    if (auto f = ready_fds_.find(next_write_seq_); f != ready_fds_.end()) {
      if (fd == nullptr || !batch->empty()) break;  // flush what is before it first
      *fd = f->second;
      ready_fds_.erase(f);
    }
    const bool last = close_after_seq_ && *close_after_seq_ == next_write_seq_;
    if (last && close_now == nullptr) break;
    batch->insert(batch->end(), it->second.begin(), it->second.end());
    ready_.erase(it);
    if (frames_out_ != nullptr) ++*frames_out_;
    ++next_write_seq_;
    ++taken;
    if (last) *close_now = true;
    if (last || (fd != nullptr && *fd >= 0)) break;
  }
  return taken;
}

void ReplyWriter::Flush() {
  if (busy_ || done_ || stopped_ || !unsent_.empty()) {
    wake_.Notify();
    return;
  }
  // Frames carrying an fd and the one after which the connection closes stay the writer's.
  Frame batch;
  if (TakeReady(&batch, nullptr, nullptr) > 0) {
    ssize_t n;
    do {
      n = ::send(socket_.native_handle(), batch.data(), batch.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    const size_t sent = n > 0 ? static_cast<size_t>(n) : 0;
    // What did not go (a full socket buffer, or an error the writer's own write then reports)
    // is the writer's to send first.
    if (sent < batch.size()) unsent_.assign(batch.begin() + sent, batch.end());
    on_sent_();
  }
  if (!unsent_.empty() || ready_.count(next_write_seq_) > 0) wake_.Notify();
}

asio::awaitable<boost::system::error_code> ReplyWriter::WriteWithFd(const Frame& frame, int fd) {
  boost::system::error_code ec;
  size_t sent = 0;
  while (sent == 0) {
    iovec iov{const_cast<uint8_t*>(frame.data()), frame.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t n = ::sendmsg(socket_.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent = static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      co_await socket_.async_wait(asio::socket_base::wait_write,
                                  asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return ec;
    } else {
      co_return boost::system::error_code(n < 0 ? errno : EPIPE, boost::system::system_category());
    }
  }
  if (sent < frame.size()) {  // the fd went with the first bytes; the rest is plain
    co_await asio::async_write(socket_, asio::buffer(frame.data() + sent, frame.size() - sent),
                               asio::redirect_error(asio::use_awaitable, ec));
  }
  co_return ec;
}

asio::awaitable<bool> ReplyWriter::Run(std::function<bool()> finished) {
  Frame batch;
  boost::system::error_code ec;
  bool close_now = false;
  while (true) {
    batch.clear();
    int fd = -1;  // a frame carrying an fd goes alone, by sendmsg
    busy_ = true;
    if (!unsent_.empty()) {
      batch.swap(unsent_);  // the rest of a direct write (Flush) goes first
    } else {
      TakeReady(&batch, &fd, &close_now);
    }
    bool wrote = false;
    if (fd >= 0) {
      if (!stopped_) ec = co_await WriteWithFd(batch, fd);
      ::close(fd);
      wrote = true;
    } else if (!batch.empty() && !stopped_) {
      co_await asio::async_write(socket_, asio::buffer(batch),
                                 asio::redirect_error(asio::use_awaitable, ec));
      wrote = true;
    }
    if (wrote) {
      on_sent_();
      if (ec) {
        KVD_LOG(DEBUG) << "write failed" << Kv("session", log_id_) << Kv("error", ec.message());
        break;
      }
    }
    busy_ = false;
    if (close_now || stopped_) break;
    if (finished() && next_write_seq_ == next_seq_) break;
    if (batch.empty()) co_await wake_.Wait();
  }
  DropAll();
  co_return close_now;
}

void ReplyWriter::DropAll() {
  busy_ = false;
  done_ = true;
  // Frames that will never be written no longer hold pipelining slots.
  unsent_.clear();
  ready_.clear();
  for (auto& [seq, fd] : ready_fds_) ::close(fd);
  ready_fds_.clear();
  next_write_seq_ = next_seq_;
}

}  // namespace kvd::daemon
