// The slot metadata of compact chunk format v2: per (layer, KV head), the slot count, the
// cardinalities, the representative positions and the rebuild flags of a CompactHead, bit-packed
// with Gamma and Rice codes (bit_io.h). The field-by-field layout is in docs/chunk-format.md
// ("Slot metadata"); keep the two in step. Internal to kvd_kernels.
#pragma once

#include <cstdint>

#include "bit_io.h"
#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"

namespace kvd::kernels::internal {

// Rice parameters of one list kind (bit_io.h), as the previous head used them.
struct ListParameters {
  uint64_t k = 0;           // plain mode: every value
  uint64_t zero_run_k = 0;  // zero-run mode: the lengths of the runs of zeros
  uint64_t value_k = 0;     // zero-run mode: each nonzero value minus 1
};

// Per-head parameters are coded as differences from the previous head's (layer-major order), so
// heads with equal budgets and similar statistics cost one bit per parameter. Start with {}.
struct SlotCodingState {
  uint64_t slots = 0;
  uint64_t rebuild_count = 0;
  ListParameters cardinality, position, rebuild;
};

// Appends `head`'s slot metadata. REQUIRES: the head passed CompactChunk::Validate() and has no
// rebuild flag unless `has_route`. Any `position_base` decodes back exactly; the code is shortest
// with the chunk's smallest (position - cardinality + 1), the first token a slot stands for.
void EncodeSlotMetadata(const CompactHead& head, bool has_route, int64_t position_base,
                        SlotCodingState* state, BitWriter* out);

// Reads one head's metadata into head->flags / cardinality / positions (keys and values are left
// to the caller). At most `max_slots` slots are accepted before anything is allocated. On a value
// no encoder writes (a slot count above max_slots, a parameter out of range, a cardinality
// outside [1, 2^31), a negative position, a rebuild index past the slots) or on running out of
// bits: DATA_LOSS whose message says what was wrong (without the head's name: the caller adds it).
Status DecodeSlotMetadata(BitReader* in, bool has_route, int64_t position_base, uint64_t max_slots,
                          SlotCodingState* state, CompactHead* head);

}  // namespace kvd::kernels::internal
