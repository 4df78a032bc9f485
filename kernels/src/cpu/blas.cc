// Loading CBLAS on first use (blas.h).
#include "blas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "kvd/common/logging.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels::cpu {
namespace {

// True when the user chose OpenBLAS's thread count through its environment variables.
bool EnvironmentSetsBlasThreads() {
  for (const char* name : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

// One thread per call (LoadBlas's contract in vector.h) when this loader is the one bringing the
// library in: a library the process already had belongs to whoever loaded it (e.g. an engine that
// links OpenBLAS and sets its own count).
void LimitThreads(void* handle, bool already_loaded, CblasApi* api) {
  api->get_num_threads = reinterpret_cast<int (*)()>(dlsym(handle, "openblas_get_num_threads"));
  auto set = reinterpret_cast<void (*)(int)>(dlsym(handle, "openblas_set_num_threads"));
  if (set == nullptr || already_loaded || EnvironmentSetsBlasThreads()) return;
  set(1);
}

template <typename Fn>
bool Resolve(void* handle, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

struct Loaded {
  CblasApi api;
  bool ok = false;
  std::string tried;  // every library tried and why it was not taken (when !ok)
};

Loaded Load() {
  const char* const candidates[] = {
#ifdef KVD_BLAS_LIBRARY
      KVD_BLAS_LIBRARY,
#endif
      "libopenblas.so.0", "libcblas.so.3", "libblas.so.3"};
  std::string tried;
  for (const char* name : candidates) {
    // RTLD_LOCAL: the symbols are reached through dlsym only; the handle is kept for the
    // process's lifetime (never dlclosed: the kernels may call it until exit).
    void* const present = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (present != nullptr) dlclose(present);  // drops the reference NOLOAD took
    void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      tried += std::string("\n  ") + name + ": " + (why != nullptr ? why : "not loadable");
      continue;
    }
    Loaded loaded;
    CblasApi& api = loaded.api;
    std::string missing;
    bool ok = Resolve(handle, "cblas_sgemm", &api.sgemm, &missing);
    ok = Resolve(handle, "cblas_dgemm", &api.dgemm, &missing) && ok;
    ok = Resolve(handle, "cblas_dsyrk", &api.dsyrk, &missing) && ok;
    ok = Resolve(handle, "cblas_dsymm", &api.dsymm, &missing) && ok;
    if (ok) {
      LimitThreads(handle, present != nullptr, &api);
      loaded.ok = true;
      return loaded;
    }
    tried += std::string("\n  ") + name + ": loaded but lacks " + missing;
    dlclose(handle);
  }
  Loaded failed;
  failed.tried = std::move(tried);
  return failed;
}

const Loaded& TheLibrary() {
  static const Loaded loaded = Load();
  return loaded;
}

std::string NotLoadedMessage(const Loaded& loaded) {
  return "no CBLAS library could be loaded (install OpenBLAS, e.g. Debian's libopenblas0); "
         "tried:" +
         loaded.tried;
}

}  // namespace

const CblasApi& Cblas() {
  const Loaded& loaded = TheLibrary();
  if (!loaded.ok) KVD_LOG(FATAL) << "kvd kernels: " << NotLoadedMessage(loaded);
  return loaded.api;
}

}  // namespace kvd::kernels::cpu

namespace kvd::kernels {

Status LoadBlas() {
  const cpu::Loaded& loaded = cpu::TheLibrary();
  if (loaded.ok) return Status::Ok();
  return Status::FailedPrecondition(cpu::NotLoadedMessage(loaded));
}

int BlasThreads() {
  const cpu::Loaded& loaded = cpu::TheLibrary();
  if (!loaded.ok || loaded.api.get_num_threads == nullptr) return 0;
  return loaded.api.get_num_threads();
}

}  // namespace kvd::kernels
