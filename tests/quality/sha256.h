// SHA-256 (FIPS 180-4), for verifying the text manifest. Not for anything secret.
#pragma once

#include <string>
#include <string_view>

namespace kvd::quality {

// Lower-case hex digest of `data`.
std::string Sha256Hex(std::string_view data);

}  // namespace kvd::quality
