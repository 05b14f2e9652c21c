# Optional CUDA, shared by the root build and python/CMakeLists.txt. Call at a project's top level, as CCCL and
# nvbench do: enable_language in a subfolder leaves the CUDA variables scoped to that folder.

# Enables the CUDA language when a compiler is found and sets FOREMOE_CUDA_ENABLED (ON/OFF) in the caller's scope.
# Architectures are explicit (Hopper unless CMAKE_CUDA_ARCHITECTURES says otherwise): `native` fails on a machine
# without a GPU.
macro(foremoe_enable_cuda)
  set(FOREMOE_CUDA_ENABLED OFF)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    set(FOREMOE_CUDA_ENABLED ON)
  endif()
endmacro()
