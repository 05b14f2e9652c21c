#pragma once
/// @file
/// Every built-in planning strategy; each file registers itself when included.
/// Kept equal to include/foremoe/plan/strategies/*.hpp by cmake/ForemoeHeaders.cmake at every configure.

#include <foremoe/plan/strategies/eplb.hpp>
#include <foremoe/plan/strategies/eplb_oracle.hpp>
#include <foremoe/plan/strategies/eplb_split.hpp>
#include <foremoe/plan/strategies/foremoe.hpp>
#include <foremoe/plan/strategies/foremoe_free.hpp>
#include <foremoe/plan/strategies/ideal.hpp>
#include <foremoe/plan/strategies/moonep.hpp>
#include <foremoe/plan/strategies/static.hpp>
#include <foremoe/plan/strategies/ultraep.hpp>
