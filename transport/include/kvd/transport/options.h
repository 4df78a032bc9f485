// Options of a Transport. Fixed at creation (none can change at runtime).
//
// TransportOptions holds what every backend reads (backend, close_timeout_ms) and, per backend,
// that backend's own options struct, derived from BackendOptions: the built-in ones are
// UcxOptions, LoopbackOptions and NcclOptions (ucx_options.h, ...), a backend registered outside
// transport/ brings its own. Set and read them by type:
//
//   MutableBackendOptions<UcxOptions>(&options).ucx_tls = "tcp";
//   int device = BackendOptionsOf<NcclOptions>(options).nccl_device;
//
// The topology file's `transport:` keys reach them through each backend's registration
// (registry.h, BindTransportOptions).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::transport {

// One backend's options. Copyable values; a default-constructed one must be valid.
struct BackendOptions {
  virtual ~BackendOptions() = default;
  // INVALID_ARGUMENT naming the field if a value is out of range.
  virtual Status Validate() const = 0;
};

struct TransportOptions {
  // Registry name of the backend: "ucx" (default) or "loopback" (in-process, for tests); others
  // registered with RegisterTransportBackend.
  std::string backend = "ucx";

  // ---- all backends ----
  // How long Disconnect and the destructor wait for in-flight transfers to be cancelled and
  // endpoints to close before giving up (and leaking the backend state rather than freeing
  // memory UCX may still touch). Default 2000 ms.
  int64_t close_timeout_ms = 2000;

  // Each backend's options, at most one per type, in the order first set; a type absent here
  // reads as its defaults. Use MutableBackendOptions / BackendOptionsOf rather than this list.
  // Copies of TransportOptions share the structs; MutableBackendOptions copies a shared one
  // before writing.
  std::vector<std::shared_ptr<const BackendOptions>> backend_options;

  // INVALID_ARGUMENT naming the field if a value is out of range: backend empty, a negative
  // close_timeout_ms, then each of backend_options' Validate in order.
  Status Validate() const;
};

namespace options_internal {
// The index in options.backend_options of the options of exactly `type`, or -1.
int SlotOf(const TransportOptions& options, const std::type_info& type);
}  // namespace options_internal

// The options of type T in `options`, for writing: T's defaults if none are set yet. Write
// through the reference before copying or assigning `options`.
template <typename T>
T& MutableBackendOptions(TransportOptions* options) {
  static_assert(std::is_base_of_v<BackendOptions, T>, "T must derive BackendOptions");
  auto& slots = options->backend_options;
  int i = options_internal::SlotOf(*options, typeid(T));
  if (i < 0) {
    i = static_cast<int>(slots.size());
    slots.push_back(std::make_shared<T>());
  } else if (slots[i].use_count() > 1) {  // shared with a copy of `options`: write a copy
    slots[i] = std::make_shared<T>(static_cast<const T&>(*slots[i]));
  }
  return const_cast<T&>(static_cast<const T&>(*slots[i]));  // made non-const by make_shared
}

// The options of type T in `options`: the set ones, or T's defaults if none are set. The
// reference is valid while `options` lives and is not written.
template <typename T>
const T& BackendOptionsOf(const TransportOptions& options) {
  static_assert(std::is_base_of_v<BackendOptions, T>, "T must derive BackendOptions");
  static const T defaults{};  // value-initialized: a member without an initializer reads 0
  const int i = options_internal::SlotOf(options, typeid(T));
  return i >= 0 ? static_cast<const T&>(*options.backend_options[i]) : defaults;
}

}  // namespace kvd::transport
