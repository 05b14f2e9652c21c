#pragma once
// Synthetic routed ids for the token-map benchmarks: skewed, distinct top-k experts per (token, layer), each layer
// with its own hot experts, so that plans replicate (an xorshift stream: the same ids on every run).

#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/trace/count.hpp"

namespace foremoe_bench {

/// `[tokens][layers][topk]` ids over `num_experts` (a cubic skew towards low ranks, permuted per layer; `topk` <= 8
/// distinct ids per (token, layer) through an odd stride when `num_experts` is a power of two).
inline std::vector<std::uint16_t> skewed_ids(std::int64_t num_tokens, int num_layers, int topk, int num_experts) {
  std::vector<std::uint16_t> ids(static_cast<std::size_t>(num_tokens) * num_layers * topk);
  std::uint64_t s = 0x9E3779B97F4A7C15ull;
  auto next = [&s] {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  };
  std::size_t i = 0;
  for (std::int64_t t = 0; t < num_tokens; ++t)
    for (int l = 0; l < num_layers; ++l) {
      const double u = static_cast<double>(next() % 1000000) / 1e6;
      const auto hot = static_cast<int>(num_experts * u * u * u);    // cubic skew towards low ranks
      const int base = (hot * 37 + l * 11) % num_experts;            // a per-layer permutation of ranks
      const int step = 1 + 2 * static_cast<int>((next() >> 20) % 8); // odd: distinct ids
      for (int k = 0; k < topk; ++k)
        ids[i++] = static_cast<std::uint16_t>((base + k * step) % num_experts);
    }
  return ids;
}

/// A micro-step of `skewed_ids` over `num_gpus` source ranks of equal token ranges, counted by source.
struct SkewedStep {
  std::vector<std::uint16_t> ids;           ///< `[tokens][layers][topk]`
  std::vector<std::int64_t> source_offsets; ///< `[num_gpus + 1]`
  foremoe::LoadTensor loads;                ///< `[1][layers][experts]` with the per-source split
};

inline SkewedStep skewed_step(std::int64_t num_tokens, int num_layers, int topk, int num_experts, int num_gpus) {
  SkewedStep m;
  m.ids = skewed_ids(num_tokens, num_layers, topk, num_experts);
  for (int g = 0; g <= num_gpus; ++g)
    m.source_offsets.push_back(num_tokens * g / num_gpus);
  foremoe::CountOptions o;
  o.num_experts = num_experts;
  o.num_sources = num_gpus;
  o.source_offsets = m.source_offsets;
  m.loads = foremoe::count_loads(std::span<const std::uint16_t>(m.ids), num_tokens, num_layers, topk, o);
  return m;
}

} // namespace foremoe_bench
