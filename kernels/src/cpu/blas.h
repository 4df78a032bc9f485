// CBLAS (OpenBLAS) for the CPU kernels, loaded on first use instead of at program start.
//
// Why: libkvd_client carries the kernels for one job (expanding compact chunks, expand.h), and
// OpenBLAS starts its worker threads in its load-time constructor, which then spin on
// sched_yield for a while: every client process paid that, although copying puts and gets never
// call BLAS. Loaded here, a process that never reaches a BLAS call never maps the library, and
// libkvd_client's NEEDED list has no BLAS (ctest client_library_does_not_link_blas).
//
// Library: the CBLAS found at configure time (KVD_BLAS_LIBRARY, absolute path), else by soname
// libopenblas.so.0, libcblas.so.3, libblas.so.3 (the first that loads and has every symbol).
// None loadable is a deployment error: the first BLAS call logs which libraries were tried
// and why, and aborts (before this seam such a process did not start at all).
// Threads: one per call when this loader brought OpenBLAS into the process and the environment
// does not choose (LoadBlas in kvd/kernels/vector.h says why).
// Thread safety: Cblas() may be called from any thread; the load happens once.
#pragma once

#include <cblas.h>

namespace kvd::kernels::cpu {

// The CBLAS entry points the kernels use; the signatures are cblas.h's.
struct CblasApi {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&cblas_dgemm) dgemm = nullptr;
  decltype(&cblas_dsyrk) dsyrk = nullptr;
  decltype(&cblas_dsymm) dsymm = nullptr;
  // OpenBLAS's thread count, when the library is OpenBLAS (else nullptr).
  int (*get_num_threads)() = nullptr;
};

// The loaded library's entry points (loads it on the first call).
const CblasApi& Cblas();

}  // namespace kvd::kernels::cpu
