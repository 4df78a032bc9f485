// Standard base64 (RFC 4648, with padding): how etcd's gateway carries keys and values in JSON.
#pragma once

#include <string>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::cluster {

std::string Base64Encode(std::string_view bytes);
// INVALID_ARGUMENT for a length that is not a multiple of 4 or a character outside the alphabet.
StatusOr<std::string> Base64Decode(std::string_view text);

}  // namespace kvd::cluster
