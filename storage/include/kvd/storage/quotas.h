// Per-namespace quotas: how much of the host tier, and of the daemon's event queues, one
// namespace (tenant) may hold. Enforced by HostTier (stored, reserved, pinned bytes, leases) and
// by the daemon's event hub (queued events). A request over a quota fails RESOURCE_EXHAUSTED
// with Reason::kQuotaExceeded, its message naming the namespace, the limit and its value; it
// never makes another namespace's request fail.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::storage {

// One namespace's limits. 0 = no limit of this kind.
struct NamespaceQuota {
  // Payload bytes stored in the host tier plus open reservations. Over it, a Reserve first
  // evicts the namespace's own least-recently-used unpinned chunks, never another's.
  uint64_t stored_bytes = 0;
  // Payload bytes of open reservations (Reserve, ReserveAhead, InlinePut until committed).
  uint64_t reserved_bytes = 0;
  // Payload bytes of the namespace's chunks held by its open leases (each chunk once).
  uint64_t pinned_bytes = 0;
  // Open leases of the namespace, over all its connections.
  uint32_t leases = 0;
  // Events queued for the namespace's subscribers, over all of them, and their bytes. At the
  // limit new events become a "dropped" marker on the subscriber's queue (resync with List).
  uint32_t queued_events = 0;
  uint64_t queued_event_bytes = 0;

  bool operator==(const NamespaceQuota&) const = default;
};

// The quotas of every namespace: those named, and a default for the rest.
struct QuotaTable {
  NamespaceQuota defaults;
  std::map<std::string, NamespaceQuota, std::less<>> namespaces;

  const NamespaceQuota& For(std::string_view name_space) const;
  bool operator==(const QuotaTable&) const = default;
};

// RESOURCE_EXHAUSTED, Reason::kQuotaExceeded: `asked` more of `limit` (a NamespaceQuota field name,
// e.g. "reserved_bytes") would take namespace `name_space` from `held` over `value`.
Status QuotaExceeded(std::string_view name_space, std::string_view limit, uint64_t value,
                     uint64_t held, uint64_t asked);

}  // namespace kvd::storage
