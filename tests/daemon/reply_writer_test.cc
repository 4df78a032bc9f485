// The ordered reply writer (daemon/src/reply_writer.h) over a socket pair, without a daemon:
// order by sequence number, the reader's direct flush, fd passing, close-after, finishing.
#include "reply_writer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <optional>
#include <string>

namespace kvd::daemon {
namespace {

Frame Bytes(const std::string& s) { return Frame(s.begin(), s.end()); }

class ReplyWriterTest : public ::testing::Test {
 protected:
  ReplyWriterTest() {
    asio::local::stream_protocol::socket ours(io_), theirs(io_);
    asio::local::connect_pair(ours, theirs);
    socket_.emplace(std::move(ours));
    peer_ = theirs.release();
    writer_.emplace(io_, *socket_, /*log_id=*/1, &frames_out_, [this] { ++sent_calls_; });
  }
  ~ReplyWriterTest() override {
    writer_.reset();
    socket_.reset();
    ::close(peer_);
  }

  // Starts the writer loop; its result lands in run_result_.
  void StartRun() {
    asio::co_spawn(
        io_,
        [this]() -> asio::awaitable<void> {
          run_result_ = co_await writer_->Run([this] { return finished_; });
        },
        asio::detached);
  }
  void Pump() {
    io_.restart();
    io_.run_for(std::chrono::milliseconds(20));
  }
  // What the peer can read now (and the fd a frame carried, if any, into *fd).
  std::string ReadNow(int* fd = nullptr) {
    std::string out;
    while (::poll(std::array<pollfd, 1>{pollfd{peer_, POLLIN, 0}}.data(), 1, 0) > 0) {
      char buf[256];
      iovec iov{buf, sizeof(buf)};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      const ssize_t n = ::recvmsg(peer_, &msg, MSG_DONTWAIT);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
      if (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr && c->cmsg_type == SCM_RIGHTS) {
        int received = -1;
        std::memcpy(&received, CMSG_DATA(c), sizeof(int));
        if (fd != nullptr) *fd = received;
      }
    }
    return out;
  }

  asio::io_context io_{1};
  std::optional<asio::generic::stream_protocol::socket> socket_;
  int peer_ = -1;
  uint64_t frames_out_ = 0;
  int sent_calls_ = 0;
  bool finished_ = false;
  std::optional<bool> run_result_;
  std::optional<ReplyWriter> writer_;
};

TEST_F(ReplyWriterTest, FramesGoOutInSequenceOrderWhateverOrderTheyFinishIn) {
  StartRun();
  const uint64_t a = writer_->NextSeq(), b = writer_->NextSeq(), c = writer_->NextSeq();
  writer_->Add(c, Bytes("c"));
  writer_->Add(a, Bytes("a"));
  Pump();
  EXPECT_EQ(ReadNow(), "a");  // c waits for b
  EXPECT_EQ(writer_->pending(), 2u);
  EXPECT_TRUE(writer_->written(a));
  EXPECT_FALSE(writer_->written(b));
  writer_->Add(b, Bytes("b"));
  Pump();
  EXPECT_EQ(ReadNow(), "bc");
  EXPECT_EQ(writer_->pending(), 0u);
  EXPECT_EQ(frames_out_, 3u);
  EXPECT_GE(sent_calls_, 2);
}

TEST_F(ReplyWriterTest, FlushWritesABatchsRepliesWithoutTheWriterLoop) {
  // No Run: the reader's direct write alone.
  writer_->SetBatching(true);
  const uint64_t a = writer_->NextSeq(), b = writer_->NextSeq();
  writer_->Add(b, Bytes("b"));
  writer_->Add(a, Bytes("a"));
  writer_->SetBatching(false);
  writer_->Flush();
  EXPECT_EQ(ReadNow(), "ab");
  EXPECT_EQ(frames_out_, 2u);
  EXPECT_EQ(sent_calls_, 1);
  EXPECT_EQ(writer_->pending(), 0u);
}

TEST_F(ReplyWriterTest, AFrameCarryingAnFdAndWhatFollowsItAreTheWritersToSend) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const uint64_t a = writer_->NextSeq(), b = writer_->NextSeq();
  writer_->AddWithFd(a, Bytes("a"), pipe_fds[1]);
  writer_->Add(b, Bytes("b"));
  writer_->Flush();
  EXPECT_EQ(ReadNow(), "");  // Flush never sends an fd
  StartRun();
  Pump();
  int received = -1;
  EXPECT_EQ(ReadNow(&received), "ab");
  ASSERT_GE(received, 0);
  // The descriptor received is the pipe's write end, and the writer closed its own copy: once
  // the received one is closed, the pipe reads end-of-file.
  ASSERT_EQ(::write(received, "x", 1), 1);
  ::close(received);
  char got = 0;
  EXPECT_EQ(::read(pipe_fds[0], &got, 1), 1);
  EXPECT_EQ(got, 'x');
  EXPECT_EQ(::read(pipe_fds[0], &got, 1), 0);
  ::close(pipe_fds[0]);
}

TEST_F(ReplyWriterTest, CloseAfterEndsTheWriterOnceThatFrameIsOutAndDropsTheRest) {
  StartRun();
  const uint64_t a = writer_->NextSeq(), b = writer_->NextSeq(), c = writer_->NextSeq();
  writer_->CloseAfter(b);
  writer_->Add(c, Bytes("c"));
  writer_->Add(a, Bytes("a"));
  writer_->Add(b, Bytes("b"));
  Pump();
  EXPECT_EQ(ReadNow(), "ab");
  ASSERT_TRUE(run_result_.has_value());
  EXPECT_TRUE(*run_result_);  // ended by the closing frame
  EXPECT_TRUE(writer_->done());
  EXPECT_EQ(writer_->pending(), 0u);  // dropped frames hold no pipelining slot
  // After the end a frame is dropped, and an fd with it is closed.
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  writer_->AddWithFd(writer_->NextSeq(), Bytes("d"), pipe_fds[1]);
  EXPECT_EQ(::fcntl(pipe_fds[1], F_GETFD), -1);
  ::close(pipe_fds[0]);
  Pump();
  EXPECT_EQ(ReadNow(), "");
}

TEST_F(ReplyWriterTest, TheWriterFinishesOnceNoMoreRequestsComeAndAllIsWritten) {
  StartRun();
  const uint64_t a = writer_->NextSeq();
  finished_ = true;
  writer_->Wake();
  Pump();
  EXPECT_FALSE(run_result_.has_value());  // the frame of `a` is still due
  writer_->Add(a, Bytes("a"));
  Pump();
  EXPECT_EQ(ReadNow(), "a");
  ASSERT_TRUE(run_result_.has_value());
  EXPECT_FALSE(*run_result_);
}

TEST_F(ReplyWriterTest, StopEndsTheWriterWithoutWriting) {
  StartRun();
  writer_->Stop();
  writer_->Add(writer_->NextSeq(), Bytes("a"));
  Pump();
  ASSERT_TRUE(run_result_.has_value());
  EXPECT_FALSE(*run_result_);
  EXPECT_TRUE(writer_->done());
  EXPECT_EQ(ReadNow(), "");
}

}  // namespace
}  // namespace kvd::daemon
