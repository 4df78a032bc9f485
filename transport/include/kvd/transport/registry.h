// The backend registry: a backend is a name, a factory and the topology keys it binds.
//
//   TransportBackend b;
//   b.name = "mine";
//   b.create = &MyTransport::Create;                     // reads BackendOptionsOf<MyOptions>
//   b.keys.push_back({"mine_depth", [](const std::string& path, const std::string& text,
//                                      TransportOptions* o) {
//     return ParseIntText(path, text, 1, 64, &MutableBackendOptions<MyOptions>(o).depth);
//   }});
//   KVD_RETURN_IF_ERROR(RegisterTransportBackend(std::move(b)));
//
// The built-in backends (ucx, loopback, none, nccl) are registered the same way, each from its
// folder (src/ucx/ucx_backend.cc, ...), by the one list in src/backends.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvd/common/scalar_text.h"
#include "kvd/transport/transport.h"

namespace kvd::transport {

// One `transport:` key a backend binds. `bind` applies the key's scalar text to `options`;
// on a bad value it returns INVALID_ARGUMENT naming `path` (the key as the topology file spells
// it, "transport.<key>"), e.g. via ParseIntText / ParseBoolText (kvd/common/scalar_text.h).
struct TransportOptionKey {
  std::string name;
  std::function<Status(const std::string& path, const std::string& text, TransportOptions* options)>
      bind;
};

struct TransportBackend {
  std::string name;                      // registry name, TransportOptions::backend
  TransportFactory create;               // builds a Transport from validated options
  std::vector<TransportOptionKey> keys;  // its own `transport:` keys (may be empty)
};

// Adds a backend. INVALID_ARGUMENT without a name or factory, or for a key without a binder;
// ALREADY_EXISTS if the name is taken. Thread-safe.
Status RegisterTransportBackend(TransportBackend backend);

// The topology file's `transport:` section, as (key, scalar text) pairs in document order; a key
// written without a value (YAML null) has no text: it must be known, and keeps its default.
using TransportSection = std::vector<std::pair<std::string, std::optional<std::string>>>;

// Binds `section` onto `options`: "backend" first (it picks the keys), then "close_timeout_ms"
// (every backend), then each other key through the backend that binds it: the chosen backend's
// keys and the built-in backends' keys (bound whichever backend is chosen: a ucx client also
// sets its nccl_device).
// INVALID_ARGUMENT "transport.<key>: unknown key (known here: ...)" for any other key, or the
// binder's error naming the key.
Status BindTransportOptions(const TransportSection& section, TransportOptions* options);

}  // namespace kvd::transport
