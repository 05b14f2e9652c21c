#pragma once
/// @file
/// Umbrella header: everything in the header-only library (`foremoe/plan.hpp` is the lean counting + planning
/// set).

#include "foremoe/version.hpp"

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"

#include "foremoe/trace/count.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/trace/npy.hpp"
#include "foremoe/trace/routed_view.hpp"
#include "foremoe/trace/stats.hpp"
#include "foremoe/trace/synthetic.hpp"

#include "foremoe/cost/comm.hpp"
#include "foremoe/cost/expert_compute.hpp"
#include "foremoe/cost/params.hpp"

#include "foremoe/plan/dispatch.hpp"
#include "foremoe/plan/even_split.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/replica_sync.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/plan/traffic.hpp"

#include "foremoe/sim/simulator.hpp"
#include "foremoe/transfer/transfer_plan.hpp"
