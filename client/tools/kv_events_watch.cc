#include "kv_events_watch.h"

#include <zmq.h>

#include <exception>
#include <memory>
#include <msgpack.hpp>
#include <span>
#include <string_view>
#include <vector>

namespace kvd::tools::cluster_bench {
namespace {

// The string of a msgpack str object, "" for anything else.
std::string_view Str(const msgpack::object& o) {
  return o.type == msgpack::type::STR ? std::string_view(o.via.str.ptr, o.via.str.size)
                                      : std::string_view();
}

// Receives one frame into `out`; false when none came (timeout) or on an error.
bool Receive(void* socket, std::string* out) {
  zmq_msg_t msg;
  zmq_msg_init(&msg);
  const int n = zmq_msg_recv(&msg, socket, 0);
  if (n >= 0) out->assign(static_cast<const char*>(zmq_msg_data(&msg)), static_cast<size_t>(n));
  zmq_msg_close(&msg);
  return n >= 0;
}

bool More(void* socket) {
  int more = 0;
  size_t size = sizeof more;
  return zmq_getsockopt(socket, ZMQ_RCVMORE, &more, &size) == 0 && more != 0;
}

}  // namespace

StatusOr<std::unique_ptr<KvEventsWatch>> KvEventsWatch::Start(const std::string& endpoint) {
  std::unique_ptr<KvEventsWatch> w(new KvEventsWatch());
  w->context_ = zmq_ctx_new();
  w->sub_ = zmq_socket(w->context_, ZMQ_SUB);
  const int timeout_ms = 100, linger = 0;
  zmq_setsockopt(w->sub_, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
  zmq_setsockopt(w->sub_, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(w->sub_, ZMQ_SUBSCRIBE, "", 0);
  if (zmq_connect(w->sub_, endpoint.c_str()) != 0) {
    return Status(StatusCode::kUnavailable, "cannot connect to KV events endpoint " + endpoint +
                                                ": " + zmq_strerror(zmq_errno()));
  }
  w->thread_ = std::thread([p = w.get()] { p->Run(); });
  return w;
}

KvEventsWatch::~KvEventsWatch() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (sub_ != nullptr) zmq_close(sub_);
  if (context_ != nullptr) zmq_ctx_term(context_);
}

void KvEventsWatch::Run() {
  std::vector<std::string> frames;
  std::string frame;
  while (!stop_.load()) {
    frames.clear();
    if (!Receive(sub_, &frame)) continue;  // timeout: look at stop_ again
    const Clock::time_point at = Clock::now();
    frames.push_back(frame);
    while (More(sub_) && Receive(sub_, &frame)) frames.push_back(frame);
    if (frames.size() == 3) {
      Note(frames[2], at);
    } else {
      ++undecodable_;
    }
  }
}

void KvEventsWatch::Note(const std::string& payload, Clock::time_point at) {
  msgpack::object_handle h;
  try {
    h = msgpack::unpack(payload.data(), payload.size());
  } catch (const std::exception&) {
    ++undecodable_;
    return;
  }
  const msgpack::object& batch = h.get();
  if (batch.type != msgpack::type::ARRAY || batch.via.array.size < 2 ||
      batch.via.array.ptr[1].type != msgpack::type::ARRAY) {
    ++undecodable_;
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const msgpack::object& e :
       std::span(batch.via.array.ptr[1].via.array.ptr, batch.via.array.ptr[1].via.array.size)) {
    if (e.type != msgpack::type::MAP) continue;
    std::string_view type;
    const msgpack::object* hashes = nullptr;
    for (const msgpack::object_kv& kv : std::span(e.via.map.ptr, e.via.map.size)) {
      if (Str(kv.key) == "type") type = Str(kv.val);
      if (Str(kv.key) == "block_hashes" && kv.val.type == msgpack::type::ARRAY) hashes = &kv.val;
    }
    if (hashes == nullptr || (type != "BlockStored" && type != "BlockRemoved")) continue;
    auto& seen = type == "BlockStored" ? stored_ : removed_;
    for (const msgpack::object& b : std::span(hashes->via.array.ptr, hashes->via.array.size)) {
      if (b.type == msgpack::type::POSITIVE_INTEGER) seen.try_emplace(b.via.u64, at);
    }
  }
  cv_.notify_all();
}

std::optional<Clock::time_point> KvEventsWatch::WaitFor(uint64_t block_hash, bool stored,
                                                        Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& seen = stored ? stored_ : removed_;
  std::optional<Clock::time_point> at;
  cv_.wait_until(lock, deadline, [&] {
    auto it = seen.find(block_hash);
    if (it != seen.end()) at = it->second;
    return at.has_value();
  });
  return at;
}

}  // namespace kvd::tools::cluster_bench
