# Sanitizer and fuzzing builds (docs/reliability.md, "Fuzzing and sanitizers").
#
#   KVD_SANITIZE=address,undefined   ASan + UBSan over the whole tree (tests/sanitizers/run.sh asan)
#   KVD_SANITIZE=thread              TSan (tests/sanitizers/run.sh tsan)
#   KVD_FUZZ=ON                      libFuzzer targets of tests/fuzz (clang only; tests/fuzz/run.sh)
#
# The flags apply to every C/C++ target of the tree, so a finding in any library is reported with
# its stack. UBSan does not recover: undefined behaviour aborts the process, so a test (or a fuzz
# run) that hits it fails instead of printing a line nobody reads.
set(KVD_SANITIZE "" CACHE STRING
    "Sanitizers for every C/C++ target: address,undefined or thread (empty: none)")
option(KVD_FUZZ "Build the libFuzzer targets of tests/fuzz (needs clang; see tests/fuzz/run.sh)" OFF)

if(KVD_SANITIZE)
  string(REPLACE "," ";" kvd_sanitizers "${KVD_SANITIZE}")
  foreach(s ${kvd_sanitizers})
    if(NOT s MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "KVD_SANITIZE: unknown sanitizer '${s}' (address, undefined, thread, "
                          "leak; e.g. address,undefined)")
    endif()
  endforeach()
  if("thread" IN_LIST kvd_sanitizers AND ("address" IN_LIST kvd_sanitizers OR
                                          "leak" IN_LIST kvd_sanitizers))
    message(FATAL_ERROR "KVD_SANITIZE: thread cannot be combined with address or leak")
  endif()
  set(kvd_sanitize_flags -fsanitize=${KVD_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST kvd_sanitizers)
    list(APPEND kvd_sanitize_flags -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${kvd_sanitize_flags}>")
  add_link_options(-fsanitize=${KVD_SANITIZE})
  message(STATUS "kvd: sanitizers ${KVD_SANITIZE}")
endif()

if(KVD_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVD_FUZZ=ON needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                        "configure with CC=clang CXX=clang++, or run tests/fuzz/run.sh")
  endif()
  # Coverage feedback in every library the targets reach; each target links -fsanitize=fuzzer.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>")
  if(NOT KVD_SANITIZE)
    message(WARNING "KVD_FUZZ=ON without KVD_SANITIZE finds crashes only; tests/fuzz/run.sh uses "
                    "address,undefined")
  endif()
endif()
