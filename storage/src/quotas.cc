#include "kvd/storage/quotas.h"

namespace kvd::storage {

const NamespaceQuota& QuotaTable::For(std::string_view name_space) const {
  auto it = namespaces.find(name_space);
  return it == namespaces.end() ? defaults : it->second;
}

Status QuotaExceeded(std::string_view name_space, std::string_view limit, uint64_t value,
                     uint64_t held, uint64_t asked) {
  return Status(StatusCode::kResourceExhausted,
                "namespace \"" + std::string(name_space) + "\" is at its quota " +
                    std::string(limit) + "=" + std::to_string(value) + ": it holds " +
                    std::to_string(held) + ", " + std::to_string(asked) +
                    " more asked; other namespaces are not affected",
                Reason::kQuotaExceeded);
}

}  // namespace kvd::storage
