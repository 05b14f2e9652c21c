# Generates one translation unit per public header that includes only that
# header, so a header that forgets an include fails the build.
# Headers whose path matches `exclude_regex` are left out; `lib` is linked.
# Further arguments name generated headers (relative, e.g. foremoe/version.hpp) to check as well.
function(foremoe_add_header_checks target include_dir exclude_regex lib)
  file(GLOB_RECURSE _headers RELATIVE ${include_dir} CONFIGURE_DEPENDS ${include_dir}/foremoe/*.hpp)
  list(APPEND _headers ${ARGN})
  list(REMOVE_DUPLICATES _headers)
  set(_sources "")
  foreach(h IN LISTS _headers)
    if(h MATCHES "${exclude_regex}")
      continue()
    endif()
    string(MAKE_C_IDENTIFIER "${h}" _id)
    set(_tu ${CMAKE_CURRENT_BINARY_DIR}/${target}/${_id}.cpp)
    file(CONFIGURE OUTPUT ${_tu} CONTENT "#include <${h}>\n#include <${h}> // twice: include guards work\n")
    list(APPEND _sources ${_tu})
  endforeach()
  # One more TU with every checked header at once: scripts/lint.sh --all runs clang-tidy on it instead of on each
  # header's own TU (the same diagnostics, each header analysed once instead of once per header including it).
  set(_all "")
  foreach(h IN LISTS _headers)
    if(NOT h MATCHES "${exclude_regex}")
      string(APPEND _all "#include <${h}>\n")
    endif()
  endforeach()
  file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/${target}/all_headers.cpp CONTENT "${_all}")
  list(APPEND _sources ${CMAKE_CURRENT_BINARY_DIR}/${target}/all_headers.cpp)
  add_library(${target} OBJECT ${_sources})
  target_link_libraries(${target} PRIVATE ${lib} foremoe_warnings)
  # Whether a header compiles alone is a front-end question: unoptimised, these TUs build in half the time (the
  # optimiser's warnings come from the TUs that call the code, which build with the real flags).
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -O0)
  endif()
endfunction()
