// UTF-8 well-formedness, the one definition kvd uses (wire text, logs, config strings).
#pragma once

#include <cstddef>
#include <string_view>

namespace kvd {

// Bytes (1-4) of the well-formed UTF-8 sequence that starts at s[i], or 0 when the byte there
// does not start one (a stray continuation byte, a truncated sequence, an overlong form, a
// surrogate, a code point past U+10FFFF). REQUIRES: i < s.size().
size_t Utf8SequenceBytes(std::string_view s, size_t i);

// Offset of the first byte of `s` that is not part of well-formed UTF-8; std::string_view::npos
// when all of `s` is well-formed.
size_t FirstInvalidUtf8(std::string_view s);
inline bool IsValidUtf8(std::string_view s) { return FirstInvalidUtf8(s) == std::string_view::npos; }

}  // namespace kvd
