// Scalars written as text (a topology file's values, a `transport:` key's value), parsed the one
// way every kvd configuration reader parses them. `path` names the value in the errors (e.g.
// "tiers.host.read_ttl_ms", "transport.keepalive_interval_ms").
#pragma once

#include <cstdint>
#include <string>

#include "kvd/common/status.h"

namespace kvd {

// A decimal integer in [min_value, max_value]. INVALID_ARGUMENT `<path>: "<text>" is not an
// integer` or `... is outside [min, max]`; `*out` is left as it is on an error.
Status ParseIntText(const std::string& path, const std::string& text, int64_t min_value,
                    int64_t max_value, int64_t* out);
template <typename Int>
Status ParseIntText(const std::string& path, const std::string& text, int64_t min_value,
                    int64_t max_value, Int* out) {
  int64_t v = 0;
  KVD_RETURN_IF_ERROR(ParseIntText(path, text, min_value, max_value, &v));
  *out = static_cast<Int>(v);
  return Status::Ok();
}

// true/yes/on or false/no/off. INVALID_ARGUMENT `<path>: "<text>" is not a boolean
// (true/false)`; `*out` is left as it is on an error.
Status ParseBoolText(const std::string& path, const std::string& text, bool* out);

}  // namespace kvd
