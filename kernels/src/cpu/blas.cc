// Loading CBLAS on first use (blas.h).
#include "blas.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "kvd/common/logging.h"
#include "kvd/common/shared_library.h"
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
void LimitThreads(const SharedLibrary& lib, bool already_loaded, CblasApi* api) {
  if (!lib.Resolve("openblas_get_num_threads", &api->get_num_threads).ok()) {
    api->get_num_threads = nullptr;
  }
  void (*set)(int) = nullptr;
  if (!lib.Resolve("openblas_set_num_threads", &set).ok() || already_loaded ||
      EnvironmentSetsBlasThreads()) {
    return;
  }
  set(1);
}

template <typename Fn>
bool Resolve(const SharedLibrary& lib, const char* name, Fn* out, std::string* missing) {
  if (lib.Resolve(name, out).ok()) return true;
  *missing += std::string(missing->empty() ? "" : ", ") + name;
  return false;
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
    // The symbols are reached through the table only; the library is kept for the process's
    // lifetime (the kernels may call it until exit).
    const bool present = SharedLibrary::IsLoaded(name);
    auto lib = SharedLibrary::Open(name);
    if (!lib.ok()) {
      tried += std::string("\n  ") + name + ": " + lib.status().message();
      continue;
    }
    Loaded loaded;
    CblasApi& api = loaded.api;
    std::string missing;
    bool ok = Resolve(*lib, "cblas_sgemm", &api.sgemm, &missing);
    ok = Resolve(*lib, "cblas_dgemm", &api.dgemm, &missing) && ok;
    ok = Resolve(*lib, "cblas_dsyrk", &api.dsyrk, &missing) && ok;
    ok = Resolve(*lib, "cblas_dsymm", &api.dsymm, &missing) && ok;
    if (ok) {
      LimitThreads(*lib, present, &api);
      lib->Leak();
      loaded.ok = true;
      return loaded;
    }
    tried += std::string("\n  ") + name + ": loaded but lacks " + missing;
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
