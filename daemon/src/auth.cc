#include "auth.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "kvd/daemon/config.h"
#include "quotas.h"

namespace kvd::daemon {

StatusOr<AuthTokens> LoadAuthTokens(const std::string& path) {
  std::ifstream in(path);
  struct stat st {};
  if (!in || ::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return Status::NotFound("auth.tokens_file: cannot read \"" + path + "\" (not a readable file)");
  }
  AuthTokens out;
  out.enabled = true;
  out.loose_permissions = (st.st_mode & (S_IRWXG | S_IRWXO)) != 0;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string kind, a, b;
    if (!(words >> kind)) continue;  // blank or comment
    auto bad = [&](const std::string& why) {
      return Status::InvalidArgument("auth.tokens_file " + path + " line " +
                                     std::to_string(number) + ": " + why);
    };
    words >> a >> b;
    std::vector<std::string> extra;
    for (std::string w; words >> w;) extra.push_back(w);
    if (kind == "namespace") {
      if (a.empty() || b.empty()) {
        return bad("expected \"namespace NAME TOKEN [FIELD=VALUE ...]\"");
      }
      if (Status s = CheckUtf8("namespace name", a); !s.ok()) return bad(s.message());
      if (!out.namespaces.emplace(a, b).second) return bad("namespace \"" + a + "\" listed twice");
      storage::NamespaceQuota scratch;
      for (const std::string& w : extra) {
        const size_t eq = w.find('=');
        if (eq == std::string::npos || eq == 0) {
          return bad("\"" + w +
                     "\" is not a quota (expected FIELD=VALUE, e.g. reserved_bytes=256MiB)");
        }
        std::string field = w.substr(0, eq), value = w.substr(eq + 1);
        if (Status s = SetQuotaField(&scratch, field, value); !s.ok()) {
          return bad("namespace \"" + a + "\": " + s.message());
        }
        out.quotas[a].emplace_back(std::move(field), std::move(value));
      }
    } else if (kind == "admin") {
      if (a.empty() || !b.empty() || !extra.empty()) return bad("expected \"admin TOKEN\"");
      if (!out.admin.empty()) return bad("a second admin line");
      out.admin = a;
    } else {
      return bad("unknown entry \"" + kind + "\" (expected \"namespace\" or \"admin\")");
    }
  }
  return out;
}

bool TokenEquals(std::string_view expected, std::string_view given) {
  if (expected.empty()) return false;
  unsigned diff = expected.size() != given.size() ? 1u : 0u;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i]) ^
            static_cast<unsigned char>(expected[i % expected.size()]);
  }
  return diff == 0;
}

}  // namespace kvd::daemon
