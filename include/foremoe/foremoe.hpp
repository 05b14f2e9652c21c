#pragma once
/// @file
/// Umbrella header: everything in the header-only library.

#include "foremoe/version.hpp"

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"

#include "foremoe/trace/count.hpp"
#include "foremoe/trace/routed_view.hpp"
