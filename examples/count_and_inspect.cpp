// Example: count per-micro-step expert loads from a trainer's routed ids and
// look at how unevenly a contiguous expert placement would load the GPUs.
//
//   count_and_inspect            (uses a small synthetic trace)

#include <foremoe/foremoe.hpp>
#include <foremoe/trace/stats.hpp>
#include <foremoe/trace/synthetic.hpp>

#include <iostream>

int main() {
  // What a trainer hands over: routed ids [tokens, layers, topk] plus the
  // token offsets of its micro-batches. Here a small synthetic GRPO batch.
  foremoe::SyntheticConfig cfg;
  cfg.num_layers = 8;
  cfg.prompts_per_step = 16;
  cfg.num_gpus = 8;
  const foremoe::SyntheticTrace trace = foremoe::generate_trace(cfg);

  foremoe::CountOptions opts;
  opts.num_experts = trace.num_experts;
  opts.microbatch_offsets = trace.microbatch_offsets;
  const foremoe::RoutedView ids(std::span<const std::int16_t>(trace.routed_ids), trace.num_tokens, trace.num_layers,
                                trace.topk);
  const foremoe::LoadTensor loads = foremoe::count_loads(ids, opts);

  const auto stats = foremoe::compute_trace_stats(loads, trace.step_offsets, cfg.num_gpus, trace.topk);
  foremoe::print_trace_stats(std::cout, stats);
  return 0;
}
