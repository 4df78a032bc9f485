// etcd's gRPC gateway over HTTP/1.1 with Beast. Boost and JSON exceptions stay in this file.
#include "kvd/cluster/etcd_client.h"

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "base64.h"

namespace kvd::cluster {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using boost::system::error_code;
using Json = nlohmann::json;

// The gateway prefix of etcd 3.4 (it also serves /v3beta/; 3.5 dropped that).
constexpr const char* kApiPrefix = "/v3/";

struct HostPort {
  std::string host;
  std::string port;
};

std::optional<HostPort> SplitEndpoint(const std::string& endpoint) {
  std::string text = endpoint;
  if (text.rfind("http://", 0) == 0) text = text.substr(7);
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) return std::nullopt;
  HostPort hp{text.substr(0, colon), text.substr(colon + 1)};
  if (hp.host.front() == '[' && hp.host.back() == ']')
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  int port = 0;
  auto [ptr, ec] = std::from_chars(hp.port.data(), hp.port.data() + hp.port.size(), port);
  if (ec != std::errc() || ptr != hp.port.data() + hp.port.size() || port <= 0 || port > 65535) {
    return std::nullopt;
  }
  return hp;
}

// The Host header's value for an endpoint: host:port, an IPv6 host in brackets, no scheme.
std::string HostHeader(const HostPort& hp) {
  const bool v6 = hp.host.find(':') != std::string::npos;
  return (v6 ? "[" + hp.host + "]" : hp.host) + ":" + hp.port;
}

// gRPC status codes (as the gateway reports them in "code"), by number, onto kvd's. UNKNOWN (2)
// and INTERNAL (13) have no counterpart but kvd's INTERNAL, which names the gRPC code.
constexpr StatusCode kFromGrpc[] = {
    StatusCode::kOk,                  // 0 OK
    StatusCode::kCancelled,           // 1 CANCELLED
    StatusCode::kInternal,            // 2 UNKNOWN
    StatusCode::kInvalidArgument,     // 3 INVALID_ARGUMENT
    StatusCode::kDeadlineExceeded,    // 4 DEADLINE_EXCEEDED
    StatusCode::kNotFound,            // 5 NOT_FOUND
    StatusCode::kAlreadyExists,       // 6 ALREADY_EXISTS
    StatusCode::kPermissionDenied,    // 7 PERMISSION_DENIED
    StatusCode::kResourceExhausted,   // 8 RESOURCE_EXHAUSTED
    StatusCode::kFailedPrecondition,  // 9 FAILED_PRECONDITION
    StatusCode::kAborted,             // 10 ABORTED
    StatusCode::kOutOfRange,          // 11 OUT_OF_RANGE
    StatusCode::kUnimplemented,       // 12 UNIMPLEMENTED
    StatusCode::kInternal,            // 13 INTERNAL
    StatusCode::kUnavailable,         // 14 UNAVAILABLE
    StatusCode::kDataLoss,            // 15 DATA_LOSS
    StatusCode::kPermissionDenied,    // 16 UNAUTHENTICATED
};

Status FromGrpc(int code, const std::string& message) {
  const bool known = code >= 0 && code < static_cast<int>(std::size(kFromGrpc));
  const StatusCode kvd_code = known ? kFromGrpc[code] : StatusCode::kInternal;
  if (kvd_code == StatusCode::kOk) return Status::Ok();
  std::string m = "etcd: " + message;
  if (kvd_code == StatusCode::kInternal) m += " (gRPC code " + std::to_string(code) + ")";
  return Status(kvd_code, std::move(m));
}

// The gateway writes int64 fields as strings; accept numbers too. Absent: `fallback`.
int64_t Int64Field(const Json& j, const char* key, int64_t fallback = 0) {
  auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc() && ptr == s.data() + s.size()) return v;
  }
  return fallback;
}

StatusOr<std::string> Bytes(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return std::string();
  auto bytes = Base64Decode(it->get_ref<const std::string&>());
  if (!bytes.ok())
    return Status::Internal("etcd: reply field " + std::string(key) + ": " +
                            bytes.status().message());
  return bytes;
}

StatusOr<KeyValue> ParseKeyValue(const Json& j) {
  KeyValue kv;
  KVD_ASSIGN_OR_RETURN(kv.key, Bytes(j, "key"));
  KVD_ASSIGN_OR_RETURN(kv.value, Bytes(j, "value"));
  kv.lease = Int64Field(j, "lease");
  kv.create_revision = Int64Field(j, "create_revision");
  kv.mod_revision = Int64Field(j, "mod_revision");
  return kv;
}

