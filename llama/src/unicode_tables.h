// Private: Unicode code point classes for the BPE pre-tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvd::llama::internal {

struct CodepointRange {
  uint32_t lo, hi;  // inclusive
};
extern const CodepointRange kLetterRanges[];
extern const size_t kNumLetterRanges;
extern const CodepointRange kNumberRanges[];
extern const size_t kNumNumberRanges;

}  // namespace kvd::llama::internal
