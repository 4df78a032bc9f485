// The HTTP endpoint of the metrics (Boost.Beast on the daemon's io_context): GET /metrics
// answers the Prometheus text of `render()`; any other path is 404, any other method 405.
// One request per connection (Connection: close); a client that does not send its request
// within 5 s is dropped. Private to daemon/.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "asio_util.h"
#include "kvd/common/status.h"

namespace kvd::daemon {

class MetricsEndpoint {
 public:
  // Binds `listen` ("host:port", port 0 = ephemeral) and starts accepting on `io`. `render` is
  // called on the io_context thread for every scrape. Errors: UNAVAILABLE naming the address.
  static StatusOr<std::unique_ptr<MetricsEndpoint>> Start(asio::io_context& io,
                                                          const std::string& listen,
                                                          std::function<std::string()> render);
  ~MetricsEndpoint();
  // "127.0.0.1:9464" as bound.
  const std::string& address() const { return address_; }
  // Stops accepting (io_context thread). Requests in progress finish.
  void Close();

 private:
  MetricsEndpoint(asio::io_context& io, std::function<std::string()> render);
  asio::awaitable<void> Accept();
  asio::awaitable<void> Serve(asio::ip::tcp::socket socket);

  asio::io_context& io_;
  std::function<std::string()> render_;
  asio::ip::tcp::acceptor acceptor_;
  std::string address_;
  bool closed_ = false;
};

}  // namespace kvd::daemon