// An error object of the gateway ({"error": ..., "code": N, "message": ...}), or OK.
Status GatewayError(const Json& j) {
  const Json* e = &j;
  if (auto it = j.find("error"); it != j.end() && it->is_object()) e = &*it;  // in a stream
  if (!e->contains("code")) return Status::Ok();
  const int code = static_cast<int>(Int64Field(*e, "code"));
  std::string message = e->value("message", std::string());
  if (message.empty() && e->contains("error") && (*e)["error"].is_string()) {
    message = (*e)["error"].get<std::string>();
  }
  return FromGrpc(code, message);
}

// Runs `f`, turning an exception (a JSON reply of unexpected shape) into INTERNAL: nothing
// thrown leaves this file.
template <typename F>
auto Guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    return Status::Internal(std::string("etcd: unexpected reply: ") + e.what());
  }
}

std::string Describe(const error_code& ec) {
  return ec == beast::error::timeout ? "timed out" : ec.message();
}

// The steady_clock ticks of EtcdClient::last_response_ before any response.
constexpr int64_t kNoResponse = std::numeric_limits<int64_t>::min();

using ResponseTime = std::shared_ptr<std::atomic<int64_t>>;

// One HTTP connection to one endpoint, driven on its own io_context so that every wait is bounded.
class Connection {
 public:
  // Connects to the first endpoint that accepts within connect_timeout. Every reply and watch
  // message without an error sets `answered` to the time it arrived.
  static StatusOr<std::unique_ptr<Connection>> Open(const EtcdClientOptions& options,
                                                    ResponseTime answered) {
    auto c = std::unique_ptr<Connection>(new Connection(std::move(answered)));
    std::string tried;
    for (const std::string& endpoint : options.endpoints) {
      auto hp = SplitEndpoint(endpoint);
      if (!hp)
        return Status::InvalidArgument("etcd endpoint \"" + endpoint + "\" is not host:port");
      error_code ec;
      asio::ip::tcp::resolver resolver(c->ioc_);
      auto results = resolver.resolve(hp->host, hp->port, ec);
      if (!ec) {
        c->stream_.expires_after(options.connect_timeout);
        ec = asio::error::would_block;
        c->stream_.async_connect(results, [&](error_code e, const auto&) { ec = e; });
        c->RunUntilDone();
      }
      if (!ec) {
        c->host_ = HostHeader(*hp);
        return c;
      }
      tried += (tried.empty() ? "" : "; ") + endpoint + ": " + Describe(ec);
      c->stream_.close();
    }
    return Status::Unavailable("etcd unreachable (" + tried + ")");
  }

  // Writes a POST of `body` to `path` (request_timeout bounds the write).
  Status Send(const std::string& path, const std::string& body, std::chrono::milliseconds timeout) {
    http::request<http::string_body> req{http::verb::post, path, 11};
    req.set(http::field::host, host_);
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    stream_.expires_after(timeout);
    error_code ec = asio::error::would_block;
    http::async_write(stream_, req, [&](error_code e, size_t) { ec = e; });
    RunUntilDone();
    if (ec) return Status::Unavailable("etcd " + host_ + ": sending " + path + ": " + Describe(ec));
    return Status::Ok();
  }

