// A small etcd v3 client: the calls kvd's cluster membership needs, spoken as JSON over HTTP/1.1
// to etcd's gRPC gateway (POST /v3/<service>/<method>, keys and values base64 in the body), with
// Boost.Beast. Tested against Debian's etcd-server 3.4 (whose gateway serves /v3/ and /v3beta/).
//
//   EtcdClient etcd({.endpoints = {"127.0.0.1:2379"}});
//   int64_t lease = etcd.LeaseGrant(10).value();
//   KVD_RETURN_IF_ERROR(etcd.Put("/kvd/c/members/a", record_json, lease));
//   auto members = etcd.RangePrefix("/kvd/c/members/").value();    // + the store's revision
//   auto watch = etcd.WatchPrefix("/kvd/c/members/", members.revision + 1).value();
//   auto events = watch->Next(std::chrono::milliseconds(500));      // DEADLINE_EXCEEDED: none yet
//
// Errors (every call): UNAVAILABLE when no endpoint accepts a connection or a connection breaks
// (the message names each endpoint tried and why); DEADLINE_EXCEEDED when the endpoint that
// accepted does not answer within request_timeout; INTERNAL for a reply that is not the JSON the
// gateway sends; otherwise the gRPC code etcd answered, mapped onto kvd's codes (NOT_FOUND for an
// unknown lease, PERMISSION_DENIED / UNAUTHENTICATED as PERMISSION_DENIED, ...) with etcd's
// message. No call blocks longer than connect_timeout per endpoint plus request_timeout.
//
// Thread safety: EtcdClient is thread-safe (each call uses its own connection; nothing is shared
// but the immutable options and the atomic time of the last response). A WatchStream is used by
// one thread at a time (Interrupt aside).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::cluster {

struct EtcdClientOptions {
  // etcd client endpoints, "host:port" (IPv4 literal or name; "[v6]:port"). Tried in order; the
  // first that accepts a connection answers the call. Required, non-empty.
  std::vector<std::string> endpoints;
  // Longest wait for one endpoint's TCP connection. Default 1000 ms.
  std::chrono::milliseconds connect_timeout{1000};
  // Longest wait for a reply once a request is sent. Default 2000 ms.
  std::chrono::milliseconds request_timeout{2000};

  // INVALID_ARGUMENT: no endpoint, an endpoint that is not host:port, a timeout <= 0.
  Status Validate() const;
};

struct KeyValue {
  std::string key;
  std::string value;
  int64_t lease = 0;  // 0: none
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
};

struct RangeResult {
  std::vector<KeyValue> kvs;  // in key order
  int64_t revision = 0;       // the store's revision the result was read at
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  KeyValue kv;  // for kDelete only key and mod_revision are set
};

struct LeaseInfo {
  int64_t id = 0;
  int64_t ttl_s = -1;         // seconds left; -1: the lease does not exist (expired, revoked)
  int64_t granted_ttl_s = 0;  // the TTL it was granted with
};

// One watch: a streaming HTTP response whose body is one JSON message per line.
class WatchStream {
 public:
  virtual ~WatchStream() = default;
  // Events that arrive within `timeout` (a batch from one or more messages; never empty when
  // OK). DEADLINE_EXCEEDED: none arrived, the watch stays open (call again). UNAVAILABLE: the
  // connection ended (etcd stopped or the network broke); open a new watch. ABORTED: etcd
  // cancelled the watch (e.g. its start revision was compacted away).
  virtual StatusOr<std::vector<WatchEvent>> Next(std::chrono::milliseconds timeout) = 0;
  // The revision of the last message received (events or progress), 0 before any.
  virtual int64_t revision() const = 0;
  // Makes a Next under way, and every later one, return CANCELLED at once. The one call that
  // any thread may make while another is in Next.
  virtual void Interrupt() = 0;
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdClientOptions options);
  const EtcdClientOptions& options() const { return options_; }
  // When etcd last answered a call of this client, or sent a message on a watch it opened,
  // without an error; nullopt before the first such answer. Copies of the client share it.
  std::optional<std::chrono::steady_clock::time_point> last_response() const;

  // A lease of `ttl_s` seconds (etcd may grant more; the granted TTL is returned in LeaseInfo).
  StatusOr<LeaseInfo> LeaseGrant(int64_t ttl_s);
  // Refreshes the lease once. OK with ttl_s of the refreshed lease, or NOT_FOUND when the lease
  // no longer exists (it expired or was revoked: register again with a new one).
  StatusOr<LeaseInfo> LeaseKeepAlive(int64_t lease_id);
  // Revokes the lease, deleting every key attached to it. NOT_FOUND: it did not exist.
  Status LeaseRevoke(int64_t lease_id);
  // What is left of a lease: ttl_s -1 when it does not exist.
  StatusOr<LeaseInfo> LeaseTimeToLive(int64_t lease_id);

  // Puts key = value, attached to `lease_id` (0: no lease). NOT_FOUND: the lease does not exist.
  Status Put(const std::string& key, const std::string& value, int64_t lease_id = 0);
  // Every key starting with `prefix` (non-empty), with the revision they were read at.
  StatusOr<RangeResult> RangePrefix(const std::string& prefix);
  // Deletes one key; returns how many were deleted (0 or 1).
  StatusOr<int64_t> Delete(const std::string& key);
  // Watches every key starting with `prefix`, from `start_revision` (0: from now). Returns once
  // etcd confirmed the watch (its "created" message), so no event after that point is missed.
  StatusOr<std::unique_ptr<WatchStream>> WatchPrefix(const std::string& prefix,
                                                     int64_t start_revision);

 private:
  EtcdClientOptions options_;
  // last_response() as steady_clock ticks (INT64_MIN: none yet), shared with the watches.
  std::shared_ptr<std::atomic<int64_t>> last_response_;
};

// The key just past every key starting with `prefix` (etcd's range_end for a prefix).
std::string PrefixRangeEnd(const std::string& prefix);

}  // namespace kvd::cluster
