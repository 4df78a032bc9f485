// Conversions between kvd's C++ types and their Cap'n Proto wire forms (proto/kvd.capnp).
#pragma once

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

void ToProto(const kvd::Status& status, Error::Builder out);
// An Error as a Status; an out-of-range code becomes INTERNAL (message kept).
kvd::Status FromProto(Error::Reader in);

}  // namespace kvd::proto
