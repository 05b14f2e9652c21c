#pragma once
/// @file
/// The built-in strategies, each registering itself when included.
///
/// Temporary and hand-written: the build will generate this file from a glob of
/// `include/foremoe/plan/strategies/*.hpp` into the build tree, after which this copy goes away. Until then a
/// new built-in strategy adds its include here.

#include "foremoe/plan/strategies/eplb.hpp"
#include "foremoe/plan/strategies/eplb_oracle.hpp"
#include "foremoe/plan/strategies/foremoe.hpp"
#include "foremoe/plan/strategies/foremoe_free.hpp"
#include "foremoe/plan/strategies/static.hpp"
