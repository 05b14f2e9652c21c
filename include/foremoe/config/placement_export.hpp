#pragma once
/// @file
/// A placement in the forms SGLang and vLLM read: SGLang's `--init-expert-location FILE.json`
/// (`{"physical_to_logical_map": [L][R]}`) and vLLM's EPLB state (`physical_to_logical_map [L][R]`,
/// `logical_to_physical_map [L][E][maxcnt]` padded with -1, `logical_replica_count [L][E]`, the attribute
/// names of vLLM's `EplbState`). Physical id `p = gpu * slots + slot`, so GPU `g` holds `[g*S, (g+1)*S)`.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/json.hpp"
#include "foremoe/core/placement.hpp"

namespace foremoe {
inline namespace v0 {
namespace config {

/// The export formats of `foremoe plan --placement-format` (`foremoe` is the native placement document).
inline const std::vector<std::string> &placement_format_names() {
  static const std::vector<std::string> n{"foremoe", "sglang", "vllm"};
  return n;
}

/// Fills every empty slot of `p` with the expert of largest `weights[l][e] / replicas` not yet on that GPU
/// (SGLang and vLLM need an expert in every physical slot; a filled slot is one more replica to split over).
/// `weights` is `[L][E]` (empty: all equal). Throws when a GPU has more slots than there are experts.
inline void fill_empty_slots(Placement &p, std::span<const std::int64_t> weights) {
  for (int l = 0; l < p.num_layers(); ++l) {
    LayerPlacement &lp = p.layer(l);
    const int E = lp.num_experts(), S = lp.slots_per_gpu();
    foremoe::detail::require(S <= E, "placement export: ", S, " slots per GPU exceed the ", E,
                             " experts; a full placement would need two copies on one GPU");
    std::vector<int> cnt = lp.replica_counts();
    for (int g = 0; g < lp.num_gpus(); ++g)
      for (int s = 0; s < S; ++s) {
        if (lp.slot(g, s) >= 0) continue;
        int best = -1;
        double best_score = -1;
        for (int e = 0; e < E; ++e) {
          if (lp.holds(g, e)) continue;
          const double w = weights.empty() ? 1.0 : static_cast<double>(weights[static_cast<std::size_t>(l) * E + e]);
          const double score = cnt[e] == 0 ? 1e300 : w / cnt[e]; // an unplaced expert first
          if (score > best_score) best = e, best_score = score;
        }
        lp.slot(g, s) = best;
        ++cnt[best];
      }
  }
}

/// `p` (every slot filled) as the JSON text that `format` (sglang or vllm) reads (written directly: the
/// documents are plain nested integer arrays).
[[nodiscard]] inline std::string placement_export_text(const Placement &p, std::string_view format) {
  foremoe::detail::require(format == "sglang" || format == "vllm", "placement format must be sglang or vllm, got '",
                           format, "'");
  std::string p2l = "[", l2p = "[", cnt = "[";
  for (int l = 0; l < p.num_layers(); ++l) {
    const LayerPlacement &lp = p.layer(l);
    const int E = lp.num_experts();
    std::vector<std::vector<std::int64_t>> phys(static_cast<std::size_t>(E));
    const auto slots = lp.phys_to_log();
    p2l += l > 0 ? ",[" : "[";
    for (std::size_t i = 0; i < slots.size(); ++i) {
      foremoe::detail::require(slots[i] >= 0, "placement export: physical slot ", i, " of layer ", l, " is empty");
      if (i > 0) p2l += ',';
      p2l += std::to_string(slots[i]);
      phys[static_cast<std::size_t>(slots[i])].push_back(static_cast<std::int64_t>(i));
    }
    p2l += "]";
    std::size_t maxcnt = 1;
    for (const auto &v : phys)
      maxcnt = std::max(maxcnt, v.size());
    l2p += l > 0 ? ",[" : "[";
    cnt += l > 0 ? ",[" : "[";
    for (std::size_t e = 0; e < phys.size(); ++e) {
      l2p += e > 0 ? ",[" : "[";
      for (std::size_t k = 0; k < maxcnt; ++k) {
        // Appended piece by piece: `"," + std::to_string(..)` trips g++ 12's -Wrestrict false positive at -O2.
        if (k > 0) l2p += ',';
        l2p += std::to_string(k < phys[e].size() ? phys[e][k] : -1); // -1: EPLB's padding
      }
      l2p += "]";
      if (e > 0) cnt += ',';
      cnt += std::to_string(phys[e].size());
    }
    l2p += "]";
    cnt += "]";
  }
  p2l += "]";
  l2p += "]";
  cnt += "]";
  if (format == "sglang") return "{\"physical_to_logical_map\":" + p2l + "}\n";
  return "{\"physical_to_logical_map\":" + p2l + ",\"logical_to_physical_map\":" + l2p +
         ",\"logical_replica_count\":" + cnt + "}\n";
}

} // namespace config
} // namespace v0
} // namespace foremoe
