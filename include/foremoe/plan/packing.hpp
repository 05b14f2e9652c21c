#pragma once
/// @file
/// Routing-aware micro-batch packing: which sequences of an optimizer step form which micro-batch.
///
/// Gradient accumulation sums over the whole mini-batch, so the assignment of sequences to (micro-step, rank) does
/// not change the update (as long as the loss is normalised over the mini-batch, not per micro-batch). Trainers
/// already re-pack by token count (verl's `rearrange_micro_batches`); with routing replay every sequence's per-layer
/// expert histogram is known too, so sequences can be packed so that every micro-step's expert load is close to the
/// step's share, and a step-level placement is then near-balanced in every micro-step.
///
/// The model. `S` sequences with lengths `len[s]` and histograms `h[s, l, e]` (routed tokens of sequence `s` to
/// expert `e` in layer `l`); `M` micro-steps of `R` micro-batches each (one per data-parallel rank), every
/// micro-batch holding at most `token_budget` tokens. All ranks' micro-batches of micro-step `m` run together, so the
/// expert load of micro-step `m` is the sum over its sequences. Under a placement (`gpu_of[l, e]`, the GPU that
/// serves expert `e` of layer `l`; none given: every expert its own column) the per-GPU load is
/// `G(m, l, g) = sum of h[s, l, e] over sequences s of m and experts e on g`, and the objective is the squared
/// deviation from the step's share
///
///     J = sum over m, l, g of (G(m, l, g) - T(l, g))^2,   T(l, g) = (sum over m of G(m, l, g)) / M,
///
/// a smooth stand-in for the slowest GPU of every micro-step (its maximum is what a step waits for; the tests and
/// the benchmark report that too).
///
/// The algorithm (deterministic):
/// 1. *Start*: the trainer's packing if given, else `pack_by_tokens` (longest first to the micro-batch with the
///    fewest tokens that has room, verl-style); either must respect the budget.
/// 2. *Greedy*: longest sequence first, each to the micro-step whose J grows least among those with a micro-batch
///    that has room (best fit inside the micro-step). Kept only if it places every sequence and has a lower J.
/// 3. *Local search*, first improvement, at most `max_passes` passes over the sequences (longest first) and at most
///    `search_work` dot products of histogram rows (a deterministic budget; the default is four greedy passes' worth,
///    `4 S M`, since on the benchmark's steps the greedy start leaves little to gain: `BM_Packing`): move a
///    sequence to the micro-step that lowers J most where it fits; else swap it with a sequence of that micro-step
///    when both micro-batches keep to the budget and J drops. Every step strictly lowers J, so the result is never
///    worse than the start: in particular never worse than the trainer's own packing.
/// 4. *Ranks*: each micro-step's sequences are dealt again to its ranks, longest first to the rank with the fewest
///    tokens, where that keeps every micro-batch within the budget and the fullest no fuller (J is unchanged: it
///    depends only on the micro-steps), so that per-rank work evens out within each micro-step.
/// The change of J for a move or swap is exact: moving a vector `d` from micro-step `a` to `b` changes J by
/// `2 d.(G_b - G_a) + 2 |d|^2` (the shares T do not change).
///
/// Cost per pass: O(S (M + S/M) L G) arithmetic on the compressed histograms (`bench_plan`'s `BM_Packing`).

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/limits.hpp"

