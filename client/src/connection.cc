#include "connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "kvd/proto/convert.h"

namespace kvd::client::internal {
namespace {

int MsLeft(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > 1'000'000 ? 1'000'000 : static_cast<int>(left.count());
}

std::string Errno(int err) { return std::strerror(err); }

// Connects a non-blocking socket to `addr` within the deadline.
Status ConnectFd(int fd, const sockaddr* addr, socklen_t len, const std::string& display,
                 Deadline deadline) {
  if (::connect(fd, addr, len) == 0) return Status::Ok();
  if (errno != EINPROGRESS && errno != EAGAIN) {
    return Status::Unavailable("cannot connect to kvd at " + display + ": " + Errno(errno) +
                               " (is kvd running there?)");
  }
  pollfd p{fd, POLLOUT, 0};
  int r;
  do {
    r = ::poll(&p, 1, MsLeft(deadline));
  } while (r < 0 && errno == EINTR);
  if (r == 0) return Status::DeadlineExceeded("connecting to kvd at " + display + " timed out");
  int err = 0;
  socklen_t errlen = sizeof err;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &errlen);
  if (err != 0) {
    return Status::Unavailable("cannot connect to kvd at " + display + ": " + Errno(err) +
                               " (is kvd running there?)");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Connection>> Connection::Open(const DaemonAddress& address,
                                                       std::string display, Deadline deadline,
                                                       uint32_t max_frame_bytes) {
  int fd = -1;
  if (address.is_unix) {
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    if (address.path.size() >= sizeof(sun.sun_path)) {
      return Status::InvalidArgument("unix socket path too long: " + address.path);
    }
    std::memcpy(sun.sun_path, address.path.data(), address.path.size());
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return Status::Unavailable("socket(): " + Errno(errno));
    Status s = ConnectFd(fd, reinterpret_cast<sockaddr*>(&sun), sizeof sun, display, deadline);
    if (!s.ok()) {
      ::close(fd);
      return s;
    }
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    std::string port = std::to_string(address.port);
    int rc = ::getaddrinfo(address.host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) {
      return Status::Unavailable("cannot resolve kvd host '" + address.host +
                                 "': " + ::gai_strerror(rc));
    }
    Status last = Status::Unavailable("no address for " + display);
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      last = ConnectFd(fd, ai->ai_addr, ai->ai_addrlen, display, deadline);
      if (last.ok()) break;
      ::close(fd);
      fd = -1;
    }
    ::freeaddrinfo(res);
    if (fd < 0) return last;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return std::unique_ptr<Connection>(new Connection(fd, std::move(display), max_frame_bytes));
}

int Connection::TakeFd() {
  if (fds_.empty()) return -1;
  int fd = fds_.front();
  fds_.pop_front();
  return fd;
}

Connection::~Connection() {
  for (int fd : fds_) ::close(fd);
  if (fd_ >= 0) ::close(fd_);
}

Status Connection::WriteAll(std::span<const uint8_t> bytes, Deadline deadline) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      int r = ::poll(&p, 1, MsLeft(deadline));
      if (r == 0) {
        return Status::DeadlineExceeded("writing to kvd at " + display_ + " timed out");
      }
      continue;
    }
    return Status::Unavailable("kvd at " + display_ + " closed the connection (" + Errno(errno) +
                               ")");
  }
  return Status::Ok();
}

Status Connection::Fill(Deadline deadline) {
  if (begin_ > 0 && begin_ == buf_.size()) {
    buf_.clear();
    begin_ = 0;
  }
  uint8_t tmp[64 * 1024];
  // Set at the first read that finds nothing: until then (reply_spin_) reads repeat, with
  // sched_yield between them so that a kvd on this CPU goes first; then poll sleeps until the
  // reply (or the deadline). A yield that took longer than the whole spin means other threads
  // want this CPU: a thread that yields to them waits out their time slice even after the
  // reply came (no wake-up brings it back early, as one brings back a thread asleep in poll),
  // so the next kSpinBackoffWaits calls sleep at once.
  std::optional<Clock::time_point> spin_until;
  const bool spin = reply_spin_.count() > 0 && spin_backoff_ == 0;
  if (spin_backoff_ > 0) --spin_backoff_;
  while (true) {
    // recvmsg: a shared-memory reply carries the daemon's memfd (SCM_RIGHTS) on its first byte.
    iovec iov{tmp, sizeof tmp};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int received = -1;
          std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds_.push_back(received);
        }
      }
      if ((msg.msg_flags & MSG_CTRUNC) != 0) {
        return Status::Internal("kvd at " + display_ + " sent more descriptors than expected");
      }
    }
    if (n > 0) {
      buf_.insert(buf_.end(), tmp, tmp + n);
      return Status::Ok();
    }
    if (n == 0) return Status::Unavailable("kvd at " + display_ + " closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return Status::Unavailable("connection to kvd at " + display_ + " failed: " + Errno(errno));
    }
    if (spin && spin_backoff_ == 0) {
      const Clock::time_point now = Clock::now();
      if (!spin_until) spin_until = std::min(now + reply_spin_, deadline);
      if (now < *spin_until) {
        if (yield_) {
          yield_();
        } else {
          ::sched_yield();
        }
        if (Clock::now() - now > reply_spin_) spin_backoff_ = kSpinBackoffWaits;
        continue;
      }
    }
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, MsLeft(deadline));
    if (r == 0) {
      return Status::DeadlineExceeded("kvd at " + display_ + " did not answer in time");
    }
  }
}

