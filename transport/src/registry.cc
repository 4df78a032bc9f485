// The backend registry (registry.h) and the binding of the topology's `transport:` section.
#include "kvd/transport/registry.h"

#include <map>
#include <mutex>

#include "backends.h"

namespace kvd::transport {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, TransportBackend> backends;
  std::vector<std::string> builtin;  // names of the built-in backends, in BuiltinBackends order
};

Status AddLocked(Registry& r, TransportBackend backend) {
  if (backend.name.empty() || !backend.create) {
    return Status::InvalidArgument("RegisterTransportBackend needs a name and a factory");
  }
  for (const TransportOptionKey& key : backend.keys) {
    if (key.name.empty() || !key.bind) {
      return Status::InvalidArgument("transport backend '" + backend.name +
                                     "' has a key without a name or a binder");
    }
  }
  std::string name = backend.name;
  if (!r.backends.emplace(name, std::move(backend)).second) {
    return Status::AlreadyExists("transport backend '" + name + "' is already registered");
  }
  return Status::Ok();
}

Registry& GetRegistry() {
  static Registry* registry = [] {
    auto* r = new Registry();
    for (TransportBackend& b : BuiltinBackends()) {
      r->builtin.push_back(b.name);
      AddLocked(*r, std::move(b)).IgnoreError();  // distinct names with factories: cannot fail
    }
    return r;
  }();
  return *registry;
}

// The keys every backend reads.
std::vector<TransportOptionKey> CommonKeys() {
  using S = const std::string&;
  return {
      {"backend", [](S, S text, TransportOptions* o) { return (o->backend = text, Status::Ok()); }},
      {"close_timeout_ms",
       [](S path, S text, TransportOptions* o) {
         return ParseIntText(path, text, 0, 3600000, &o->close_timeout_ms);
       }},
  };
}

// The keys a `transport:` section may hold with `backend` chosen: the common ones, the chosen
// backend's, then the built-in backends' (each name once).
std::vector<TransportOptionKey> KnownKeys(const std::string& backend) {
  std::vector<TransportOptionKey> known = CommonKeys();
  auto add = [&known](const TransportBackend& b) {
    for (const TransportOptionKey& key : b.keys) {
      bool seen = false;
      for (const TransportOptionKey& k : known) seen = seen || k.name == key.name;
      if (!seen) known.push_back(key);
    }
  };
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (auto it = r.backends.find(backend); it != r.backends.end()) add(it->second);
  for (const std::string& name : r.builtin) add(r.backends.at(name));
  return known;
}

}  // namespace

Status BindTransportOptions(const TransportSection& section, TransportOptions* options) {
  for (const auto& [key, text] : section) {
    if (key == "backend" && text.has_value()) options->backend = *text;
  }
  std::vector<TransportOptionKey> known = KnownKeys(options->backend);
  auto find = [&known](const std::string& name) -> const TransportOptionKey* {
    for (const TransportOptionKey& k : known) {
      if (k.name == name) return &k;
    }
    return nullptr;
  };
  for (const auto& [key, text] : section) {  // every key checked before any value
    if (find(key) != nullptr) continue;
    std::string list;
    for (const TransportOptionKey& k : known) list += (list.empty() ? "" : ", ") + k.name;
    return Status::InvalidArgument("transport." + key + ": unknown key (known here: " + list + ")");
  }
  for (const auto& [key, text] : section) {
    if (text.has_value()) KVD_RETURN_IF_ERROR(find(key)->bind("transport." + key, *text, options));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  TransportFactory factory;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.backends.find(options.backend);
    if (it == r.backends.end()) {
      std::string names;
      for (const auto& [name, b] : r.backends) names += (names.empty() ? "" : ", ") + name;
      return Status::NotFound("unknown transport backend '" + options.backend +
                              "' (registered: " + names + ")");
    }
    factory = it->second.create;
  }
  return factory(options);
}

Status RegisterTransportBackend(TransportBackend backend) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return AddLocked(r, std::move(backend));
}

Status RegisterTransportBackend(const std::string& name, TransportFactory factory) {
  TransportBackend b;
  b.name = name;
  b.create = std::move(factory);
  return RegisterTransportBackend(std::move(b));
}

std::vector<std::string> RegisteredTransportBackends() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, b] : r.backends) names.push_back(name);
  return names;
}

}  // namespace kvd::transport
