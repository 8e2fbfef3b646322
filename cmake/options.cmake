# What dtrain builds. The libraries (dtrain_comm_base, dtrain_comm, dtrain) are always built. The rest
# defaults ON when dtrain is the top-level project and OFF under add_subdirectory or FetchContent, so a
# consumer builds only what it links (and needs neither GTest nor nlohmann-json).
#   cmake -S . -B build -DDTRAIN_BUILD_TESTS=OFF -DDTRAIN_BUILD_APPS=OFF   # the libraries without the MIL-NCE job
option(DTRAIN_BUILD_TESTS "Build dtrain's tests (GTest); needs examples, benchmarks, apps and tools" ${PROJECT_IS_TOP_LEVEL})
# The tests run the examples, dtrain-bench and milnce: turning the tests on turns them on by default.
set(_dtrain_default ${PROJECT_IS_TOP_LEVEL})
if(DTRAIN_BUILD_TESTS)
  set(_dtrain_default ON)
endif()
option(DTRAIN_BUILD_EXAMPLES "Build the example programs (examples/)" ${_dtrain_default})
option(DTRAIN_BUILD_BENCHMARKS "Build dtrain-bench" ${_dtrain_default})
option(DTRAIN_BUILD_APPS "Build the MIL-NCE job (apps/milnce; needs nlohmann-json)" ${_dtrain_default})
option(DTRAIN_BUILD_TOOLS "Build the launcher dtrain-run (needs CLI11)" ON)
option(DTRAIN_INSTALL "Install rules, the CMake package (find_package(dtrain)) and cpack's .deb"
       ${PROJECT_IS_TOP_LEVEL})
unset(_dtrain_default)
# The MPI transport (DTRAIN_TRANSPORT=mpi): AUTO builds it when CMake finds MPI, ON requires MPI, OFF omits it.
set(DTRAIN_WITH_MPI AUTO CACHE STRING "Build the MPI transport: AUTO (when MPI is found), ON or OFF")
set_property(CACHE DTRAIN_WITH_MPI PROPERTY STRINGS AUTO ON OFF)

if(DTRAIN_BUILD_TESTS)
  foreach(needed DTRAIN_BUILD_EXAMPLES DTRAIN_BUILD_BENCHMARKS DTRAIN_BUILD_APPS DTRAIN_BUILD_TOOLS)
    if(NOT ${needed})
      message(FATAL_ERROR "dtrain: DTRAIN_BUILD_TESTS=ON needs ${needed}=ON (the tests run those programs); "
                          "turn ${needed} on or DTRAIN_BUILD_TESTS off")
    endif()
  endforeach()
endif()
