#include "quotas.h"

#include <charconv>
#include <limits>
#include <string>

namespace kvd::daemon {

storage::QuotaTable QuotaOptions::DefaultTable() {
  storage::QuotaTable t;
  t.defaults.queued_events = 65536;
  t.defaults.queued_event_bytes = 16ull << 20;
  return t;
}

namespace {

Status ParseCount(std::string_view name, std::string_view value, uint32_t* out) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size() ||
      v > std::numeric_limits<uint32_t>::max()) {
    return Status::InvalidArgument(std::string(name) + ": \"" + std::string(value) +
                                   "\" is not a count (0 .. 4294967295; 0 = no limit)");
  }
  *out = static_cast<uint32_t>(v);
  return Status::Ok();
}

Status ParseBytes(std::string_view name, std::string_view value, uint64_t* out) {
  auto bytes = ParseByteSize(value);
  if (!bytes.ok())
    return Status::InvalidArgument(std::string(name) + ": " + bytes.status().message());
  *out = *bytes;
  return Status::Ok();
}

}  // namespace

Status SetQuotaField(storage::NamespaceQuota* quota, std::string_view name,
                     std::string_view value) {
  if (name == "stored_bytes") return ParseBytes(name, value, &quota->stored_bytes);
  if (name == "reserved_bytes") return ParseBytes(name, value, &quota->reserved_bytes);
  if (name == "pinned_bytes") return ParseBytes(name, value, &quota->pinned_bytes);
  if (name == "queued_event_bytes") return ParseBytes(name, value, &quota->queued_event_bytes);
  if (name == "leases") return ParseCount(name, value, &quota->leases);
  if (name == "queued_events") return ParseCount(name, value, &quota->queued_events);
  return Status::InvalidArgument(
      "unknown quota \"" + std::string(name) +
      "\" (expected stored_bytes, reserved_bytes, pinned_bytes, leases, queued_events or "
      "queued_event_bytes)");
}

storage::QuotaTable ResolveQuotas(const QuotaOptions& options, const AuthTokens& auth,
                                  uint64_t host_capacity) {
  storage::QuotaTable table = options.table;
  for (const auto& [name, words] : auth.quotas) {
    storage::NamespaceQuota q = table.For(name);
    // Validated when the tokens file was loaded.
    for (const auto& [field, value] : words) SetQuotaField(&q, field, value).IgnoreError();
    table.namespaces[name] = q;
  }
  const size_t tenants = auth.namespaces.size();
  if (options.protect && tenants >= 2) {
    const uint64_t share = host_capacity / (2 * tenants);
    auto protect = [&](storage::NamespaceQuota& q) {
      if (q.reserved_bytes == 0) q.reserved_bytes = share;
      if (q.pinned_bytes == 0) q.pinned_bytes = share;
    };
    protect(table.defaults);
    for (auto& [name, q] : table.namespaces) protect(q);
  }
  return table;
}

}  // namespace kvd::daemon
