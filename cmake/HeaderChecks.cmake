# Generates one translation unit per public header that includes only that
# header, so a header that forgets an include fails the build.
function(foremoe_add_header_checks target include_dir)
  file(GLOB_RECURSE _headers RELATIVE ${include_dir} CONFIGURE_DEPENDS ${include_dir}/foremoe/*.hpp)
  set(_sources "")
  foreach(h IN LISTS _headers)
    if(h MATCHES "^foremoe/runtime/")
      continue() # the runtime's headers are checked against the runtime target
    endif()
    string(MAKE_C_IDENTIFIER "${h}" _id)
    set(_tu ${CMAKE_CURRENT_BINARY_DIR}/header_checks/${_id}.cpp)
    file(CONFIGURE OUTPUT ${_tu} CONTENT "#include <${h}>\n#include <${h}> // twice: include guards work\n")
    list(APPEND _sources ${_tu})
  endforeach()
  add_library(${target} OBJECT ${_sources})
  target_link_libraries(${target} PRIVATE foremoe::foremoe foremoe_warnings)
endfunction()
