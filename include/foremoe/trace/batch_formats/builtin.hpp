#pragma once
/// @file
/// Every built-in in-memory trace format; each file registers itself when included.
/// Kept equal to include/foremoe/trace/batch_formats/*.hpp by cmake/ForemoeHeaders.cmake at every configure.

#include <foremoe/trace/batch_formats/megatron.hpp>
#include <foremoe/trace/batch_formats/slime.hpp>
#include <foremoe/trace/batch_formats/verl.hpp>
