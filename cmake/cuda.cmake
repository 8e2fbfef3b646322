# The CUDA build (included by the top-level CMakeLists.txt after cmake/torch_version.cmake):
#   DTRAIN_CUDA          ON by default when the libtorch found was built with CUDA (every torch wheel PyPI
#                        serves for Linux x86_64), OFF otherwise (Debian's libtorch-dev): then nothing here
#                        is needed, and CPU-only builds are unchanged.
#   DTRAIN_NCCL_LIBRARY  the libnccl.so.2 that libtorch_cuda itself loads (a wheel's nvidia/nccl/lib; the
#                        toolkit's otherwise): one NCCL per process (the reference, pitfall 6)
#   DTRAIN_CUDART_LIBRARY  likewise the wheel's libcudart.so.13 before the toolkit's
# With DTRAIN_CUDA the comm layer gets the NCCL backend (src/comm/nccl/), the torch layer its CUDA paths
# (src/torch/device/, compiled with DTRAIN_WITH_CUDA) and tests/gpu/ its tests.
set(_dtrain_cuda_default OFF)
if(DTRAIN_TORCH_CUDA_VERSION)
  set(_dtrain_cuda_default ON)
endif()
option(DTRAIN_CUDA "CUDA tensors through every layer: NCCL and host staging (needs a CUDA build of libtorch)"
       ${_dtrain_cuda_default})
unset(_dtrain_cuda_default)
if(DTRAIN_CUDA AND NOT DTRAIN_TORCH_CUDA_VERSION)
  message(FATAL_ERROR "dtrain: DTRAIN_CUDA=ON needs a CUDA build of libtorch; ${Torch_DIR} is CPU-only "
                      "(configure with -DDTRAIN_CUDA=OFF, or against a torch wheel)")
endif()
if(DTRAIN_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # The wheel's site-packages (torch's parent), where its nvidia-* packages live.
  get_filename_component(_dtrain_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  find_path(DTRAIN_NCCL_INCLUDE_DIR nccl.h HINTS ${_dtrain_site}/nvidia/nccl/include ${CUDAToolkit_INCLUDE_DIRS}
            NO_DEFAULT_PATH)
  find_library(DTRAIN_NCCL_LIBRARY NAMES libnccl.so.2 nccl HINTS ${_dtrain_site}/nvidia/nccl/lib
               ${CUDAToolkit_LIBRARY_DIR} NO_DEFAULT_PATH)
  find_library(DTRAIN_CUDART_LIBRARY NAMES libcudart.so.13 libcudart.so.12 cudart
               HINTS ${_dtrain_site}/nvidia/cu13/lib ${_dtrain_site}/nvidia/cuda_runtime/lib ${CUDAToolkit_LIBRARY_DIR}
               NO_DEFAULT_PATH)
  unset(_dtrain_site)
  if(NOT DTRAIN_NCCL_INCLUDE_DIR OR NOT DTRAIN_NCCL_LIBRARY OR NOT DTRAIN_CUDART_LIBRARY)
    message(FATAL_ERROR "dtrain: DTRAIN_CUDA=ON: NCCL or the CUDA runtime not found (nccl.h: ${DTRAIN_NCCL_INCLUDE_DIR}, "
                        "libnccl: ${DTRAIN_NCCL_LIBRARY}, cudart: ${DTRAIN_CUDART_LIBRARY}); the torch wheel's "
                        "nvidia-nccl package or the CUDA toolkit's NCCL provides them")
  endif()
  target_sources(dtrain_comm PRIVATE ${PROJECT_SOURCE_DIR}/src/comm/nccl/cuda_api.cc)  # nccl_comm.cc: every build
  target_include_directories(dtrain_comm SYSTEM PRIVATE ${DTRAIN_NCCL_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(dtrain_comm PRIVATE ${DTRAIN_NCCL_LIBRARY} ${DTRAIN_CUDART_LIBRARY})
  # PUBLIC: what links dtrain compiles with it too (and may test it), and the targets that reuse dtrain's
  # precompiled headers must be compiled with the same definitions, or gcc ignores the headers.
  target_compile_definitions(dtrain PUBLIC DTRAIN_WITH_CUDA)
  target_include_directories(dtrain SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(dtrain PRIVATE ${DTRAIN_CUDART_LIBRARY})
  message(STATUS "dtrain: CUDA build (DTRAIN_CUDA=ON): NCCL ${DTRAIN_NCCL_LIBRARY}, CUDA runtime ${DTRAIN_CUDART_LIBRARY}")
else()
  target_sources(dtrain_comm PRIVATE ${PROJECT_SOURCE_DIR}/src/comm/nccl/unavailable.cc)
  message(STATUS "dtrain: CPU build (DTRAIN_CUDA=OFF)")
endif()
