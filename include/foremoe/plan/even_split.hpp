#pragma once
/// @file
/// EPLB's contract, planned for EPLB's callers: the placement that vLLM and SGLang dispatch by splitting every
/// expert's tokens evenly over its copies, never two copies of one expert on one GPU.
///
/// The objective is EPLB's: the largest GPU load when each copy of expert `e` carries `weight[e] / count[e]` (a GPU
/// load is the sum over its slots). Per layer:
/// 1. *First start*: counts by EPLB's greedy (the next copy to the largest load per copy), capped at one copy per
///    GPU; copies by load per copy, descending, each to the lightest GPU with a free slot that does not hold the
///    expert; then the local search below.
/// 2. Only if that peak is above EPLB's (`eplb_rebalance_layer`, hierarchical or global by EPLB's rules): *EPLB's
///    own placement* as a second start, its duplicates (two copies of one expert on a GPU) removed by moves that do
///    not raise its peak, then the local search; the lower peak is kept. Where EPLB has no duplicates, or they go
///    so, the result is therefore never less balanced than EPLB's.
/// 3. Only if still above: bounded random restarts (kicks, each followed by the local search) until EPLB's peak is
///    reached. This is where a duplicate-free placement may not exist: EPLB's two copies on one GPU split that
///    expert unevenly over GPUs, and on small shapes (few GPUs or few experts per slot) that reaches peaks no
///    placement without duplicates reaches (tests/test_plan_even_split.cpp has one, checked by hand).
///
/// The local search repeatedly lowers the most loaded GPU `g` while every GPU it changes ends strictly below the
/// current peak (so the pair (peak, GPUs at the peak) decreases): swap a copy on `g` with a lighter copy elsewhere;
/// give an expert on `g` one more copy, in the slot of an expert with two or more; or give the slot of a copy on
/// `g` to another expert. Moves are ranked by an upper bound of the loads they leave (decreases on GPUs other than
/// the two slots' are ignored); loads are summed afresh on every GPU a move changes.
///
/// Expert groups and nodes shape only the EPLB start: the search moves copies across nodes freely (EPLB's callers
/// place any expert on any GPU).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/eplb.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// One layer's placement under the even split: slots per GPU, copy counts, copies of each expert per GPU, loads.
class EvenSplitState {
public:
  EvenSplitState(std::span<const double> weights, int num_gpus, int slots_per_gpu)
      : w_(weights), num_experts_(static_cast<int>(weights.size())), num_gpus_(num_gpus), slots_(slots_per_gpu) {}

  /// Takes `phys_to_log` (`[gpus * slots]`, duplicates allowed) and derives counts, copies per GPU and loads.
  void assign(std::vector<std::int32_t> phys_to_log) {
    p2l_ = std::move(phys_to_log);
    recompute();
  }

  void recompute() {
    count_.assign(static_cast<std::size_t>(num_experts_), 0);
    on_.assign(static_cast<std::size_t>(num_gpus_) * num_experts_, 0);
    for (int g = 0; g < num_gpus_; ++g)
      for (int s = 0; s < slots_; ++s) {
        const std::int32_t e = p2l_[static_cast<std::size_t>(g) * slots_ + s];
        ++count_[e];
        ++on(g, e);
      }
    load_.assign(static_cast<std::size_t>(num_gpus_), 0.0);
    for (int g = 0; g < num_gpus_; ++g) {
      double sum = 0.0;
      for (int s = 0; s < slots_; ++s)
        sum += share(p2l_[static_cast<std::size_t>(g) * slots_ + s]);
      load_[g] = sum;
    }
  }

  /// Puts expert `e` in slot `s` of GPU `g`; the loads of every GPU holding the old or the new expert (their
  /// loads per copy change) are summed afresh.
  void set_slot(int g, int s, int e) {
    std::int32_t &cell = p2l_[static_cast<std::size_t>(g) * slots_ + s];
    const int old = cell;
    if (old == e) return;
    cell = e;
    --count_[old];
    --on(g, old);
    ++count_[e];
    ++on(g, e);
    for (int q = 0; q < num_gpus_; ++q)
      if (q == g || on(q, old) > 0 || on(q, e) > 0) {
        double sum = 0.0;
        for (int t = 0; t < slots_; ++t)
          sum += share(p2l_[static_cast<std::size_t>(q) * slots_ + t]);
        load_[q] = sum;
      }
  }

