# DTRAIN_TORCH_LIBRARIES: ${TORCH_LIBRARIES} (what find_package(Torch) says to link) with every library
# file that one of Torch's imported targets stands for replaced by that target. Debian's libtorch gives
# "torch;torch_library;/usr/lib/x86_64-linux-gnu/libc10.so": linking the target c10 instead keeps the
# build machine's paths out of the exported dtrain::dtrain, whose consumer finds Torch itself
# (dtrainConfig.cmake's find_dependency(Torch)) and so defines the same targets.
set(DTRAIN_TORCH_LIBRARIES)
foreach(lib IN LISTS TORCH_LIBRARIES)
  if(NOT TARGET "${lib}" AND IS_ABSOLUTE "${lib}")
    get_filename_component(name "${lib}" NAME_WE)  # /usr/lib/.../libc10.so -> libc10
    string(REGEX REPLACE "^lib" "" name "${name}")
    if(TARGET "${name}")
      get_target_property(configs ${name} IMPORTED_CONFIGURATIONS)
      list(TRANSFORM configs PREPEND _)
      foreach(config IN LISTS configs ITEMS "")  # IMPORTED_LOCATION_<CONFIG>, then IMPORTED_LOCATION
        get_target_property(location ${name} IMPORTED_LOCATION${config})
        if(location)
          file(REAL_PATH "${location}" location)
          file(REAL_PATH "${lib}" real)
          if(location STREQUAL real)
            set(lib ${name})
            break()
          endif()
        endif()
      endforeach()
    endif()
  endif()
  list(APPEND DTRAIN_TORCH_LIBRARIES "${lib}")
endforeach()
