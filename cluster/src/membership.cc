// The membership thread: register (lease + record), list, then watch and keep the lease alive
// until etcd or the lease is lost; then again, until Stop.
#include "kvd/cluster/membership.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "kvd/cluster/etcd_client.h"
#include "kvd/common/logging.h"

namespace kvd::cluster {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class Membership::Impl {
 public:
  Impl(MembershipOptions options, RecordSource source)
      : options_(std::move(options)),
        source_(std::move(source)),
        etcd_(EtcdClientOptions{options_.etcd, options_.etcd_timeout, options_.etcd_timeout}),
        key_(options_.MembersPrefix() + options_.node) {}

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }

  void Stop() {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      if (watch_ != nullptr) watch_->Interrupt();  // the thread waits in it
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  MembershipState state() const {
    std::lock_guard lock(mu_);
    MembershipState s = state_;
    if (!s.reachable) {  // etcd's last answer to this node, else Start
      s.age = std::chrono::duration_cast<milliseconds>(Clock::now() -
                                                       etcd_.last_response().value_or(started_));
    }
    for (const auto& [key, member] : members_) s.members.push_back(member);
    for (const auto& [key, why] : refused_) s.refused.push_back(why);
    return s;
  }

  const MembershipOptions& options() const { return options_; }

 private:
  bool stopping() const {
    std::lock_guard lock(mu_);
    return stopping_;
  }

  // Sleeps up to `d`; false when stopping.
  bool Pause(milliseconds d) {
    std::unique_lock lock(mu_);
    wake_.wait_for(lock, d, [this] { return stopping_; });
    return !stopping_;
  }

  void Loop() {
    while (!stopping()) {
      Status why = Session();
      if (stopping()) break;
      MarkUnreachable(why);
      Pause(options_.retry_interval);
    }
    if (lease_ != 0) {
      // The record goes with the lease: the others see this node leave now, not after the TTL.
      Status revoked = etcd_.LeaseRevoke(lease_);
      if (!revoked.ok()) {
        KVD_LOG(INFO) << "cluster: leaving without revoking" << Kv("why", revoked);
      }
    }
  }

  void MarkUnreachable(const Status& why) {
    bool was_reachable;
    {
      std::lock_guard lock(mu_);
      was_reachable = state_.reachable;
      state_.reachable = false;
      state_.last_error = why.ToString();
    }
    if (was_reachable || !logged_unreachable_) {
      KVD_LOG(WARNING) << "cluster: etcd unreachable; serving this node alone until it answers"
                       << Kv("cluster", options_.name) << Kv("why", why);
      logged_unreachable_ = true;
    }
  }

  MemberRecord OwnRecord() {
    MemberRecord r = source_ ? source_() : MemberRecord{};
    r.node = options_.node;
    r.token_digest = TokenDigest(options_.token);
    return r;
  }

  // Grants a lease and puts this node's record on it.
  Status Register() {
    KVD_ASSIGN_OR_RETURN(LeaseInfo lease, etcd_.LeaseGrant(options_.lease_ttl_s));
    MemberRecord record = OwnRecord();
    record.registered_unix_ms = std::chrono::duration_cast<milliseconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count();
    KVD_RETURN_IF_ERROR(etcd_.Put(key_, record.ToJson(), lease.id));
    // A lease of an earlier registration may outlive the outage (etcd keeps leases across its
    // restarts); the record moved to the new one, so revoking the old deletes nothing else.
    if (lease_ != 0 && lease_ != lease.id) etcd_.LeaseRevoke(lease_).IgnoreError();
    lease_ = lease.id;
    published_ = record;
    std::lock_guard lock(mu_);
    state_.lease = lease_;
    ++state_.registrations;
    return Status::Ok();
  }

  // Replaces the member list with what etcd holds now.
  StatusOr<int64_t> List() {
    KVD_ASSIGN_OR_RETURN(RangeResult range, etcd_.RangePrefix(options_.MembersPrefix()));
    std::map<std::string, Member> before;
    {
      std::lock_guard lock(mu_);
      before = members_;
      members_.clear();
      refused_.clear();
    }
    for (const KeyValue& kv : range.kvs) Apply(kv);
    std::lock_guard lock(mu_);
    for (const auto& [key, m] : members_) {
      if (!before.count(key)) {
        KVD_LOG(INFO) << "cluster: member present" << Kv("node", m.record.node);
      }
    }
    for (const auto& [key, m] : before) {
      if (!members_.count(key)) {
        KVD_LOG(INFO) << "cluster: member gone" << Kv("node", m.record.node);
      }
    }
    return range.revision;
  }

  // A record put under the prefix: a member, or refused naming why.
  void Apply(const KeyValue& kv) {
    const std::string id = kv.key.substr(std::min(kv.key.size(), options_.MembersPrefix().size()));
    auto record = MemberRecord::FromJson(kv.value);
    std::string refused;
    if (!record.ok()) {
      refused = id + ": " + record.status().message();
    } else if (record->token_digest != TokenDigest(options_.token)) {
      refused = id + ": cluster token differs from this node's";
    }
    std::lock_guard lock(mu_);
    if (!refused.empty()) {
      members_.erase(kv.key);
      if (!refused_.count(kv.key)) {
        KVD_LOG(WARNING) << "cluster: record refused" << Kv("why", refused);
      }
      refused_[kv.key] = refused;
      return;
    }
    refused_.erase(kv.key);
    members_[kv.key] = Member{std::move(*record), kv.lease};
  }

  void Remove(const std::string& key) {
    std::lock_guard lock(mu_);
    refused_.erase(key);
    if (auto it = members_.find(key); it != members_.end()) {
      KVD_LOG(INFO) << "cluster: member left" << Kv("node", it->second.record.node);
      members_.erase(it);
    }
  }

  // One stretch of contact with etcd; returns why it ended.
  Status Session() {
    KVD_RETURN_IF_ERROR(Register());
    KVD_ASSIGN_OR_RETURN(int64_t revision, List());
    KVD_ASSIGN_OR_RETURN(auto watch, etcd_.WatchPrefix(options_.MembersPrefix(), revision + 1));
    {
      std::lock_guard lock(mu_);
      if (stopping_) return Status::Cancelled("stopping");
      watch_ = watch.get();  // Stop interrupts it
      state_.reachable = true;
      state_.last_error.clear();
    }
    Status ended = Watch(*watch);
    std::lock_guard lock(mu_);
    watch_ = nullptr;
    return ended;
  }

  // Applies the watch's events and keeps the lease alive and the record current until etcd, the
  // lease or Stop ends it.
  Status Watch(WatchStream& watch) {
    logged_unreachable_ = false;
    KVD_LOG(INFO) << "cluster: registered" << Kv("cluster", options_.name)
                  << Kv("node", options_.node) << Kv("lease", lease_)
                  << Kv("members", state().members.size());
    const milliseconds keepalive_period(options_.lease_ttl_s * 1000 / 3);
    auto next_keepalive = Clock::now() + keepalive_period;
    auto next_refresh = Clock::now() + options_.refresh_interval;
    while (!stopping()) {
      auto wait = std::chrono::duration_cast<milliseconds>(std::min(next_keepalive, next_refresh) -
                                                           Clock::now());
      auto events = watch.Next(std::max(wait, milliseconds(1)));  // Stop interrupts the wait
      if (events.ok()) {
        for (const WatchEvent& e : *events) {
          if (e.type == WatchEvent::Type::kDelete) {
            Remove(e.kv.key);
          } else {
            Apply(e.kv);
          }
        }
      } else if (events.status().code() != StatusCode::kDeadlineExceeded) {
        return events.status();
      }
      if (Clock::now() >= next_keepalive) {
        KVD_RETURN_IF_ERROR(etcd_.LeaseKeepAlive(lease_).status());
        next_keepalive = Clock::now() + keepalive_period;
      }
      if (Clock::now() >= next_refresh) {
        MemberRecord now = OwnRecord();
        now.registered_unix_ms = published_.registered_unix_ms;
        if (!(now == published_)) {
          KVD_RETURN_IF_ERROR(etcd_.Put(key_, now.ToJson(), lease_));
          published_ = now;
        }
        next_refresh = Clock::now() + options_.refresh_interval;
      }
    }
    return Status::Cancelled("stopping");
  }

  const MembershipOptions options_;
  const RecordSource source_;
  EtcdClient etcd_;  // its last_response() is when etcd last answered this node
  const std::string key_;
  const Clock::time_point started_ = Clock::now();
  std::thread thread_;

  // Membership thread only.
  int64_t lease_ = 0;
  MemberRecord published_;
  bool logged_unreachable_ = false;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;                       // GUARDED_BY(mu_)
  WatchStream* watch_ = nullptr;                // GUARDED_BY(mu_), the session's, while open
  MembershipState state_;                       // GUARDED_BY(mu_), members/refused below
  std::map<std::string, Member> members_;       // GUARDED_BY(mu_), by key
  std::map<std::string, std::string> refused_;  // GUARDED_BY(mu_), by key
};

StatusOr<std::unique_ptr<Membership>> Membership::Start(MembershipOptions options,
                                                        RecordSource source) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (options.node.empty()) return Status::InvalidArgument("cluster.node: required");
  auto impl = std::make_unique<Impl>(std::move(options), std::move(source));
  impl->Start();
  return std::unique_ptr<Membership>(new Membership(std::move(impl)));
}

Membership::Membership(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Membership::~Membership() { Stop(); }
void Membership::Stop() { impl_->Stop(); }
MembershipState Membership::state() const { return impl_->state(); }
const MembershipOptions& Membership::options() const { return impl_->options(); }

}  // namespace kvd::cluster
