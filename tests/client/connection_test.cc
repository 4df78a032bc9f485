// The client's connection reading kvd's replies (client/src/connection.h): the short look for a
// reply before sleeping (ClientOptions::reply_spin_us) and when it stops looking. A real unix
// socket; the yield between reads is the seam: here it writes the awaited frame itself, so the
// tests never depend on timing.
#include "connection.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"

namespace kvd::client::internal {
namespace {

using std::chrono::microseconds;

// A connection to a unix socket of this process and the accepted end (`peer`).
class ConnectionSpinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvd-connection-test-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/s";
    int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(listener, 0);
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    std::memcpy(sun.sun_path, path_.c_str(), path_.size() + 1);
    ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&sun), sizeof sun), 0);
    ASSERT_EQ(::listen(listener, 1), 0);
    auto address = ParseDaemonAddress("unix:" + path_);
    ASSERT_TRUE(address.ok()) << address.status();
    auto conn = Connection::Open(*address, "unix:" + path_, DeadlineIn(5000), 1u << 20);
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = std::move(conn).value();
    peer_ = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(listener);
    ASSERT_GE(peer_, 0);
  }
  void TearDown() override {
    conn_.reset();
    if (peer_ >= 0) ::close(peer_);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  // Sends one reply frame (requestId `id`) from the peer's end.
  void SendReply(uint64_t id) {
    capnp::MallocMessageBuilder m;
    m.initRoot<proto::Response>().setRequestId(id);
    auto bytes = proto::EncodeFrame(m);
    ASSERT_EQ(::send(peer_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  uint64_t ReadReplyId() {
    auto frame = conn_->ReadFrame(DeadlineIn(10000));
    EXPECT_TRUE(frame.ok()) << frame.status();
    return frame.ok() ? (*frame)->Root<proto::Response>().getRequestId() : 0;
  }

  std::string dir_, path_;
  std::unique_ptr<Connection> conn_;
  int peer_ = -1;
};

// The frame is written by the first yield: a read that found nothing looked again instead of
// sleeping (a read that slept would wait for the deadline, as nothing else writes).
TEST_F(ConnectionSpinTest, AReadThatFindsNothingLooksAgainBeforeSleeping) {
  conn_->set_reply_spin(microseconds(1000));
  int yields = 0;
  conn_->set_yield_for_test([&] {
    if (++yields == 1) SendReply(7);
  });
  EXPECT_EQ(ReadReplyId(), 7u);
  EXPECT_EQ(yields, 1);
}

// Without a spin a read sleeps at once: the frame comes from another thread, never a yield.
TEST_F(ConnectionSpinTest, WithoutASpinAReadNeverYields) {
  conn_->set_reply_spin(microseconds(0));
  int yields = 0;
  conn_->set_yield_for_test([&] { ++yields; });
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    SendReply(8);
  });
  EXPECT_EQ(ReadReplyId(), 8u);
  writer.join();
  EXPECT_EQ(yields, 0);
}

// A yield that took longer than the whole spin (another thread had this CPU): the next
// kSpinBackoffWaits reads sleep at once, whenever their frames come; the one after spins again.
TEST_F(ConnectionSpinTest, AYieldLongerThanTheSpinMakesTheNextReadsSleepAtOnce) {
  conn_->set_reply_spin(microseconds(100));
  int yields = 0;
  conn_->set_yield_for_test([&] {
    ++yields;
    if (yields == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    SendReply(100 + static_cast<uint64_t>(yields));
  });
  EXPECT_EQ(ReadReplyId(), 101u);
  ASSERT_EQ(yields, 1);
  for (int i = 0; i < Connection::kSpinBackoffWaits; ++i) {
    std::thread writer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      SendReply(1000 + static_cast<uint64_t>(i));
    });
    EXPECT_EQ(ReadReplyId(), 1000u + static_cast<uint64_t>(i));
    writer.join();
  }
  EXPECT_EQ(yields, 1);
  EXPECT_EQ(ReadReplyId(), 102u);  // written by the second yield
  EXPECT_EQ(yields, 2);
}

}  // namespace
}  // namespace kvd::client::internal
