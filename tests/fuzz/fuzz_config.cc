// Fuzz target: the topology / configuration parsers of the daemon (daemon/include/kvd/daemon/
// config.h, daemon/src/auth.h) over arbitrary text: the topology YAML (ParseConfigYaml: YAML
// syntax, one document, no duplicate keys, binding of every section, DaemonConfig::Validate),
// byte sizes (ParseByteSize), and the auth tokens file (LoadAuthTokens, read from an anonymous
// memfd: no file is left anywhere).
//
// Invariants: a refused topology or tokens file is INVALID_ARGUMENT (the file exists); an
// accepted topology passes Validate() again; a parsed byte size formats and parses back to
// itself.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "auth.h"
#include "fuzz_check.h"
#include "kvd/daemon/config.h"

namespace {

using kvd::StatusCode;

void CheckTokensFile(std::string_view text) {
  kvd::fuzz::MemFile file(text.data(), text.size());
  auto tokens = kvd::daemon::LoadAuthTokens(file.path());
  if (!tokens.ok()) {
    KVD_FUZZ_CHECK(tokens.status().code() == StatusCode::kInvalidArgument, "%s",
                   tokens.status().ToString().c_str());
    return;
  }
  for (const auto& [ns, token] : tokens->namespaces) {
    KVD_FUZZ_CHECK(!token.empty(), "namespace %s with an empty token", ns.c_str());
    KVD_FUZZ_CHECK(kvd::daemon::TokenEquals(token, token), "a token differs from itself");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);

  auto config = kvd::daemon::ParseConfigYaml(text, "fuzz.yaml");
  if (config.ok()) {
    kvd::Status again = config->Validate();
    KVD_FUZZ_CHECK(again.ok(), "accepted config fails Validate: %s", again.ToString().c_str());
  } else {
    KVD_FUZZ_CHECK(config.status().code() == StatusCode::kInvalidArgument, "%s",
                   config.status().ToString().c_str());
  }

  auto bytes = kvd::daemon::ParseByteSize(text);
  if (bytes.ok()) {
    const std::string formatted = kvd::daemon::FormatByteSize(*bytes);
    auto back = kvd::daemon::ParseByteSize(formatted);
    KVD_FUZZ_CHECK(back.ok() && *back == *bytes, "%s does not parse back to %llu",
                   formatted.c_str(), static_cast<unsigned long long>(*bytes));
  } else {
    KVD_FUZZ_CHECK(bytes.status().code() == StatusCode::kInvalidArgument, "%s",
                   bytes.status().ToString().c_str());
  }

  CheckTokensFile(text);
  return 0;
}
