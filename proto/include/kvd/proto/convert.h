// Conversions between kvd's C++ types and their Cap'n Proto wire forms (proto/kvd.capnp).
#pragma once

#include <string>
#include <string_view>

#include "kvd/common/hash.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/proto/kvd.capnp.h"

namespace kvd::proto {

void ToProto(const kvd::ModelLayout& layout, ModelLayout::Builder out);
// Errors: INVALID_ARGUMENT for an unknown enum value or a layout that fails Validate().
StatusOr<kvd::ModelLayout> FromProto(ModelLayout::Reader in);

void ToProto(const kvd::Hash128& h, Hash128::Builder out);
kvd::Hash128 FromProto(Hash128::Reader in);

// The message goes out as valid UTF-8 (ValidUtf8), whatever bytes it echoes.
void ToProto(const kvd::Status& status, Error::Builder out);
// `in` with every byte that is not part of a well-formed UTF-8 sequence (truncated, overlong,
// surrogate, > U+10FFFF) replaced by U+FFFD.
std::string ValidUtf8(std::string_view in);
// An Error as a Status; an out-of-range code becomes INTERNAL (message kept), a reason this
// build does not know becomes Reason::kNone. The message is
// made valid UTF-8 here too (ValidUtf8): a daemon of another build may send any bytes.
kvd::Status FromProto(Error::Reader in);

}  // namespace kvd::proto