  // One whole response (request_timeout bounds it), parsed as JSON; etcd's error object as its
  // Status.
  StatusOr<Json> Call(const std::string& path, const Json& body,
                      std::chrono::milliseconds timeout) {
    KVD_RETURN_IF_ERROR(Send(path, body.dump(), timeout));
    http::response<http::string_body> res;
    error_code ec = asio::error::would_block;
    http::async_read(stream_, buffer_, res, [&](error_code e, size_t) { ec = e; });
    RunUntilDone();
    if (ec == beast::error::timeout) {
      return Status::DeadlineExceeded("etcd " + host_ + ": no answer to " + path + " within " +
                                      std::to_string(timeout.count()) + " ms");
    }
    if (ec) return Status::Unavailable("etcd " + host_ + ": reading " + path + ": " + ec.message());
    Json j = Json::parse(res.body(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Status::Internal("etcd " + host_ + ": " + path + " answered HTTP " +
                              std::to_string(res.result_int()) + " with a body that is not JSON");
    }
    KVD_RETURN_IF_ERROR(GatewayError(j));
    if (res.result() != http::status::ok) {
      return Status::Internal("etcd " + host_ + ": " + path + " answered HTTP " +
                              std::to_string(res.result_int()));
    }
    Answered();
    return j;
  }

  // etcd answered without an error now.
  void Answered() { answered_->store(std::chrono::steady_clock::now().time_since_epoch().count()); }

  asio::io_context& ioc() { return ioc_; }
  beast::tcp_stream& stream() { return stream_; }
  beast::flat_buffer& buffer() { return buffer_; }
  const std::string& host() const { return host_; }
  // Runs the io_context until no operation is left.
  void RunUntilDone() {
    ioc_.restart();
    ioc_.run();
  }

 private:
  explicit Connection(ResponseTime answered) : answered_(std::move(answered)) {}

  const ResponseTime answered_;
  asio::io_context ioc_;
  beast::tcp_stream stream_{ioc_};
  beast::flat_buffer buffer_;
  std::string host_;
};

StatusOr<Json> Call(const EtcdClientOptions& options, const ResponseTime& answered,
                    const std::string& method, const Json& body) {
  KVD_ASSIGN_OR_RETURN(auto connection, Connection::Open(options, answered));
  return connection->Call(kApiPrefix + method, body, options.request_timeout);
}

class GatewayWatchStream : public WatchStream {
 public:
  explicit GatewayWatchStream(std::unique_ptr<Connection> c) : c_(std::move(c)) {
    parser_.body_limit(boost::none);
  }
  ~GatewayWatchStream() override {
    error_code ec;
    c_->stream().socket().shutdown(asio::ip::tcp::socket::shutdown_both, ec);
    c_->stream().close();
    c_->ioc().restart();
    c_->ioc().poll();  // lets the cancelled read finish before the parser goes away
  }

  // Reads the header and the "created" message within `timeout`.
  Status Created(std::chrono::milliseconds timeout) {
    c_->stream().expires_after(timeout);
    error_code ec = asio::error::would_block;
    http::async_read_header(c_->stream(), c_->buffer(), parser_,
                            [&](error_code e, size_t) { ec = e; });
    c_->RunUntilDone();
    if (ec == beast::error::timeout) {
      return Status::DeadlineExceeded("etcd " + c_->host() + ": watch not answered within " +
                                      std::to_string(timeout.count()) + " ms");
    }
    if (ec) return Status::Unavailable("etcd " + c_->host() + ": watch: " + ec.message());
    c_->stream().expires_never();
    if (parser_.get().result() != http::status::ok) {
      return Status::Internal("etcd " + c_->host() + ": watch answered HTTP " +
                              std::to_string(parser_.get().result_int()));
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      auto result = NextResult(deadline);
      if (result.status().code() == StatusCode::kDeadlineExceeded) {
        return Status::DeadlineExceeded("etcd " + c_->host() + ": watch not confirmed within " +
                                        std::to_string(timeout.count()) + " ms");
      }
      if (!result.ok()) return result.status();
      if (result->value("created", false)) return Status::Ok();
    }
  }

  StatusOr<std::vector<WatchEvent>> Next(std::chrono::milliseconds timeout) override {
    return Guarded([&] { return NextEvents(timeout); });
  }

  int64_t revision() const override { return revision_; }

  // The flag answers every later Next; the posted stop ends the run of a Next under way (a
  // posted handler survives the restart a run begins with, so none is missed).
  void Interrupt() override {
    interrupted_.store(true);
    asio::post(c_->ioc(), [this] { c_->ioc().stop(); });
  }

 private:
  StatusOr<std::vector<WatchEvent>> NextEvents(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<WatchEvent> events;
    while (events.empty()) {
      auto next = NextResult(deadline);
      if (next.status().code() == StatusCode::kDeadlineExceeded) {
        return Status::DeadlineExceeded("etcd watch: no event within " +
                                        std::to_string(timeout.count()) + " ms");
      }
      KVD_ASSIGN_OR_RETURN(Json result, std::move(next));
      if (result.value("canceled", false)) {
        return Status::Aborted("etcd " + c_->host() + ": watch cancelled: " +
                               result.value("cancel_reason", std::string("(no reason given)")) +
                               " (compact_revision " +
                               std::to_string(Int64Field(result, "compact_revision")) + ")");
      }
      auto evs = result.find("events");
      if (evs == result.end() || !evs->is_array()) continue;
      for (const Json& e : *evs) {
        WatchEvent event;
        event.type = e.value("type", std::string("PUT")) == "DELETE" ? WatchEvent::Type::kDelete
                                                                     : WatchEvent::Type::kPut;
        if (auto kv = e.find("kv"); kv != e.end()) {
          KVD_ASSIGN_OR_RETURN(event.kv, ParseKeyValue(*kv));
        }
        events.push_back(std::move(event));
      }
    }
    return events;
  }