bool Connection::Readable(Deadline deadline) {
  size_t have = buf_.size() - begin_;
  if (have >= proto::kFrameHeaderBytes) {
    auto len =
        proto::ParseFrameHeader({buf_.data() + begin_, proto::kFrameHeaderBytes}, max_frame_bytes_);
    if (!len.ok() || have >= proto::kFrameHeaderBytes + *len) return true;
  }
  pollfd p{fd_, POLLIN, 0};
  int r = ::poll(&p, 1, MsLeft(deadline));
  return r > 0;
}

StatusOr<std::unique_ptr<proto::DecodedMessage>> Connection::ReadFrame(Deadline deadline) {
  while (buf_.size() - begin_ < proto::kFrameHeaderBytes) KVD_RETURN_IF_ERROR(Fill(deadline));
  auto len =
      proto::ParseFrameHeader({buf_.data() + begin_, proto::kFrameHeaderBytes}, max_frame_bytes_);
  if (!len.ok()) {
    return Status(len.status().code(), "bad frame from kvd: " + len.status().message());
  }
  size_t total = proto::kFrameHeaderBytes + *len;
  while (buf_.size() - begin_ < total) KVD_RETURN_IF_ERROR(Fill(deadline));
  auto msg = proto::DecodePayload({buf_.data() + begin_ + proto::kFrameHeaderBytes, *len});
  begin_ += total;
  return msg;
}

Status Channel::Break(Status s) {
  if (broken_.ok()) {
    broken_ = s.code() == StatusCode::kDeadlineExceeded || s.code() == StatusCode::kUnavailable
                  ? s
                  : Status::Unavailable(s.message());
  }
  return s;
}

Status Channel::ReadOne(Deadline deadline) {
  auto msg = conn_->ReadFrame(deadline);
  if (!msg.ok()) return Break(msg.status());
  uint64_t id = 0;
  std::unique_ptr<proto::DecodedMessage> m = std::move(msg).value();
  Status s = proto::TryDecode([&]() {
    id = m->Root<proto::Response>().getRequestId();
    return Status::Ok();
  });
  if (!s.ok()) return Break(s);
  // A shared-memory slot with fdAttached: its memfd came with this frame's first byte.
  bool carries_fd = false;
  bool is_events = false;
  proto::TryDecode([&]() {
    auto r = m->Root<proto::Response>();
    is_events = r.isEvents();
    if (r.isReserve() && r.getReserve().hasShm()) {
      carries_fd = r.getReserve().getShm().getFdAttached();
    } else if (r.isGet() && r.getGet().hasShm()) {
      carries_fd = r.getGet().getShm().getFdAttached();
    } else if (r.isCommit() && r.getCommit().hasNext() && r.getCommit().getNext().hasShm()) {
      carries_fd = r.getCommit().getNext().getShm().getFdAttached();  // a slot held ahead
    }
    return Status::Ok();
  }).IgnoreError();
  if (carries_fd) {
    int fd = conn_->TakeFd();
    if (fd < 0) return Break(Status::Internal("kvd announced a memfd that did not arrive"));
    fds_[id] = fd;
  }
  if (is_events) {
    event_frames_.push_back(std::move(m));  // a subscription's stream, not a reply
    return Status::Ok();
  }
  pending_[id] = std::move(m);
  return Status::Ok();
}

int Channel::TakeFd(uint64_t request_id) {
  auto it = fds_.find(request_id);
  if (it == fds_.end()) return -1;
  int fd = it->second;
  fds_.erase(it);
  return fd;
}

Channel::~Channel() {
  for (auto& [id, fd] : fds_) ::close(fd);
}

StatusOr<std::unique_ptr<proto::DecodedMessage>> Channel::Take(uint64_t request_id) {
  auto it = pending_.find(request_id);
  if (it == pending_.end()) return std::unique_ptr<proto::DecodedMessage>();
  auto m = std::move(it->second);
  pending_.erase(it);
  Status s = ResponseStatus(*m);
  if (!s.ok()) return s;
  return m;
}

StatusOr<std::unique_ptr<proto::DecodedMessage>> Channel::Await(uint64_t request_id,
                                                                Deadline deadline) {
  while (true) {
    if (pending_.count(request_id)) return Take(request_id);
    // A reply for request 0 is the daemon's answer to a frame it could not parse (or its
    // handshake refusal): surface it to whoever waits.
    if (pending_.count(0)) return Take(0);
    if (broken()) return broken_;
    KVD_RETURN_IF_ERROR(ReadOne(deadline));
  }
}

Status Channel::Pump() {
  while (true) {
    if (broken()) return broken_;
    if (!conn_->Readable(Clock::now())) return Status::Ok();
    KVD_RETURN_IF_ERROR(ReadOne(DeadlineIn(request_timeout_ms_)));
  }
}

StatusOr<std::unique_ptr<proto::DecodedMessage>> Channel::Poll(uint64_t request_id) {
  if (!pending_.count(request_id) && !pending_.count(0)) KVD_RETURN_IF_ERROR(Pump());
  if (pending_.count(request_id)) return Take(request_id);
  if (pending_.count(0)) return Take(0);
  return std::unique_ptr<proto::DecodedMessage>();
}

Status ResponseStatus(proto::DecodedMessage& msg) {
  return proto::TryDecode([&]() -> Status {
    auto r = msg.Root<proto::Response>();
    if (r.isError()) return proto::FromProto(r.getError());
    return Status::Ok();
  });
}

}  // namespace kvd::client::internal
