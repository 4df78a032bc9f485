# Code compiled for this machine's instruction set (KVD_NATIVE: -march=native) next to code
# compiled for the baseline one, in one program.
#
# kvd_add_native_objects(LIBRARY OBJECTS): OBJECTS is an OBJECT library, LIBRARY a STATIC one.
# With KVD_NATIVE_OBJECTS (below), OBJECTS is compiled with it and its objects reach LIBRARY as one
# object, <LIBRARY>_native.o, whose weak functions are local (localize_weak.sh: the inline
# functions and templates it instantiates are also emitted, baseline, by the other libraries, and
# a linker keeps one copy of each per program: without this a native copy could run in baseline
# code and the other way round). Without it, LIBRARY takes OBJECTS' objects as they are.
set(KVD_LOCALIZE_WEAK ${CMAKE_CURRENT_LIST_DIR}/localize_weak.sh)

# The localizing step needs a linker with `-r --force-group-allocation` (GNU ld >= 2.30; lld, the
# linker clang builds use, has no such option). CMAKE_LINKER is tried first, then GNU ld.bfd.
# KVD_NATIVE_OBJECTS: ON when native code is built (KVD_NATIVE, -march=native accepted, such a
# linker found); without it the code is compiled for the baseline instruction set, which is
# always correct, only slower in the kernels.
set(KVD_NATIVE_OBJECTS OFF)
if(KVD_HAS_MARCH_NATIVE)
  find_program(KVD_LD_BFD NAMES ld.bfd)
  foreach(candidate IN ITEMS "${CMAKE_LINKER}" "${KVD_LD_BFD}")
    if(candidate)
      execute_process(COMMAND ${candidate} --help OUTPUT_VARIABLE help ERROR_QUIET
                      RESULT_VARIABLE rc)
      if(rc EQUAL 0 AND help MATCHES "force-group-allocation")
        set(KVD_NATIVE_LINKER ${candidate})
        set(KVD_NATIVE_OBJECTS ON)
        break()
      endif()
    endif()
  endforeach()
  if(NOT KVD_NATIVE_OBJECTS)
    message(WARNING "kvd: no linker accepts -r --force-group-allocation (GNU ld >= 2.30 does): "
                    "the kernels and the reference engine are compiled for the baseline "
                    "instruction set instead of -march=native")
  endif()
endif()
message(STATUS "kvd: native code (-march=native) ${KVD_NATIVE_OBJECTS}")

function(kvd_add_native_objects library objects)
  if(NOT KVD_NATIVE_OBJECTS)
    target_sources(${library} PRIVATE $<TARGET_OBJECTS:${objects}>)
    return()
  endif()
  target_compile_options(${objects} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  set(native ${CMAKE_CURRENT_BINARY_DIR}/${library}_native.o)
  add_custom_command(OUTPUT ${native}
    COMMAND ${KVD_LOCALIZE_WEAK} ${KVD_NATIVE_LINKER} ${CMAKE_NM} ${CMAKE_OBJCOPY} ${native}
            $<TARGET_OBJECTS:${objects}>
    DEPENDS $<TARGET_OBJECTS:${objects}> ${KVD_LOCALIZE_WEAK}
    COMMAND_EXPAND_LISTS VERBATIM
    COMMENT "Localizing the weak functions of ${library}'s native code")
  set_source_files_properties(${native} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  target_sources(${library} PRIVATE ${native})
endfunction()
