#pragma once
// JSON forms of plans and placements used by `foremoe plan` (and read back
// with --resident).

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/transfer/transfer_plan.hpp"

namespace foremoe::cli {

/// `{"gpu_slots": [[expert or -1 ...] per GPU], "owner_gpu": [...], "slot_tokens": ..., "moves": ...}`
nlohmann::json layer_plan_json(const LayerPlan &lp);
/// `{"num_rounds", "est_seconds", "link_bound_seconds", "path_bytes": {nvlink, pcie, network}, "chunk_columns",
/// "chunks": [[move, path, src_gpu, src_slot, dst_gpu, dst_slot, expert, offset_bytes, num_bytes, round] ...]}`
nlohmann::json transfer_plan_json(const transfer::TransferPlan &tp);
/// A placement file: `{"nodes", "gpus_per_node", "slots", "num_experts", "layers": [{"gpu_slots": ...}]}`.
nlohmann::json placement_json(const Topology &topo, const Placement &p);
/// Reads a placement file and checks it against the topology and expert count.
Placement read_placement_json(const std::filesystem::path &path, const Topology &topo, int num_layers,
                              int num_experts);
/// Writes `j` to `path` (compact with 1-space indent for lists of numbers), naming the path on failure.
void write_json(const std::filesystem::path &path, const nlohmann::json &j);

} // namespace foremoe::cli
