// A shared library opened at run time (dlopen) and its symbols (dlsym), with errors that name
// the library and the symbol. The optional parts of kvd (the CUDA runtime, NCCL, the CUDA
// kernels module, CBLAS) are loaded through it on first use, so that a process that never uses
// them never maps them.
//
// Errors: UNAVAILABLE, the message naming what was tried and the loader's reason
// ("libnccl.so.2: cannot open shared object file: No such file or directory").
// Lifetime: the library stays loaded while the object lives; Leak() keeps it for the process's
// lifetime (function tables that may be called until exit).
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "kvd/common/status.h"

namespace kvd {

class SharedLibrary {
 public:
  // dlopen(name, RTLD_NOW | RTLD_LOCAL): a soname ("libcudart.so.13") or a path.
  static StatusOr<SharedLibrary> Open(const std::string& name);
  // The first of `names` that opens. UNAVAILABLE "<what>: none of ... loads:" listing every name
  // and its reason.
  static StatusOr<SharedLibrary> OpenFirst(std::span<const std::string> names,
                                           std::string_view what);
  // OpenFirst of the value of environment variable `env` when it is set and not empty (the one
  // choice then), else of `defaults`.
  static StatusOr<SharedLibrary> OpenChosen(const char* env, std::span<const std::string> defaults,
                                            std::string_view what);
  // True when `name` is already loaded in this process (nothing is loaded by asking).
  static bool IsLoaded(const std::string& name);

  SharedLibrary(SharedLibrary&& other) noexcept;
  SharedLibrary& operator=(SharedLibrary&& other) noexcept;
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;
  ~SharedLibrary();

  // The address of `symbol`; UNAVAILABLE "<library>: no symbol <symbol>" when it lacks it.
  StatusOr<void*> Symbol(const char* symbol) const;
  // *fn = the function `symbol` (its type is the caller's to get right).
  template <typename Fn>
  Status Resolve(const char* symbol, Fn* fn) const {
    KVD_ASSIGN_OR_RETURN(void* p, Symbol(symbol));
    *fn = reinterpret_cast<Fn>(p);
    return Status::Ok();
  }
  // The name it was opened by.
  const std::string& name() const { return name_; }
  // Keeps the library loaded after this object is gone.
  void Leak() { handle_ = nullptr; }

 private:
  SharedLibrary(std::string name, void* handle) : name_(std::move(name)), handle_(handle) {}
  std::string name_;
  void* handle_ = nullptr;
};

}  // namespace kvd
