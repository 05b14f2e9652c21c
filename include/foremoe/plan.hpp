#pragma once
/// @file
/// Lean include for trainers: counting routed tokens and planning, nothing else (no simulator, cost model,
/// transfer planner or NPY/JSON I/O; `foremoe/foremoe.hpp` has everything).

#include "foremoe/version.hpp"

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"

#include "foremoe/trace/count.hpp"
#include "foremoe/trace/routed_view.hpp"

#include "foremoe/plan/dispatch.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/replica_sync.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/plan/traffic.hpp"