namespace foremoe {
inline namespace v0 {

/// How a step's sequences are packed into micro-batches: the choice every front end offers (`--packing`: the
/// synthetic batch's `SyntheticConfig::packing`, `foremoe plan --ids`).
enum class BatchPacking {
  none,    ///< not re-packed: the trainer's layout (the generator's), or the order given (`plan --ids`)
  tokens,  ///< `pack_by_tokens`: longest first to the micro-batch with the fewest tokens (verl-style)
  routing, ///< `pack_by_routing`: every micro-step's loads close to the step's share
};

/// The names of `BatchPacking`'s values, in order.
inline constexpr std::array<std::string_view, 3> batch_packing_names{"none", "tokens", "routing"};

[[nodiscard]] inline std::string_view to_string(BatchPacking p) noexcept {
  return batch_packing_names[static_cast<std::size_t>(p)];
}

/// The packing named `name`; throws `Error` "`who` must be one of none, tokens, routing, got 'name'".
[[nodiscard]] inline BatchPacking parse_batch_packing(std::string_view name, std::string_view who) {
  return detail::enum_from_name<BatchPacking>(batch_packing_names, name, who);
}

/// Bumped whenever `pack_by_tokens` or `pack_by_routing` may return another packing for the same input, so that
/// loads cached under a packing (the simulator's load cache) are not reused across such a change.
inline constexpr int packing_version = 1;

/// The per-sequence routing of one optimizer step.
struct PackingInput {
  std::int64_t layers = 0, experts = 0;
  std::span<const std::int64_t> lengths;    ///< `[S]` tokens per sequence, each >= 1
  std::span<const std::int64_t> histograms; ///< `[S, layers, experts]` routed tokens per expert, each >= 0
  [[nodiscard]] std::int64_t sequences() const noexcept { return static_cast<std::int64_t>(lengths.size()); }
};

/// The trainer's micro-batch layout: `micro_steps` x `ranks` micro-batches of at most `token_budget` tokens.
struct PackingShape {
  std::int64_t micro_steps = 1, ranks = 1, token_budget = 0;
};

/// Options of `pack_by_routing`.
struct PackingOptions {
  /// `[layers, experts]` the GPU serving each expert (a placement), or empty: every expert counts on its own.
  std::span<const std::int32_t> gpu_of;
  std::int64_t gpus = 0; ///< GPUs that `gpu_of` names (ids in [0, gpus)); ignored without `gpu_of`
  int max_passes = 8;    ///< local-search passes at most
  /// Local-search work at most, in dot products of two compressed histogram rows; -1: `4 x sequences x micro_steps`.
  std::int64_t search_work = -1;
};

/// Where each sequence runs: `micro_step[s]` in [0, M), `rank[s]` in [0, R).
struct Packing {
  std::vector<std::int32_t> micro_step, rank;
  /// Set by `pack_by_routing`: the objective J of its start and of this packing (`packing_deviation`'s values).
  double start_deviation = 0, deviation = 0;
  /// Per micro-step, the sequence indices (ascending), derived from `micro_step`.
  [[nodiscard]] std::vector<std::vector<std::int64_t>> by_micro_step(std::int64_t micro_steps) const {
    std::vector<std::vector<std::int64_t>> out(static_cast<std::size_t>(micro_steps));
    for (std::size_t s = 0; s < micro_step.size(); ++s)
      out[static_cast<std::size_t>(micro_step[s])].push_back(static_cast<std::int64_t>(s));
    return out;
  }
};

namespace detail {

inline void check_packing_shape(const PackingShape &shape, std::span<const std::int64_t> lengths,
                                std::string_view who) {
  require(shape.micro_steps >= 1 && shape.micro_steps <= (std::int64_t{1} << 20), who, ": micro_steps ",
          shape.micro_steps, " is outside [1, 2^20]");
  require(shape.ranks >= 1 && shape.ranks <= (std::int64_t{1} << 20), who, ": ranks ", shape.ranks,
          " is outside [1, 2^20]");
  require(shape.micro_steps * shape.ranks <= (std::int64_t{1} << 24), who,
          ": micro_steps x ranks = ", shape.micro_steps * shape.ranks, " micro-batches is more than 2^24");
  require(shape.token_budget >= 1, who, ": token_budget ", shape.token_budget, " must be at least 1");
  std::int64_t total = 0;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    require(lengths[s] >= 1, who, ": sequence ", s, " has length ", lengths[s], " (must be at least 1)");
    require(lengths[s] <= shape.token_budget, who, ": sequence ", s, " has ", lengths[s],
            " tokens, more than the micro-batch token budget ", shape.token_budget);
    require(lengths[s] <= limits::max_load_total - total, who, ": the sequences' lengths sum past 2^42");
    total += lengths[s];
  }
  const std::int64_t room = limits::saturating_product(
      {{"micro_steps", shape.micro_steps}, {"ranks", shape.ranks}, {"token_budget", shape.token_budget}});
  require(total <= room, who, ": ", total, " tokens do not fit in ", shape.micro_steps, " x ", shape.ranks,
          " micro-batches of ", shape.token_budget, " tokens");
}

/// Sequence indices, longest first (ties: lower index first).
[[nodiscard]] inline std::vector<std::int64_t> longest_first(std::span<const std::int64_t> lengths) {
  std::vector<std::int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return lengths[static_cast<std::size_t>(a)] > lengths[static_cast<std::size_t>(b)];
  });
  return order;
}

