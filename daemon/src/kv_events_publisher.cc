#include "kv_events_publisher.h"

#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <msgpack.hpp>
#include <string_view>

#include "kvd/common/logging.h"

namespace kvd::daemon {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// vLLM's medium names (MEDIUM_GPU / MEDIUM_CPU / MEDIUM_STORAGE) of kvd's tiers.
std::string_view Medium(storage::TierKind tier) {
  switch (tier) {
    case storage::TierKind::kGpu:
      return "GPU";
    case storage::TierKind::kHost:
      return "CPU";
    case storage::TierKind::kDisk:
      return "STORAGE";
  }
  return "CPU";
}

// The block hash routers key on: the low 64 bits of the chunk's chain hash (vLLM's integer block
// hashes are likewise the low 64 bits of its digest).
uint64_t BlockHash(const storage::ChunkKey& key) { return key.chain_hash.lo; }

void PackStored(Packer& pk, const storage::ChunkEvent& e) {
  pk.pack_map(8);
  PackStr(pk, "type");
  PackStr(pk, "BlockStored");
  PackStr(pk, "block_hashes");
  pk.pack_array(1);
  pk.pack_uint64(BlockHash(e.key));
  PackStr(pk, "parent_block_hash");
  pk.pack_nil();  // kvd's chunk key is a chain hash: it does not know its parent's
  PackStr(pk, "token_ids");
  pk.pack_array(0);  // kvd receives chain hashes, never token ids
  PackStr(pk, "block_size");
  pk.pack_uint32(e.tokens);
  PackStr(pk, "lora_id");
  pk.pack_nil();
  PackStr(pk, "medium");
  PackStr(pk, Medium(e.tier));
  PackStr(pk, "lora_name");
  pk.pack_nil();
}

void PackRemoved(Packer& pk, const storage::ChunkEvent& e) {
  pk.pack_map(3);
  PackStr(pk, "type");
  PackStr(pk, "BlockRemoved");
  PackStr(pk, "block_hashes");
  pk.pack_array(1);
  pk.pack_uint64(BlockHash(e.key));
  PackStr(pk, "medium");
  PackStr(pk, Medium(e.tier));
}

std::string BigEndian(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) out[i] = static_cast<char>(v & 0xff);
  return out;
}

// Sends `frames` as one multipart message (blocking; PUB never blocks, it drops at its HWM).
void SendMultipart(void* socket, std::initializer_list<std::string_view> frames) {
  size_t i = 0;
  for (std::string_view f : frames) {
    const int flags = ++i < frames.size() ? ZMQ_SNDMORE : 0;
    if (zmq_send(socket, f.data(), f.size(), flags) < 0) {
      KVD_LOG(WARNING) << "kv_events: send failed" << Kv("error", zmq_strerror(zmq_errno()));
      return;
    }
  }
}

}  // namespace

std::string EncodeKvEventBatch(double ts, bool cleared_first,
                               const std::vector<QueuedEvent>& events) {
  uint32_t n = cleared_first ? 1 : 0;
  for (const QueuedEvent& q : events) n += q.dropped == 0 ? 1 : 0;
  msgpack::sbuffer buf;
  Packer pk(&buf);
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(n);
  if (cleared_first) {
    pk.pack_map(1);
    PackStr(pk, "type");
    PackStr(pk, "AllBlocksCleared");
  }
  for (const QueuedEvent& q : events) {
    if (q.dropped != 0) continue;
    if (q.event.kind == storage::ChunkEventKind::kStored) {
      PackStored(pk, q.event);
    } else {
      PackRemoved(pk, q.event);
    }
  }
  pk.pack_uint32(0);  // data_parallel_rank
  return std::string(buf.data(), buf.size());
}

KvEventsPublisher::KvEventsPublisher(KvEventsOptions options, EventHub* hub,
                                     ListCopiesFn list_copies)
    : options_(std::move(options)), hub_(hub), list_copies_(std::move(list_copies)) {}

StatusOr<std::unique_ptr<KvEventsPublisher>> KvEventsPublisher::Start(
    const KvEventsOptions& options, EventHub* hub, ListCopiesFn list_copies) {
  std::unique_ptr<KvEventsPublisher> p(
      new KvEventsPublisher(options, hub, std::move(list_copies)));
  KVD_RETURN_IF_ERROR(p->Bind());
  // The admin tenant (""), every namespace, the largest queue the hub grants. The hub wakes the
  // thread through the eventfd when the queue turns non-empty.
  p->sub_ = hub->Subscribe("", std::nullopt, UINT32_MAX, [raw = p.get()] { raw->Wake(); });
  p->thread_ = std::thread([raw = p.get()] { raw->Run(); });
  KVD_LOG(INFO) << "kv_events publishing" << Kv("endpoint", options.endpoint)
                << Kv("replay_endpoint", options.replay_endpoint) << Kv("topic", options.topic);
  return p;
}

Status KvEventsPublisher::Bind() {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    return Status::Internal(std::string("kv_events: eventfd failed: ") + std::strerror(errno));
  }
  context_ = zmq_ctx_new();
  if (context_ == nullptr) return Status::Internal("kv_events: zmq_ctx_new failed");
  pub_ = zmq_socket(context_, ZMQ_PUB);
  const int hwm = static_cast<int>(options_.hwm), linger = 0;
  zmq_setsockopt(pub_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
  zmq_setsockopt(pub_, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(pub_, options_.endpoint.c_str()) != 0) {
    return Status::Unavailable("kv_events.endpoint: cannot bind \"" + options_.endpoint +
                               "\": " + zmq_strerror(zmq_errno()));
  }
  if (options_.replay_endpoint.empty()) return Status::Ok();
  replay_ = zmq_socket(context_, ZMQ_ROUTER);
  zmq_setsockopt(replay_, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(replay_, options_.replay_endpoint.c_str()) != 0) {
    return Status::Unavailable("kv_events.replay_endpoint: cannot bind \"" +
                               options_.replay_endpoint + "\": " + zmq_strerror(zmq_errno()));
  }
  return Status::Ok();
}

