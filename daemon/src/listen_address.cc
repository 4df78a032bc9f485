#include "listen_address.h"

#include <charconv>

namespace kvd::daemon {

StatusOr<HostPort> ParseHostPort(std::string_view text) {
  auto bad = [&](const char* why) {
    return Status::InvalidArgument("\"" + std::string(text) + "\" is not host:port (" + why + ")");
  };
  size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return bad("no port");
  std::string_view host = text.substr(0, colon);
  std::string_view port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return bad("IPv6 hosts need brackets");
  }
  if (host.empty()) return bad("empty host");
  if (port.empty()) return bad("empty port");
  unsigned value = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || ptr != port.data() + port.size() || value > 65535) {
    return bad("port must be 0..65535");
  }
  return HostPort{std::string(host), static_cast<uint16_t>(value)};
}

}  // namespace kvd::daemon
