// `foremoe plan`: plans the micro-steps of one RL step from a load file.

#include <chrono>
#include <filesystem>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <utility>

#include "command.hpp"
#include "foremoe/config/documents.hpp"
#include "foremoe/config/placement_export.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/core/limits.hpp"
#include "foremoe/plan/evaluate.hpp"
#include "foremoe/plan/packing.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/split.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/plan/traffic.hpp"
#include "foremoe/trace/count.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/transfer/transfer_plan.hpp"

namespace foremoe::cli {
namespace {

namespace fs = std::filesystem;
using foremoe::detail::require;

/// The options that only `--ids` takes (its per-sequence input, the packing and its outputs).
constexpr const char *ids_only_options[] = {
    "sequences",  "experts",     "dense-layers", "micro-steps", "ranks",         "token-budget",     "packing",
    "packing-by", "out-packing", "out-loads",    "node-hits",   "traffic-aware", "traffic-tolerance"};

/// `--packing none`: the sequences in the order given fill the micro-batches in execution order (micro-step 0's
/// ranks 0 to R-1, then micro-step 1's, ...), each closed when the next sequence does not fit in it.
Packing pack_in_order(std::span<const std::int64_t> lengths, const PackingShape &shape) {
  foremoe::detail::check_packing_shape(shape, lengths, "--packing none");
  Packing p;
  p.micro_step.assign(lengths.size(), 0);
  p.rank.assign(lengths.size(), 0);
  std::int64_t bin = 0, fill = 0;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    if (fill + lengths[s] > shape.token_budget) ++bin, fill = 0;
    require(bin < shape.micro_steps * shape.ranks, "--packing none: sequence ", s, " (", lengths[s],
            " tokens) is past the last of the ", shape.micro_steps, " x ", shape.ranks, " micro-batches of ",
            shape.token_budget,
            " tokens when they are filled in the order given; use --packing tokens or routing, "
            "or a larger --token-budget");
    fill += lengths[s];
    p.micro_step[s] = static_cast<std::int32_t>(bin / shape.ranks);
    p.rank[s] = static_cast<std::int32_t>(bin % shape.ranks);
  }
  return p;
}

/// The sequences' lengths from their token offsets `[S + 1]`, checked against the ids' token count; `name` says
/// where the offsets came from.
std::vector<std::int64_t> sequence_lengths(std::span<const std::int64_t> offsets, std::int64_t tokens,
                                           const std::string &name) {
  require(offsets.size() >= 2, name, " holds ", offsets.size(),
          " offsets: the sequences' token offsets [S + 1] start at 0 and end at the ids' ", tokens, " tokens");
  require(offsets.front() == 0, name, ": offsets[0] is ", offsets.front(), ", must be 0");
  std::vector<std::int64_t> lengths(offsets.size() - 1);
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    require(offsets[s + 1] > offsets[s], name, ": offsets must increase (every sequence holds a token), but offsets[",
            s, "] = ", offsets[s], " and offsets[", s + 1, "] = ", offsets[s + 1]);
    lengths[s] = offsets[s + 1] - offsets[s];
  }
  require(offsets.back() == tokens, name, " ends at token ", offsets.back(), " but --ids holds ", tokens, " tokens");
  return lengths;
}

/// Per micro-step, the largest of its layers' max/mean expert loads (`packing_imbalance`'s `[M, layers]` rows).
std::vector<double> worst_layer(const std::vector<double> &by_layer, std::int64_t layers) {
  std::vector<double> out;
  for (std::size_t i = 0; i < by_layer.size(); i += static_cast<std::size_t>(layers))
    out.push_back(*std::max_element(by_layer.begin() + static_cast<std::ptrdiff_t>(i),
                                    by_layer.begin() + static_cast<std::ptrdiff_t>(i) + layers));
  return out;
}

/// `[M][layers]` rows of a row-major `[M * layers]` vector, for JSON.
json::Value rows_json(const std::vector<double> &v, std::int64_t layers) {
  json::Value out = json::Array{};
  for (std::size_t i = 0; i < v.size(); i += static_cast<std::size_t>(layers))
    out.push_back(std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(i),
                                      v.begin() + static_cast<std::ptrdiff_t>(i) + layers));
  return out;
}

/// What `--ids` gives: the loads of the packed batch, the packing as a JSON document and the lines to print, and
/// what `--node-hits` maps again: the ids, the sequences' token offsets and each micro-step's sequences per rank.
struct PackedBatch {
  LoadTensor loads;
  std::string document, report;
  RoutedIdsFile ids;
  std::vector<std::int64_t> offsets;                        ///< `[S + 1]` the sequences' token offsets
  std::vector<std::vector<std::vector<std::int64_t>>> seqs; ///< `[M][R]` the sequences of each micro-batch
  int dense_layers = 0, experts = 0;
};