  [[nodiscard]] double share(int e) const { return w_[e] / count_[e]; }
  [[nodiscard]] double share_with(int e, int copies) const { return w_[e] / copies; }
  [[nodiscard]] std::int32_t &on(int g, int e) { return on_[static_cast<std::size_t>(g) * num_experts_ + e]; }
  [[nodiscard]] std::int32_t on(int g, int e) const { return on_[static_cast<std::size_t>(g) * num_experts_ + e]; }
  [[nodiscard]] std::int32_t &slot(int g, int s) { return p2l_[static_cast<std::size_t>(g) * slots_ + s]; }
  [[nodiscard]] int peak_gpu() const {
    return static_cast<int>(std::max_element(load_.begin(), load_.end()) - load_.begin());
  }
  [[nodiscard]] double peak() const { return load_[peak_gpu()]; }
  [[nodiscard]] int slot_of(int g, int e) const {
    for (int s = 0; s < slots_; ++s)
      if (p2l_[static_cast<std::size_t>(g) * slots_ + s] == e) return s;
    return -1;
  }
  [[nodiscard]] bool has_duplicate() const {
    return std::any_of(on_.begin(), on_.end(), [](std::int32_t c) { return c > 1; });
  }

  /// Highest load, over GPUs other than `skip` that hold `e`, after `e`'s copies each carry `delta` more.
  struct Top2 {
    double value[2] = {-1.0, -1.0};
    int gpu[2] = {-1, -1};
    [[nodiscard]] double excluding(int g) const { return gpu[0] == g ? value[1] : value[0]; }
    /// Keeps `v` (on GPU `g`) if it is among the two largest offered so far.
    void offer(double v, int g) {
      if (v > value[0]) {
        value[1] = value[0];
        gpu[1] = gpu[0];
        value[0] = v;
        gpu[0] = g;
      } else if (v > value[1]) {
        value[1] = v;
        gpu[1] = g;
      }
    }
  };
  [[nodiscard]] Top2 raised_loads(int e, double delta, int skip) const {
    Top2 t;
    for (int q = 0; q < num_gpus_; ++q) {
      const std::int32_t c = on(q, e);
      if (c == 0 || q == skip) continue;
      t.offer(load_[q] + c * delta, q);
    }
    return t;
  }

  std::span<const double> w_;
  int num_experts_, num_gpus_, slots_;
  std::vector<std::int32_t> p2l_, count_, on_;
  std::vector<double> load_;
};

/// A move of the local search (see the file comment); `kind` none when nothing qualifies.
struct EvenSplitMove {
  enum Kind { none, swap, grow, shrink } kind = none;
  int gpu = -1, slot = -1;        ///< the copy on the GPU being lowered (swap, grow: keeps it; shrink: replaces it)
  int other_gpu = -1, other = -1; ///< swap: GPU and slot of the other copy; grow: GPU and slot the new copy takes
  int expert = -1;                ///< shrink: the expert that takes the slot
  double bound = 0.0;             ///< upper bound of the largest load among the GPUs the move changes
};

/// Applies `m`.
inline void apply_move(EvenSplitState &st, const EvenSplitMove &m) {
  switch (m.kind) {
  case EvenSplitMove::swap: {
    const int a = st.slot(m.gpu, m.slot), b = st.slot(m.other_gpu, m.other);
    st.set_slot(m.gpu, m.slot, b);
    st.set_slot(m.other_gpu, m.other, a);
    break;
  }
  case EvenSplitMove::grow: st.set_slot(m.other_gpu, m.other, st.slot(m.gpu, m.slot)); break;
  case EvenSplitMove::shrink: st.set_slot(m.gpu, m.slot, m.expert); break;
  case EvenSplitMove::none: break;
  }
}

/// What every move from GPU `g` needs, computed once per GPU and round: each slot's load, whether its expert is
/// also on `g`, the expert whose next copy is lightest among those not on `g` (for shrinks) and, for grows, per
/// expert with two or more copies how much more each copy carries with one copy fewer and the two highest loads of
/// the GPUs other than `g` holding it after that (the latter assume a placement without duplicates).
struct MoveContext {
  int gpu = -1;
  std::vector<double> slot_share, up;
  std::vector<std::uint8_t> on_gpu;
  std::vector<EvenSplitState::Top2> top;
  int lightest_new = -1;
  double lightest_new_share = 0.0;

