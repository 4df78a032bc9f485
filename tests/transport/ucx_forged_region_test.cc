// What a peer that holds a UCX endpoint to a Transport can do to the Transport's memory beyond
// what it was given (the facts behind TransportOptions::enable_rma and the trust boundary in
// docs/reliability.md), on the lanes kvd's endpoints get (peer failure detection on: tcp).
//
// 1. A forged region: the peer imports its own ExportRegion bytes with the address and length
//    edited to point at a buffer of the target it was never given, then posts kRead / kWrite.
//    UCX emulates RMA over tcp in software (the target reads or writes at the address in the
//    message; the remote key is not checked), so with the target's RMA on both land; with RMA
//    off (the default) UCX has no handler for them and the target drops them.
// 2. UCX's tcp transport's own put (UCT, below UCP): the target's tcp interface writes the
//    payload of a put request at the address in its header, whatever the target's UCP features
//    or UCX_TCP_PUT_ENABLE. Anyone who can open a tcp connection to the interface's port can do
//    it, with no UCP endpoint and no kvd handshake. The test shows that this still holds, so that
//    the documented trust boundary (UCX over tcp = trusted network) stays true to the library.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <uct/api/uct.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kvd/transport/transport.h"
#include "listening_ports.h"
#include "test_util.h"

namespace kvd::transport {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;
using test_support::ListeningTcpPorts;
using testing::FillPattern;
using testing::PatternByte;

constexpr size_t kSecretBytes = 64 << 10;
constexpr uint64_t kSecretSeed = 7;
// How long a forged operation may take to land. Long enough on a loaded machine: with RMA on the
// same operations finish in milliseconds.
constexpr milliseconds kLandTimeout(3000);

// Bytes of `p` that still differ from the secret pattern (0: untouched).
size_t ChangedBytes(const std::vector<uint8_t>& p) {
  size_t n = 0;
  for (size_t i = 0; i < p.size(); ++i) n += p[i] != PatternByte(kSecretSeed, i);
  return n;
}

// Polls `done` up to `timeout`.
template <typename F>
bool Eventually(F done, milliseconds timeout) {
  const auto deadline = steady_clock::now() + timeout;
  while (!done()) {
    if (steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

// Progresses a Transport on a thread of its own, as the daemon's progress thread does.
class ProgressThread {
 public:
  explicit ProgressThread(Transport* t)
      : thread_([this, t] {
          while (!stop_) t->Progress();
        }) {}
  ~ProgressThread() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// (UCX configuration of both sides, target's RMA: "default" leaves TransportOptions' default,
// "rma-on" sets enable_rma). The attacker always has RMA on.
using ForgedParam = std::tuple<std::string, std::string>;

class UcxForgedRegionTest : public ::testing::TestWithParam<ForgedParam> {
 protected:
  void SetUp() override {
    TransportOptions target = testing::OptionsFor(std::get<0>(GetParam()));
    if (std::get<1>(GetParam()) == "rma-on")
      MutableBackendOptions<UcxOptions>(&target).enable_rma = true;
    TransportOptions attacker = testing::OptionsFor(std::get<0>(GetParam()));
    MutableBackendOptions<UcxOptions>(&attacker).enable_rma = true;
    auto t = CreateTransport(target);
    ASSERT_TRUE(t.ok()) << t.status();
    auto a = CreateTransport(attacker);
    ASSERT_TRUE(a.ok()) << a.status();
    target_ = std::move(t).value();
    attacker_ = std::move(a).value();
    // Both ways, as kvd's daemon and client connect.
    auto at = attacker_->Connect(*target_->LocalAddress());
    ASSERT_TRUE(at.ok()) << at.status();
    auto ta = target_->Connect(*attacker_->LocalAddress());
    ASSERT_TRUE(ta.ok()) << ta.status();
    a_to_t_ = *at;
    t_to_a_ = *ta;
    FillPattern(kSecretSeed, secret_.data(), secret_.size());
    progress_ = std::make_unique<ProgressThread>(target_.get());
    // The endpoints carry a message before the attack, as a client's do after its first put.
    ASSERT_NO_FATAL_FAILURE(ExpectTagMessagesStillFlow(1));
  }

  void TearDown() override { progress_.reset(); }

  bool TargetRmaOn() const { return std::get<1>(GetParam()) == "rma-on"; }

  // The attacker's own region export, edited to cover the target's secret buffer.
  StatusOr<RemoteRegionHandle> ForgeRegionOverSecret() {
    KVD_ASSIGN_OR_RETURN(Region own, attacker_->AllocateRegistered(4096));
    KVD_ASSIGN_OR_RETURN(std::string exported, attacker_->ExportRegion(own.handle));
    const uint64_t address = reinterpret_cast<uint64_t>(secret_.data());
    const uint64_t length = secret_.size();
    // ExportRegion's layout (ucx_memory.cc): 8 bytes of magic, base address, size, rkey.
    std::memcpy(exported.data() + 8, &address, 8);
    std::memcpy(exported.data() + 16, &length, 8);
    return attacker_->ImportRegion(a_to_t_, exported);
  }

  // Posts a kRead / kWrite of kSecretBytes on a region forged over the secret and waits for it.
  // The attacker's side accepts the request: the region looks like its own.
  Status Forged(TransferOp op, uint8_t* buffer) {
    KVD_ASSIGN_OR_RETURN(RemoteRegionHandle remote, ForgeRegionOverSecret());
    TransferRequest r;
    r.op = op;
    r.peer = a_to_t_;
    r.buffer = buffer;
    r.length = kSecretBytes;
    r.remote = remote;
    KVD_ASSIGN_OR_RETURN(TransferHandle h, attacker_->Post(r));
    return attacker_->Wait(h, kLandTimeout);  // an unanswered request stays in flight
  }

  // A tag message attacker -> target still arrives: the target neither aborted nor hung.
  void ExpectTagMessagesStillFlow(uint64_t tag) {
    std::vector<uint8_t> in(4096), out(4096);
    FillPattern(tag, out.data(), out.size());
    auto recv = target_->PostRecv(t_to_a_, tag, in.data(), in.size());
    ASSERT_TRUE(recv.ok()) << recv.status();
    auto send = attacker_->PostSend(a_to_t_, tag, out.data(), out.size());
    ASSERT_TRUE(send.ok()) << send.status();
    EXPECT_TRUE(attacker_->Wait(*send, milliseconds(20000)).ok());
    Status r = target_->Wait(*recv, milliseconds(20000));
    ASSERT_TRUE(r.ok()) << r;
    EXPECT_TRUE(in == out) << "tag message " << tag << " arrived altered";
    EXPECT_TRUE(attacker_->Release(*send).ok());
    EXPECT_TRUE(target_->Release(*recv).ok());
  }

  std::unique_ptr<Transport> target_, attacker_;
  PeerHandle a_to_t_, t_to_a_;
  std::vector<uint8_t> secret_ = std::vector<uint8_t>(kSecretBytes);
  std::unique_ptr<ProgressThread> progress_;
};

TEST_P(UcxForgedRegionTest, DefaultTargetCapabilitiesHaveNoRma) {
  EXPECT_EQ(target_->capabilities().rma, TargetRmaOn());
}

TEST_P(UcxForgedRegionTest, ForgedWriteLandsOnlyWhereTheTargetEnablesRma) {
  std::vector<uint8_t> evil(kSecretBytes, 0xAB);
  Status s = Forged(TransferOp::kWrite, evil.data());
  if (TargetRmaOn()) {
    // The positive control: the forged region is a real attack, not a malformed request.
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(Eventually([&] { return secret_ == evil; }, kLandTimeout))
        << ChangedBytes(secret_) << " of " << kSecretBytes << " bytes overwritten";
  } else {
    // The target has no handler for UCX's emulated put: it drops it (with a UCX warning) and
    // never acknowledges it, so the attacker's write stays in flight.
    EXPECT_FALSE(s.ok()) << "the target acknowledged a forged request";
    EXPECT_EQ(ChangedBytes(secret_), 0u) << "a forged write landed in the target's memory";
  }
  ASSERT_NO_FATAL_FAILURE(ExpectTagMessagesStillFlow(2));
  EXPECT_EQ(ChangedBytes(secret_), TargetRmaOn() ? ChangedBytes(evil) : 0u);
}

TEST_P(UcxForgedRegionTest, ForgedReadLeaksOnlyWhereTheTargetEnablesRma) {
  std::vector<uint8_t> got(kSecretBytes, 0);
  Status s = Forged(TransferOp::kRead, got.data());
  if (TargetRmaOn()) {
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(got == secret_) << "the forged read did not return the target's bytes";
  } else {
    EXPECT_FALSE(s.ok()) << "the target acknowledged a forged request";
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == 0; }))
        << "target bytes reached the attacker";
  }
  ASSERT_NO_FATAL_FAILURE(ExpectTagMessagesStillFlow(3));
  EXPECT_EQ(ChangedBytes(secret_), 0u);
}

INSTANTIATE_TEST_SUITE_P(Lanes, UcxForgedRegionTest,
                         ::testing::Combine(::testing::Values("ucx-tcp", "ucx-sm"),
                                            ::testing::Values("default", "rma-on")),
                         [](const ::testing::TestParamInfo<ForgedParam>& info) {
                           std::string name =
                               std::get<0>(info.param) + "_" + std::get<1>(info.param);
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

// ---- UCX's tcp put, sent by a bare UCT interface (no UCP, no kvd handshake) ----

// One UCT tcp interface on "lo", put_zcopy to (port, address): what a peer that speaks UCX's
// tcp wire protocol can send to any UCX tcp interface it reaches.
class RawTcpPutter {
 public:
  ~RawTcpPutter() {
    if (ep_ != nullptr) uct_ep_destroy(ep_);
    if (iface_ != nullptr) uct_iface_close(iface_);
    if (md_ != nullptr) uct_md_close(md_);
    if (components_ != nullptr) uct_release_component_list(components_);
    if (worker_ != nullptr) uct_worker_destroy(worker_);
    if (async_ != nullptr) ucs_async_context_destroy(async_);
  }

  // Opens the interface; empty on success, else what failed.
  std::string Open() {
    if (ucs_async_context_create(UCS_ASYNC_MODE_THREAD_SPINLOCK, &async_) != UCS_OK) {
      return "ucs_async_context_create";
    }
    if (uct_worker_create(async_, UCS_THREAD_MODE_SINGLE, &worker_) != UCS_OK) {
      return "uct_worker_create";
    }
    unsigned count = 0;
    if (uct_query_components(&components_, &count) != UCS_OK) return "uct_query_components";
    uct_component_h tcp = nullptr;
    for (unsigned i = 0; i < count; ++i) {
      uct_component_attr_t attr{};
      attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
      if (uct_component_query(components_[i], &attr) == UCS_OK &&
          std::strcmp(attr.name, "tcp") == 0) {
        tcp = components_[i];
      }
    }
    if (tcp == nullptr) return "no tcp component in this UCX";
    uct_md_config_t* md_config = nullptr;
    if (uct_md_config_read(tcp, nullptr, nullptr, &md_config) != UCS_OK) return "md config";
    ucs_status_t s = uct_md_open(tcp, "tcp", md_config, &md_);
    uct_config_release(md_config);
    if (s != UCS_OK) return "uct_md_open(tcp)";
    uct_iface_config_t* iface_config = nullptr;
    if (uct_md_iface_config_read(md_, "tcp", nullptr, nullptr, &iface_config) != UCS_OK) {
      return "iface config";
    }
    uct_iface_params_t params{};
    params.field_mask = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE |
                        UCT_IFACE_PARAM_FIELD_STATS_ROOT | UCT_IFACE_PARAM_FIELD_RX_HEADROOM;
    params.open_mode = UCT_IFACE_OPEN_MODE_DEVICE;
    params.mode.device.tl_name = "tcp";
    params.mode.device.dev_name = "lo";
    params.stats_root = nullptr;
    params.rx_headroom = 0;
    s = uct_iface_open(md_, worker_, &params, iface_config, &iface_);
    uct_config_release(iface_config);
    if (s != UCS_OK) return "uct_iface_open(tcp, lo)";
    uct_iface_progress_enable(iface_, UCT_PROGRESS_SEND | UCT_PROGRESS_RECV);
    uct_iface_attr_t attr{};
    if (uct_iface_query(iface_, &attr) != UCS_OK) return "uct_iface_query";
    if ((attr.cap.flags & UCT_IFACE_FLAG_PUT_ZCOPY) == 0) return "tcp without put_zcopy";
    // On one host the target's device address (the loopback flag and the network namespace) is
    // this interface's own; its interface address is its port.
    device_address_.resize(attr.device_addr_len);
    if (uct_iface_get_device_address(
            iface_, reinterpret_cast<uct_device_addr_t*>(device_address_.data())) != UCS_OK) {
      return "uct_iface_get_device_address";
    }
    return "";
  }

  // Puts `data` at `remote_address` in the process listening on `port`; true once UCX reports
  // the put complete (the target acknowledged it) within `timeout`.
  bool Put(uint16_t port, const void* data, size_t length, uint64_t remote_address,
           milliseconds timeout) {
    const uint16_t port_be = htons(port);
    uct_ep_params_t ep_params{};
    ep_params.field_mask =
        UCT_EP_PARAM_FIELD_IFACE | UCT_EP_PARAM_FIELD_DEV_ADDR | UCT_EP_PARAM_FIELD_IFACE_ADDR;
    ep_params.iface = iface_;
    ep_params.dev_addr = reinterpret_cast<const uct_device_addr_t*>(device_address_.data());
    ep_params.iface_addr = reinterpret_cast<const uct_iface_addr_t*>(&port_be);
    if (uct_ep_create(&ep_params, &ep_) != UCS_OK) return false;
    struct Done {
      uct_completion_t comp;
      bool done;
    } done{};
    done.comp.func = [](uct_completion_t* c) { reinterpret_cast<Done*>(c)->done = true; };
    done.comp.count = 1;
    done.comp.status = UCS_OK;
    uct_iov_t iov{};
    iov.buffer = const_cast<void*>(data);
    iov.length = length;
    iov.memh = UCT_MEM_HANDLE_NULL;
    iov.count = 1;
    const auto deadline = steady_clock::now() + timeout;
    ucs_status_t s;
    // NO_RESOURCE while the connection is being made.
    while ((s = uct_ep_put_zcopy(ep_, &iov, 1, remote_address, /*rkey=*/0, &done.comp)) ==
           UCS_ERR_NO_RESOURCE) {
      uct_worker_progress(worker_);
      if (steady_clock::now() > deadline) return false;
    }
    if (s == UCS_OK) return true;
    if (s != UCS_INPROGRESS) return false;
    while (!done.done && steady_clock::now() < deadline) uct_worker_progress(worker_);
    return done.done && done.comp.status == UCS_OK;
  }

 private:
  ucs_async_context_t* async_ = nullptr;
  uct_worker_h worker_ = nullptr;
  uct_component_h* components_ = nullptr;
  uct_md_h md_ = nullptr;
  uct_iface_h iface_ = nullptr;
  uct_ep_h ep_ = nullptr;
  std::vector<uint8_t> device_address_;
};

class UcxRawTcpPutTest : public ::testing::TestWithParam<std::string> {};

// The target runs with kvd's settings (RMA off, peer failure detection on) and has no endpoint
// to the putter at all. Its memory still changes: UCX's tcp interface is a write primitive for
// anyone who can reach its port. If this ever fails, the UCX in use checks puts: update the
// trust boundary in docs/reliability.md and transport/README.md.
TEST_P(UcxRawTcpPutTest, AnyoneReachingTheTcpPortWritesTheTargetsMemoryEvenWithRmaOff) {
  const std::set<uint16_t> before = ListeningTcpPorts(getpid());
  auto target = CreateTransport(testing::OptionsFor(GetParam()));
  ASSERT_TRUE(target.ok()) << target.status();
  ASSERT_FALSE((*target)->capabilities().rma);
  std::vector<uint16_t> ports;
  for (uint16_t p : ListeningTcpPorts(getpid())) {
    if (before.count(p) == 0) ports.push_back(p);
  }
  ASSERT_EQ(ports.size(), 1u) << "expected the target's one tcp interface on lo";
  std::vector<uint8_t> secret(kSecretBytes);
  FillPattern(kSecretSeed, secret.data(), secret.size());
  ProgressThread progress(target->get());

  RawTcpPutter putter;
  std::string error = putter.Open();
  ASSERT_EQ(error, "");
  std::vector<uint8_t> evil(kSecretBytes, 0xAB);
  EXPECT_TRUE(putter.Put(ports[0], evil.data(), evil.size(),
                         reinterpret_cast<uint64_t>(secret.data()), milliseconds(20000)));
  EXPECT_TRUE(Eventually([&] { return secret == evil; }, kLandTimeout))
      << ChangedBytes(secret) << " of " << kSecretBytes << " bytes overwritten";
}

INSTANTIATE_TEST_SUITE_P(Lanes, UcxRawTcpPutTest, ::testing::Values("ucx-tcp", "ucx-sm"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace kvd::transport
