// Binding of per-namespace quotas (QuotaOptions, tokens-file quota words) and the table kvd
// enforces. Private to daemon/.
#pragma once

#include <cstdint>
#include <string_view>

#include "auth.h"
#include "kvd/daemon/config.h"
#include "kvd/storage/quotas.h"

namespace kvd::daemon {

// Sets field `name` of `quota` (a NamespaceQuota field: stored_bytes, reserved_bytes,
// pinned_bytes, queued_event_bytes take a byte size such as "64MiB"; leases, queued_events a
// count) from `value`. INVALID_ARGUMENT "FIELD: ..." for an unknown field or a bad value.
Status SetQuotaField(storage::NamespaceQuota* quota, std::string_view name, std::string_view value);

// The quotas kvd enforces: `options.table`, the tokens file's quota words laid over it (a
// namespace they name starts from its topology entry, else from the default), then, with
// options.protect and two or more namespaces in the tokens file, host_capacity / (2 x namespaces)
// for every reserved_bytes and pinned_bytes left 0.
storage::QuotaTable ResolveQuotas(const QuotaOptions& options, const AuthTokens& auth,
                                  uint64_t host_capacity);

}  // namespace kvd::daemon