  void build(const EvenSplitState &st, int g, bool grow) {
    const int E = st.num_experts_, G = st.num_gpus_, S = st.slots_, R = G * S;
    gpu = g;
    slot_share.resize(static_cast<std::size_t>(R));
    on_gpu.resize(static_cast<std::size_t>(R));
    for (int p = 0; p < R; ++p) {
      const int e = st.p2l_[p];
      slot_share[p] = st.share(e);
      on_gpu[p] = st.on(g, e) > 0 ? 1 : 0;
    }
    lightest_new = -1;
    for (int e = 0; e < E; ++e) {
      if (st.on(g, e) > 0 || st.count_[e] >= G) continue;
      const double v = st.share_with(e, st.count_[e] + 1);
      if (lightest_new < 0 || v < lightest_new_share) {
        lightest_new = e;
        lightest_new_share = v;
      }
    }
    if (!grow) return;
    up.assign(static_cast<std::size_t>(E), 0.0);
    top.assign(static_cast<std::size_t>(E), {});
    for (int x = 0; x < E; ++x)
      if (st.count_[x] >= 2) up[x] = st.share_with(x, st.count_[x] - 1) - st.share(x);
    for (int q = 0; q < G; ++q) {
      if (q == g) continue;
      for (int t = 0; t < S; ++t) {
        const int x = st.p2l_[static_cast<std::size_t>(q) * S + t];
        if (st.count_[x] < 2) continue;
        top[x].offer(st.load_[q] + up[x], q);
      }
    }
  }
};

/// The best move (smallest bound) that changes copy `slot` of GPU `ctx.gpu`. Descending (`grow`, on a placement
/// without duplicates): every GPU the move changes ends strictly below `limit`, the GPU itself included. Removing
/// a duplicate (not `grow`): swaps in either direction and shrinks, every changed GPU at most `limit`.
inline EvenSplitMove best_move_from(const EvenSplitState &st, const MoveContext &ctx, int slot, double limit,
                                    bool grow) {
  const int G = st.num_gpus_, S = st.slots_, g = ctx.gpu;
  const bool strict = grow;
  EvenSplitMove best;
  double best_bound = limit;
  const auto better = [&](double v) {
    return v < best_bound || (!strict && best.kind == EvenSplitMove::none && v <= limit);
  };
  const double load_g = st.load_[g];
  const int a = st.p2l_[static_cast<std::size_t>(g) * S + slot];
  const int ca = st.count_[a];
  const double sa = st.share(a);
  // Shrink: a loses this copy (its other copies each carry more), the slot goes to the expert not on g whose next
  // copy is lightest.
  if (ca >= 2 && ctx.lightest_new >= 0) {
    const double up = st.share_with(a, ca - 1) - sa;
    const double v =
        std::max(load_g - sa + (st.on(g, a) - 1) * up + ctx.lightest_new_share, st.raised_loads(a, up, g).value[0]);
    if (better(v)) {
      best = {EvenSplitMove::shrink, g, slot, -1, -1, ctx.lightest_new, v};
      best_bound = v;
    }
  }
  // Swap a (on g) with b (on h): g loses sa - sb, h gains it. Grow: a gets a copy on h in the slot of x (x keeps
  // at least one copy, its others each carry more; GPUs that hold a as well carry less, which the bound ignores).
  const bool can_grow = grow && ca < G;
  const double a_next = st.share_with(a, ca + 1);
  const double g_after_grow = load_g - (sa - a_next);
  for (int h = 0; h < G; ++h) {
    if (h == g || st.on(h, a) > 0) continue;
    const double load_h = st.load_[h];
    const bool can_swap = !strict || load_h < best_bound; // a swap raises h
    if (!can_swap && !can_grow) continue;
    for (int t = 0; t < S; ++t) {
      const int p = h * S + t;
      const double sb = ctx.slot_share[p];
      if (can_swap && !ctx.on_gpu[p]) {
        const double d = sa - sb;
        if (!strict || d > 0) {
          const double v = std::max(load_g - d, load_h + d);
          if (better(v)) {
            best = {EvenSplitMove::swap, g, slot, h, t, -1, v};
            best_bound = v;
          }
        }
      }
      if (can_grow) {
        const int x = st.p2l_[p];
        if (st.count_[x] < 2) continue;
        const double v =
            std::max({g_after_grow + (ctx.on_gpu[p] ? ctx.up[x] : 0.0), load_h - sb + a_next, ctx.top[x].excluding(h)});
        if (better(v)) {
          best = {EvenSplitMove::grow, g, slot, h, t, -1, v};
          best_bound = v;
        }
      }
    }
  }
  return best;
}

