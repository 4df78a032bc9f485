#include "metrics_http.h"

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "kvd/common/logging.h"
#include "listen_address.h"

namespace kvd::daemon {

namespace beast = boost::beast;
namespace http = beast::http;

MetricsEndpoint::MetricsEndpoint(asio::io_context& io, std::function<std::string()> render)
    : io_(io), render_(std::move(render)), acceptor_(io) {}

MetricsEndpoint::~MetricsEndpoint() = default;

StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    asio::io_context& io, const std::string& listen, std::function<std::string()> render) {
  KVD_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen));
  boost::system::error_code ec;
  asio::ip::tcp::resolver resolver(io);
  auto results = resolver.resolve(hp.host, std::to_string(hp.port), ec);
  if (ec || results.empty()) {
    return Status::InvalidArgument("metrics.listen: cannot resolve \"" + hp.host +
                                   "\": " + ec.message());
  }
  std::unique_ptr<MetricsEndpoint> m(new MetricsEndpoint(io, std::move(render)));
  asio::ip::tcp::endpoint endpoint = results.begin()->endpoint();
  m->acceptor_.open(endpoint.protocol(), ec);
  if (!ec) m->acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) m->acceptor_.bind(endpoint, ec);
  if (!ec) m->acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::Unavailable("cannot serve metrics on " + listen + ": " + ec.message());
  auto bound = m->acceptor_.local_endpoint();
  std::string host = bound.address().to_string();
  if (bound.address().is_v6()) host = "[" + host + "]";
  m->address_ = host + ":" + std::to_string(bound.port());
  asio::co_spawn(io, m->Accept(), asio::detached);
  return m;
}

void MetricsEndpoint::Close() {
  closed_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
}

asio::awaitable<void> MetricsEndpoint::Accept() {
  while (!closed_) {
    boost::system::error_code ec;
    asio::ip::tcp::socket socket(io_);
    co_await acceptor_.async_accept(socket, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (closed_ || ec == asio::error::operation_aborted) break;
      KVD_LOG(WARNING) << "metrics accept failed" << Kv("error", ec.message());
      continue;
    }
    asio::co_spawn(io_, Serve(std::move(socket)), asio::detached);
  }
}

asio::awaitable<void> MetricsEndpoint::Serve(asio::ip::tcp::socket socket) {
  beast::tcp_stream stream(std::move(socket));
  beast::flat_buffer buffer;
  http::request_parser<http::string_body> parser;  // a body (of a refused POST) is read and dropped
  parser.header_limit(16 * 1024);
  parser.body_limit(64 * 1024);
  boost::system::error_code ec;
  stream.expires_after(std::chrono::seconds(5));
  co_await http::async_read(stream, buffer, parser, asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return;  // timeout, garbage or a closed connection: nothing to answer
  const auto& req = parser.get();
  http::response<http::string_body> res;
  res.version(req.version());
  res.keep_alive(false);
  res.set(http::field::server, "kvd");
  std::string target(req.target());
  if (size_t q = target.find('?'); q != std::string::npos) target.resize(q);
  if (req.method() != http::verb::get) {
    res.result(http::status::method_not_allowed);
    res.set(http::field::allow, "GET");
    res.set(http::field::content_type, "text/plain");
    res.body() = "only GET /metrics is served\n";
  } else if (target != "/metrics") {
    res.result(http::status::not_found);
    res.set(http::field::content_type, "text/plain");
    res.body() = "not found: " + target + " (metrics are at /metrics)\n";
  } else {
    res.result(http::status::ok);
    res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    res.body() = render_();
  }
  res.prepare_payload();
  stream.expires_after(std::chrono::seconds(5));
  co_await http::async_write(stream, res, asio::redirect_error(asio::use_awaitable, ec));
  stream.socket().shutdown(asio::ip::tcp::socket::shutdown_both, ec);
}

}  // namespace kvd::daemon
