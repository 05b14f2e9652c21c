// Multi-process expert moves, end to end on one CPU: the planner plans two micro-steps of one layer, and four
// "processes" (threads here, ranks in a trainer) each drive one GPU of a 2-node x 2-GPU group with their own
// transfer engine. Every process submits the same move batch; bytes between processes travel as paired
// send/receive groups through a HostFabric, which stands for NCCL (on the CUDA backend set peers.nccl_comm_of_gpu
// instead). The host backend's "device memory" is plain host memory.
//
//   ./example_moves_across_processes

#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "foremoe/plan/planner.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

namespace rt = foremoe::runtime;
using foremoe::LayerPlacement;

int main() {
  const foremoe::Topology topo{2, 2, 4}; // 2 nodes x 2 GPUs x 4 slots
  constexpr int experts = 8;
  constexpr std::int64_t expert_bytes = 1 << 20;

  // Two micro-steps of skewed loads; the second one's moves start from the first one's placement.
  std::mt19937_64 rng(5);
  std::lognormal_distribution<double> pop(0.0, 1.2);
  std::vector<std::int64_t> a(experts), b(experts);
  for (int e = 0; e < experts; ++e)
    a[e] = static_cast<std::int64_t>(1000 * pop(rng)), b[e] = static_cast<std::int64_t>(1000 * pop(rng));
  foremoe::Planner planner(1, experts, topo);
  const foremoe::Placement resident = foremoe::to_placement(planner.plan(a));
  const auto next = planner.plan(b, foremoe::Stage::update, &resident);
  const std::vector<foremoe::Move> &moves = next[0].moves;
  const LayerPlacement &before = resident.layer(0);

  // The group's memory: slots per GPU (each process touches only its own) and one mirror per node.
  std::vector<std::vector<std::byte>> slots(topo.num_gpus(), std::vector<std::byte>(expert_bytes * topo.slots_per_gpu));
  std::vector<std::vector<std::byte>> mirror(topo.num_nodes, std::vector<std::byte>(expert_bytes * experts));
  for (auto &m : mirror)
    for (int e = 0; e < experts; ++e)
      std::fill_n(m.begin() + e * expert_bytes, expert_bytes, static_cast<std::byte>(e + 1));
  for (int g = 0; g < topo.num_gpus(); ++g)
    for (int s = 0; s < topo.slots_per_gpu; ++s)
      if (const int e = before.slot(g, s); e != foremoe::empty_slot)
        std::fill_n(slots[g].begin() + s * expert_bytes, expert_bytes, static_cast<std::byte>(e + 1));

  auto fabric = std::make_shared<rt::HostFabric>();
  std::vector<rt::Status> result(topo.num_gpus());
  std::vector<std::vector<rt::MoveTelemetry>> telemetry(topo.num_gpus());
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < topo.num_gpus(); ++rank)
    ranks.emplace_back([&, rank] {
      rt::EngineOptions o;
      o.topology = topo;
      o.num_experts = experts;
      o.tensors = {{0, expert_bytes}};
      o.verify = true;
      o.peers.local_gpus = {rank}; // this process drives one GPU
      o.peers.host_fabric = fabric;
      std::unique_ptr<rt::TransferEngine> engine;
      rt::Status st = rt::TransferEngine::create(o, engine);
      if (st.ok()) st = engine->register_slots(0, rank, {slots[rank].data(), expert_bytes, topo.slots_per_gpu});
      if (st.ok())
        st = engine->register_mirror(0, topo.node_of(rank), {mirror[topo.node_of(rank)].data(), expert_bytes, experts});
      if (st.ok()) st = engine->set_resident(0, before);
      rt::Ticket t;
      if (st.ok()) st = engine->submit({0, moves}, t);
      if (st.ok()) st = t.wait_for(std::chrono::seconds(10));
      result[rank] = st;
      telemetry[rank] = t.telemetry();
    });
  for (auto &t : ranks)
    t.join();

  std::printf("%zu moves planned between two micro-steps\n", moves.size());
  int bad = 0;
  for (int rank = 0; rank < topo.num_gpus(); ++rank) {
    int landed = 0, paired = 0;
    for (const rt::MoveTelemetry &m : telemetry[rank])
      if (!m.remote && m.ok) {
        ++landed;
        paired += m.path == foremoe::transfer::Path::nvlink || m.path == foremoe::transfer::Path::network;
      }
    std::printf("rank %d: %s, %d moves landed here (%d from another GPU's copy)\n", rank,
                result[rank].to_string().c_str(), landed, paired);
    bad += !result[rank].ok();
  }
  // Every slot now holds what the plan says, byte for byte.
  const LayerPlacement after = foremoe::to_placement(next).layer(0);
  for (int g = 0; g < topo.num_gpus(); ++g)
    for (int s = 0; s < topo.slots_per_gpu; ++s)
      if (const int e = after.slot(g, s); e != foremoe::empty_slot)
        for (std::int64_t i = 0; i < expert_bytes; i += 4096)
          if (slots[g][s * expert_bytes + i] != static_cast<std::byte>(e + 1)) {
            std::printf("GPU %d slot %d does not hold expert %d\n", g, s, e);
            return 1;
          }
  std::printf("%s\n", bad ? "some ranks failed" : "every slot holds its planned expert");
  return bad ? 1 : 0;
}