/// Counts every sequence's expert histogram from the routed ids, packs the sequences into the trainer's
/// micro-batches (`--packing`) and sums the histograms per micro-step: the loads the packed batch runs.
PackedBatch pack_ids(const Args &a, const fs::path &ids_path, const fs::path &seq_path, const std::string &seq_name,
                     const std::string &method, const PackingShape &shape, const Topology &topo,
                     const PlannerOptions &opts, std::ostream &err) {
  PackedBatch out;
  out.ids = read_routed_ids_npy(ids_path);
  const RoutedView view = out.ids.view();
  const std::vector<std::int64_t> offsets = read_offsets_npy(seq_path);
  const std::vector<std::int64_t> lengths = sequence_lengths(offsets, view.num_tokens(), seq_name);
  const auto num_seqs = static_cast<std::int64_t>(lengths.size());
  // The budget first: no sequence above it and all of them within the micro-batches' room.
  foremoe::detail::check_packing_shape(shape, lengths, "--token-budget");

  CountOptions o;
  const int dense = static_cast<int>(a.integer("dense-layers", 0, 4096));
  if (dense > 0) {
    if (dense >= view.num_layers())
      throw UsageError{"--dense-layers " + std::to_string(dense) + " leaves no MoE layer of the ids' " +
                       std::to_string(view.num_layers())};
    o.layer_map = LayerMap::dense_prefix(view.num_layers(), dense);
  }
  const std::int64_t layers = view.num_layers() - dense;
  if (a.has("experts")) {
    o.num_experts = static_cast<int>(a.integer("experts", 1, 32767));
  } else {
    o.num_experts = infer_num_experts(view, {});
    err << "--experts not given: using largest id + 1 = " << o.num_experts << "\n";
  }
  const std::int64_t experts = o.num_experts;
  const bool by_gpus = a.str("packing-by") == "gpus";
  // Sizes first: the histograms, the packed loads and the packer's work, before anything is allocated or run.
  limits::require_product("--ids", {{"sequences", num_seqs}, {"MoE layers", layers}, {"experts", experts}},
                          limits::max_load_cells, "histogram cells");
  limits::require_product("--micro-steps",
                          {{"micro-steps", shape.micro_steps}, {"MoE layers", layers}, {"experts", experts}},
                          limits::max_load_cells, "load cells");
  // Both packers look at every micro-batch for every sequence.
  if (method != "none")
    limits::require_product("--packing " + method,
                            {{"sequences", num_seqs}, {"micro-steps", shape.micro_steps}, {"ranks", shape.ranks}},
                            limits::max_packing_work, "packing work");
  if (method == "routing")
    limits::require_product("--packing routing",
                            {{"sequences", num_seqs},
                             {"micro-steps", shape.micro_steps},
                             {"MoE layers", layers},
                             {by_gpus ? "GPUs" : "experts", by_gpus ? topo.num_gpus() : experts}},
                            limits::max_packing_work, "packing work");
  o.microbatch_offsets = offsets;
  const LoadTensor hist = count_loads(view, o); // [S, layers, experts]: micro-steps of one sequence each

  PackingInput in;
  in.layers = layers;
  in.experts = experts;
  in.lengths = lengths;
  in.histograms = hist.totals();
  // The columns the packer balances: each GPU's load under the step's owners (the same for every packing, since
  // owners come from the step's totals), or each expert's.
  PackingOptions po;
  Planner::OwnerMap owners;
  std::vector<std::int32_t> gpu_of;
  if (by_gpus) {
    std::vector<std::int64_t> totals(static_cast<std::size_t>(layers * experts), 0);
    for (std::size_t i = 0; i < hist.totals().size(); ++i)
      totals[i % totals.size()] += hist.totals()[i];
    topo.validate(o.num_experts); // the owners' topology holds the experts
    owners = Planner(static_cast<int>(layers), static_cast<int>(experts), topo, opts).plan_owners(totals);
    for (const auto &row : owners)
      gpu_of.insert(gpu_of.end(), row.begin(), row.end());
    po.gpu_of = gpu_of;
    po.gpus = topo.num_gpus();
  }
  Packing start = method == "none" ? pack_in_order(lengths, shape) : pack_by_tokens(lengths, shape);
  Packing p = method == "routing" ? pack_by_routing(in, shape, po, start) : start;
  // pack_by_routing reports both deviations; the other packings are their own start.
  const bool routed = method == "routing";
  const double start_dev = routed ? p.start_deviation : packing_deviation(in, shape, start, po);
  const double dev = routed ? p.deviation : start_dev;
  const std::vector<double> start_imb = packing_imbalance(in, shape, start, po);
  const std::vector<double> imb = routed ? packing_imbalance(in, shape, p, po) : start_imb;

  out.loads = LoadTensor(static_cast<int>(shape.micro_steps), static_cast<int>(layers), static_cast<int>(experts));
  const std::span<const std::int64_t> h = hist.totals();
  const std::span<std::int64_t> loads = out.loads.totals();
  const std::size_t cells = static_cast<std::size_t>(layers * experts);
  std::vector<std::vector<std::vector<std::int64_t>>> batches(static_cast<std::size_t>(shape.micro_steps),
                                                              std::vector<std::vector<std::int64_t>>(shape.ranks));
  std::vector<std::vector<std::int64_t>> batch_tokens(static_cast<std::size_t>(shape.micro_steps),
                                                      std::vector<std::int64_t>(shape.ranks, 0));
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    const auto m = static_cast<std::size_t>(p.micro_step[s]), r = static_cast<std::size_t>(p.rank[s]);
    batches[m][r].push_back(static_cast<std::int64_t>(s));
    batch_tokens[m][r] += lengths[s];
    for (std::size_t c = 0; c < cells; ++c)
      loads[m * cells + c] += h[s * cells + c];
  }

  json::Value j;
  j["packing"] = method;
  j["start"] = method == "routing" ? "tokens" : method;
  j["sequences"] = num_seqs;
  j["tokens"] = view.num_tokens();
  j["micro_steps"] = shape.micro_steps;
  j["ranks"] = shape.ranks;
  j["token_budget"] = shape.token_budget;
  j["num_layers"] = layers;
  j["num_experts"] = experts;
  j["packing_by"] = by_gpus ? "gpus" : "experts";
  if (by_gpus) j["owner_gpu"] = owners;
  j["micro_step"] = p.micro_step;
  j["rank"] = p.rank;
  json::Value mb = json::Array{}, mt = json::Array{};
  for (std::size_t m = 0; m < batches.size(); ++m) {
    json::Value ranks = json::Array{};
    for (const auto &seqs : batches[m])
      ranks.push_back(seqs);
    mb.push_back(std::move(ranks));
    mt.push_back(batch_tokens[m]);
  }
  j["micro_batches"] = std::move(mb);
  j["micro_batch_tokens"] = std::move(mt);
  j["start_deviation"] = start_dev;
  j["deviation"] = dev;
  const std::vector<double> start_worst = worst_layer(start_imb, layers), worst = worst_layer(imb, layers);
  j["start_max_over_mean"] = start_worst;
  j["max_over_mean"] = worst;
  j["start_layer_max_over_mean"] = rows_json(start_imb, layers);
  j["layer_max_over_mean"] = rows_json(imb, layers);
  out.document = json::dump(j) + "\n";

  const BalanceStats before = balance_stats(start_worst), after = balance_stats(worst);
  std::ostringstream rep;
  rep << "packed " << num_seqs << " sequences (" << view.num_tokens() << " tokens) into " << shape.micro_steps
      << " micro-steps x " << shape.ranks << " ranks of at most " << shape.token_budget << " tokens with --packing "
      << method << "\n"
      << "  deviation from the step's share: " << std::setprecision(6) << start_dev << " ("
      << (method == "routing" ? "tokens" : method) << ") -> " << dev << "\n"
      << "  micro-step " << (by_gpus ? "GPU load under the step's owners" : "expert load")
      << ", max/mean of the worst layer: median " << std::fixed << std::setprecision(4) << before.median << " -> "
      << after.median << ", max " << before.max << " -> " << after.max << "\n";
  out.report = rep.str();
  out.offsets = offsets;
  out.seqs = std::move(batches);
  out.dense_layers = dense;
  out.experts = o.num_experts;
  return out;
}