/// The compressed histograms `[S, D]` (D = layers x columns) and the step's share `[D]`.
struct PackingState {
  std::int64_t S = 0, M = 0, R = 0, D = 0, budget = 0;
  std::vector<double> h;          ///< [S, D]
  std::vector<double> g;          ///< [M, D] per-micro-step loads
  std::vector<double> target;     ///< [D]
  std::vector<std::int64_t> fill; ///< [M, R] tokens per micro-batch
  std::span<const std::int64_t> len;

  [[nodiscard]] const double *row(std::int64_t s) const { return h.data() + s * D; }
  [[nodiscard]] double *gm(std::int64_t m) { return g.data() + m * D; }
  [[nodiscard]] const double *gm(std::int64_t m) const { return g.data() + m * D; }
  [[nodiscard]] std::int64_t &bin(std::int64_t m, std::int64_t r) { return fill[static_cast<std::size_t>(m * R + r)]; }

  /// The rank of micro-step `m` whose micro-batch has room for `need` more tokens with the least left (best fit),
  /// or -1.
  [[nodiscard]] std::int64_t fit(std::int64_t m, std::int64_t need, std::int64_t freed_rank = -1,
                                 std::int64_t freed = 0) {
    std::int64_t best = -1, best_left = std::numeric_limits<std::int64_t>::max();
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int64_t left = budget - bin(m, r) + (r == freed_rank ? freed : 0);
      if (left >= need && left < best_left) best = r, best_left = left;
    }
    return best;
  }

  /// J of the current loads.
  [[nodiscard]] double objective() const {
    double j = 0;
    for (std::int64_t m = 0; m < M; ++m) {
      const double *x = gm(m);
      for (std::int64_t d = 0; d < D; ++d)
        j += (x[d] - target[static_cast<std::size_t>(d)]) * (x[d] - target[static_cast<std::size_t>(d)]);
    }
    return j;
  }
};

[[nodiscard]] inline PackingState packing_state(const PackingInput &in, const PackingShape &shape,
                                                const PackingOptions &opt, std::string_view who) {
  const std::int64_t S = in.sequences();
  require(in.layers >= 1, who, ": layers ", in.layers, " must be at least 1");
  require(in.experts >= 1, who, ": experts ", in.experts, " must be at least 1");
  limits::require_product(who, {{"sequences", S}, {"layers", in.layers}, {"experts", in.experts}},
                          limits::max_load_cells, "histogram cells");
  require(static_cast<std::int64_t>(in.histograms.size()) == S * in.layers * in.experts, who, ": histograms hold ",
          in.histograms.size(), " values, expected sequences x layers x experts = ", S, " x ", in.layers, " x ",
          in.experts);
  check_packing_shape(shape, in.lengths, who);
  const bool placed = !opt.gpu_of.empty();
  if (placed) {
    require(static_cast<std::int64_t>(opt.gpu_of.size()) == in.layers * in.experts, who, ": gpu_of holds ",
            opt.gpu_of.size(), " values, expected layers x experts = ", in.layers * in.experts);
    require(opt.gpus >= 1 && opt.gpus <= (std::int64_t{1} << 20), who, ": gpus ", opt.gpus, " is outside [1, 2^20]");
    for (std::size_t i = 0; i < opt.gpu_of.size(); ++i)
      require(opt.gpu_of[i] >= 0 && opt.gpu_of[i] < opt.gpus, who, ": gpu_of[layer ",
              static_cast<std::int64_t>(i) / in.experts, ", expert ", static_cast<std::int64_t>(i) % in.experts,
              "] = ", opt.gpu_of[i], " is outside [0, ", opt.gpus, ")");
  }
  require(opt.max_passes >= 0 && opt.max_passes <= 1000, who, ": max_passes ", opt.max_passes, " is outside [0, 1000]");
  require(opt.search_work >= -1, who, ": search_work ", opt.search_work, " must be -1 (the default) or at least 0");
  PackingState st;
  st.S = S, st.M = shape.micro_steps, st.R = shape.ranks, st.budget = shape.token_budget, st.len = in.lengths;
  const std::int64_t cols = placed ? opt.gpus : in.experts;
  st.D = in.layers * cols;
  st.h.assign(static_cast<std::size_t>(S * st.D), 0.0);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t l = 0; l < in.layers; ++l)
      for (std::int64_t e = 0; e < in.experts; ++e) {
        const std::int64_t v = in.histograms[static_cast<std::size_t>((s * in.layers + l) * in.experts + e)];
        require(v >= 0 && v <= limits::max_load_total, who, ": histograms[sequence ", s, ", layer ", l, ", expert ", e,
                "] = ", v, " is outside [0, 2^42]");
        const std::int64_t c = placed ? opt.gpu_of[static_cast<std::size_t>(l * in.experts + e)] : e;
        st.h[static_cast<std::size_t>(s * st.D + l * cols + c)] += static_cast<double>(v);
      }
  st.target.assign(static_cast<std::size_t>(st.D), 0.0);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t d = 0; d < st.D; ++d)
      st.target[static_cast<std::size_t>(d)] += st.h[static_cast<std::size_t>(s * st.D + d)];
  for (double &t : st.target)
    t /= static_cast<double>(st.M);
  return st;
}

