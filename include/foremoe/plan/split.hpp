#pragma once
/// @file
/// Exact token split: for a fixed placement, integer tokens per copy that minimise the largest GPU load.
///
/// Experts with one copy are fixed loads. The others form a bipartite graph with the GPUs holding their copies; a
/// makespan `T` is feasible iff a flow source -> expert (its load) -> GPU (`T` minus its fixed load) -> sink
/// saturates every expert. The solver works per connected component of that graph and raises `T` Dinkelbach-style:
/// when the flow falls short, the GPUs reachable in the residual graph form a set `X` whose own experts cannot fit
/// under `T`, so `ceil((load inside X) / |X|)` is a strictly larger lower bound. The flow is kept across raises
/// (capacities only grow), so the whole search costs about one max-flow. Integer capacities give integer flows.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"

namespace foremoe {
inline namespace v0 {

/// Reusable workspace for exact splits; after warm-up it does not allocate.
class SplitSolver {
public:
  /// Minimises the maximum GPU load of `placement` for `expert_loads`, writes the tokens of every physical slot
  /// into `slot_tokens` (`[gpus * slots]`) and returns the maximum GPU load. Throws `Error` for a loaded expert
  /// without a copy or a size mismatch.
  std::int64_t solve(const LayerPlacement &placement, std::span<const std::int64_t> expert_loads,
                     std::span<std::int64_t> slot_tokens) {
    const int num_gpus = placement.num_gpus(), slots = placement.slots_per_gpu(), num_experts = placement.num_experts();
    detail::require(static_cast<int>(expert_loads.size()) == num_experts, "exact split: ", expert_loads.size(),
                    " expert loads for a placement of ", num_experts, " experts");
    detail::require(static_cast<int>(slot_tokens.size()) == placement.num_slots(), "exact split: slot_tokens has ",
                    slot_tokens.size(), " entries for ", placement.num_slots(), " slots");
    copies_.assign(static_cast<std::size_t>(num_experts), 0);
    const std::int32_t *phys = placement.phys_to_log().data();
    const int num_slots = num_gpus * slots;
    for (int p = 0; p < num_slots; ++p)
      if (phys[p] != empty_slot) ++copies_[phys[p]];
    base_.assign(static_cast<std::size_t>(num_gpus), 0);
    shared_idx_.assign(static_cast<std::size_t>(num_experts), -1);
    shared_loads_.clear();
    for (int e = 0; e < num_experts; ++e) {
      const std::int64_t v = expert_loads[e];
      if (v < 0 || (copies_[e] == 0 && v > 0)) [[unlikely]] {
        if (v < 0) detail::fail("exact split: expert ", e, " has a negative load ", v);
        detail::fail("exact split: expert ", e, " has load ", v, " but no copy");
      }
      if (copies_[e] > 1) {
        shared_idx_[e] = static_cast<std::int32_t>(shared_loads_.size());
        shared_loads_.push_back(v);
      }
    }
    const int num_shared = static_cast<int>(shared_loads_.size());
    offsets_.assign(static_cast<std::size_t>(num_shared) + 1, 0);
    for (int p = 0; p < num_slots; ++p)
      if (const std::int32_t e = phys[p]; e != empty_slot && shared_idx_[e] >= 0) ++offsets_[shared_idx_[e] + 1];
    for (int i = 0; i < num_shared; ++i)
      offsets_[i + 1] += offsets_[i];
    copy_gpu_.resize(offsets_.back());
    copy_slot_.resize(offsets_.back());
    fill_.assign(offsets_.begin(), offsets_.end() - 1);
    for (int g = 0; g < num_gpus; ++g) {
      std::int64_t fixed = 0;
      for (int p = g * slots; p < (g + 1) * slots; ++p) {
        const std::int32_t e = phys[p];
        if (e == empty_slot) {
          slot_tokens[p] = 0;
          continue;
        }
        const std::int32_t i = shared_idx_[e];
        if (i < 0) {
          fixed += expert_loads[e];
          slot_tokens[p] = expert_loads[e];
          continue;
        }
        const std::int32_t c = fill_[i]++;
        copy_gpu_[c] = g;
        copy_slot_[c] = p;
      }
      base_[g] = fixed;
    }
    copy_tokens_.resize(copy_gpu_.size());
    gpu_loads_.resize(static_cast<std::size_t>(num_gpus));
    const std::int64_t makespan = solve_core(base_, shared_loads_, offsets_, copy_gpu_, copy_tokens_, gpu_loads_);
    for (std::size_t c = 0; c < copy_slot_.size(); ++c)
      slot_tokens[copy_slot_[c]] = copy_tokens_[c];
    return makespan;
  }

  /// The core problem: GPU `g` carries the fixed load `base[g]`; shared expert `i` has load `shared_loads[i]` and
  /// copies on the distinct GPUs `copy_gpu[copy_offsets[i] .. copy_offsets[i + 1])`. Writes the tokens of every
  /// copy into `copy_tokens`, every GPU's load into `gpu_loads`, and returns the maximum GPU load, which is the
  /// least possible. Every connected component is balanced on its own, so no GPU carries more than its component
  /// needs.
  ///
  /// With `limit`, it may stop as soon as some component provably needs more than `limit`: it then returns a value
  /// above `limit` (a lower bound on the maximum) and leaves `copy_tokens` and `gpu_loads` unspecified.
  std::int64_t solve_core(std::span<const std::int64_t> base, std::span<const std::int64_t> shared_loads,
                          std::span<const std::int32_t> copy_offsets, std::span<const std::int32_t> copy_gpu,
                          std::span<std::int64_t> copy_tokens, std::span<std::int64_t> gpu_loads,
                          std::int64_t limit = std::numeric_limits<std::int64_t>::max()) {
    const int num_gpus = static_cast<int>(base.size());
    const int num_shared = static_cast<int>(shared_loads.size());
    const int num_copies = static_cast<int>(copy_gpu.size());
    for (int c = 0; c < num_copies; ++c)
      copy_tokens[c] = 0;
    for (int g = 0; g < num_gpus; ++g)
      gpu_loads[g] = base[g];
    if (num_shared == 0) return max_of(gpu_loads);

    // Components over GPUs.
    parent_.resize(static_cast<std::size_t>(num_gpus));
    for (int g = 0; g < num_gpus; ++g)
      parent_[g] = g;
    copy_expert_.resize(static_cast<std::size_t>(num_copies));
    for (int i = 0; i < num_shared; ++i)
      for (int c = copy_offsets[i]; c < copy_offsets[i + 1]; ++c) {
        copy_expert_[c] = i;
        unite(copy_gpu[copy_offsets[i]], copy_gpu[c]);
      }
    // GPU -> copies (for residual back edges), GPU lists and expert lists per component.
    gpu_off_.assign(static_cast<std::size_t>(num_gpus) + 1, 0);
    for (int c = 0; c < num_copies; ++c)
      ++gpu_off_[copy_gpu[c] + 1];
    for (int g = 0; g < num_gpus; ++g)
      gpu_off_[g + 1] += gpu_off_[g];
    gpu_copies_.resize(static_cast<std::size_t>(num_copies));
    fill_.assign(gpu_off_.begin(), gpu_off_.end() - 1);
    for (int c = 0; c < num_copies; ++c)
      gpu_copies_[fill_[copy_gpu[c]]++] = c;

    comp_of_root_.assign(static_cast<std::size_t>(num_gpus), -1);
    int num_comps = 0;
    for (int i = 0; i < num_shared; ++i) {
      const int r = find(copy_gpu[copy_offsets[i]]);
      if (comp_of_root_[r] < 0) comp_of_root_[r] = num_comps++;
    }
    comp_gpu_off_.assign(static_cast<std::size_t>(num_comps) + 1, 0);
    comp_exp_off_.assign(static_cast<std::size_t>(num_comps) + 1, 0);
    for (int g = 0; g < num_gpus; ++g)
      if (gpu_off_[g + 1] > gpu_off_[g]) ++comp_gpu_off_[comp_of_root_[find(g)] + 1];
    for (int i = 0; i < num_shared; ++i)
      ++comp_exp_off_[comp_of_root_[find(copy_gpu[copy_offsets[i]])] + 1];
    for (int k = 0; k < num_comps; ++k) {
      comp_gpu_off_[k + 1] += comp_gpu_off_[k];
      comp_exp_off_[k + 1] += comp_exp_off_[k];
    }
    comp_gpus_.resize(comp_gpu_off_.back());
    comp_exps_.resize(comp_exp_off_.back());
    fill_.assign(comp_gpu_off_.begin(), comp_gpu_off_.end() - 1);
    for (int g = 0; g < num_gpus; ++g)
      if (gpu_off_[g + 1] > gpu_off_[g]) comp_gpus_[fill_[comp_of_root_[find(g)]]++] = g;
    fill_.assign(comp_exp_off_.begin(), comp_exp_off_.end() - 1);
    for (int i = 0; i < num_shared; ++i)
      comp_exps_[fill_[comp_of_root_[find(copy_gpu[copy_offsets[i]])]]++] = i;

    exp_res_.resize(static_cast<std::size_t>(num_shared));
    gpu_res_.resize(static_cast<std::size_t>(num_gpus));
    exp_mark_.assign(static_cast<std::size_t>(num_shared), 0);
    gpu_mark_.assign(static_cast<std::size_t>(num_gpus), 0);
    exp_parent_.resize(static_cast<std::size_t>(num_shared));
    gpu_parent_.resize(static_cast<std::size_t>(num_gpus));
    queue_.resize(static_cast<std::size_t>(num_shared) + num_gpus);
    stamp_ = 0;
    for (int k = 0; k < num_comps; ++k)
      if (const std::int64_t t =
              solve_component(k, base, shared_loads, copy_offsets, copy_gpu, copy_tokens, gpu_loads, limit);
          t > limit)
        return t;
    return max_of(gpu_loads);
  }

private:
  static std::int64_t max_of(std::span<const std::int64_t> v) {
    std::int64_t m = 0;
    for (std::int64_t x : v)
      m = std::max(m, x);
    return m;
  }
  int find(int g) {
    while (parent_[g] != g) {
      parent_[g] = parent_[parent_[g]];
      g = parent_[g];
    }
    return g;
  }
  void unite(int a, int b) {
    a = find(a);
    b = find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);
  }

  /// Balances component `k`; returns its maximum, or early a lower bound on it above `limit`.
  std::int64_t solve_component(int k, std::span<const std::int64_t> base, std::span<const std::int64_t> shared_loads,
                               std::span<const std::int32_t> copy_offsets, std::span<const std::int32_t> copy_gpu,
                               std::span<std::int64_t> copy_tokens, std::span<std::int64_t> gpu_loads,
                               std::int64_t limit) {
    const std::span<const std::int32_t> gpus(comp_gpus_.data() + comp_gpu_off_[k],
                                             comp_gpu_off_[k + 1] - comp_gpu_off_[k]);
    const std::span<const std::int32_t> exps(comp_exps_.data() + comp_exp_off_[k],
                                             comp_exp_off_[k + 1] - comp_exp_off_[k]);
    std::int64_t total = 0, max_base = 0, unsent = 0;
    for (std::int32_t g : gpus) {
      total += base[g];
      max_base = std::max(max_base, base[g]);
    }
    for (std::int32_t i : exps) {
      total += shared_loads[i];
      exp_res_[i] = shared_loads[i];
      unsent += shared_loads[i];
    }
    const auto n = static_cast<std::int64_t>(gpus.size());
    std::int64_t t = std::max(max_base, (total + n - 1) / n);
    if (t > limit) return t;
    for (std::int32_t g : gpus)
      gpu_res_[g] = t - base[g];
    // Greedy start: most experts fit where they first look, which leaves few augmenting paths to find.
    for (std::int32_t i : exps)
      for (int c = copy_offsets[i]; c < copy_offsets[i + 1] && exp_res_[i] > 0; ++c) {
        const std::int32_t g = copy_gpu[c];
        const std::int64_t f = std::min(exp_res_[i], gpu_res_[g]);
        if (f <= 0) continue;
        copy_tokens[c] += f;
        exp_res_[i] -= f;
        gpu_res_[g] -= f;
        unsent -= f;
      }
    while (unsent > 0) {
      const std::int64_t pushed = augment(exps, copy_offsets, copy_gpu, copy_tokens);
      if (pushed > 0) {
        unsent -= pushed;
        continue;
      }
      // No augmenting path: the reachable set (marked by the failed search) bounds T from below.
      std::int64_t inside = 0, num_x = 0;
      for (std::int32_t i : exps)
        if (exp_mark_[i] == stamp_) inside += shared_loads[i];
      for (std::int32_t g : gpus)
        if (gpu_mark_[g] == stamp_) {
          inside += base[g];
          ++num_x;
        }
      const std::int64_t next = (inside + num_x - 1) / num_x;
      // `next > t` holds by the max-flow min-cut argument; the guard keeps a bug from looping forever.
      const std::int64_t raise = std::max<std::int64_t>(next - t, 1);
      t += raise;
      if (t > limit) return t;
      for (std::int32_t g : gpus)
        gpu_res_[g] += raise;
    }
    for (std::int32_t g : gpus)
      gpu_loads[g] = t - gpu_res_[g];
    return t;
  }

  /// One BFS from every expert with unsent tokens; pushes along the first path found. Returns the amount pushed,
  /// or 0 with the reachable set marked by `stamp_`.
  std::int64_t augment(std::span<const std::int32_t> exps, std::span<const std::int32_t> copy_offsets,
                       std::span<const std::int32_t> copy_gpu, std::span<std::int64_t> copy_tokens) {
    ++stamp_;
    std::size_t head = 0, tail = 0;
    for (std::int32_t i : exps)
      if (exp_res_[i] > 0) {
        exp_mark_[i] = stamp_;
        exp_parent_[i] = -1;
        queue_[tail++] = i;
      }
    // Queue entries: expert i as i, GPU g as ~g.
    while (head < tail) {
      const std::int32_t node = queue_[head++];
      if (node >= 0) {
        for (int c = copy_offsets[node]; c < copy_offsets[node + 1]; ++c) {
          const std::int32_t g = copy_gpu[c];
          if (gpu_mark_[g] == stamp_) continue;
          gpu_mark_[g] = stamp_;
          gpu_parent_[g] = c;
          if (gpu_res_[g] > 0) return push(g, copy_gpu, copy_tokens);
          queue_[tail++] = ~g;
        }
      } else {
        const std::int32_t g = ~node;
        for (int j = gpu_off_[g]; j < gpu_off_[g + 1]; ++j) {
          const std::int32_t c = gpu_copies_[j];
          const std::int32_t i = copy_expert_[c];
          if (copy_tokens[c] <= 0 || exp_mark_[i] == stamp_) continue;
          exp_mark_[i] = stamp_;
          exp_parent_[i] = c;
          queue_[tail++] = i;
        }
      }
    }
    return 0;
  }

  std::int64_t push(std::int32_t g_end, std::span<const std::int32_t> copy_gpu, std::span<std::int64_t> copy_tokens) {
    std::int64_t amount = gpu_res_[g_end];
    std::int32_t g = g_end;
    std::int32_t i;
    for (;;) {
      const std::int32_t c = gpu_parent_[g];
      i = copy_expert_[c];
      const std::int32_t back = exp_parent_[i];
      if (back < 0) break;
      amount = std::min(amount, copy_tokens[back]);
      g = copy_gpu[back];
    }
    amount = std::min(amount, exp_res_[i]);
    g = g_end;
    gpu_res_[g_end] -= amount;
    for (;;) {
      const std::int32_t c = gpu_parent_[g];
      copy_tokens[c] += amount;
      i = copy_expert_[c];
      const std::int32_t back = exp_parent_[i];
      if (back < 0) break;
      copy_tokens[back] -= amount;
      g = copy_gpu[back];
    }
    exp_res_[i] -= amount;
    return amount;
  }

  std::vector<int> copies_;
  std::vector<std::int64_t> base_, shared_loads_, copy_tokens_, gpu_loads_;
  std::vector<std::int32_t> shared_idx_, offsets_, copy_gpu_, copy_slot_, fill_;
  std::vector<std::int32_t> parent_, copy_expert_, gpu_off_, gpu_copies_, comp_of_root_;
  std::vector<std::int32_t> comp_gpu_off_, comp_exp_off_, comp_gpus_, comp_exps_;
  std::vector<std::int64_t> exp_res_, gpu_res_;
  std::vector<std::uint32_t> exp_mark_, gpu_mark_;
  std::vector<std::int32_t> exp_parent_, gpu_parent_, queue_;
  std::uint32_t stamp_ = 0;
};

/// Tokens per physical slot and the resulting maximum GPU load.
struct SplitResult {
  std::vector<std::int64_t> slot_tokens;
  std::int64_t max_gpu_load = 0;
};

/// The exact split of one layer (allocates a workspace; reuse a `SplitSolver` in loops).
[[nodiscard]] inline SplitResult exact_split(const LayerPlacement &placement,
                                             std::span<const std::int64_t> expert_loads) {
  SplitSolver solver;
  SplitResult r;
  r.slot_tokens.resize(static_cast<std::size_t>(placement.num_slots()));
  r.max_gpu_load = solver.solve(placement, expert_loads, r.slot_tokens);
  return r;
}

/// Even split, as EPLB assumes: each expert's tokens divided over its copies, the remainder one token each to the
/// first copies in physical order.
[[nodiscard]] inline SplitResult even_split(const LayerPlacement &placement,
                                            std::span<const std::int64_t> expert_loads) {
  const auto counts = placement.replica_counts();
  std::vector<int> seen(counts.size(), 0);
  SplitResult r;
  r.slot_tokens.assign(static_cast<std::size_t>(placement.num_slots()), 0);
  const auto phys = placement.phys_to_log();
  for (int p = 0; p < placement.num_slots(); ++p) {
    const std::int32_t e = phys[p];
    if (e == empty_slot) continue;
    const std::int64_t c = counts[e];
    r.slot_tokens[p] = expert_loads[e] / c + (seen[e]++ < expert_loads[e] % c ? 1 : 0);
  }
  std::int64_t load = 0;
  for (int p = 0; p < placement.num_slots(); ++p) {
    load += r.slot_tokens[p];
    if ((p + 1) % placement.slots_per_gpu() == 0) {
      r.max_gpu_load = std::max(r.max_gpu_load, load);
      load = 0;
    }
  }
  return r;
}

/// Assigns every (expert, source rank) token count to the expert's copies, keeping each copy's total from
/// `slot_tokens` and preferring a copy on the source GPU, then one on its node. Source rank `s` is GPU `s`.
/// `source_loads` is `[experts][num_sources]`; returns `[gpus * slots][num_sources]`.
[[nodiscard]] inline std::vector<std::int64_t> split_by_source(const LayerPlacement &placement,
                                                               std::span<const std::int64_t> slot_tokens,
                                                               std::span<const std::int64_t> source_loads,
                                                               int num_sources, int gpus_per_node) {
  const int num_experts = placement.num_experts(), slots = placement.slots_per_gpu();
  detail::require(num_sources == placement.num_gpus(), "split_by_source: ", num_sources,
                  " source ranks, expected one per GPU (", placement.num_gpus(), ")");
  detail::require(gpus_per_node > 0, "split_by_source: gpus_per_node must be positive, got ", gpus_per_node);
  detail::require(source_loads.size() == static_cast<std::size_t>(num_experts) * num_sources,
                  "split_by_source: ", source_loads.size(), " per-source loads, expected ", num_experts, " x ",
                  num_sources);
  detail::require(static_cast<int>(slot_tokens.size()) == placement.num_slots(),
                  "split_by_source: ", slot_tokens.size(), " slot token counts for ", placement.num_slots(), " slots");
  const auto l2p = placement.log_to_phys();
  std::vector<std::int64_t> out(static_cast<std::size_t>(placement.num_slots()) * num_sources, 0);
  std::vector<std::int64_t> cap, rem(static_cast<std::size_t>(num_sources));
  for (int e = 0; e < num_experts; ++e) {
    const int first = l2p.offsets[e], last = l2p.offsets[e + 1];
    cap.assign(static_cast<std::size_t>(last - first), 0);
    std::int64_t cap_sum = 0, src_sum = 0;
    for (int j = first; j < last; ++j)
      cap_sum += cap[j - first] = slot_tokens[l2p.phys[j]];
    for (int s = 0; s < num_sources; ++s) {
      rem[s] = source_loads[static_cast<std::size_t>(e) * num_sources + s];
      detail::require(rem[s] >= 0, "split_by_source: expert ", e, " source ", s, " has a negative load ", rem[s]);
      src_sum += rem[s];
    }
    detail::require(cap_sum == src_sum, "split_by_source: expert ", e, " has ", src_sum,
                    " tokens over its sources but its copies get ", cap_sum);
    // Pass 0: copy on the source GPU; pass 1: on its node; pass 2: anywhere.
    for (int pass = 0; pass < 3; ++pass)
      for (int s = 0; s < num_sources; ++s)
        for (int j = first; j < last && rem[s] > 0; ++j) {
          const int phys = l2p.phys[j], gpu = phys / slots;
          if ((pass == 0 && gpu != s) || (pass == 1 && gpu / gpus_per_node != s / gpus_per_node)) continue;
          const std::int64_t f = std::min(rem[s], cap[j - first]);
          out[static_cast<std::size_t>(phys) * num_sources + s] += f;
          rem[s] -= f;
          cap[j - first] -= f;
        }
  }
  return out;
}

} // namespace v0
} // namespace foremoe