/// `--node-hits`: the token-node hits of the packed micro-steps under their plans, per token map.
struct TokenMapHits {
  NodeHits positional;  ///< the plan's split by source (`split_by_source`), positional map: today's dispatch
  NodeHits node_affine; ///< the same split, node_affine map
  /// the plan's per-copy totals, node_affine choosing the split by source too (`home_offsets`, `source_split`),
  /// then mapped by source with node_affine under that split as the ranks' dispatch does
  NodeHits node_affine_split;
};

/// Maps every MoE layer of every packed micro-step under its plan with each token map and counts the node hits.
/// A micro-step's tokens are its micro-batches' in rank order; with one rank per GPU (`--ranks` = GPUs) rank `r`'s
/// tokens come from GPU `r`, otherwise the micro-step's tokens are cut into equal source ranges (as `count_loads`
/// splits a micro-step by source).
TokenMapHits token_map_hits(const PackedBatch &b, const StepPlan &sp, const Topology &topo) {
  const RoutedView view = b.ids.view();
  const int num_gpus = topo.num_gpus(), topk = view.topk(), experts = b.experts;
  TokenMapHits h;
  TokenMapOptions affine;
  affine.rule = TokenMapRule::node_affine;
  affine.topo = topo;
  std::vector<std::int32_t> ids, pos, aff;
  std::vector<std::int64_t> src_loads;
  for (std::size_t m = 0; m < b.seqs.size(); ++m) {
    std::vector<std::int64_t> tokens, rank_ends{0}; // the micro-step's tokens in rank order
    for (const auto &rank : b.seqs[m]) {
      for (const std::int64_t seq : rank)
        for (std::int64_t t = b.offsets[static_cast<std::size_t>(seq)];
             t < b.offsets[static_cast<std::size_t>(seq) + 1]; ++t)
          tokens.push_back(t);
      rank_ends.push_back(static_cast<std::int64_t>(tokens.size()));
    }
    const auto num_tokens = static_cast<std::int64_t>(tokens.size());
    std::vector<std::int64_t> so;
    for (int g = 0; g <= num_gpus; ++g)
      so.push_back(static_cast<int>(b.seqs[m].size()) == num_gpus ? rank_ends[static_cast<std::size_t>(g)]
                                                                  : num_tokens * g / num_gpus);
    ids.resize(tokens.size() * static_cast<std::size_t>(topk));
    pos.resize(ids.size());
    aff.resize(ids.size());
    for (std::size_t ml = 0; ml < sp.micro_steps[m].size(); ++ml) {
      const LayerPlan &plan = sp.micro_steps[m][ml];
      const int l = static_cast<int>(ml) + b.dense_layers;
      src_loads.assign(static_cast<std::size_t>(experts) * num_gpus, 0);
      for (int g = 0; g < num_gpus; ++g)
        for (std::int64_t i = so[static_cast<std::size_t>(g)]; i < so[static_cast<std::size_t>(g) + 1]; ++i)
          for (int k = 0; k < topk; ++k) {
            const std::int64_t e = view.at(tokens[static_cast<std::size_t>(i)], l, k, experts);
            ids[static_cast<std::size_t>(i * topk + k)] = static_cast<std::int32_t>(e);
            if (e >= 0 && e < experts) ++src_loads[static_cast<std::size_t>(e * num_gpus + g)];
          }
      const RoutedView one(std::span<const std::int32_t>(ids), num_tokens, 1, topk);
      const auto split = split_by_source(plan.placement, plan.slot_tokens, src_loads, num_gpus, topo.gpus_per_node);
      const TokenRanges by_source = token_ranges(plan.placement, split, num_gpus);
      map_tokens(by_source, one, 0, pos, so);
      add_node_hits(h.positional, pos, topk, topo, so);
      map_tokens(by_source, one, 0, aff, so, affine);
      add_node_hits(h.node_affine, aff, topk, topo, so);
      // The split the node-affine map chooses from the plan's totals, then mapped by source as each rank's
      // dispatch maps its column of it (dispatch_layout with node_affine): what the dispatch would send.
      TokenMapOptions homes = affine;
      homes.home_offsets = so;
      map_tokens(token_ranges(plan), one, 0, aff, {}, homes);
      const TokenRanges chosen = token_ranges(plan.placement, source_split(aff, topk, topo, so), num_gpus);
      map_tokens(chosen, one, 0, aff, so, affine);
      add_node_hits(h.node_affine_split, aff, topk, topo, so);
    }
  }
  return h;
}