/// Loads the assignment `p` into `st` (fill and per-micro-step loads), checking it.
inline void load_packing(PackingState &st, const Packing &p, std::string_view who) {
  require(static_cast<std::int64_t>(p.micro_step.size()) == st.S && static_cast<std::int64_t>(p.rank.size()) == st.S,
          who, ": the packing places ", p.micro_step.size(), " sequences (ranks: ", p.rank.size(), "), expected ",
          st.S);
  st.fill.assign(static_cast<std::size_t>(st.M * st.R), 0);
  st.g.assign(static_cast<std::size_t>(st.M * st.D), 0.0);
  for (std::int64_t s = 0; s < st.S; ++s) {
    const std::int64_t m = p.micro_step[static_cast<std::size_t>(s)], r = p.rank[static_cast<std::size_t>(s)];
    require(m >= 0 && m < st.M && r >= 0 && r < st.R, who, ": sequence ", s, " is placed at (micro-step ", m, ", rank ",
            r, "), outside ", st.M, " x ", st.R);
    st.bin(m, r) += st.len[static_cast<std::size_t>(s)];
    require(st.bin(m, r) <= st.budget, who, ": micro-batch (micro-step ", m, ", rank ", r, ") holds more than ",
            st.budget, " tokens");
    double *x = st.gm(m);
    const double *y = st.row(s);
    for (std::int64_t d = 0; d < st.D; ++d)
      x[d] += y[d];
  }
}

} // namespace detail

namespace detail {

/// Step 4 of `pack_by_routing`: `order` is every sequence, longest first (`longest_first`).
inline void balance_ranks(Packing &p, std::span<const std::int64_t> lengths, const PackingShape &shape,
                          std::span<const std::int64_t> order) {
  const auto R = static_cast<std::size_t>(shape.ranks);
  std::vector<std::vector<std::int64_t>> members(static_cast<std::size_t>(shape.micro_steps));
  for (const std::int64_t s : order) // each micro-step's sequences, longest first
    members[static_cast<std::size_t>(p.micro_step[static_cast<std::size_t>(s)])].push_back(s);
  std::vector<std::int64_t> old_fill(R), fill(R);
  std::vector<std::int32_t> rank_of;
  for (const std::vector<std::int64_t> &seqs : members) {
    std::fill(old_fill.begin(), old_fill.end(), 0);
    std::fill(fill.begin(), fill.end(), 0);
    rank_of.clear();
    bool fits = true;
    for (const std::int64_t s : seqs) {
      const auto su = static_cast<std::size_t>(s);
      old_fill[static_cast<std::size_t>(p.rank[su])] += lengths[su];
      const auto r = static_cast<std::size_t>(std::min_element(fill.begin(), fill.end()) - fill.begin());
      fill[r] += lengths[su];
      fits = fits && fill[r] <= shape.token_budget;
      rank_of.push_back(static_cast<std::int32_t>(r));
    }
    if (!fits || *std::max_element(fill.begin(), fill.end()) > *std::max_element(old_fill.begin(), old_fill.end()))
      continue;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      p.rank[static_cast<std::size_t>(seqs[i])] = rank_of[i];
  }
}

} // namespace detail