KvEventsPublisher::~KvEventsPublisher() { Stop(); }

void KvEventsPublisher::Wake() {
  const uint64_t one = 1;
  // Fails only when the counter is at its maximum: the thread is woken anyway.
  (void)!::write(wake_fd_, &one, sizeof one);
}

void KvEventsPublisher::Stop() {
  if (sub_) hub_->Unsubscribe(sub_);
  stop_.store(true);
  if (thread_.joinable()) {
    Wake();
    thread_.join();
    KVD_LOG(INFO) << "kv_events stopped" << Kv("batches", published())
                  << Kv("events_lost", dropped());
  }
  if (replay_ != nullptr) zmq_close(replay_);
  if (pub_ != nullptr) zmq_close(pub_);
  if (context_ != nullptr) zmq_ctx_term(context_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  replay_ = pub_ = context_ = nullptr;
  wake_fd_ = -1;
}

void KvEventsPublisher::Run() {
  // Subscribed before this listing: a change made meanwhile is in the listing, in the queue, or
  // both, and either order ends with the router's index equal to the tiers.
  Resync();
  std::vector<QueuedEvent> batch;
  bool more = false;  // the last Take filled a batch: do not wait before the next
  while (!stop_.load()) {
    // Sleeps until the hub wakes the thread (events queued, or Stop) or a replay request comes;
    // not at all while the last Take left events behind.
    zmq_pollitem_t items[2] = {{nullptr, wake_fd_, ZMQ_POLLIN, 0}, {replay_, 0, ZMQ_POLLIN, 0}};
    const int n = replay_ != nullptr ? 2 : 1;
    if (zmq_poll(items, n, more ? 0 : -1) > 0) {
      uint64_t wakes;
      if (items[0].revents & ZMQ_POLLIN) (void)!::read(wake_fd_, &wakes, sizeof wakes);
      if (n == 2 && (items[1].revents & ZMQ_POLLIN)) ServeReplay();
    }
    batch.clear();
    hub_->Take(*sub_, static_cast<size_t>(options_.max_batch_events), &batch);
    more = batch.size() == static_cast<size_t>(options_.max_batch_events);
    // Events were lost at each marker: what came before the last one is superseded by a
    // resync listed now; what came after it follows.
    uint64_t lost = 0;
    size_t after_last_marker = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (batch[i].dropped == 0) continue;
      lost += batch[i].dropped;
      after_last_marker = i + 1;
    }
    if (lost > 0) {
      dropped_.fetch_add(lost);
      KVD_LOG(WARNING) << "kv_events: the event queue overflowed; resyncing routers"
                       << Kv("lost", lost);
      batch.erase(batch.begin(), batch.begin() + static_cast<ptrdiff_t>(after_last_marker));
      Resync();
    }
    if (!batch.empty()) Publish(false, batch);
  }
}

void KvEventsPublisher::Resync() {
  std::vector<QueuedEvent> copies;
  for (const storage::ChunkMeta& m : list_copies_()) {
    QueuedEvent q;
    q.event = storage::MakeChunkEvent(storage::ChunkEventKind::kStored,
                                      storage::RemoveReason::kNone, m.tier, m);
    copies.push_back(std::move(q));
  }
  // Batches of max_batch_events; the first carries AllBlocksCleared and one copy fewer.
  const size_t per_batch = static_cast<size_t>(options_.max_batch_events);
  size_t end = std::min(copies.size(), per_batch - 1);
  Publish(true, {copies.begin(), copies.begin() + static_cast<ptrdiff_t>(end)});
  for (size_t at = end; at < copies.size(); at = end) {
    end = std::min(copies.size(), at + per_batch);
    Publish(false, {copies.begin() + static_cast<ptrdiff_t>(at),
                    copies.begin() + static_cast<ptrdiff_t>(end)});
  }
  resyncs_.fetch_add(1);
}

void KvEventsPublisher::Publish(bool cleared_first, const std::vector<QueuedEvent>& events) {
  const double ts =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string payload = EncodeKvEventBatch(ts, cleared_first, events);
  const uint64_t seq = next_sequence_.load();
  const std::string seq_bytes = BigEndian(seq);
  SendMultipart(pub_, {options_.topic, seq_bytes, payload});
  next_sequence_.store(seq + 1);
  if (replay_ == nullptr) return;
  kept_.emplace_back(seq, std::move(payload));
  while (kept_.size() > static_cast<size_t>(options_.buffer_steps)) kept_.pop_front();
}

void KvEventsPublisher::ServeReplay() {
  std::vector<std::string> frames;
  for (int more = 1; more;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, replay_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&msg);
      return;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
  }
  if (frames.size() != 3 || frames[2].size() != 8) {
    KVD_LOG(WARNING) << "kv_events: malformed replay request" << Kv("frames", frames.size());
    return;
  }
  uint64_t start = 0;
  for (unsigned char c : frames[2]) start = (start << 8) | c;
  const std::string& client = frames[0];
  for (const auto& [seq, payload] : kept_) {
    if (seq < start) continue;
    SendMultipart(replay_, {client, "", options_.topic, BigEndian(seq), payload});
  }
  SendMultipart(replay_, {client, "", "", BigEndian(UINT64_MAX), ""});  // -1: the end
}

}  // namespace kvd::daemon