  // The "result" of the next stream message, read before `deadline`; its revision noted.
  StatusOr<Json> NextResult(std::chrono::steady_clock::time_point deadline) {
    KVD_ASSIGN_OR_RETURN(std::string line,
                         NextLine(std::chrono::duration_cast<std::chrono::milliseconds>(
                             deadline - std::chrono::steady_clock::now())));
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Status::Internal("etcd " + c_->host() + ": watch sent a line that is not JSON");
    }
    KVD_RETURN_IF_ERROR(GatewayError(j));
    auto it = j.find("result");
    if (it == j.end() || !it->is_object()) {
      return Status::Internal("etcd " + c_->host() + ": watch message without a result");
    }
    if (auto h = it->find("header"); h != it->end()) {
      revision_ = std::max(revision_, Int64Field(*h, "revision"));
    }
    c_->Answered();
    return *it;
  }

  // One '\n'-terminated message of the body within `timeout`. The read stays posted across
  // calls: a timeout leaves it pending, and the next call waits on it again.
  StatusOr<std::string> NextLine(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (interrupted_) return Status::Cancelled("etcd watch: interrupted");
      if (size_t nl = pending_.find('\n'); nl != std::string::npos) {
        std::string line = pending_.substr(0, nl);
        pending_.erase(0, nl + 1);
        if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
        return line;
      }
      if (ended_) {
        return Status::Unavailable("etcd " + c_->host() + ": watch connection ended" +
                                   (end_reason_.empty() ? "" : ": " + end_reason_));
      }
      if (!reading_) StartRead();
      auto left = deadline - std::chrono::steady_clock::now();
      if (left.count() <= 0) {
        return Status::DeadlineExceeded("etcd watch: nothing within the wait");
      }
      c_->ioc().restart();
      c_->ioc().run_for(left);
    }
  }

  void StartRead() {
    reading_ = true;
    parser_.get().body().data = chunk_;
    parser_.get().body().size = sizeof chunk_;
    http::async_read_some(c_->stream(), c_->buffer(), parser_, [this](error_code ec, size_t) {
      reading_ = false;
      const size_t got = sizeof chunk_ - parser_.get().body().size;
      pending_.append(chunk_, got);
      if (ec == http::error::need_buffer) ec = {};
      if (ec) {
        ended_ = true;
        end_reason_ = ec.message();
      } else if (parser_.is_done()) {
        ended_ = true;
      }
    });
  }

  std::unique_ptr<Connection> c_;
  http::response_parser<http::buffer_body> parser_;
  char chunk_[16384];
  std::string pending_;
  bool reading_ = false;
  bool ended_ = false;
  std::atomic<bool> interrupted_{false};
  std::string end_reason_;
  int64_t revision_ = 0;
};

LeaseInfo ParseLease(const Json& j) {
  LeaseInfo info;
  info.id = Int64Field(j, "ID");
  info.ttl_s = Int64Field(j, "TTL", 0);
  info.granted_ttl_s = Int64Field(j, "grantedTTL", info.ttl_s);
  return info;
}

}  // namespace

Status EtcdClientOptions::Validate() const {
  if (endpoints.empty()) return Status::InvalidArgument("etcd: no endpoint given");
  for (const std::string& e : endpoints) {
    if (e.rfind("https://", 0) == 0) {
      return Status::InvalidArgument("etcd endpoint \"" + e +
                                     "\": https is not supported (kvd speaks plain HTTP to etcd's "
                                     "gateway; give http://host:port or host:port)");
    }
    if (!SplitEndpoint(e)) {
      return Status::InvalidArgument("etcd endpoint \"" + e + "\" is not host:port");
    }
  }
  if (connect_timeout.count() <= 0 || request_timeout.count() <= 0) {
    return Status::InvalidArgument("etcd: timeouts must be > 0 ms");
  }
  return Status::Ok();
}

std::string PrefixRangeEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

EtcdClient::EtcdClient(EtcdClientOptions options)
    : options_(std::move(options)),
      last_response_(std::make_shared<std::atomic<int64_t>>(kNoResponse)) {}

std::optional<std::chrono::steady_clock::time_point> EtcdClient::last_response() const {
  const int64_t ticks = last_response_->load();
  if (ticks == kNoResponse) return std::nullopt;
  return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(ticks));
}

