#pragma once
/// @file
/// Readers for the routed-id records of trainers and inference engines: every built-in input format of the
/// registry in `foremoe/trace/formats.hpp` (verl, SGLang, Megatron-core, plain NPY ids). Each gives a
/// `RoutedRecord` (a `RoutedView` and a mask) for `count_loads`.

#include "foremoe/trace/formats.hpp"
#include "foremoe/trace/formats/builtin.hpp"
