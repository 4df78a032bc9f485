# Install rules: `cmake --install build --prefix P` lays out
#   P/bin/{kvd,kvdctl,kvd-bench}
#   P/lib/libkvd_client.so.<version> (+ SONAME link libkvd_client.so.<major> and libkvd_client.so)
#   P/lib/kvd/libkvd_kernels_cuda.so              the CUDA kernels, loaded on first device use
#   P/include/kvd/{client,common,transport}/...   the client API and the headers it includes
#   P/lib/cmake/kvd/kvdConfig.cmake ...           find_package(kvd CONFIG) -> kvd::client
#   P/lib/pkgconfig/kvd_client.pc                 pkg-config --cflags --libs kvd_client
include(CMakePackageConfigHelpers)

set(KVD_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvd)

foreach(tool kvd kvdctl kvd-bench)
  if(TARGET ${tool})
    install(TARGETS ${tool} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endforeach()

# The CUDA kernels module: libkvd_client and the programs load it from <libdir>/kvd/ on first
# device use (kernels/src/cuda_module.h). It finds the CUDA runtime where it was built against.
if(TARGET kvd_kernels_cuda)
  set_target_properties(kvd_kernels_cuda PROPERTIES INSTALL_RPATH "${CUDAToolkit_LIBRARY_DIR}")
  install(TARGETS kvd_kernels_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/kvd)
endif()

if(TARGET kvd_client)
  install(TARGETS kvd_client EXPORT kvdTargets
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  # The public client headers and exactly the common/transport headers they include.
  install(FILES
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/admin.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/client.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/hashing.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/in_place.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/json.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/kvd_client.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/options.h
    ${PROJECT_SOURCE_DIR}/client/include/kvd/client/types.h
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvd/client)
  install(FILES
    ${PROJECT_SOURCE_DIR}/common/include/kvd/common/dtype.h
    ${PROJECT_SOURCE_DIR}/common/include/kvd/common/hash.h
    ${PROJECT_SOURCE_DIR}/common/include/kvd/common/layout.h
    ${PROJECT_SOURCE_DIR}/common/include/kvd/common/status.h
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvd/common)
  install(FILES
    ${PROJECT_SOURCE_DIR}/transport/include/kvd/transport/loopback_options.h
    ${PROJECT_SOURCE_DIR}/transport/include/kvd/transport/nccl_options.h
    ${PROJECT_SOURCE_DIR}/transport/include/kvd/transport/options.h
    ${PROJECT_SOURCE_DIR}/transport/include/kvd/transport/ucx_options.h
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvd/transport)

  install(EXPORT kvdTargets NAMESPACE kvd:: DESTINATION ${KVD_INSTALL_CMAKEDIR})
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvdConfig.cmake.in
    ${CMAKE_CURRENT_BINARY_DIR}/kvdConfig.cmake INSTALL_DESTINATION ${KVD_INSTALL_CMAKEDIR})
  write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/kvdConfigVersion.cmake
    VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvdConfig.cmake
                ${CMAKE_CURRENT_BINARY_DIR}/kvdConfigVersion.cmake
    DESTINATION ${KVD_INSTALL_CMAKEDIR})

  file(RELATIVE_PATH KVD_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/kvd_client.pc.in
    ${CMAKE_CURRENT_BINARY_DIR}/kvd_client.pc @ONLY)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/kvd_client.pc
    DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endif()
