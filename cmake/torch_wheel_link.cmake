# The link options a torch wheel's libtorch needs (included by cmake/torch_version.cmake and, installed
# beside it, by dtrainConfig.cmake, after find_package(Torch)):
#   DTRAIN_TORCH_LINK_OPTIONS  -Wl,-rpath-link,DIR for every site-packages/nvidia/*/lib beside the wheel's torch
#
# A wheel's libtorch_cuda.so finds its NCCL, cuDNN, cuBLAS, ... through its own RPATH
# ($ORIGIN/../../nvidia/<name>/lib), which the dynamic loader follows. The static linker searches the
# executable's -rpath directories first, and Torch's CMake puts the CUDA toolkit's lib/ there (for cudart and
# nvrtc): with a toolkit whose NCCL is older than the wheel's (13.0's 2.28 against 2.15's 2.30), linking
# then fails on the NCCL symbols libtorch_cuda.so uses. -rpath-link directories are searched before any.
set(DTRAIN_TORCH_LINK_OPTIONS "")
if(TORCH_INSTALL_PREFIX)
  file(GLOB _dtrain_nvidia_libs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(_dtrain_dir IN LISTS _dtrain_nvidia_libs)
    if(IS_DIRECTORY "${_dtrain_dir}")
      get_filename_component(_dtrain_dir "${_dtrain_dir}" REALPATH)
      list(APPEND DTRAIN_TORCH_LINK_OPTIONS "-Wl,-rpath-link,${_dtrain_dir}")
    endif()
  endforeach()
  unset(_dtrain_dir)
  unset(_dtrain_nvidia_libs)
endif()