/// `NodeHits` as JSON: its counts under their field names (tokens and ids summed over MoE layers too).
json::Value node_hits_json(const NodeHits &h) {
  static constexpr std::pair<const char *, std::int64_t NodeHits::*> fields[] = {
      {"tokens", &NodeHits::tokens},
      {"routed", &NodeHits::routed},
      {"nodes", &NodeHits::nodes},
      {"gpus", &NodeHits::gpus},
      {"remote_nodes", &NodeHits::remote_nodes},
      {"remote_gpus", &NodeHits::remote_gpus}};
  json::Value j;
  for (const auto &[name, field] : fields)
    j[name] = h.*field;
  return j;
}

/// `--traffic-aware`: what the owner search did, summed over MoE layers.
struct TrafficReport {
  std::int64_t cut_before = 0, cut_after = 0;         ///< co-activation weight of pairs owned on different nodes
  double node_ratio_before = 0, node_ratio_after = 0; ///< worst layer's max/mean node load under the owners
  double count_seconds = 0, owner_seconds = 0;        ///< co-activation count; owner search
  std::int64_t counted_tokens = 0;                    ///< tokens the co-activation was counted on

  [[nodiscard]] json::Value json() const {
    json::Value j;
    j["cut_before"] = cut_before;
    j["cut_after"] = cut_after;
    j["node_max_over_mean_before"] = node_ratio_before;
    j["node_max_over_mean_after"] = node_ratio_after;
    j["counted_tokens"] = counted_tokens;
    j["count_seconds"] = count_seconds;
    j["owner_seconds"] = owner_seconds;
    return j;
  }
  [[nodiscard]] std::string text() const {
    std::ostringstream o;
    const double cut = cut_before > 0 ? 100.0 * double(cut_before - cut_after) / double(cut_before) : 0.0;
    o << "  traffic-aware owners: co-activation cut " << cut_before << " -> " << cut_after << " (-" << std::fixed
      << std::setprecision(2) << cut << "%), worst layer's node load max/mean " << std::setprecision(4)
      << node_ratio_before << " -> " << node_ratio_after << "; " << std::setprecision(2) << count_seconds * 1e3
      << " ms counting " << counted_tokens << " tokens, " << owner_seconds * 1e3 << " ms searching\n";
    return o.str();
  }
};

/// The worst layer's max/mean node load of `owners` under `totals` (`[layers][experts]`).
double worst_node_ratio(const Planner::OwnerMap &owners, std::span<const std::int64_t> totals, const Topology &topo) {
  double worst = 0;
  std::vector<std::int64_t> node(static_cast<std::size_t>(topo.num_nodes));
  for (std::size_t l = 0; l < owners.size(); ++l) {
    std::fill(node.begin(), node.end(), 0);
    std::int64_t total = 0;
    for (std::size_t e = 0; e < owners[l].size(); ++e) {
      const std::int64_t w = totals[l * owners[l].size() + e];
      node[static_cast<std::size_t>(topo.node_of(owners[l][e]))] += w;
      total += w;
    }
    if (total > 0)
      worst = std::max(worst, double(*std::max_element(node.begin(), node.end())) * topo.num_nodes / double(total));
  }
  return worst;
}

/// `--traffic-aware`: the step's co-activation counted from the packed ids (about `s.tokens` of them; 0: all), the
/// load-only owners improved by `traffic_aware_owners` (`traffic_step_owners`), then every micro-step planned under
/// them.
StepPlan plan_traffic_aware(Planner &planner, const LoadTensor &loads, const PackedBatch &b, const TrafficSettings &s,
                            const Placement *resident, Stage stage, TrafficReport &r) {
  using clock = std::chrono::steady_clock;
  const Topology &topo = planner.topology();
  auto t = clock::now();
  const RoutedView view = b.ids.view();
  const LayerMap map = b.dense_layers > 0 ? LayerMap::dense_prefix(view.num_layers(), b.dense_layers) : LayerMap{};
  const std::int64_t every = s.every(view.num_tokens());
  const CoActivation co = count_coactivation(view, b.experts, 0, -1, map, every);
  r.counted_tokens = (view.num_tokens() + every - 1) / every;
  r.count_seconds = std::chrono::duration<double>(clock::now() - t).count();
  t = clock::now();
  TrafficStepOwners o = traffic_step_owners(planner, loads, co, s);
  r.owner_seconds = std::chrono::duration<double>(clock::now() - t).count();
  for (int l = 0; l < co.num_layers; ++l) {
    r.cut_before += coactivation_cut(co, l, o.start[static_cast<std::size_t>(l)], topo);
    r.cut_after += coactivation_cut(co, l, o.owners[static_cast<std::size_t>(l)], topo);
  }
  r.node_ratio_before = worst_node_ratio(o.start, o.totals, topo);
  r.node_ratio_after = worst_node_ratio(o.owners, o.totals, topo);
  return planner.plan_step_with_owners(loads, std::move(o.owners), resident, stage);
}

