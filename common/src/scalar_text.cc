#include "kvd/common/scalar_text.h"

#include <charconv>

namespace kvd {
namespace {

Status Bad(const std::string& path, const std::string& text, const std::string& what) {
  return Status::InvalidArgument(path + ": \"" + text + "\" " + what);
}

}  // namespace

Status ParseIntText(const std::string& path, const std::string& text, int64_t min_value,
                    int64_t max_value, int64_t* out) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    return Bad(path, text, "is not an integer");
  }
  if (v < min_value || v > max_value) {
    return Bad(path, text,
               "is outside [" + std::to_string(min_value) + ", " + std::to_string(max_value) + "]");
  }
  *out = v;
  return Status::Ok();
}

Status ParseBoolText(const std::string& path, const std::string& text, bool* out) {
  if (text == "true" || text == "yes" || text == "on") {
    *out = true;
  } else if (text == "false" || text == "no" || text == "off") {
    *out = false;
  } else {
    return Bad(path, text, "is not a boolean (true/false)");
  }
  return Status::Ok();
}

}  // namespace kvd
