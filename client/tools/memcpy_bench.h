// kvd-bench --op memcpy (internal to client/tools): the reference a same-node data path is
// measured against (see kvd_bench.cc's header comment).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvd::tools::bench {

// --op memcpy (see kvd_bench.cc's header comment); `scatter_bytes`: memcpy_scatter's destinations
// in all (0: count x bytes). Returns the exit code.
int RunMemcpy(size_t bytes, int64_t count, int64_t concurrency, uint64_t scatter_bytes, bool json);

}  // namespace kvd::tools::bench
