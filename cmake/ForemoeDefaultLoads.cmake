# The default batch's loads (tools/default_loads.bin, a packed entry: foremoe/trace/packed_loads.hpp) built into
# `target` through tools/default_loads.cpp, for the root build's `foremoe` and tests and for the Python extension.
function(foremoe_add_default_loads target root)
  set(_bin "${root}/tools/default_loads.bin")
  set(_src "${root}/tools/default_loads.cpp")
  target_sources(${target} PRIVATE "${_src}")
  target_include_directories(${target} PRIVATE "${root}/tools")
  # The assembler reads the file, so neither the compiler's dependency scan nor ccache sees it (ccache does not
  # cache a source with .incbin): the build must.
  # It stays out of a unity build: a unity source holding it would be uncacheable as a whole.
  set_source_files_properties("${_src}" TARGET_DIRECTORY ${target} PROPERTIES
    OBJECT_DEPENDS "${_bin}" COMPILE_DEFINITIONS "FOREMOE_DEFAULT_LOADS_FILE=\"${_bin}\"" SKIP_UNITY_BUILD_INCLUSION ON)
endfunction()
