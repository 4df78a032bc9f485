#include "kvd/common/utf8.h"

#include <cstdint>

namespace kvd {

size_t Utf8SequenceBytes(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  size_t n = 0;  // continuation bytes
  uint32_t cp = 0;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 1, cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 2, cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 3, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n >= s.size()) return 0;
  for (size_t k = 1; k <= n; ++k) {
    const auto cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (cc & 0x3f);
  }
  // Overlong forms, surrogates and code points past U+10FFFF are invalid too.
  if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10ffff ||
      (cp >= 0xd800 && cp <= 0xdfff)) {
    return 0;
  }
  return n + 1;
}

size_t FirstInvalidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SequenceBytes(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

}  // namespace kvd
