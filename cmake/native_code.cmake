# Code compiled for this machine's instruction set (KVD_NATIVE: -march=native) next to code
# compiled for the baseline one, in one program.
#
# kvd_add_native_objects(LIBRARY OBJECTS): OBJECTS is an OBJECT library, LIBRARY a STATIC one.
# With -march=native available, OBJECTS is compiled with it and its objects reach LIBRARY as one
# object, <LIBRARY>_native.o, whose weak functions are local (localize_weak.sh: the inline
# functions and templates it instantiates are also emitted, baseline, by the other libraries, and
# a linker keeps one copy of each per program: without this a native copy could run in baseline
# code and the other way round). Without it, LIBRARY takes OBJECTS' objects as they are.
set(KVD_LOCALIZE_WEAK ${CMAKE_CURRENT_LIST_DIR}/localize_weak.sh)

function(kvd_add_native_objects library objects)
  if(NOT KVD_HAS_MARCH_NATIVE)
    target_sources(${library} PRIVATE $<TARGET_OBJECTS:${objects}>)
    return()
  endif()
  target_compile_options(${objects} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  set(native ${CMAKE_CURRENT_BINARY_DIR}/${library}_native.o)
  add_custom_command(OUTPUT ${native}
    COMMAND ${KVD_LOCALIZE_WEAK} ${CMAKE_LINKER} ${CMAKE_NM} ${CMAKE_OBJCOPY} ${native}
            $<TARGET_OBJECTS:${objects}>
    DEPENDS $<TARGET_OBJECTS:${objects}> ${KVD_LOCALIZE_WEAK}
    COMMAND_EXPAND_LISTS VERBATIM
    COMMENT "Localizing the weak functions of ${library}'s native code")
  set_source_files_properties(${native} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  target_sources(${library} PRIVATE ${native})
endfunction()
