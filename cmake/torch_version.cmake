# find_package(Torch) and what follows from the libtorch it finds (included by the top-level CMakeLists.txt):
#   DTRAIN_TORCH_CXX_STANDARD  20 from libtorch 2.14 (whose headers #error below C++20), else 17
#   DTRAIN_TORCH_CUDA_VERSION  the CUDA a CUDA build of libtorch was made for (a torch wheel's), else ""
#   <build>/include/dtrain/build_info.h, installed with the headers (dtrain-run --version prints it)
#
# A CUDA build of libtorch (every torch wheel PyPI serves for Linux x86_64) needs a CUDA toolkit when
# CMake configures: its Caffe2 package looks for nvcc, the headers and cudart, and stops without them.
if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)  # the toolkit's usual home, when nvcc is not on PATH
endif()
# CUDA 12.9 and later ship NVTX 3 as headers only; libtorch releases that still ask for CUDA::nvToolsExt
# (pytorch#152756) then fail to configure. Stand in for it with the header-only target when it is missing.
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND AND NOT TARGET CUDA::nvToolsExt AND TARGET CUDA::nvtx3)
  add_library(CUDA::nvToolsExt INTERFACE IMPORTED)
  target_link_libraries(CUDA::nvToolsExt INTERFACE CUDA::nvtx3)
endif()

find_package(Torch REQUIRED)
if(NOT Torch_VERSION)
  message(FATAL_ERROR "dtrain: the libtorch at ${Torch_DIR} reports no version (TorchConfigVersion.cmake)")
endif()
# TorchConfig.cmake finds libtorch.so with find_library, which looks in the system's directories before
# the package's own: a torch wheel's package named alone (CMAKE_PREFIX_PATH=.../torch/share/cmake) on a
# machine that also has Debian's libtorch-dev got Debian's libtorch.so beside the wheel's headers.
# Naming the libtorch root (.../site-packages/torch, or the zip's libtorch/) puts its lib/ first.
get_filename_component(_dtrain_torch_root "${TORCH_INSTALL_PREFIX}" REALPATH)
get_filename_component(_dtrain_torch_lib "${TORCH_LIBRARY}" REALPATH)
string(FIND "${_dtrain_torch_lib}" "${_dtrain_torch_root}/" _dtrain_at)
if(NOT _dtrain_at EQUAL 0)
  message(FATAL_ERROR "dtrain: the libtorch package at ${Torch_DIR} (${Torch_VERSION}) would link ${TORCH_LIBRARY}, "
                      "which is not its own (${_dtrain_torch_root}/lib): give the libtorch root instead, "
                      "-DCMAKE_PREFIX_PATH=${_dtrain_torch_root}, in a fresh build directory")
endif()
unset(_dtrain_at)
unset(_dtrain_torch_lib)
unset(_dtrain_torch_root)
if(Torch_VERSION VERSION_LESS 1.13)
  message(FATAL_ERROR "dtrain: needs libtorch 1.13 or later; ${Torch_DIR} is ${Torch_VERSION}")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/torch_wheel_link.cmake)  # DTRAIN_TORCH_LINK_OPTIONS
set(DTRAIN_TORCH_CXX_STANDARD 17)
if(Torch_VERSION VERSION_GREATER_EQUAL 2.14)
  set(DTRAIN_TORCH_CXX_STANDARD 20)
endif()
# libtorch 2.x (wheels and zips) ships fmt's headers in its include/ (fmt 12.2 in 2.15), and they shadow
# the system's (Debian's fmt 9, which dtrain links) in every translation unit that sees libtorch's headers.
# Those units use the bundled fmt header-only (FMT_HEADER_ONLY, set on dtrain for everything linking it):
# fmt versions its inline namespace (fmt::v9, fmt::v12), so the two never mix, and the comm layer, which
# never sees libtorch's headers, keeps the system's fmt.
set(DTRAIN_TORCH_BUNDLES_FMT OFF)
if(EXISTS "${TORCH_INSTALL_PREFIX}/include/fmt/format.h")
  set(DTRAIN_TORCH_BUNDLES_FMT ON)
endif()
set(DTRAIN_TORCH_CUDA_VERSION "")
if(TORCH_CUDA_LIBRARIES)
  set(DTRAIN_TORCH_CUDA_VERSION "${CUDAToolkit_VERSION}")
  if(NOT DTRAIN_TORCH_CUDA_VERSION)
    set(DTRAIN_TORCH_CUDA_VERSION "${CUDA_VERSION}")
  endif()
endif()
set(_dtrain_cuda "CPU only")
if(DTRAIN_TORCH_CUDA_VERSION)
  set(_dtrain_cuda "CUDA ${DTRAIN_TORCH_CUDA_VERSION}")
endif()
message(STATUS "dtrain: libtorch ${Torch_VERSION} from ${Torch_DIR} (C++${DTRAIN_TORCH_CXX_STANDARD}, ${_dtrain_cuda})")
unset(_dtrain_cuda)
configure_file(${CMAKE_CURRENT_LIST_DIR}/build_info.h.in ${PROJECT_BINARY_DIR}/include/dtrain/build_info.h @ONLY)