/// Removes every duplicate, each by the move that leaves the lowest load on the GPUs it changes; with `keep_peak`
/// only by moves that do not raise the peak. False if a duplicate is left.
inline bool remove_duplicates(EvenSplitState &st, bool keep_peak) {
  const int G = st.num_gpus_, S = st.slots_;
  for (int guard = 0; guard < G * S; ++guard) {
    const double limit = keep_peak ? st.peak() : std::numeric_limits<double>::infinity();
    EvenSplitMove best;
    MoveContext ctx;
    for (int g = 0; g < G; ++g) {
      bool built = false;
      for (int s = 0; s < S; ++s) {
        const int e = st.slot(g, s);
        if (st.on(g, e) < 2 || st.slot_of(g, e) != s) continue; // one candidate per duplicated expert and GPU
        if (!built) ctx.build(st, g, false);
        built = true;
        const EvenSplitMove m = best_move_from(st, ctx, s, limit, false);
        if (m.kind != EvenSplitMove::none && (best.kind == EvenSplitMove::none || m.bound < best.bound)) best = m;
      }
    }
    if (best.kind == EvenSplitMove::none) return !st.has_duplicate();
    apply_move(st, best);
  }
  return !st.has_duplicate();
}

/// Lowers the peak GPU load until no single move lowers the most loaded GPU.
inline void lower_peak(EvenSplitState &st) {
  const int S = st.slots_;
  MoveContext ctx;
  const int max_rounds = 64 * st.num_gpus_ * S;
  for (int round = 0; round < max_rounds; ++round) {
    const int g = st.peak_gpu();
    const double peak = st.load_[g];
    // A relative margin keeps rounding in the recomputed sums from cycling.
    const double limit = peak - std::abs(peak) * 1e-13;
    ctx.build(st, g, true);
    EvenSplitMove best;
    for (int s = 0; s < S; ++s) {
      const EvenSplitMove m = best_move_from(st, ctx, s, best.kind == EvenSplitMove::none ? limit : best.bound, true);
      if (m.kind != EvenSplitMove::none) best = m;
    }
    if (best.kind == EvenSplitMove::none) return;
    apply_move(st, best);
  }
}

/// EPLB's counts (each extra copy to the expert with the largest load per copy), capped at one copy per GPU.
inline std::vector<std::int32_t> greedy_counts(std::span<const double> w, int num_gpus, int num_physical) {
  const int E = static_cast<int>(w.size());
  std::vector<std::int32_t> count(static_cast<std::size_t>(E), 1);
  for (int p = E; p < num_physical; ++p) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (count[e] < num_gpus && (best < 0 || w[e] / count[e] > w[best] / count[best])) best = e;
    ++count[best];
  }
  return count;
}

/// Copies by load per copy (descending; an expert's copies together), each to the lightest GPU with a free slot
/// that does not hold its expert. `count` sums to `num_gpus * slots`, each at most `num_gpus`.
inline std::vector<std::int32_t> distinct_packing(std::span<const double> w, std::span<const std::int32_t> count,
                                                  int num_gpus, int slots) {
  const int E = static_cast<int>(w.size()), R = num_gpus * slots;
  std::vector<std::int32_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int32_t a, std::int32_t b) { return w[a] / count[a] > w[b] / count[b]; });
  std::vector<std::int32_t> p2l(static_cast<std::size_t>(R), -1), used(static_cast<std::size_t>(num_gpus), 0);
  std::vector<std::uint8_t> on(static_cast<std::size_t>(num_gpus) * E, 0);
  std::vector<double> load(static_cast<std::size_t>(num_gpus), 0.0);
  const auto put = [&](int g, int e) {
    p2l[static_cast<std::size_t>(g) * slots + used[g]++] = e;
    on[static_cast<std::size_t>(g) * E + e] = 1;
    load[g] += w[e] / count[e];
  };
  for (const std::int32_t e : order)
    for (int c = 0; c < count[e]; ++c) {
      int best = -1;
      for (int g = 0; g < num_gpus; ++g)
        if (used[g] < slots && !on[static_cast<std::size_t>(g) * E + e] && (best < 0 || load[g] < load[best])) best = g;
      if (best >= 0) {
        put(best, e);
        continue;
      }
      // Every GPU with a free slot already holds e: a full GPU h without e hands one of its experts y (not on the
      // GPU r with room) to r and takes e. Such h and y exist: e has fewer than num_gpus copies so far, and h's
      // distinct experts outnumber r's.
      int r = -1;
      for (int g = 0; g < num_gpus; ++g)
        if (used[g] < slots && (r < 0 || load[g] < load[r])) r = g;
      bool placed = false;
      for (int h = 0; h < num_gpus && !placed; ++h) {
        if (on[static_cast<std::size_t>(h) * E + e]) continue;
        for (int s = 0; s < slots && !placed; ++s) {
          const int y = p2l[static_cast<std::size_t>(h) * slots + s];
          if (on[static_cast<std::size_t>(r) * E + y]) continue;
          on[static_cast<std::size_t>(h) * E + y] = 0;
          load[h] -= w[y] / count[y];
          p2l[static_cast<std::size_t>(h) * slots + s] = e;
          on[static_cast<std::size_t>(h) * E + e] = 1;
          load[h] += w[e] / count[e];
          put(r, y);
          placed = true;
        }
      }
      require(placed, "even_split: no slot for a copy of expert ", e); // unreachable by the argument above
    }
  return p2l;
}

