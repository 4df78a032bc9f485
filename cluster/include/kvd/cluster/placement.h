// The cluster's placement rule: which member a prefill engine puts a chain's chunks to, so that
// the node that decodes it finds them local. Rendezvous (highest-random-weight) hashing of the
// chain's first chunk hash over the candidate members:
//
//   score(node) = xxh3-64( chain[0].hi as 8 bytes LE || chain[0].lo as 8 bytes LE || node id )
//
// the highest score wins, ties (never seen in practice) go to the smaller node id. Keyed on the
// first chunk, every chunk of a prompt and every prompt that shares its first chunk land on the
// same member; a member joining or leaving moves only the chains it wins or won (1/N of them).
// Every kvd and every client computes the same order from the same member list.
//
//   auto order = RendezvousOrder(chain[0], {"a", "b", "c"});   // indexes, best first
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/common/hash.h"

namespace kvd::cluster {

// The rendezvous score of `node` for a chain whose first chunk hash is `first`.
uint64_t RendezvousScore(const Hash128& first, std::string_view node);

// Indexes into `nodes`, highest score first (ties: smaller node id first). Empty for none.
std::vector<size_t> RendezvousOrder(const Hash128& first, std::span<const std::string> nodes);

}  // namespace kvd::cluster
