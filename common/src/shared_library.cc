// dlopen/dlsym behind SharedLibrary (shared_library.h).
#include "kvd/common/shared_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <utility>

namespace kvd {
namespace {

std::string LoaderError(const char* fallback) {
  const char* why = dlerror();
  return why != nullptr ? why : fallback;
}

}  // namespace

StatusOr<SharedLibrary> SharedLibrary::Open(const std::string& name) {
  dlerror();  // clear a stale error
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return Status::Unavailable(LoaderError((name + ": not loadable").c_str()));
  return SharedLibrary(name, handle);
}

StatusOr<SharedLibrary> SharedLibrary::OpenFirst(std::span<const std::string> names,
                                                 std::string_view what) {
  std::string tried;
  for (const std::string& name : names) {
    auto lib = Open(name);
    if (lib.ok()) return lib;
    tried += "\n  " + name + ": " + lib.status().message();
  }
  return Status::Unavailable(std::string(what) + ": none of these loads:" + tried);
}

StatusOr<SharedLibrary> SharedLibrary::OpenChosen(const char* env,
                                                  std::span<const std::string> defaults,
                                                  std::string_view what) {
  if (const char* chosen = std::getenv(env); chosen != nullptr && *chosen != '\0') {
    const std::string name = chosen;
    return OpenFirst(std::span<const std::string>(&name, 1),
                     std::string(what) + " ($" + env + ")");
  }
  return OpenFirst(defaults, what);
}

bool SharedLibrary::IsLoaded(const std::string& name) {
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return false;
  dlclose(handle);  // drops the reference RTLD_NOLOAD took
  return true;
}

SharedLibrary::SharedLibrary(SharedLibrary&& other) noexcept
    : name_(std::move(other.name_)), handle_(std::exchange(other.handle_, nullptr)) {}

SharedLibrary& SharedLibrary::operator=(SharedLibrary&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) dlclose(handle_);
    name_ = std::move(other.name_);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

SharedLibrary::~SharedLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

StatusOr<void*> SharedLibrary::Symbol(const char* symbol) const {
  if (handle_ == nullptr) return Status::FailedPrecondition(name_ + ": not open");
  dlerror();
  void* p = dlsym(handle_, symbol);
  if (p == nullptr) {
    return Status::Unavailable(name_ + ": no symbol " + symbol + " (" +
                               LoaderError("not found") + ")");
  }
  return p;
}

}  // namespace kvd