/// Random kicks followed by `lower_peak`, keeping the best placement, until its peak is at most `target` or
/// `rounds` kicks are spent. A kick swaps a copy on the most loaded GPU with one elsewhere or gives a copy's slot
/// to another expert (one to three per round); the generator is seeded the same every call (a deterministic plan).
inline void kick_and_descend(EvenSplitState &best, double target, int rounds) {
  const int G = best.num_gpus_, S = best.slots_, E = best.num_experts_;
  std::mt19937_64 rng(0x9e3779b97f4a7c15ULL);
  const auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  EvenSplitState cur = best;
  for (int round = 0; round < rounds && best.peak() > target; ++round) {
    cur = best;
    const int kicks = 1 + pick(3);
    for (int k = 0; k < kicks; ++k) {
      if (G > 1 && pick(2) == 0) {
        const int g = cur.peak_gpu(), s = pick(S);
        const int h = (g + 1 + pick(G - 1)) % G, t = pick(S);
        const int a = cur.slot(g, s), b = cur.slot(h, t);
        if (cur.on(h, a) > 0 || cur.on(g, b) > 0) continue;
        cur.set_slot(g, s, b);
        cur.set_slot(h, t, a);
      } else if (pick(2) == 0) {
        // New counts (one copy moves from one expert to another), packed afresh.
        std::vector<std::int32_t> count = cur.count_;
        const int x = pick(E), a = pick(E);
        if (x == a || count[x] < 2 || count[a] >= G) continue;
        --count[x];
        ++count[a];
        cur.assign(distinct_packing(cur.w_, count, G, S));
      } else {
        const int h = pick(G), t = pick(S), x = cur.slot(h, t), a = pick(E);
        if (cur.count_[x] < 2 || cur.on(h, a) > 0) continue;
        cur.set_slot(h, t, a);
      }
    }
    lower_peak(cur);
    if (cur.peak() < best.peak()) best = cur;
  }
}

} // namespace detail

/// Per-GPU load of `phys_to_log` (`[gpus * slots]`) when each expert's tokens are split evenly over its copies.
[[nodiscard]] inline std::vector<double> even_split_gpu_loads(std::span<const std::int32_t> phys_to_log,
                                                              std::span<const double> weights, int num_gpus) {
  std::vector<std::int32_t> count(weights.size(), 0);
  for (const std::int32_t e : phys_to_log)
    ++count[e];
  const std::size_t per_gpu = phys_to_log.size() / static_cast<std::size_t>(num_gpus);
  std::vector<double> out(static_cast<std::size_t>(num_gpus), 0.0);
  for (std::size_t p = 0; p < phys_to_log.size(); ++p)
    out[p / per_gpu] += weights[phys_to_log[p]] / count[phys_to_log[p]];
  return out;
}

