# Checks the public headers that are derived from other sources but checked in, so that a copy of include/
# compiles with nothing but `-I include` (a trainer vendoring the headers has no CMake of ours):
#   foremoe/version.hpp                    must state `project(foremoe VERSION ...)`: a mismatch fails the configure;
#   foremoe/plan/strategies/builtin.hpp    one #include per include/foremoe/plan/strategies/*.hpp, so a new strategy
#                                          is one new file: the configure rewrites the list when a file was added or
#                                          removed (commit the result), and the build re-runs it when that happens;
#   foremoe/trace/formats/builtin.hpp      the same for the trace input formats (include/foremoe/trace/formats/*.hpp).
#   foremoe/trace/batch_formats/builtin.hpp  the same for the in-memory formats (include/foremoe/trace/batch_formats/*.hpp).
# Used by the root build and python/CMakeLists.txt; `cmake -P cmake/ForemoeHeaders.cmake` updates the builtin.hpp files alone.

# Reads the version from `project(foremoe VERSION x.y.z` in `<root>/CMakeLists.txt` (for builds that are not
# the root project, e.g. the Python extension) into `out_var`.
function(foremoe_read_version root out_var)
  file(READ "${root}/CMakeLists.txt" _text)
  if(NOT _text MATCHES "project\\(foremoe[ \t\r\n]+VERSION[ \t\r\n]+([0-9]+\\.[0-9]+\\.[0-9]+)")
    message(FATAL_ERROR "foremoe: no `project(foremoe VERSION x.y.z` in ${root}/CMakeLists.txt")
  endif()
  set(${out_var} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

# The text a builtin.hpp must have for the registering files now in `<include_dir>/foremoe/<folder>/`: one
# #include each, sorted, so the registration order (and so nothing observable) does not depend on the file system.
function(_foremoe_builtin_text include_dir folder what out_var)
  set(_deps "")
  if(NOT CMAKE_SCRIPT_MODE_FILE)
    set(_deps CONFIGURE_DEPENDS) # a file added or removed re-runs the configure at build time
  endif()
  file(GLOB _files RELATIVE "${include_dir}" ${_deps} "${include_dir}/foremoe/${folder}/*.hpp")
  list(REMOVE_ITEM _files "foremoe/${folder}/builtin.hpp")
  list(SORT _files)
  set(_text "#pragma once\n/// @file\n/// Every built-in ${what}; each file registers itself when included.\n")
  string(APPEND _text "/// Kept equal to include/foremoe/${folder}/*.hpp by cmake/ForemoeHeaders.cmake at every configure.\n\n")
  foreach(f IN LISTS _files)
    string(APPEND _text "#include <${f}>\n")
  endforeach()
  set(${out_var} "${_text}" PARENT_SCOPE)
endfunction()

# Rewrites `<include_dir>/foremoe/<folder>/builtin.hpp` when it differs from `_foremoe_builtin_text`.
function(_foremoe_sync_builtin include_dir folder what)
  _foremoe_builtin_text("${include_dir}" "${folder}" "${what}" _text)
  set(_bh "${include_dir}/foremoe/${folder}/builtin.hpp")
  set(_old "")
  if(EXISTS "${_bh}")
    file(READ "${_bh}" _old)
  endif()
  if(NOT _old STREQUAL _text)
    file(WRITE "${_bh}" "${_text}")
    message(STATUS "foremoe: rewrote ${_bh} for the files present (commit it)")
  endif()
endfunction()

# `include_dir` is the source include dir holding foremoe/; `version` is "major.minor.patch".
function(foremoe_check_headers include_dir version)
  if(NOT version MATCHES "^([0-9]+)\\.([0-9]+)\\.([0-9]+)$")
    message(FATAL_ERROR "foremoe: version '${version}' is not major.minor.patch")
  endif()
  set(_vh "${include_dir}/foremoe/version.hpp")
  file(READ "${_vh}" _v)
  set(_found "")
  foreach(part MAJOR MINOR PATCH)
    if(NOT _v MATCHES "#define FOREMOE_VERSION_${part} ([0-9]+)")
      message(FATAL_ERROR "foremoe: ${_vh} defines no FOREMOE_VERSION_${part}")
    endif()
    list(APPEND _found "${CMAKE_MATCH_1}")
  endforeach()
  list(JOIN _found "." _found)
  if(NOT _v MATCHES "version_string = \"([0-9.]+)\"")
    message(FATAL_ERROR "foremoe: ${_vh} defines no version_string")
  endif()
  if(NOT _found STREQUAL version OR NOT CMAKE_MATCH_1 STREQUAL version)
    message(FATAL_ERROR "foremoe: ${_vh} says ${_found} (version_string \"${CMAKE_MATCH_1}\") but "
                        "project(foremoe VERSION) is ${version}: change the three defines and version_string too")
  endif()

  _foremoe_sync_builtin("${include_dir}" "plan/strategies" "planning strategy")
  _foremoe_sync_builtin("${include_dir}" "trace/formats" "trace input format")
  _foremoe_sync_builtin("${include_dir}" "trace/batch_formats" "in-memory trace format")
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  get_filename_component(_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
  foremoe_read_version("${_root}" _version)
  foremoe_check_headers("${_root}/include" "${_version}")
endif()