Command make_plan() {
  Command c;
  c.words = {"plan"};
  c.summary = "plan replicas, placement, token split and moves for the micro-steps of one RL step";
  c.description =
      "LOADS.npy is [L, E] (one micro-step) or [M, L, E] (the micro-steps of one RL step in execution order;\n"
      "owners are planned from their sum), integer or float. Writes PLAN.json with, per micro-step and layer,\n"
      "owner_gpu, gpu_slots, slot_tokens and moves ([expert, src_gpu or -1 for host, dst_gpu, dst_slot]).\n"
      "Per-sequence input instead of --loads: --ids IDS.npy, the routed ids [T, L, K] of one optimizer step\n"
      "(any int dtype, -1 = no route) with --sequences OFFSETS.npy, the sequences' token offsets [S+1] (0, ..., T;\n"
      "default IDS.sequences.npy, which trace gen --ids writes), and the trainer's micro-batches: --micro-steps M\n"
      "x --ranks R (data-parallel) micro-batches of at most --token-budget B tokens. The sequences are packed\n"
      "(--packing: none = in the order given, each micro-batch filled until the next sequence does not fit,\n"
      "micro-step 0's ranks first; tokens = token-balanced, longest first to the emptiest micro-batch with room;\n"
      "routing = from tokens' packing, every micro-step's load close to the step's share, per GPU under the\n"
      "step's owners or per expert: --packing-by), the loads of the packed micro-steps are counted from the\n"
      "ids and planned as --loads would be. --out-packing writes per sequence its micro_step and rank, per\n"
      "micro-step and rank its sequences (micro_batches) and tokens, the deviation from the step's share of the\n"
      "start and of the packing, and per micro-step the max/mean load of its worst layer (start_max_over_mean,\n"
      "max_over_mean; per layer too), per GPU under the step's owners (owner_gpu) or per expert.";
  c.options = {
      {"loads", "LOADS.npy", "per-micro-step loads (this or --ids is required)", ""},
      {"ids", "IDS.npy", "routed ids [T, L, K] of one optimizer step: packed, counted and planned", ""},
      {"sequences", "OFFSETS.npy", "--ids: token offsets [S+1] of the sequences (default: IDS.sequences.npy)", ""},
      {"experts", "E", "--ids: routed experts per MoE layer (default: largest id + 1)", ""},
      {"dense-layers", "N", "--ids: leading dense layers in the ids to skip (vLLM/SGLang layout)", "0"},
      {"micro-steps", "M", "--ids: micro-steps of the optimizer step (required with --ids)", ""},
      {"ranks", "R", "--ids: data-parallel ranks, one micro-batch each per micro-step", "1"},
      {"token-budget", "B", "--ids: tokens per micro-batch at most (required with --ids)", ""},
      {"packing", "NAME", "--ids: none (the order given), tokens (token-balanced) or routing", "routing"},
      {"packing-by", "NAME",
       "--ids: the loads routing packing balances and the figures report: gpus (each GPU's under the step's owners, "
       "planned from the step's totals as two-level planning does) or experts (each expert's)",
       "gpus"},
      {"out-packing", "PACKING.json", "--ids: write the packing here", ""},
      {"out-loads", "LOADS.npy", "--ids: write the packed micro-steps' loads [M, L, E] here", ""},
      {"node-hits", "",
       "--ids: map every token under the plans with both token maps (positional; node_affine, a token to the copy "
       "on a node it already visits) and report each token's distinct remote nodes and GPUs (node_hits in --out: "
       "counts summed over micro-steps and MoE layers)",
       ""},
      {"previous-loads", "FILE.npy",
       "previous step's loads: one finished step for EPLB's window (a rebalance from it with --eplb-interval 1)", ""},
      {"resident", "PLACEMENT.json", "placement left by the previous micro-step (from --out-placement)", ""},
      {"out", "PLAN.json", "write the plan here", ""},
      {"out-placement", "PLACEMENT.json", "write the final placement here (readable by --resident)", ""},
      {"placement-format", "NAME",
       "--out-placement form: foremoe (readable by --resident), sglang (--init-expert-location JSON: "
       "physical_to_logical_map), vllm (EplbState maps); sglang/vllm fill spare slots",
       "foremoe"},
      {"expert-bytes", "B",
       "bytes of one expert's weights: adds each layer's transfer plan (chunks, paths, rounds, "
       "modelled time)",
       ""},
      {"max-chunk-bytes", "B", "transfer chunks are cut to at most this", "67108864"},
      {"no-mirror", "", "the nodes have no pinned host mirror (GPU-direct sources only)", ""},
      {"mode", "MODE", "gone: free mode is --strategy foremoe-free, foremoe is two-level", ""},
  };
  for (auto &o : plot_options("plan"))
    c.options.push_back(std::move(o));
  for (auto &o : schema_specs(config::plan_schema())) {
    if (o.name == "strategy") o.help += "; all (side by side, no --out); list (the registered strategies)";
    c.options.push_back(std::move(o));
  }
  c.run = [](const Args &a, std::ostream &out, std::ostream &err) {
    refuse_plot(a, "plan");
    if (a.str("strategy") == "list") {
      for (const StrategyInfo *s : strategies()) {
        out << "  " << std::left << std::setw(14) << s->name << s->help << "\n";
        if (!s->options.empty()) {
          out << "  " << std::setw(14) << ""
              << "options:";
          for (const std::string &o : s->options)
            out << " " << o;
          out << "\n";
        }
      }
      return 0;
    }
    if (a.has("mode"))
      throw UsageError{"--mode is gone: use --strategy foremoe-free for free mode (foremoe is two-level)"};
    const bool from_ids = a.has("ids");
    if (from_ids == a.has("loads")) throw UsageError{"give --loads LOADS.npy or --ids IDS.npy (one of them)"};
    if (!from_ids)
      for (const char *o : ids_only_options)
        if (a.has(o)) throw UsageError{std::string("--") + o + " is for --ids (the per-sequence input)"};
    PackingShape shape;
    std::string packing_method;
    fs::path seq_path;
    std::string seq_name;
    if (from_ids) {
      if (!a.has("micro-steps") || !a.has("token-budget"))
        throw UsageError{"--ids needs the trainer's micro-batches: --micro-steps M and --token-budget B"};
      shape.micro_steps = a.integer("micro-steps", 1, std::int64_t{1} << 20);
      shape.ranks = a.integer("ranks", 1, std::int64_t{1} << 20);
      shape.token_budget = a.integer("token-budget", 1, limits::max_load_total);
      packing_method = a.str("packing");
      try {
        static_cast<void>(parse_batch_packing(packing_method, "--packing"));
      } catch (const Error &e) {
        throw UsageError{e.what()};
      }
      if (a.str("packing-by") != "gpus" && a.str("packing-by") != "experts")
        throw UsageError{"--packing-by must be gpus or experts, got '" + a.str("packing-by") + "'"};
      // The packing document lists every micro-batch (2^24 of them, empty, took 2 GB): far above any trainer's.
      if (shape.micro_steps * shape.ranks > (std::int64_t{1} << 20))
        throw UsageError{"--micro-steps x --ranks = " + std::to_string(shape.micro_steps * shape.ranks) +
                         " micro-batches is more than 2^20"};
      seq_path = a.has("sequences") ? fs::path(a.str("sequences")) : sidecar_path(a.str("ids"), "sequences");
      seq_name = a.has("sequences") ? "--sequences " + seq_path.string() : "the sequences sidecar " + seq_path.string();
      if (!a.has("sequences") && !fs::exists(seq_path))
        throw UsageError{"--ids needs the sequences' token offsets: give --sequences OFFSETS.npy (no " +
                         seq_path.string() + ")"};
    }
    const std::string placement_format = a.has("placement-format") ? a.str("placement-format") : "foremoe";
    {
      const auto &names = config::placement_format_names();
      if (std::find(names.begin(), names.end(), placement_format) == names.end())
        throw UsageError{"--placement-format must be foremoe, sglang or vllm, got '" + placement_format + "'"};
      if (a.has("placement-format") && !a.has("out-placement"))
        throw UsageError{"--placement-format is for --out-placement"};
    }
    const bool all = a.str("strategy") == "all";
    if (all && (a.has("out") || a.has("out-placement") || a.has("plot-document") || a.flag("node-hits") ||
                a.flag("traffic-aware")))
      throw UsageError{"--strategy all prints a comparison; --out, --out-placement, --plot, --traffic-aware and "
                       "--node-hits need one strategy"};
    const bool no_traffic = a.has("no-traffic-aware");
    for (const char *o : {"traffic-tolerance", "traffic-tokens"})
      if (a.has(o) && no_traffic)
        throw UsageError{std::string("--") + o + " is for traffic-aware owners, not --no-traffic-aware"};
    const json::Value flags = all ? schema_overrides(config::plan_schema(), a, {"planner.strategy"})
                                  : schema_overrides(config::plan_schema(), a);
    config::PlanSettings settings;
    try {
      config::plan_schema().read(settings, flags, "--");
      // What the flags alone decide is checked here, so that a bad flag value is a usage error (exit 2).
      settings.topo.validate();
      settings.planner.validate();
    } catch (const Error &e) {
      throw UsageError{e.what()}; // an unknown --strategy or a bad flag value is a usage error (exit 2)
    }
    {
      std::vector<NamedPath> inputs, outputs;
      if (from_ids) inputs.push_back({a.has("sequences") ? "--sequences" : "the sequences sidecar of --ids", seq_path});
      for (const char *o : {"loads", "ids", "previous-loads", "resident"})
        if (a.has(o)) inputs.push_back({std::string("--") + o, a.str(o)});
      for (const char *o : {"out", "out-placement", "plot-document", "out-packing", "out-loads"})
        if (a.has(o)) outputs.push_back({std::string("--") + o, a.str(o)});
      check_outputs(outputs, inputs);
    }
    const Topology topo = settings.topo;
    const PlannerOptions opts = settings.planner;
    // planner.traffic_aware: on by default, where the ids are known and the strategy chooses owners (foremoe); asked
    // for explicitly with another strategy, an error.
    const bool foremoe_strategy = find_strategy(opts.strategy).name == "foremoe";
    if (a.flag("traffic-aware") && !foremoe_strategy)
      throw UsageError{"--traffic-aware chooses the owners of two-level planning: it needs --strategy foremoe, got '" +
                       opts.strategy + "'"};
    const bool traffic = settings.traffic.aware && from_ids && foremoe_strategy && !all;
    const Stage stage = settings.stage;
    // Every output is staged first and renamed into place together: a failure leaves none of them behind.
    files::OutputSet outputs;
    LoadTensor loads;
    std::string packing_report;
    PackedBatch packed;
    if (from_ids) {
      packed = pack_ids(a, a.str("ids"), seq_path, seq_name, packing_method, shape, topo, opts, err);
      loads = std::move(packed.loads);
      packing_report = std::move(packed.report);
      if (a.has("out-packing")) outputs.add_text(a.str("out-packing"), packed.document);
      if (a.has("out-loads")) outputs.add(a.str("out-loads"), loads_npy_writer(loads));
    } else {
      loads = read_loads_npy(a.str("loads"));
    }
    topo.validate(loads.num_experts());

    std::vector<std::int64_t> previous;
    if (a.has("previous-loads")) {
      const LoadTensor prev = read_loads_npy(a.str("previous-loads"));
      if (prev.num_layers() != loads.num_layers() || prev.num_experts() != loads.num_experts())
        throw Error("--previous-loads has " + std::to_string(prev.num_layers()) + " layers x " +
                    std::to_string(prev.num_experts()) + " experts, --loads has " + std::to_string(loads.num_layers()) +
                    " x " + std::to_string(loads.num_experts()));
      previous = Planner(loads.num_layers(), loads.num_experts(), topo, opts).sum_steps(prev);
    }
    Placement resident;
    if (a.has("resident"))
      resident = config::read_placement_file(a.str("resident"), topo, loads.num_layers(), loads.num_experts());

    const Placement *res = a.has("resident") ? &resident : nullptr;
    if (all) {
      out << "planning " << loads.num_micro_steps() << " micro-steps x " << loads.num_layers() << " layers x "
          << loads.num_experts() << " experts on " << topo.num_nodes << " x " << topo.gpus_per_node << " GPUs x "
          << topo.slots_per_gpu << " slots" << (previous.empty() ? " (eplb without history = static)" : "") << "\n";
      out << "  " << std::left << std::setw(14) << "strategy" << std::right << std::setw(12) << "median"
          << std::setw(10) << "p99" << std::setw(10) << "max" << std::setw(16) << "moves/micro" << std::setw(14)
          << "planner ms"
          << "   (layer max/mean GPU load)\n";
      for (const StrategyInfo *st : strategies()) {
        PlannerOptions o = opts;
        o.strategy = st->name;
        Planner p(loads.num_layers(), loads.num_experts(), topo, o);
        const StepPlan sp = p.plan_step(loads, res, previous, stage);
        std::size_t moves = 0;
        for (const auto &layers : sp.micro_steps)
          for (const LayerPlan &lp : layers)
            moves += lp.moves.size();
        const BalanceStats b = balance_stats(imbalances(sp.micro_steps));
        out << "  " << std::left << std::setw(14) << st->name << std::right << std::fixed << std::setprecision(4)
            << std::setw(12) << b.median << std::setw(10) << b.p99 << std::setw(10) << b.max << std::setprecision(1)
            << std::setw(16) << double(moves) / double(sp.micro_steps.size()) << std::setprecision(2) << std::setw(14)
            << sp.planner_seconds * 1e3 << "\n";
      }
      outputs.commit();
      out << packing_report;
      for (const char *o : {"out-packing", "out-loads"})
        if (a.has(o)) out << "  wrote " << a.str(o) << "\n";
      return 0;
    }

    transfer::Options topt;
    const bool transfers = a.has("expert-bytes");
    if (transfers) {
      topt.expert_bytes = a.integer("expert-bytes", 1, std::int64_t{1} << 40);
      topt.max_chunk_bytes = a.integer("max-chunk-bytes", 1, std::int64_t{1} << 40);
      topt.align_bytes = std::min<std::int64_t>(topt.align_bytes, topt.max_chunk_bytes);
      topt.host_mirror = !a.flag("no-mirror");
      topt.move = settings.move; // the one move model (`cost.move_*`), as the simulator's
      try {
        topt.validate(); // before planning: a chunk count above the limit is a usage error, not a late failure
      } catch (const Error &e) {
        throw UsageError{std::string("--expert-bytes / --max-chunk-bytes: ") + e.what()};
      }
    } else if (a.has("max-chunk-bytes") || a.flag("no-mirror")) {
      throw UsageError{"--max-chunk-bytes and --no-mirror shape the transfer plan: give --expert-bytes too"};
    }

    Planner planner(loads.num_layers(), loads.num_experts(), topo, opts);
    TrafficReport traffic_report;
    const StepPlan sp = traffic
                            ? plan_traffic_aware(planner, loads, packed, settings.traffic, res, stage, traffic_report)
                            : planner.plan_step(loads, res, previous, stage);

    // Sources are what the slots held before each micro-step: the previous one's placement, or --resident, or
    // (micro-step 0 without --resident) what the planner assumed resident: every slot its moves do not write.
    std::vector<std::vector<transfer::TransferPlan>> transfer_plans;
    std::size_t num_moves = 0;
    double est_seconds = 0.0, bound_seconds = 0.0;
    std::int64_t path_bytes[transfer::num_paths] = {0, 0, 0};
    for (std::size_t m = 0; m < sp.micro_steps.size(); ++m) {
      const auto &layers = sp.micro_steps[m];
      if (transfers) transfer_plans.emplace_back();
      for (std::size_t l = 0; l < layers.size(); ++l) {
        const LayerPlan &lp = layers[l];
        num_moves += lp.moves.size();
        if (!transfers) continue;
        const LayerPlacement before = m > 0            ? sp.micro_steps[m - 1][l].placement
                                      : res != nullptr ? res->layer(static_cast<int>(l))
                                                       : transfer::resident_before(lp.placement, lp.moves);
        try {
          transfer_plans.back().push_back(transfer::plan_transfers(lp.moves, before, topo, topt));
        } catch (const Error &e) {
          throw Error("micro-step " + std::to_string(m) + " layer " + std::to_string(l) + ": " + e.what());
        }
        const transfer::TransferPlan &tp = transfer_plans.back().back();
        est_seconds += tp.est_seconds;
        bound_seconds += tp.link_bound_seconds;
        for (int p = 0; p < transfer::num_paths; ++p)
          path_bytes[p] += tp.path_bytes[p];
      }
    }
    const bool node_hits = a.flag("node-hits");
    TokenMapHits hits;
    if (node_hits) hits = token_map_hits(packed, sp, topo);
    if (a.has("out") || a.has("plot-document")) {
      const config::PlanHeader h{opts.strategy, topo, loads.num_layers(), loads.num_experts(), sp.planner_seconds};
      json::Value doc = config::plan_document(h, sp.micro_steps, transfers ? &transfer_plans : nullptr);
      if (node_hits) {
        json::Value nh;
        nh["positional"] = node_hits_json(hits.positional);
        nh["node_affine"] = node_hits_json(hits.node_affine);
        nh["node_affine_split"] = node_hits_json(hits.node_affine_split);
        doc["node_hits"] = std::move(nh);
      }
      if (traffic) doc["traffic_aware"] = traffic_report.json();
      const std::string text = json::dump(doc) + "\n";
      if (a.has("out")) outputs.add_text(a.str("out"), text);
      if (a.has("plot-document")) outputs.add_text(a.str("plot-document"), text);
    }
    if (a.has("out-placement") && placement_format == "foremoe") {
      outputs.add_text(a.str("out-placement"),
                       json::dump(config::placement_document(topo, sp.final_placement())) + "\n");
    } else if (a.has("out-placement")) {
      // SGLang and vLLM need every physical slot filled: spare slots get the step's heaviest experts per replica.
      const std::size_t cells = static_cast<std::size_t>(loads.num_layers()) * loads.num_experts();
      std::vector<std::int64_t> weights(cells, 0);
      const auto tot = loads.totals();
      for (std::size_t i = 0; i < tot.size(); ++i)
        weights[i % cells] += tot[i];
      Placement full = sp.final_placement();
      config::fill_empty_slots(full, weights);
      outputs.add_text(a.str("out-placement"), config::placement_export_text(full, placement_format));
    }
    outputs.commit();

    out << packing_report;
    const BalanceStats balance = balance_stats(imbalances(sp.micro_steps));
    out << "planned " << sp.micro_steps.size() << " micro-steps x " << loads.num_layers() << " layers x "
        << loads.num_experts() << " experts on " << topo.num_nodes << " x " << topo.gpus_per_node << " GPUs x "
        << topo.slots_per_gpu << " slots with " << opts.strategy << " in " << std::fixed << std::setprecision(2)
        << sp.planner_seconds * 1e3 << " ms\n"
        << "  layer max/mean GPU load: median " << std::setprecision(4) << balance.median << ", p99 " << balance.p99
        << ", max " << balance.max << "\n"
        << "  moves: " << num_moves << " (" << std::setprecision(2)
        << (sp.micro_steps.empty() ? 0.0 : double(num_moves) / double(sp.micro_steps.size())) << " per micro-step)\n";
    if (transfers) {
      const double micro = sp.micro_steps.empty() ? 1.0 : double(sp.micro_steps.size());
      const double total = double(path_bytes[0] + path_bytes[1] + path_bytes[2]);
      out << "  transfers: " << std::setprecision(3) << est_seconds * 1e3 / micro
          << " ms modelled per micro-step (all layers, link bound " << bound_seconds * 1e3 / micro << " ms), "
          << std::setprecision(1) << (total > 0 ? 100.0 * double(path_bytes[0]) / total : 0.0) << "% NVLink, "
          << (total > 0 ? 100.0 * double(path_bytes[1]) / total : 0.0) << "% host mirror, "
          << (total > 0 ? 100.0 * double(path_bytes[2]) / total : 0.0) << "% network\n";
    }
    if (traffic) out << traffic_report.text();
    if (node_hits) {
      const double tokens = std::max<double>(1.0, static_cast<double>(hits.positional.tokens));
      auto per = [&](const NodeHits &x) { return static_cast<double>(x.remote_nodes) / tokens; };
      auto cut = [&](const NodeHits &x) {
        const auto p = static_cast<double>(hits.positional.remote_nodes);
        return p > 0 ? 100.0 * (p - static_cast<double>(x.remote_nodes)) / p : 0.0;
      };
      out << "  inter-node token copies per token: positional " << std::setprecision(4) << per(hits.positional)
          << ", node_affine " << per(hits.node_affine) << " (" << std::setprecision(2) << -cut(hits.node_affine)
          << "%), node_affine choosing the split by source " << std::setprecision(4) << per(hits.node_affine_split)
          << " (" << std::setprecision(2) << -cut(hits.node_affine_split) << "%); remote GPUs per token "
          << std::setprecision(4) << static_cast<double>(hits.positional.remote_gpus) / tokens << ", "
          << static_cast<double>(hits.node_affine.remote_gpus) / tokens << ", "
          << static_cast<double>(hits.node_affine_split.remote_gpus) / tokens << "\n";
    }
    if (a.has("out")) out << "  wrote " << a.str("out") << "\n";
    if (a.has("out-placement")) out << "  wrote " << a.str("out-placement") << "\n";
    for (const char *o : {"out-packing", "out-loads"})
      if (a.has(o)) out << "  wrote " << a.str(o) << "\n";
    return 0;
  };
  return c;
}

FOREMOE_REGISTER_COMMAND(make_plan);

} // namespace
} // namespace foremoe::cli