/// EPLB's `rebalance_experts` contract for one layer, optimised for the even split (see the file comment): never
/// a higher peak GPU load under the even split than `eplb_rebalance_layer` on the same arguments (when EPLB's
/// shape rules admit them), never two copies of an expert on one GPU. Each GPU's slots list its experts in
/// increasing id; `replica_rank` numbers an expert's copies in physical order.
[[nodiscard]] inline EplbLayer even_split_rebalance_layer(std::span<const double> weights, int num_physical,
                                                          int num_groups, int num_nodes, int num_gpus,
                                                          int kick_rounds = -1) {
  const int E = static_cast<int>(weights.size());
  detail::require(num_groups > 0 && num_nodes > 0 && num_gpus > 0,
                  "even_split: groups, nodes and GPUs must be positive, got ", num_groups, ", ", num_nodes, ", ",
                  num_gpus);
  detail::require(num_gpus % num_nodes == 0, "even_split: ", num_gpus, " GPUs do not divide into ", num_nodes,
                  " nodes");
  detail::require(num_physical % num_gpus == 0, "even_split: ", num_physical, " physical slots do not divide over ",
                  num_gpus, " GPUs");
  detail::require(E > 0 && num_physical >= E, "even_split: ", num_physical, " physical slots for ", E, " experts");
  const int S = num_physical / num_gpus;
  detail::require(S <= E, "even_split: ", S, " slots per GPU exceed the ", E, " experts (no GPU holds two copies)");
  for (int e = 0; e < E; ++e)
    detail::require(std::isfinite(weights[e]) && weights[e] >= 0, "even_split: weight of expert ", e, " is ",
                    weights[e], ", not a finite non-negative number");

  // EPLB's own result and its peak, when EPLB's shape rules admit the arguments.
  const int eplb_groups = num_groups % num_nodes == 0 ? num_groups : 1;
  const bool have_eplb = E % eplb_groups == 0;
  detail::EvenSplitState theirs(weights, num_gpus, S);
  double eplb_peak = std::numeric_limits<double>::infinity();
  if (have_eplb) {
    theirs.assign(eplb_rebalance_layer(weights, num_physical, num_groups, num_nodes, num_gpus).phys_to_log);
    eplb_peak = theirs.peak();
  }

  detail::EvenSplitState best(weights, num_gpus, S);
  best.assign(detail::distinct_packing(weights, detail::greedy_counts(weights, num_gpus, num_physical), num_gpus, S));
  detail::lower_peak(best);
  // Second start, where the first did not reach EPLB's peak: EPLB's result, its duplicates removed without
  // raising its peak where that works (then the result is at most EPLB's peak), else by the least harmful moves.
  if (have_eplb && best.peak() > eplb_peak) {
    detail::EvenSplitState relaxed = theirs;
    detail::EvenSplitState *start = detail::remove_duplicates(theirs, true)     ? &theirs
                                    : detail::remove_duplicates(relaxed, false) ? &relaxed
                                                                                : nullptr;
    if (start != nullptr) {
      detail::lower_peak(*start);
      if (start->peak() < best.peak()) best = *start;
    }
  }
  // Still above: EPLB's duplicates split an expert unevenly over GPUs, which a placement without duplicates
  // cannot always match; kicks and descents search on, for a bounded number of rounds.
  if (best.peak() > eplb_peak) {
    const int rounds = kick_rounds >= 0 ? kick_rounds : std::clamp(4'000'000 / (num_physical * S), 100, 4000);
    detail::kick_and_descend(best, eplb_peak, rounds);
  }

  EplbLayer out;
  out.phys_to_log = std::move(best.p2l_);
  for (int g = 0; g < num_gpus; ++g)
    std::sort(out.phys_to_log.begin() + static_cast<std::ptrdiff_t>(g) * S,
              out.phys_to_log.begin() + static_cast<std::ptrdiff_t>(g + 1) * S);
  out.replica_count.assign(static_cast<std::size_t>(E), 0);
  out.replica_rank.resize(out.phys_to_log.size());
  for (std::size_t p = 0; p < out.phys_to_log.size(); ++p)
    out.replica_rank[p] = out.replica_count[out.phys_to_log[p]]++;
  return out;
}

/// `even_split_rebalance_layer` for every layer of `weights` (`[layers][experts]`, C order).
[[nodiscard]] inline std::vector<EplbLayer> even_split_rebalance(std::span<const double> weights, int num_layers,
                                                                 int num_experts, int num_physical, int num_groups,
                                                                 int num_nodes, int num_gpus) {
  detail::require(num_layers >= 0 && num_experts > 0 &&
                      weights.size() == static_cast<std::size_t>(num_layers) * num_experts,
                  "even_split: ", weights.size(), " weights for ", num_layers, " layers x ", num_experts, " experts");
  std::vector<EplbLayer> out(static_cast<std::size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l)
    out[l] = even_split_rebalance_layer(weights.subspan(static_cast<std::size_t>(l) * num_experts, num_experts),
                                        num_physical, num_groups, num_nodes, num_gpus);
  return out;
}

} // namespace v0
} // namespace foremoe
