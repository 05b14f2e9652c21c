#pragma once
/// @file
/// Every built-in trace input format; each file registers itself when included.
/// Kept equal to include/foremoe/trace/formats/*.hpp by cmake/ForemoeHeaders.cmake at every configure.

#include <foremoe/trace/formats/megatron.hpp>
#include <foremoe/trace/formats/npy.hpp>
#include <foremoe/trace/formats/sglang.hpp>
#include <foremoe/trace/formats/verl.hpp>
