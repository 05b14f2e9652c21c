#include "plan_json.hpp"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "foremoe/core/error.hpp"

namespace foremoe::cli {

using nlohmann::json;

namespace {
json gpu_slots_json(const LayerPlacement &p) {
  json g = json::array();
  for (int gpu = 0; gpu < p.num_gpus(); ++gpu) {
    const auto s = p.gpu_slots(gpu);
    g.push_back(json(std::vector<std::int32_t>(s.begin(), s.end())));
  }
  return g;
}
} // namespace

json layer_plan_json(const LayerPlan &lp) {
  json j;
  j["owner_gpu"] = lp.owner_gpu;
  j["gpu_slots"] = gpu_slots_json(lp.placement);
  json tokens = json::array();
  const int slots = lp.placement.slots_per_gpu();
  for (int gpu = 0; gpu < lp.placement.num_gpus(); ++gpu)
    tokens.push_back(json(std::vector<std::int64_t>(lp.slot_tokens.begin() + gpu * slots,
                                                    lp.slot_tokens.begin() + (gpu + 1) * slots)));
  j["slot_tokens"] = std::move(tokens);
  json moves = json::array();
  for (const Move &m : lp.moves) moves.push_back({m.expert, m.src_gpu, m.dst_gpu, m.dst_slot});
  j["moves"] = std::move(moves);
  j["max_gpu_load"] = lp.max_gpu_load;
  j["imbalance"] = lp.imbalance();
  return j;
}

json transfer_plan_json(const transfer::TransferPlan &tp) {
  json j;
  j["num_rounds"] = tp.num_rounds;
  j["est_seconds"] = tp.est_seconds;
  j["link_bound_seconds"] = tp.link_bound_seconds;
  json pb;
  for (int p = 0; p < transfer::num_paths; ++p)
    pb[std::string(transfer::to_string(static_cast<transfer::Path>(p)))] = tp.path_bytes[p];
  j["path_bytes"] = std::move(pb);
  j["chunk_columns"] = {"move", "path", "src_gpu", "src_slot", "dst_gpu", "dst_slot", "expert", "offset_bytes",
                        "num_bytes", "round"};
  json chunks = json::array();
  for (const transfer::Chunk &c : tp.chunks)
    chunks.push_back({c.move_idx, std::string(transfer::to_string(c.path)), c.src_gpu, c.src_slot, c.dst_gpu,
                      c.dst_slot, c.expert, c.offset_bytes, c.num_bytes, c.round});
  j["chunks"] = std::move(chunks);
  return j;
}

json placement_json(const Topology &topo, const Placement &p) {
  json j;
  j["nodes"] = topo.num_nodes;
  j["gpus_per_node"] = topo.gpus_per_node;
  j["slots"] = topo.slots_per_gpu;
  j["num_experts"] = p.num_layers() > 0 ? p.layer(0).num_experts() : 0;
  json layers = json::array();
  for (int l = 0; l < p.num_layers(); ++l) layers.push_back({{"gpu_slots", gpu_slots_json(p.layer(l))}});
  j["layers"] = std::move(layers);
  return j;
}

Placement read_placement_json(const std::filesystem::path &path, const Topology &topo, int num_layers,
                              int num_experts) {
  const std::string where = path.string();
  std::ifstream in(path);
  detail::require(in.good(), where, ": cannot open: ", std::strerror(errno));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception &e) {
    detail::fail(where, ": not valid JSON: ", e.what());
  }
  try {
    auto get_int = [&](const char *key) {
      detail::require(j.contains(key), where, ": missing key '", key, "'");
      return j.at(key).get<long long>();
    };
    detail::require(j.is_object(), where, ": expected a JSON object");
    detail::require(get_int("nodes") == topo.num_nodes && get_int("gpus_per_node") == topo.gpus_per_node &&
                        get_int("slots") == topo.slots_per_gpu,
                    where, ": placement is for ", get_int("nodes"), " x ", get_int("gpus_per_node"), " GPUs x ",
                    get_int("slots"), " slots, the topology is ", topo.num_nodes, " x ", topo.gpus_per_node, " x ",
                    topo.slots_per_gpu);
    if (j.contains("num_experts"))
      detail::require(get_int("num_experts") == num_experts, where, ": placement has ", get_int("num_experts"),
                      " experts, the loads have ", num_experts);
    const json &layers = j.at("layers");
    detail::require(layers.is_array() && static_cast<int>(layers.size()) == num_layers, where, ": ",
                    layers.is_array() ? layers.size() : 0, " layers, the loads have ", num_layers);
    Placement p(topo, num_layers, num_experts);
    for (int l = 0; l < num_layers; ++l) {
      const json &g = layers[l].at("gpu_slots");
      detail::require(g.is_array() && static_cast<int>(g.size()) == topo.num_gpus(), where, ": layer ", l, " has ",
                      g.is_array() ? g.size() : 0, " GPU lists, expected ", topo.num_gpus());
      for (int gpu = 0; gpu < topo.num_gpus(); ++gpu) {
        const json &s = g[gpu];
        detail::require(s.is_array() && static_cast<int>(s.size()) == topo.slots_per_gpu, where, ": layer ", l,
                        " GPU ", gpu, " lists ", s.is_array() ? s.size() : 0, " slots, expected ", topo.slots_per_gpu);
        for (int k = 0; k < topo.slots_per_gpu; ++k) {
          const long long e = s[k].get<long long>();
          detail::require(e >= -1 && e < num_experts, where, ": layer ", l, " GPU ", gpu, " slot ", k,
                          " holds expert ", e, ", outside [-1, ", num_experts, ")");
          p.layer(l).slot(gpu, k) = static_cast<std::int32_t>(e);
        }
      }
    }
    p.validate();
    return p;
  } catch (const json::exception &e) {
    detail::fail(where, ": malformed placement: ", e.what());
  } catch (const Error &e) {
    const std::string msg = e.what();
    if (msg.rfind(where, 0) == 0) throw;
    detail::fail(where, ": ", msg);
  }
}

void write_json(const std::filesystem::path &path, const json &j) {
  std::ofstream out(path);
  detail::require(out.good(), path.string(), ": cannot write: ", std::strerror(errno));
  out << j.dump() << "\n";
  out.close();
  detail::require(out.good(), path.string(), ": write failed: ", std::strerror(errno));
}

} // namespace foremoe::cli
