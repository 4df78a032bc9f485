// Tokens of the `auth` section: who may open an engine session in a namespace, and who may use
// admin requests. Loaded once at start (a changed file needs a restart).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::daemon {

// How a connection reached the daemon (set at accept).
struct PeerInfo {
  bool unix_socket = false;  // over the unix socket (else TCP)
  bool loopback = false;     // TCP from a loopback address
  int64_t uid = -1;          // unix socket: the peer's uid from SO_PEERCRED (-1 unknown)
};

struct AuthTokens {
  bool enabled = false;                           // a tokens file was given
  std::map<std::string, std::string> namespaces;  // namespace -> token
  std::string admin;                              // "" = no admin token (admin only via unix)
  // Quota words of a namespace line ("reserved_bytes=256MiB"), as (field, value), in order.
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> quotas;
  // Set when the file is readable by group or others (logged as a warning at start).
  bool loose_permissions = false;
};

// Parses a tokens file (format in AuthOptions::tokens_file). NOT_FOUND if it cannot be read;
// INVALID_ARGUMENT "auth.tokens_file <path> line N: ..." for a malformed line, an empty token, a
// namespace listed twice, a second admin line, or a bad quota word (SetQuotaField's error).
StatusOr<AuthTokens> LoadAuthTokens(const std::string& path);

// Compares in time independent of where the strings differ (no timing oracle on the token).
bool TokenEquals(std::string_view expected, std::string_view given);

}  // namespace kvd::daemon
