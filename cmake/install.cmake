# Install rules, the CMake package and the Debian package (included by the top-level CMakeLists.txt when
# DTRAIN_INSTALL is on, i.e. by default when dtrain is the top-level project).
#
#   cmake --install build --prefix P    P/include/dtrain/**, P/lib/libdtrain*.a, P/bin/dtrain-run,
#                                       P/bin/dtrain-trace, P/bin/dtrain-bench, P/bin/dtrain-report,
#                                       P/lib/cmake/dtrain/ (find_package(dtrain))
#   cd build && cpack -G DEB            libdtrain-dev_<version>_<arch>.deb, the same files under /usr
#
# The package exports three targets, named as in the build tree (where they are ALIASes), so a consumer's
# CMakeLists.txt is the same for an installed dtrain, add_subdirectory and FetchContent:
#   dtrain::comm_base  types, errors, sockets and stores (fmt, Threads)
#   dtrain::comm       transports, collectives, process groups, rendezvous (+ comm_base, rt)   no libtorch
#   dtrain::dtrain     the torch layer (+ comm, Torch's targets)
# They are static libraries, so each carries its dependencies as link items of its interface.
# Two export sets: `find_package(dtrain COMPONENTS comm)` loads only the first and needs no libtorch.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DTRAIN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain CACHE STRING
    "Where the CMake package (dtrainConfig.cmake) goes, relative to the install prefix")

set_target_properties(dtrain_comm_base PROPERTIES EXPORT_NAME comm_base)
set_target_properties(dtrain_comm PROPERTIES EXPORT_NAME comm)
set_target_properties(dtrain PROPERTIES EXPORT_NAME dtrain)

# Public headers by directory: whatever include/dtrain holds is the API.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_BINARY_DIR}/include/dtrain/build_info.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dtrain)
install(TARGETS dtrain_comm_base dtrain_comm EXPORT dtrainCommTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS dtrain EXPORT dtrainTorchTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(tool dtrain-run dtrain-trace dtrain-bench dtrain-report)
  if(TARGET ${tool})
    install(TARGETS ${tool} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endforeach()

install(EXPORT dtrainCommTargets NAMESPACE dtrain:: DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
install(EXPORT dtrainTorchTargets NAMESPACE dtrain:: DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
# The license's text, installed below; dtrainConfig.cmake names it (dtrain_LICENSE, dtrain_LICENSE_FILE).
set(DTRAIN_LICENSE_FILE ${CMAKE_INSTALL_DATAROOTDIR}/doc/libdtrain-dev/copyright)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dtrainConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/dtrainConfig.cmake
                              INSTALL_DESTINATION ${DTRAIN_INSTALL_CMAKEDIR}
                              PATH_VARS DTRAIN_LICENSE_FILE)
# 0.x: a minor version may change the API, so 0.1.x satisfies find_package(dtrain 0.1) and 0.2 does not.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dtrainConfig.cmake ${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/torch_wheel_link.cmake
        DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
# The license (Apache-2.0), with the vendored Chart.js's (MIT, inlined into dtrain-report's pages) beside it.
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/libdtrain-dev RENAME copyright)
install(FILES ${PROJECT_SOURCE_DIR}/third_party/chartjs/LICENSE.md DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/libdtrain-dev
        RENAME chartjs-LICENSE.md)

# ---- the .deb: a development package (headers, static libraries, CMake package) plus the two tools ----
# It depends on Debian's libtorch-dev, so it is made only from a build against that libtorch (a wheel's or
# a zip's libtorch is no Debian package a .deb could depend on).
if(NOT Torch_DIR MATCHES "^/usr/lib/")  # Debian's: /usr/lib/<triplet>/cmake/Torch (a zip may sit in /usr/local)
  message(STATUS "dtrain: no .deb (cpack) from this build: the .deb is built against Debian's libtorch-dev, this "
                 "build uses ${Torch_DIR}")
  return()
endif()
set(CPACK_PACKAGE_NAME libdtrain-dev)
set(CPACK_PACKAGE_VENDOR dtrain)
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)  # Apache-2.0; /usr/share/doc/libdtrain-dev/copyright
set(CPACK_PACKAGE_CONTACT "dtrain maintainers <dtrain@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Distributed training for C++ on libtorch: collectives, DDP, parameter server, launcher")
set(CPACK_PACKAGE_DESCRIPTION
    "dtrain::comm (rendezvous, TCP and shared-memory transports, collectives; no libtorch), the torch \
layer dtrain::dtrain (DistributedDataParallel, DataParallel, sampler, checkpoints, parameter server), \
the launcher dtrain-run, the benchmark dtrain-bench, dtrain-trace and dtrain-report. Use from CMake with find_package(dtrain).")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # libdtrain-dev_0.1.0_amd64.deb
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
# What a consumer's build needs (dtrainConfig.cmake finds Torch and fmt, the headers include theirs), plus
# what dpkg-shlibdeps finds the two tools linked against (libtorch1.13, libfmt9, libc6, ...).
set(CPACK_DEBIAN_PACKAGE_DEPENDS "libtorch-dev, libfmt-dev, libssl-dev, libcurl4-openssl-dev, zlib1g-dev")
if(DTRAIN_HAVE_MPI)
  string(APPEND CPACK_DEBIAN_PACKAGE_DEPENDS ", libopenmpi-dev")
endif()
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_GENERATOR DEB)
include(CPack)