/// The token-balanced packing trainers use (verl's `rearrange_micro_batches` in spirit): longest sequence first, to
/// the micro-batch with the fewest tokens that has room (ties: lower micro-step, then lower rank). Throws `Error`
/// naming the value for a bad shape, a sequence longer than the budget, or when this greedy cannot fit everything.
[[nodiscard]] inline Packing pack_by_tokens(std::span<const std::int64_t> lengths, const PackingShape &shape) {
  constexpr std::string_view who = "pack_by_tokens";
  detail::check_packing_shape(shape, lengths, who);
  const std::int64_t bins = shape.micro_steps * shape.ranks;
  std::vector<std::int64_t> fill(static_cast<std::size_t>(bins), 0);
  Packing p;
  p.micro_step.assign(lengths.size(), 0);
  p.rank.assign(lengths.size(), 0);
  for (const std::int64_t s : detail::longest_first(lengths)) {
    const std::int64_t need = lengths[static_cast<std::size_t>(s)];
    std::int64_t best = -1;
    for (std::int64_t b = 0; b < bins; ++b)
      if (fill[static_cast<std::size_t>(b)] + need <= shape.token_budget &&
          (best < 0 || fill[static_cast<std::size_t>(b)] < fill[static_cast<std::size_t>(best)]))
        best = b;
    detail::require(best >= 0, who, ": sequence ", s, " (", need, " tokens) fits in no micro-batch of ",
                    shape.token_budget, " tokens after the longer ones: give a packing or a larger budget");
    fill[static_cast<std::size_t>(best)] += need;
    p.micro_step[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(best % shape.micro_steps);
    p.rank[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(best / shape.micro_steps);
  }
  return p;
}

/// The objective J of `p` (see the file comment); throws `Error` for an invalid packing or input.
[[nodiscard]] inline double packing_deviation(const PackingInput &in, const PackingShape &shape, const Packing &p,
                                              const PackingOptions &opt = {}) {
  detail::PackingState st = detail::packing_state(in, shape, opt, "packing_deviation");
  detail::load_packing(st, p, "packing_deviation");
  return st.objective();
}

/// Per micro-step and layer, the largest column load over the mean column load (under `opt`'s placement, if any):
/// `[M, layers]`, row-major; a layer with no load gives 1.
[[nodiscard]] inline std::vector<double> packing_imbalance(const PackingInput &in, const PackingShape &shape,
                                                           const Packing &p, const PackingOptions &opt = {}) {
  detail::PackingState st = detail::packing_state(in, shape, opt, "packing_imbalance");
  detail::load_packing(st, p, "packing_imbalance");
  const std::int64_t cols = st.D / in.layers;
  std::vector<double> out(static_cast<std::size_t>(st.M * in.layers), 1.0);
  for (std::int64_t m = 0; m < st.M; ++m)
    for (std::int64_t l = 0; l < in.layers; ++l) {
      const double *x = st.gm(m) + l * cols;
      const double sum = std::accumulate(x, x + cols, 0.0);
      if (sum > 0)
        out[static_cast<std::size_t>(m * in.layers + l)] =
            *std::max_element(x, x + cols) / (sum / static_cast<double>(cols));
    }
  return out;
}

/// Routing-aware packing (see the file comment): starts from `start` (the trainer's packing; empty: `pack_by_tokens`)
/// and returns a packing with every micro-batch within the budget and J never above the start's. Throws `Error`
/// naming the value for bad input or an invalid start.
[[nodiscard]] inline Packing pack_by_routing(const PackingInput &in, const PackingShape &shape,
                                             const PackingOptions &opt = {}, const Packing &start = {}) {
  constexpr std::string_view who = "pack_by_routing";
  detail::PackingState st = detail::packing_state(in, shape, opt, who);
  Packing best = start.micro_step.empty() && start.rank.empty() ? pack_by_tokens(in.lengths, shape) : start;
  detail::load_packing(st, best, who);
  double best_j = st.objective();
  const std::vector<std::int64_t> order = detail::longest_first(in.lengths);
  const std::int64_t S = st.S, M = st.M, D = st.D;
  std::int64_t work = 0;
  const std::int64_t work_limit = opt.search_work >= 0 ? opt.search_work : 4 * S * M;
  const auto dot = [D, &work](const double *a, const double *b) {
    ++work;
    double s = 0;
    for (std::int64_t d = 0; d < D; ++d)
      s += a[d] * b[d];
    return s;
  };

  // Squared norms of the rows, for the greedy and the search.
  std::vector<double> norms(static_cast<std::size_t>(S));
  for (std::int64_t s = 0; s < S; ++s) {
    const double *y = st.row(s);
    double n2 = 0;
    for (std::int64_t d = 0; d < D; ++d)
      n2 += y[d] * y[d];
    norms[static_cast<std::size_t>(s)] = n2;
  }
  const double start_j = best_j;

  // 2. Greedy construction, in `st`'s loads; the start's are set aside and put back if the greedy does not win.
  {
    std::vector<double> start_g(st.g.size(), 0.0);
    std::vector<std::int64_t> start_fill(st.fill.size(), 0);
    std::swap(st.g, start_g);
    std::swap(st.fill, start_fill);
    Packing gp;
    gp.micro_step.assign(static_cast<std::size_t>(S), 0);
    gp.rank.assign(static_cast<std::size_t>(S), 0);
    bool placed_all = true;
    for (const std::int64_t s : order) {
      const double *y = st.row(s);
      const double yy = norms[static_cast<std::size_t>(s)];
      std::int64_t bm = -1, br = -1;
      double bd = std::numeric_limits<double>::infinity();
      for (std::int64_t m = 0; m < M; ++m) {
        const std::int64_t r = st.fit(m, in.lengths[static_cast<std::size_t>(s)]);
        if (r < 0) continue;
        // (G + y - T)^2 - (G - T)^2 summed: 2 y.(G - T) + |y|^2
        const double *x = st.gm(m);
        double d2 = 0;
        for (std::int64_t d = 0; d < D; ++d)
          d2 += y[d] * (x[d] - st.target[static_cast<std::size_t>(d)]);
        const double delta = 2 * d2 + yy;
        if (delta < bd) bd = delta, bm = m, br = r;
      }
      if (bm < 0) {
        placed_all = false;
        break;
      }
      st.bin(bm, br) += in.lengths[static_cast<std::size_t>(s)];
      double *x = st.gm(bm);
      for (std::int64_t d = 0; d < D; ++d)
        x[d] += y[d];
      gp.micro_step[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(bm);
      gp.rank[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(br);
    }
    const double j = placed_all ? st.objective() : std::numeric_limits<double>::infinity();
    if (j < best_j) {
      best = std::move(gp), best_j = j;
    } else {
      st.g = std::move(start_g);
      st.fill = std::move(start_fill);
    }
  }

  // 3. Local search: moves, else swaps, each strictly lowering J.
  std::vector<std::vector<std::int64_t>> members = best.by_micro_step(M);
  const auto remove_member = [&](std::int64_t m, std::int64_t s) {
    auto &v = members[static_cast<std::size_t>(m)];
    v.erase(std::find(v.begin(), v.end(), s));
  };
  std::vector<double> diff(static_cast<std::size_t>(D)), v(static_cast<std::size_t>(D));
  // A change must beat rounding: J's terms are sums of integers squared, so relative to J's scale.
  const double eps = 1e-9 * std::max(1.0, best_j);
  for (int pass = 0; pass < opt.max_passes && work < work_limit; ++pass) {
    bool improved = false;
    for (const std::int64_t s : order) {
      if (work >= work_limit) break;
      const std::int64_t a = best.micro_step[static_cast<std::size_t>(s)];
      const std::int64_t ra = best.rank[static_cast<std::size_t>(s)];
      const std::int64_t ls = in.lengths[static_cast<std::size_t>(s)];
      const double *y = st.row(s);
      const double yy = norms[static_cast<std::size_t>(s)];
      const double ya = dot(y, st.gm(a));
      // Moves: delta(a -> b) = 2 y.(G_b - G_a) + 2 |y|^2.
      std::int64_t want = -1, want_r = -1;
      double want_delta = -eps, free_best = std::numeric_limits<double>::infinity();
      std::int64_t free_b = -1;
      for (std::int64_t b = 0; b < M; ++b) {
        if (b == a) continue;
        const double delta = 2 * (dot(y, st.gm(b)) - ya) + 2 * yy;
        if (delta < free_best) free_best = delta, free_b = b;
        if (delta < want_delta) {
          const std::int64_t r = st.fit(b, ls);
          if (r >= 0) want_delta = delta, want = b, want_r = r;
        }
      }
      if (want >= 0) {
        double *xa = st.gm(a), *xb = st.gm(want);
        for (std::int64_t d = 0; d < D; ++d)
          xa[d] -= y[d], xb[d] += y[d];
        st.bin(a, ra) -= ls;
        st.bin(want, want_r) += ls;
        best.micro_step[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(want);
        best.rank[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(want_r);
        remove_member(a, s);
        members[static_cast<std::size_t>(want)].push_back(s);
        best_j += want_delta;
        improved = true;
        continue;
      }
      if (free_b < 0 || free_best >= 2 * yy) continue; // nowhere s would rather be
      // Swaps with a sequence t of micro-step b (the one s would rather be in): d = y - z moves a -> b,
      // delta = 2 d.(G_b - G_a) + 2 |d|^2.
      const std::int64_t b = free_b;
      const double *xa = st.gm(a), *xb = st.gm(b);
      for (std::int64_t d = 0; d < D; ++d)
        v[static_cast<std::size_t>(d)] = xb[d] - xa[d];
      const double yv = dot(y, v.data());
      std::int64_t pick = -1, pick_ra = -1, pick_rb = -1;
      double pick_delta = -eps;
      for (const std::int64_t t : members[static_cast<std::size_t>(b)]) {
        const std::int64_t lt = in.lengths[static_cast<std::size_t>(t)];
        const std::int64_t rb = best.rank[static_cast<std::size_t>(t)];
        // s takes t's place in b (its micro-batch or another with room), t takes s's in a.
        const std::int64_t r_in_b = st.fit(b, ls, rb, lt);
        const std::int64_t r_in_a = st.fit(a, lt, ra, ls);
        if (r_in_b < 0 || r_in_a < 0) continue;
        const double *z = st.row(t);
        const double zz = norms[static_cast<std::size_t>(t)], yz = dot(y, z), zv = dot(z, v.data());
        const double delta = 2 * (yv - zv) + 2 * (yy - 2 * yz + zz);
        if (delta < pick_delta) pick_delta = delta, pick = t, pick_ra = r_in_a, pick_rb = r_in_b;
      }
      if (pick < 0) continue;
      const std::int64_t t = pick, lt = in.lengths[static_cast<std::size_t>(t)];
      const std::int64_t rb = best.rank[static_cast<std::size_t>(t)];
      const double *z = st.row(t);
      double *ga = st.gm(a), *gb = st.gm(b);
      for (std::int64_t d = 0; d < D; ++d) {
        const double dd = y[d] - z[d];
        ga[d] -= dd, gb[d] += dd;
      }
      st.bin(a, ra) -= ls;
      st.bin(b, rb) -= lt;
      st.bin(b, pick_rb) += ls;
      st.bin(a, pick_ra) += lt;
      best.micro_step[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(b);
      best.rank[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(pick_rb);
      best.micro_step[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(a);
      best.rank[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(pick_ra);
      remove_member(a, s);
      remove_member(b, t);
      members[static_cast<std::size_t>(b)].push_back(s);
      members[static_cast<std::size_t>(a)].push_back(t);
      best_j += pick_delta;
      improved = true;
    }
    if (!improved) break;
  }
  // 4. Ranks: J depends only on the micro-step a sequence runs in, so each micro-step's sequences are dealt again
  // to its ranks, longest first to the one with the fewest tokens, and that dealing is kept where every
  // micro-batch stays within the budget and the fullest is no fuller: per-rank work (attention, the dense layers)
  // then evens out, where the search's best fit had filled some micro-batches and left others empty.
  detail::balance_ranks(best, in.lengths, shape, order);
  best.start_deviation = start_j;
  best.deviation = st.objective();
  return best;
}

} // namespace v0
} // namespace foremoe
