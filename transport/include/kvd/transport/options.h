// Options of a Transport. Fixed at creation (none can change at runtime).
//
// Each backend owns its options: the built-in ones are UcxOptions, LoopbackOptions and
// NcclOptions (ucx_options.h, ...), which TransportOptions carries as bases (so
// `options.ucx_tls` reads as before); any other backend keeps its own struct, derived from
// BackendOptions, in `backend_options` (MutableBackendOptions / BackendOptionsOf below). The
// topology file's `transport:` keys reach them through each backend's registration
// (registry.h, BindTransportOptions).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kvd/common/status.h"
#include "kvd/transport/loopback_options.h"
#include "kvd/transport/nccl_options.h"
#include "kvd/transport/ucx_options.h"

namespace kvd::transport {

// Options of a backend registered outside transport/ (see registry.h). Copyable values.
struct BackendOptions {
  virtual ~BackendOptions() = default;
  // INVALID_ARGUMENT naming the field if a value is out of range.
  virtual Status Validate() const = 0;
};

struct TransportOptions : UcxOptions, LoopbackOptions, NcclOptions {
  // Registry name of the backend: "ucx" (default) or "loopback" (in-process, for tests); others
  // registered with RegisterTransportBackend.
  std::string backend = "ucx";

  // ---- all backends ----
  // How long Disconnect and the destructor wait for in-flight transfers to be cancelled and
  // endpoints to close before giving up (and leaking the backend state rather than freeing
  // memory UCX may still touch). Default 2000 ms.
  int64_t close_timeout_ms = 2000;

  // The options of a backend registered outside transport/ (null: none set, its defaults).
  // Shared between copies of TransportOptions; MutableBackendOptions copies before writing.
  std::shared_ptr<const BackendOptions> backend_options;

  // INVALID_ARGUMENT naming the field if a value is out of range (backend empty, a negative
  // close_timeout_ms, then UcxOptions, LoopbackOptions, NcclOptions and backend_options'
  // Validate in that order).
  Status Validate() const;
};

// The backend options of type T in `options`, for writing: a fresh copy of the present ones if
// they are a T, else a default T (replacing any other type's).
template <typename T>
T& MutableBackendOptions(TransportOptions* options) {
  const auto* present = dynamic_cast<const T*>(options->backend_options.get());
  auto fresh = present != nullptr ? std::make_shared<T>(*present) : std::make_shared<T>();
  T& ref = *fresh;
  options->backend_options = std::move(fresh);
  return ref;
}

// The backend options of type T in `options`: the set ones, or T's defaults if none of type T.
template <typename T>
T BackendOptionsOf(const TransportOptions& options) {
  const auto* present = dynamic_cast<const T*>(options.backend_options.get());
  return present != nullptr ? *present : T{};
}

}  // namespace kvd::transport
