# DTRAIN_TORCH=OFF builds the comm layer only (dtrain_comm_base, dtrain_comm), the launcher and tools, and
# the store and comm tests: no libtorch is looked for. The sanitizer and fuzzing builds (scripts/sanitize.sh)
# use it, with clang; anything that needs libtorch (apps, benchmarks, the torch examples) is off there.
option(DTRAIN_TORCH "Build the torch layer (dtrain::dtrain) and what uses it; OFF: the comm layer and its tests only" ON)
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
if(NOT DTRAIN_TORCH)
  set(_dtrain_default OFF)
endif()
option(DTRAIN_BUILD_EXAMPLES "Build the example programs (examples/)" ${_dtrain_default})
if(NOT DTRAIN_TORCH)
  set(DTRAIN_BUILD_EXAMPLES ON CACHE BOOL "" FORCE)  # example-allreduce only (the others use libtorch)
endif()
option(DTRAIN_BUILD_BENCHMARKS "Build dtrain-bench" ${_dtrain_default})
option(DTRAIN_BUILD_APPS "Build the MIL-NCE job (apps/milnce; needs nlohmann-json)" ${_dtrain_default})
if(NOT DTRAIN_TORCH)
  set(DTRAIN_BUILD_BENCHMARKS OFF CACHE BOOL "" FORCE)
  set(DTRAIN_BUILD_APPS OFF CACHE BOOL "" FORCE)
endif()
option(DTRAIN_BUILD_TOOLS "Build the launcher dtrain-run (needs CLI11)" ON)
option(DTRAIN_INSTALL "Install rules, the CMake package (find_package(dtrain)) and cpack's .deb"
       ${PROJECT_IS_TOP_LEVEL})
if(NOT DTRAIN_TORCH)
  set(DTRAIN_INSTALL OFF CACHE BOOL "" FORCE)  # the package is the whole of dtrain
endif()
unset(_dtrain_default)
# The MPI transport (DTRAIN_TRANSPORT=mpi): AUTO builds it when CMake finds MPI, ON requires MPI, OFF omits it.
set(DTRAIN_WITH_MPI AUTO CACHE STRING "Build the MPI transport: AUTO (when MPI is found), ON or OFF")
set_property(CACHE DTRAIN_WITH_MPI PROPERTY STRINGS AUTO ON OFF)

if(DTRAIN_BUILD_TESTS AND DTRAIN_TORCH)
  foreach(needed DTRAIN_BUILD_EXAMPLES DTRAIN_BUILD_BENCHMARKS DTRAIN_BUILD_APPS DTRAIN_BUILD_TOOLS)
    if(NOT ${needed})
      message(FATAL_ERROR "dtrain: DTRAIN_BUILD_TESTS=ON needs ${needed}=ON (the tests run those programs); "
                          "turn ${needed} on or DTRAIN_BUILD_TESTS off")
    endif()
  endforeach()
endif()
# Unity build of the libtorch-heavy multi-file targets (the torch layer dtrain and milnce_lib; dtrain-bench's
# families each keep an Options of their own, so it compiles file by file):
# their files compiled in batches, so the libtorch templates every file instantiates are compiled once a
# batch instead of once a file (a fresh build's largest cost; scripts/test.sh builds twice). OFF compiles
# file by file, as an edit-compile loop on one file wants.
option(DTRAIN_UNITY_BUILD "Compile the torch layer and milnce_lib in batches (CMake UNITY_BUILD)" ON)
set(DTRAIN_UNITY_BATCH 8 CACHE STRING "Files per batch of the unity build")
