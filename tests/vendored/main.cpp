// A trainer that vendors ForeMoE copies include/foremoe into its own tree and compiles with `-I` alone, no CMake of
// ours: this translation unit counts routed ids, plans a step and simulates it through the umbrella header, and
// checks the answers. tests/vendored/run.sh builds it from such a copy.
#include <foremoe/foremoe.hpp>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

int main() {
  constexpr int num_tokens = 4096, num_layers = 2, topk = 2, num_experts = 16, num_micro = 4;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pick(0, num_experts - 1);
  std::vector<std::int16_t> ids(std::size_t(num_tokens) * num_layers * topk);
  for (std::size_t t = 0; t < std::size_t(num_tokens) * num_layers; ++t) {
    const int a = pick(rng) % 6; // skewed towards the first six experts
    int b = pick(rng);
    if (b == a) b = (a + 1) % num_experts;
    ids[2 * t] = static_cast<std::int16_t>(a);
    ids[2 * t + 1] = static_cast<std::int16_t>(b);
  }
  std::vector<std::int64_t> offsets;
  for (int m = 0; m <= num_micro; ++m)
    offsets.push_back(std::int64_t(m) * num_tokens / num_micro);
  foremoe::CountOptions opts;
  opts.num_experts = num_experts;
  opts.microbatch_offsets = offsets;
  const foremoe::LoadTensor loads =
      foremoe::count_loads(std::span<const std::int16_t>(ids), num_tokens, num_layers, topk, opts);
  std::int64_t total = 0;
  for (int m = 0; m < num_micro; ++m)
    for (int e = 0; e < num_experts; ++e)
      total += loads.at(m, 0, e);
  if (total != std::int64_t(num_tokens) * topk)
    return std::printf("count: layer 0 sums to %lld\n", (long long)total), 1;

  const foremoe::Topology topo{1, 4, 5}; // 4 owned experts + 1 spare slot per GPU
  foremoe::Planner planner(num_layers, num_experts, topo);
  const foremoe::StepPlan step = planner.plan_step(loads);
  if (step.micro_steps.size() != std::size_t(num_micro)) return std::printf("plan: wrong micro-step count\n"), 1;
  for (int m = 0; m < num_micro; ++m) {
    const foremoe::LayerPlan &lp = step.micro_steps[std::size_t(m)][0];
    std::int64_t split = 0, max_owned = 0;
    for (std::int64_t v : lp.slot_tokens)
      split += v;
    std::vector<std::int64_t> owned(4, 0);
    for (int e = 0; e < num_experts; ++e)
      owned[std::size_t(lp.owner_gpu[std::size_t(e)])] += loads.at(m, 0, e);
    for (std::int64_t v : owned)
      max_owned = std::max(max_owned, v);
    if (split != std::int64_t(offsets[std::size_t(m) + 1] - offsets[std::size_t(m)]) * topk)
      return std::printf("plan: micro-step %d splits %lld tokens\n", m, (long long)split), 1;
    if (lp.max_gpu_load > max_owned) return std::printf("plan: micro-step %d is worse than its owners\n", m), 1;
  }

  foremoe::SimConfig cfg;
  cfg.model = foremoe::ModelSpec{num_layers, num_experts, topk, 256, 128, foremoe::WeightDtype::bf16};
  cfg.topo = topo;
  cfg.warmup_steps = 0;
  const std::vector<foremoe::SimStrategy> strategies{foremoe::parse_sim_strategy("static"),
                                                     foremoe::parse_sim_strategy("foremoe")};
  const auto res = foremoe::simulate(cfg, loads, {}, strategies);
  if (res.size() != 2 || !(res[0].step_seconds > 0) || res[1].imbalance_median > res[0].imbalance_median + 1e-12)
    return std::printf("simulate: unexpected results\n"), 1;
  std::printf("vendored foremoe %s: counted %lld routes, planned %d micro-steps, static %.3g s, foremoe %.3g s\n",
              foremoe::version_string, (long long)total, num_micro, res[0].step_seconds, res[1].step_seconds);
  return 0;
}