StatusOr<LeaseInfo> EtcdClient::LeaseGrant(int64_t ttl_s) {
  return Guarded([&]() -> StatusOr<LeaseInfo> {
    KVD_ASSIGN_OR_RETURN(Json j,
                         Call(options_, last_response_, "lease/grant", Json{{"TTL", ttl_s}}));
    LeaseInfo info = ParseLease(j);
    if (info.id == 0) return Status::Internal("etcd: lease/grant answered without a lease ID");
    info.granted_ttl_s = info.ttl_s;
    return info;
  });
}

StatusOr<LeaseInfo> EtcdClient::LeaseKeepAlive(int64_t lease_id) {
  return Guarded([&]() -> StatusOr<LeaseInfo> {
    KVD_ASSIGN_OR_RETURN(Json j, Call(options_, last_response_, "lease/keepalive",
                                      Json{{"ID", std::to_string(lease_id)}}));
    auto it = j.find("result");
    if (it == j.end() || !it->is_object()) {
      return Status::Internal("etcd: lease/keepalive answered without a result");
    }
    LeaseInfo info = ParseLease(*it);
    info.id = lease_id;
    // An expired or revoked lease is answered with no TTL (0).
    if (info.ttl_s <= 0) {
      return Status::NotFound("etcd: lease " + std::to_string(lease_id) + " no longer exists");
    }
    return info;
  });
}

Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  return Guarded([&]() -> Status {
    return Call(options_, last_response_, "lease/revoke", Json{{"ID", std::to_string(lease_id)}})
        .status();
  });
}

StatusOr<LeaseInfo> EtcdClient::LeaseTimeToLive(int64_t lease_id) {
  return Guarded([&]() -> StatusOr<LeaseInfo> {
    KVD_ASSIGN_OR_RETURN(Json j, Call(options_, last_response_, "lease/timetolive",
                                      Json{{"ID", std::to_string(lease_id)}}));
    LeaseInfo info = ParseLease(j);
    info.id = lease_id;
    return info;
  });
}

Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease_id) {
  return Guarded([&]() -> Status {
    Json body{{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
    if (lease_id != 0) body["lease"] = std::to_string(lease_id);
    return Call(options_, last_response_, "kv/put", body).status();
  });
}

StatusOr<RangeResult> EtcdClient::RangePrefix(const std::string& prefix) {
  return Guarded([&]() -> StatusOr<RangeResult> {
    if (prefix.empty()) return Status::InvalidArgument("etcd range: empty prefix");
    KVD_ASSIGN_OR_RETURN(Json j, Call(options_, last_response_, "kv/range",
                                      Json{{"key", Base64Encode(prefix)},
                                           {"range_end", Base64Encode(PrefixRangeEnd(prefix))}}));
    RangeResult result;
    if (auto h = j.find("header"); h != j.end()) result.revision = Int64Field(*h, "revision");
    if (auto kvs = j.find("kvs"); kvs != j.end() && kvs->is_array()) {
      for (const Json& kv : *kvs) {
        KVD_ASSIGN_OR_RETURN(KeyValue parsed, ParseKeyValue(kv));
        result.kvs.push_back(std::move(parsed));
      }
    }
    return result;
  });
}

StatusOr<int64_t> EtcdClient::Delete(const std::string& key) {
  return Guarded([&]() -> StatusOr<int64_t> {
    KVD_ASSIGN_OR_RETURN(
        Json j, Call(options_, last_response_, "kv/deleterange", Json{{"key", Base64Encode(key)}}));
    return Int64Field(j, "deleted");
  });
}

StatusOr<std::unique_ptr<WatchStream>> EtcdClient::WatchPrefix(const std::string& prefix,
                                                               int64_t start_revision) {
  return Guarded([&]() -> StatusOr<std::unique_ptr<WatchStream>> {
    if (prefix.empty()) return Status::InvalidArgument("etcd watch: empty prefix");
    KVD_ASSIGN_OR_RETURN(auto connection, Connection::Open(options_, last_response_));
    Json create{{"key", Base64Encode(prefix)}, {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
    if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
    KVD_RETURN_IF_ERROR(connection->Send(std::string(kApiPrefix) + "watch",
                                         Json{{"create_request", create}}.dump(),
                                         options_.request_timeout));
    auto stream = std::make_unique<GatewayWatchStream>(std::move(connection));
    KVD_RETURN_IF_ERROR(stream->Created(options_.request_timeout));
    return std::unique_ptr<WatchStream>(std::move(stream));
  });
}

}  // namespace kvd::cluster
