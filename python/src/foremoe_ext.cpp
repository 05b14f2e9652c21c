// `foremoe._core`: nanobind bindings over the header-only ForeMoE library (one translation unit).
//
// Inputs are borrowed without copies where the C++ side can read them in place (routed ids of any supported
// integer dtype and strides); outputs are NumPy arrays over buffers the C++ side filled (no second copy).
// `foremoe::Error` becomes `ValueError` with the C++ message. Long calls release the GIL.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "default_loads.hpp" // tools/, built into this module as into the program
#include "foremoe/config/documents.hpp"
#include "foremoe/foremoe.hpp"
#include "foremoe/plan/adapter_layout.hpp"
#include "foremoe/plan/dispatch.hpp"
#include "foremoe/plan/replica_sync.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/trace/batch_formats/builtin.hpp"
#include "foremoe/trace/formats/builtin.hpp"
#include "run_simulate.hpp" // tools/: the CLI's orchestration, shared with `foremoe simulate`

namespace foremoe::cli {
int run_cli(const std::vector<std::string> &args); // tools/main.cpp, compiled into this module
}
namespace foremoe::python {
void bind_runtime(nanobind::module_ &m);    // runtime_ext.cpp: the compiled runtime (transfer engine, counting)
void bind_even_split(nanobind::module_ &m); // even_split_ext.cpp: rebalance_experts(split="even")
void bind_packing(nanobind::module_ &m);    // packing_ext.cpp: pack_micro_batches
} // namespace foremoe::python

namespace nb = nanobind;
using namespace nb::literals;
namespace fm = foremoe;

namespace {

using fm::detail::fail;
using fm::detail::require;

// ---------------------------------------------------------------------------------------------------------------
// NumPy outputs over C++-owned buffers.

template <class T> nb::ndarray<nb::numpy, T> owned_array(std::vector<T> &&v, std::vector<std::size_t> shape) {
  auto *h = new std::vector<T>(std::move(v));
  if (h->empty()) h->reserve(1); // a non-null data pointer for empty arrays
  nb::capsule owner(h, [](void *p) noexcept { delete static_cast<std::vector<T> *>(p); });
  return nb::ndarray<nb::numpy, T>(h->data(), shape.size(), shape.data(), owner);
}

// A read-only view of `v`, kept alive by `owner` (the Python object holding `v`).
template <class T>
nb::ndarray<nb::numpy, const T> view_array(const std::vector<T> &v, std::vector<std::size_t> shape, nb::handle owner) {
  return nb::ndarray<nb::numpy, const T>(v.data(), shape.size(), shape.data(), owner);
}

std::string dtype_name(const nb::dlpack::dtype &d) {
  using Code = nb::dlpack::dtype_code;
  const char *kind = d.code == static_cast<std::uint8_t>(Code::Int)       ? "int"
                     : d.code == static_cast<std::uint8_t>(Code::UInt)    ? "uint"
                     : d.code == static_cast<std::uint8_t>(Code::Float)   ? "float"
                     : d.code == static_cast<std::uint8_t>(Code::Bfloat)  ? "bfloat"
                     : d.code == static_cast<std::uint8_t>(Code::Complex) ? "complex"
                     : d.code == static_cast<std::uint8_t>(Code::Bool)    ? "bool"
                                                                          : "other";
  return std::string(kind) + std::to_string(d.bits);
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments of the bindings users call directly (Topology, Placement.from_array, Plan's methods), checked by the
// package's own helpers in foremoe/_args.py, the one definition the Python API uses too: an integer is never
// truncated (8.7 -> 8) or wrapped (2**32 + 3 -> 3), an array of integers is never cast from NaN or 1.7, and the
// error names the argument instead of nanobind's "incompatible function arguments".

nb::object args_helper(const char *name) { return nb::module_::import_("foremoe._args").attr(name); }

template <class T = int>
T int_arg(nb::handle v, const char *name, std::int64_t lo = std::numeric_limits<T>::min(),
          std::int64_t hi = std::numeric_limits<T>::max()) {
  return nb::cast<T>(args_helper("integer")(v, name, lo, hi));
}

double number_arg(nb::handle v, const char *name) { return nb::cast<double>(args_helper("number")(v, name)); }

/// `v` as a read-only C-contiguous CPU array of `T` (int32 or int64) with every element in [lo, hi] (default: T's
/// range), kept alive by the returned array.
template <class T>
nb::ndarray<nb::ro, const T, nb::c_contig, nb::device::cpu> int_array_arg(nb::handle v, const char *name,
                                                                          std::optional<std::int64_t> lo = {},
                                                                          std::optional<std::int64_t> hi = {}) {
  static_assert(std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t>);
  nb::object a =
      args_helper("int_array")(v, name, "dtype"_a = sizeof(T) == 4 ? "int32" : "int64",
                               "lo"_a = lo ? nb::cast(*lo) : nb::none(), "hi"_a = hi ? nb::cast(*hi) : nb::none());
  return nb::cast<nb::ndarray<nb::ro, const T, nb::c_contig, nb::device::cpu>>(a);
}

std::optional<fm::IdDtype> id_dtype_of(const nb::dlpack::dtype &d) {
  if (d.lanes != 1) return std::nullopt;
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int)) {
    switch (d.bits) {
    case 8: return fm::IdDtype::i8;
    case 16: return fm::IdDtype::i16;
    case 32: return fm::IdDtype::i32;
    case 64: return fm::IdDtype::i64;
    }
  } else if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)) {
    switch (d.bits) {
    case 8: return fm::IdDtype::u8;
    case 16: return fm::IdDtype::u16;
    }
  }
  return std::nullopt;
}

using RoIds = nb::ndarray<nb::ro, nb::device::cpu>;
using RoI64 = nb::ndarray<nb::ro, const std::int64_t, nb::c_contig, nb::device::cpu>;

fm::RoutedView routed_view(const RoIds &ids, const char *who) {
  require(ids.ndim() == 3, who, ": routed_experts must be 3-D [tokens, layers, topk], got ", ids.ndim(), " dims");
  const auto dt = id_dtype_of(ids.dtype());
  require(dt.has_value(), who, ": routed_experts must be int8, uint8, int16, uint16, int32 or int64, got ",
          dtype_name(ids.dtype()));
  require(ids.shape(1) > 0 && ids.shape(1) <= (1u << 20), who, ": bad layer count ", ids.shape(1));
  require(ids.shape(2) > 0 && ids.shape(2) <= (1u << 20), who, ": bad topk ", ids.shape(2));
  return fm::RoutedView(ids.data(), *dt, static_cast<std::int64_t>(ids.shape(0)), static_cast<int>(ids.shape(1)),
                        static_cast<int>(ids.shape(2)), {ids.stride(0), ids.stride(1), ids.stride(2)});
}

std::span<const std::int64_t> span_of(const std::optional<RoI64> &a) {
  if (!a) return {};
  return {a->data(), a->size()};
}

// ---------------------------------------------------------------------------------------------------------------
// trace formats: the registry of foremoe/trace/formats.hpp

nb::list trace_formats() {
  nb::list out;
  for (const fm::TraceFormat *f : fm::trace_formats()) {
    nb::dict d;
    d["name"] = f->name;
    d["help"] = f->help;
    d["detects"] = f->detects;
    d["takes_mask"] = f->takes_mask;
    d["needs_shape"] = f->needs_shape;
    d["reads_sidecars"] = f->reads_sidecars;
    out.append(d);
  }
  return out;
}

nb::dlpack::dtype numpy_dtype(fm::IdDtype d) {
  switch (d) {
  case fm::IdDtype::i8: return nb::dtype<std::int8_t>();
  case fm::IdDtype::u8: return nb::dtype<std::uint8_t>();
  case fm::IdDtype::i16: return nb::dtype<std::int16_t>();
  case fm::IdDtype::u16: return nb::dtype<std::uint16_t>();
  case fm::IdDtype::i32: return nb::dtype<std::int32_t>();
  case fm::IdDtype::i64: break;
  }
  return nb::dtype<std::int64_t>();
}

std::span<const std::byte> byte_span(const nb::bytes &b) {
  return {reinterpret_cast<const std::byte *>(b.c_str()), b.size()};
}

/// `(format, ids [T, L, K], mask [T] uint8 or None, request_offsets or None)` of a file, or of its content
/// `data` (then `path` names it in messages); the ids are a view over the record the reader filled, in its dtype.
nb::tuple read_trace(const std::string &path, const std::string &format, std::optional<nb::bytes> data,
                     std::optional<std::string> mask_path, std::optional<nb::bytes> mask_data, int num_layers,
                     int topk) {
  fm::TraceInput in = data ? fm::TraceInput(path, byte_span(*data)) : fm::TraceInput(path);
  fm::TraceReadOptions o;
  if (mask_data)
    o.mask = fm::TraceInput(mask_path.value_or("mask"), byte_span(*mask_data));
  else if (mask_path)
    o.mask = fm::TraceInput(*mask_path);
  o.num_layers = num_layers;
  o.topk = topk;
  auto rec = std::make_unique<fm::RoutedRecord>();
  const fm::TraceFormat *f = nullptr;
  {
    nb::gil_scoped_release nogil;
    f = &fm::resolve_trace_format(in.path, format, o);
    *rec = f->read(in, o);
  }
  nb::object mask = nb::none(), offsets = nb::none();
  if (!rec->mask.empty()) {
    const std::size_t n = rec->mask.size();
    mask = nb::cast(owned_array(std::move(rec->mask), {n}));
  }
  if (!rec->request_offsets.empty()) {
    const std::size_t n = rec->request_offsets.size();
    offsets = nb::cast(owned_array(std::move(rec->request_offsets), {n}));
  }
  const fm::RoutedView v = rec->view;
  const std::size_t shape[3] = {static_cast<std::size_t>(v.num_tokens()), static_cast<std::size_t>(v.num_layers()),
                                static_cast<std::size_t>(v.topk())};
  const std::int64_t strides[3] = {v.strides()[0], v.strides()[1], v.strides()[2]};
  // A non-null pointer for zero tokens, as NumPy wants one.
  static const std::int64_t empty = 0;
  const void *data_ptr = v.data() != nullptr ? v.data() : &empty;
  auto *owned = rec.release();
  nb::capsule owner(owned, [](void *p) noexcept { delete static_cast<fm::RoutedRecord *>(p); });
  nb::object ids = nb::cast(nb::ndarray<nb::numpy, nb::ro>(data_ptr, 3, shape, owner, strides, numpy_dtype(v.dtype())));
  return nb::make_tuple(f->name, ids, mask, offsets);
}

// ---------------------------------------------------------------------------------------------------------------
// in-memory trainer formats: the registry of foremoe/trace/batch_formats.hpp

using RoAny = nb::ndarray<nb::ro, nb::device::cpu>;

/// A CPU array (read in place, kept alive in `keep`), or a device array's layout `(kind, bits, shape, strides)`
/// (kind "i", "u", "b", "f" or "?") whose values the C++ side does not read.
fm::ArrayRef array_ref_of(nb::handle h, std::vector<RoAny> &keep) {
  fm::ArrayRef a;
  if (nb::isinstance<nb::tuple>(h)) {
    const auto t = nb::borrow<nb::tuple>(h);
    const std::string kind = nb::cast<std::string>(t[0]);
    a.kind = kind == "i"   ? fm::ElemKind::int_
             : kind == "u" ? fm::ElemKind::uint_
             : kind == "b" ? fm::ElemKind::bool_
             : kind == "f" ? fm::ElemKind::float_
                           : fm::ElemKind::other;
    a.bits = nb::cast<int>(t[1]);
    a.shape = nb::cast<std::vector<std::int64_t>>(t[2]);
    a.strides = nb::cast<std::vector<std::int64_t>>(t[3]);
    return a;
  }
  const RoAny &arr = keep.emplace_back(nb::cast<RoAny>(h));
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(arr.dtype().code);
  a.kind = code == Code::Int                             ? fm::ElemKind::int_
           : code == Code::UInt                          ? fm::ElemKind::uint_
           : code == Code::Bool                          ? fm::ElemKind::bool_
           : code == Code::Float || code == Code::Bfloat ? fm::ElemKind::float_
                                                         : fm::ElemKind::other;
  a.bits = arr.dtype().bits;
  a.data = arr.data();
  for (std::size_t d = 0; d < arr.ndim(); ++d) {
    a.shape.push_back(static_cast<std::int64_t>(arr.shape(d)));
    a.strides.push_back(arr.stride(d));
  }
  return a;
}

/// `(loads [M, L, E] or None, parts or None, M, trace layers)`: the format's layout of the arrays, counted here
/// when every id array is on the CPU; otherwise the parts `(array, row, tokens, layers, topk, offsets, micro-steps,
/// first layer, mask or None)` for a device counter. `micro_batches`: None, a size or a list of index arrays.
nb::tuple count_batch(const std::string &format, const std::string &who, const nb::list &arrays,
                      std::optional<std::vector<std::int64_t>> list_sizes, const nb::object &mask,
                      const nb::object &micro_batches, std::optional<RoI64> offsets, int num_experts,
                      std::optional<std::vector<int>> layer_map) {
  const fm::BatchFormat &f = fm::find_batch_format(format);
  std::vector<RoAny> keep;
  keep.reserve(arrays.size() + 2 + (nb::isinstance<nb::list>(micro_batches) ? nb::len(micro_batches) : 0));
  fm::BatchInput in;
  in.who = who;
  for (nb::handle h : arrays)
    in.arrays.push_back(array_ref_of(h, keep));
  in.list_sizes = std::move(list_sizes);
  if (!mask.is_none()) in.mask = array_ref_of(mask, keep);
  if (nb::isinstance<nb::int_>(micro_batches)) {
    in.micro_batches = fm::MicroBatches::of_size(nb::cast<std::int64_t>(micro_batches));
  } else if (!micro_batches.is_none()) {
    std::vector<fm::ArrayRef> lists;
    for (nb::handle h : micro_batches)
      lists.push_back(array_ref_of(h, keep));
    in.micro_batches = fm::MicroBatches::of_lists(std::move(lists));
  }
  if (offsets) in.offsets = std::span<const std::int64_t>(offsets->data(), offsets->size());
  fm::LayerMap lmap;
  if (layer_map) {
    require(f.takes_layer_map, who, ": format ", format, " takes no layer map");
    try {
      lmap = fm::LayerMap(*layer_map);
    } catch (const fm::Error &e) {
      fail(who, ": layer_map: ", e.what());
    }
  }
  fm::BatchLayout layout;
  const bool on_host =
      std::all_of(in.arrays.begin(), in.arrays.end(), [](const fm::ArrayRef &a) { return a.data != nullptr; });
  auto *loads = new fm::LoadTensor();
  try {
    nb::gil_scoped_release nogil;
    layout = f.layout(in);
    if (on_host) *loads = fm::count_batch(layout, in.arrays, num_experts, lmap, who);
  } catch (...) {
    delete loads;
    throw;
  }
  const int M = layout.num_micro_steps, L = layout.num_layers;
  if (on_host) {
    nb::capsule owner(loads, [](void *p) noexcept { delete static_cast<fm::LoadTensor *>(p); });
    const std::size_t shape[3] = {static_cast<std::size_t>(loads->num_micro_steps()),
                                  static_cast<std::size_t>(loads->num_layers()),
                                  static_cast<std::size_t>(loads->num_experts())};
    nb::object t = nb::cast(nb::ndarray<nb::numpy, std::int64_t>(loads->totals().data(), 3, shape, owner));
    return nb::make_tuple(t, nb::none(), M, L);
  }
  delete loads;
  nb::list parts;
  for (fm::BatchPart &p : layout.parts) {
    const std::size_t n = p.offsets.size(), nm = p.mask.size();
    nb::object m = nm == 0 ? nb::none() : nb::cast(owned_array(std::move(p.mask), {nm}));
    parts.append(nb::make_tuple(p.array_idx, p.row, p.num_tokens, p.num_layers, p.topk,
                                owned_array(std::move(p.offsets), {n}), p.micro_step, p.first_layer, m));
  }
  return nb::make_tuple(nb::none(), parts, M, L);
}

nb::list batch_formats() {
  nb::list out;
  for (const fm::BatchFormat *f : fm::batch_formats()) {
    nb::dict d;
    d["name"] = f->name;
    d["help"] = f->help;
    d["takes_layer_map"] = f->takes_layer_map;
    out.append(d);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// count_loads

nb::tuple count_loads(const RoIds &ids, std::optional<RoI64> microbatch_offsets, int num_experts,
                      std::optional<std::vector<int>> layer_map, int num_sources, std::optional<RoI64> source_offsets,
                      std::optional<nb::ndarray<nb::ro, const std::uint8_t, nb::c_contig, nb::device::cpu>> mask) {
  const fm::RoutedView view = routed_view(ids, "count_loads");
  fm::CountOptions opts;
  opts.num_experts = num_experts;
  if (layer_map) opts.layer_map = fm::LayerMap(*layer_map);
  opts.microbatch_offsets = span_of(microbatch_offsets);
  opts.num_sources = num_sources;
  opts.source_offsets = span_of(source_offsets);
  if (mask) opts.mask = {mask->data(), mask->size()};
  auto *out = new fm::LoadTensor();
  try {
    nb::gil_scoped_release nogil;
    *out = fm::count_loads(view, opts);
  } catch (...) {
    delete out;
    throw;
  }
  nb::capsule owner(out, [](void *p) noexcept { delete static_cast<fm::LoadTensor *>(p); });
  const std::size_t M = out->num_micro_steps(), L = out->num_layers(), E = out->num_experts();
  auto totals = out->totals();
  const std::size_t shape[3] = {M, L, E};
  nb::object t = nb::cast(nb::ndarray<nb::numpy, std::int64_t>(totals.data(), 3, shape, owner));
  nb::object s = nb::none();
  if (out->has_sources()) {
    const std::size_t shape4[4] = {M, L, E, static_cast<std::size_t>(out->num_sources())};
    s = nb::cast(nb::ndarray<nb::numpy, std::int64_t>(out->by_source().data(), 4, shape4, owner));
  }
  return nb::make_tuple(t, s);
}

// ---------------------------------------------------------------------------------------------------------------
// Placement and Plan

struct PyPlacement {
  fm::Topology topo;
  int num_experts = 0;
  fm::Placement placement;

  std::vector<std::int32_t> flat() const {
    std::vector<std::int32_t> v;
    v.reserve(static_cast<std::size_t>(placement.num_layers()) * topo.num_slots());
    for (int l = 0; l < placement.num_layers(); ++l) {
      const auto p = placement.layer(l).phys_to_log();
      v.insert(v.end(), p.begin(), p.end());
    }
    return v;
  }
};

PyPlacement placement_from_array(const fm::Topology &topo, nb::handle gpu_slots_arg, nb::handle num_experts_arg) {
  const int num_experts = int_arg(num_experts_arg, "Placement.from_array: num_experts");
  topo.validate(num_experts);
  // -1 (empty) .. E - 1: an id past int32 would wrap onto another expert.
  const auto gpu_slots =
      int_array_arg<std::int32_t>(gpu_slots_arg, "Placement.from_array: gpu_slots", -1, std::int64_t{num_experts} - 1);
  require(gpu_slots.ndim() == 3, "Placement: gpu_slots must be [layers, gpus, slots], got ", gpu_slots.ndim(), " dims");
  require(static_cast<int>(gpu_slots.shape(1)) == topo.num_gpus() &&
              static_cast<int>(gpu_slots.shape(2)) == topo.slots_per_gpu,
          "Placement: gpu_slots is [", gpu_slots.shape(0), ", ", gpu_slots.shape(1), ", ", gpu_slots.shape(2),
          "] but the topology has ", topo.num_gpus(), " GPUs x ", topo.slots_per_gpu, " slots");
  PyPlacement out{topo, num_experts, fm::Placement(topo, static_cast<int>(gpu_slots.shape(0)), num_experts)};
  const std::int32_t *d = gpu_slots.data();
  for (int l = 0; l < out.placement.num_layers(); ++l) {
    auto p = out.placement.layer(l).phys_to_log();
    std::copy(d + static_cast<std::size_t>(l) * p.size(), d + static_cast<std::size_t>(l + 1) * p.size(), p.begin());
  }
  out.placement.validate();
  return out;
}

/// One micro-step's plans of every layer, flattened into arrays.
struct PyPlan {
  fm::Topology topo;
  int L = 0, G = 0, S = 0, E = 0;
  std::vector<std::int32_t> gpu_slots;     // [L, G, S]
  std::vector<std::int64_t> slot_tokens;   // [L, G, S]
  std::vector<std::int64_t> gpu_loads;     // [L, G]
  std::vector<std::int32_t> l2p_offsets;   // [L, E + 1]
  std::vector<std::int32_t> l2p_phys;      // [L, G * S], -1 past each layer's copies
  std::vector<std::int32_t> replica_count; // [L, E]
  std::vector<std::int32_t> owner_gpu;     // [L, E]
  std::vector<std::int32_t> moves;         // [N, 5]: layer, expert, src_gpu (-1 host), dst_gpu, dst_slot
  std::vector<double> imbalance;           // [L]
  std::vector<std::int64_t> max_gpu_load;  // [L]
  std::vector<bool> tolerance_met;         // [L]: false where an asked-for imbalance tolerance was not met
  double planner_seconds = 0;
  std::shared_ptr<const fm::StepPlan> step; ///< the step this micro-step's plans belong to
  std::size_t index = 0;                    ///< its micro-step in `step`
  std::string strategy;                     ///< of the planner that made it

  PyPlan(const fm::Topology &t, int num_experts, const std::vector<fm::LayerPlan> &layers)
      : topo(t), L(static_cast<int>(layers.size())), G(t.num_gpus()), S(t.slots_per_gpu), E(num_experts) {
    const std::size_t P = static_cast<std::size_t>(G) * S;
    gpu_slots.reserve(L * P);
    slot_tokens.reserve(L * P);
    gpu_loads.reserve(static_cast<std::size_t>(L) * G);
    l2p_offsets.reserve(static_cast<std::size_t>(L) * (E + 1));
    l2p_phys.assign(L * P, -1);
    replica_count.reserve(static_cast<std::size_t>(L) * E);
    owner_gpu.reserve(static_cast<std::size_t>(L) * E);
    imbalance.reserve(L);
    max_gpu_load.reserve(L);
    for (int l = 0; l < L; ++l) {
      const fm::LayerPlan &lp = layers[l];
      const auto p2l = lp.placement.phys_to_log();
      gpu_slots.insert(gpu_slots.end(), p2l.begin(), p2l.end());
      slot_tokens.insert(slot_tokens.end(), lp.slot_tokens.begin(), lp.slot_tokens.end());
      const auto gl = lp.gpu_loads();
      gpu_loads.insert(gpu_loads.end(), gl.begin(), gl.end());
      const auto m = lp.placement.log_to_phys();
      l2p_offsets.insert(l2p_offsets.end(), m.offsets.begin(), m.offsets.end());
      std::copy(m.phys.begin(), m.phys.end(), l2p_phys.begin() + l * P);
      const auto rc = lp.placement.replica_counts();
      replica_count.insert(replica_count.end(), rc.begin(), rc.end());
      owner_gpu.insert(owner_gpu.end(), lp.owner_gpu.begin(), lp.owner_gpu.end());
      for (const fm::Move &mv : lp.moves)
        moves.insert(moves.end(), {l, mv.expert, mv.src_gpu, mv.dst_gpu, mv.dst_slot});
      imbalance.push_back(lp.imbalance());
      max_gpu_load.push_back(lp.max_gpu_load);
      tolerance_met.push_back(lp.tolerance_met);
    }
  }

  PyPlacement placement() const {
    PyPlacement out{topo, E, fm::Placement(topo, L, E)};
    const std::size_t P = static_cast<std::size_t>(G) * S;
    for (int l = 0; l < L; ++l) {
      auto p = out.placement.layer(l).phys_to_log();
      std::copy(gpu_slots.begin() + l * P, gpu_slots.begin() + (l + 1) * P, p.begin());
    }
    return out;
  }
};

/// The move model of `Plan.transfers(move=...)`: a mapping of `config::move_schema()` keys (`foremoe.options("move")`:
/// the settings `foremoe plan --expert-bytes` prices moves with, its `--move-*-gb-per-s`, `--move-*-latency-us` and
/// `--pcie-ingress-gb-per-s` flags), made JSON by the package's `_json` and read by that schema (ranges, unknown keys
/// and bad values are errors naming `transfers.move.KEY`); None or a key left out: the schema's default.
fm::MoveParams move_arg(nb::handle move) {
  fm::MoveParams m;
  if (move.is_none()) return m;
  const auto text = nb::cast<std::string>(nb::module_::import_("foremoe").attr("_json")(move, "transfers.move"));
  fm::config::move_schema().read(m, fm::json::parse(text, "transfers.move"), "transfers.move");
  return m;
}

/// `Plan.transfers`: the chunks, sources, paths and rounds realising each layer's moves (transfer planning), from
/// `resident` (the placement before the micro-step; None: the owner copies alone), their times priced by the move
/// model `move` (see `move_arg`).
nb::dict plan_transfers(const PyPlan &p, const PyPlacement *resident, nb::handle expert_bytes_arg,
                        nb::handle max_chunk_bytes_arg, bool split_paths, bool host_mirror, bool allow_network,
                        nb::handle move) {
  const auto expert_bytes = int_arg<std::int64_t>(expert_bytes_arg, "transfers: expert_bytes");
  const auto max_chunk_bytes = int_arg<std::int64_t>(max_chunk_bytes_arg, "transfers: max_chunk_bytes");
  const fm::MoveParams move_params = move_arg(move);
  if (resident != nullptr)
    require(resident->placement.num_layers() == p.L && resident->num_experts == p.E &&
                resident->topo.num_gpus() == p.G && resident->topo.slots_per_gpu == p.S,
            "transfers: resident placement is ", resident->placement.num_layers(), " layers x ",
            resident->topo.num_gpus(), " GPUs x ", resident->topo.slots_per_gpu, " slots x ", resident->num_experts,
            " experts, the plan ", p.L, " x ", p.G, " x ", p.S, " x ", p.E);
  fm::transfer::Options opt;
  opt.expert_bytes = expert_bytes;
  opt.max_chunk_bytes = max_chunk_bytes;
  opt.split_paths = split_paths;
  opt.host_mirror = host_mirror;
  opt.allow_network = allow_network;
  opt.move = move_params;
  std::vector<std::int64_t> chunks, path_bytes;
  std::vector<double> est, bound;
  std::vector<std::int32_t> rounds;
  std::vector<std::int8_t> reasons;
  {
    nb::gil_scoped_release nogil;
    const std::size_t P = static_cast<std::size_t>(p.G) * p.S;
    std::size_t mi = 0;
    for (int l = 0; l < p.L; ++l) {
      fm::LayerPlacement before(p.G, p.S, p.E);
      if (resident != nullptr) {
        before = resident->placement.layer(l);
      } else {
        for (std::size_t q = 0; q < P; ++q)
          if (const std::int32_t e = p.gpu_slots[l * P + q];
              e != fm::empty_slot && p.owner_gpu[static_cast<std::size_t>(l) * p.E + e] == static_cast<int>(q / p.S))
            before.phys_to_log()[q] = e;
      }
      std::vector<fm::Move> moves;
      for (; mi * 5 < p.moves.size() && p.moves[mi * 5] == l; ++mi)
        moves.push_back({p.moves[mi * 5 + 1], p.moves[mi * 5 + 2], p.moves[mi * 5 + 3], p.moves[mi * 5 + 4]});
      const fm::transfer::TransferPlan tp = fm::transfer::plan_transfers(moves, before, p.topo, opt);
      for (const fm::transfer::Chunk &c : tp.chunks)
        chunks.insert(chunks.end(), {l, c.move_idx, static_cast<std::int64_t>(c.path), c.src_gpu, c.src_slot, c.dst_gpu,
                                     c.dst_slot, c.expert, c.offset_bytes, c.num_bytes, c.round});
      for (const fm::transfer::SourceReason r : tp.source_reason)
        reasons.push_back(static_cast<std::int8_t>(r));
      est.push_back(tp.est_seconds);
      bound.push_back(tp.link_bound_seconds);
      rounds.push_back(tp.num_rounds);
      path_bytes.insert(path_bytes.end(), tp.path_bytes.begin(), tp.path_bytes.end());
    }
  }
  nb::dict out;
  const std::size_t n = chunks.size() / 11;
  out["chunks"] = owned_array(std::move(chunks), {n, 11});
  out["chunk_columns"] =
      std::vector<std::string>{"layer",    "move",   "path",         "src_gpu",   "src_slot", "dst_gpu",
                               "dst_slot", "expert", "offset_bytes", "num_bytes", "round"};
  out["paths"] = std::vector<std::string>{"nvlink", "pcie", "network"};
  // Per move of `Plan.moves`, in order: why it reads from its source (the planner's unless overridden).
  const std::size_t num_moves = reasons.size();
  out["source_reason"] = owned_array(std::move(reasons), {num_moves});
  std::vector<std::string> reason_names;
  for (int r = 0; r < fm::transfer::num_source_reasons; ++r)
    reason_names.emplace_back(fm::transfer::to_string(static_cast<fm::transfer::SourceReason>(r)));
  out["source_reasons"] = std::move(reason_names);
  out["est_seconds"] = owned_array(std::move(est), {static_cast<std::size_t>(p.L)});
  out["link_bound_seconds"] = owned_array(std::move(bound), {static_cast<std::size_t>(p.L)});
  out["num_rounds"] = owned_array(std::move(rounds), {static_cast<std::size_t>(p.L)});
  out["path_bytes"] = owned_array(std::move(path_bytes), {static_cast<std::size_t>(p.L), std::size_t{3}});
  return out;
}

/// `Plan.map_tokens`: the physical slot of every routed id, `[T, L_trace, K]` int32 (-1: no route or dense layer).
nb::ndarray<nb::numpy, std::int32_t> plan_map_tokens(const PyPlan &p, const RoIds &ids, nb::handle layer_map_arg) {
  std::optional<std::vector<int>> layer_map;
  if (!layer_map_arg.is_none())
    layer_map = nb::cast<std::vector<int>>(args_helper("int_list")(layer_map_arg, "map_tokens: layer_map"));
  const fm::RoutedView view = routed_view(ids, "map_tokens");
  const fm::LayerMap lmap = layer_map ? fm::LayerMap(*layer_map) : fm::LayerMap::identity(view.num_layers());
  require(lmap.num_moe_layers() == p.L, "map_tokens: the layer map has ", lmap.num_moe_layers(),
          " MoE layers, the plan ", p.L);
  std::vector<std::int32_t> out(static_cast<std::size_t>(view.num_tokens()) * view.num_layers() * view.topk());
  {
    nb::gil_scoped_release nogil;
    const std::size_t P = static_cast<std::size_t>(p.G) * p.S;
    std::vector<fm::TokenRanges> ranges;
    ranges.reserve(static_cast<std::size_t>(p.L));
    for (int l = 0; l < p.L; ++l)
      ranges.push_back(fm::token_ranges(std::span<const std::int32_t>(p.gpu_slots.data() + l * P, P), p.E,
                                        std::span<const std::int64_t>(p.slot_tokens.data() + l * P, P)));
    fm::map_tokens(ranges, view, lmap, out);
  }
  return owned_array(std::move(out),
                     {static_cast<std::size_t>(view.num_tokens()), static_cast<std::size_t>(view.num_layers()),
                      static_cast<std::size_t>(view.topk())});
}

// ---------------------------------------------------------------------------------------------------------------
// Planner

struct PyPlanner {
  fm::Topology topo;
  fm::PlannerOptions opts;
  std::unique_ptr<fm::Planner> planner;
  double last_planner_seconds = 0;
  // One C++ planner keeps scratch state between calls and is rebuilt when the shape changes, so calls on one
  // Python object from several threads (a ReplayDriver's thread and the trainer's) take turns here, with the GIL
  // released while they wait.
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();

  fm::Planner &get(int L, int E) {
    if (!planner || planner->num_layers() != L || planner->num_experts() != E)
      planner = std::make_unique<fm::Planner>(L, E, topo, opts);
    return *planner;
  }
};

/// A planner from `options`: JSON text of `planner_schema()` keys (Python's keyword arguments).
PyPlanner make_planner(const fm::Topology &topo, const std::string &options) {
  topo.validate();
  PyPlanner p{topo, {}, nullptr, 0, std::make_shared<std::mutex>()};
  fm::config::planner_schema().read(p.opts, fm::json::parse(options, "Planner"), "Planner");
  return p;
}

fm::Stage parse_stage(const std::string &s) {
  if (s == "update") return fm::Stage::update;
  if (s == "recompute") return fm::Stage::recompute;
  fail("unknown stage '", s, "' (expected update or recompute)");
}

using RoLoads = nb::ndarray<nb::ro, const std::int64_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using RoLayerLoads = nb::ndarray<nb::ro, const std::int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

const fm::Placement *check_resident(const PyPlacement *resident, const fm::Topology &topo, int L, int E) {
  if (resident == nullptr) return nullptr;
  require(resident->topo.num_gpus() == topo.num_gpus() && resident->topo.slots_per_gpu == topo.slots_per_gpu,
          "plan: resident placement is ", resident->topo.num_gpus(), " GPUs x ", resident->topo.slots_per_gpu,
          " slots, the planner's topology ", topo.num_gpus(), " x ", topo.slots_per_gpu);
  require(resident->num_experts == E, "plan: resident placement has ", resident->num_experts,
          " experts, the loads have ", E);
  require(resident->placement.num_layers() == L, "plan: resident placement has ", resident->placement.num_layers(),
          " layers, the loads have ", L);
  return &resident->placement;
}

fm::LoadTensor load_tensor(const RoLoads &loads) {
  require(loads.shape(0) < (1u << 30) && loads.shape(1) > 0 && loads.shape(2) > 0,
          "plan: loads must be [micro_steps, layers, experts] with layers, experts > 0, got [", loads.shape(0), ", ",
          loads.shape(1), ", ", loads.shape(2), "]");
  return fm::LoadTensor::from_counts({loads.data(), loads.size()}, static_cast<int>(loads.shape(0)),
                                     static_cast<int>(loads.shape(1)), static_cast<int>(loads.shape(2)));
}

using RoOwners = nb::ndarray<nb::ro, const std::int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

/// The `[L, E]` owner array as the planner's owner map (shape checked here; values by the planner).
fm::Planner::OwnerMap owner_map(const RoOwners &owners, int L, int E) {
  require(static_cast<int>(owners.shape(0)) == L && static_cast<int>(owners.shape(1)) == E, "plan: owners is [",
          owners.shape(0), ", ", owners.shape(1), "], expected [", L, ", ", E, "] (owner GPU of every expert)");
  fm::Planner::OwnerMap map(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l)
    map[l].assign(owners.data() + static_cast<std::size_t>(l) * E, owners.data() + static_cast<std::size_t>(l + 1) * E);
  return map;
}

std::vector<PyPlan> plan_step(PyPlanner &self, const RoLoads &loads, const PyPlacement *resident,
                              std::optional<RoLayerLoads> previous, const std::string &stage_name,
                              std::optional<RoOwners> owners, fm::HeldGradients *held) {
  const fm::Stage stage = parse_stage(stage_name);
  const int L = static_cast<int>(loads.shape(1)), E = static_cast<int>(loads.shape(2));
  std::span<const std::int64_t> prev;
  if (previous) {
    require(static_cast<int>(previous->shape(0)) == L && static_cast<int>(previous->shape(1)) == E,
            "plan: previous_loads is [", previous->shape(0), ", ", previous->shape(1), "], expected [", L, ", ", E,
            "]");
    prev = {previous->data(), previous->size()};
  }
  std::vector<PyPlan> out;
  nb::gil_scoped_release nogil;
  const std::lock_guard<std::mutex> turn(*self.mu);
  const fm::LoadTensor t = load_tensor(loads);
  fm::Planner &p = self.get(L, E);
  const fm::Placement *res = check_resident(resident, self.topo, L, E);
  require(!(owners && previous), "plan: owners and previous_loads cannot be combined (fixed owners skip the "
                                 "step-level planning that previous_loads feeds)");
  require(held == nullptr || owners, "plan: held needs owners (it chains one stage's micro-steps under fixed owners)");
  const auto sp = std::make_shared<const fm::StepPlan>(
      owners ? p.plan_step_with_owners(t, owner_map(*owners, L, E), res, stage, held)
             : p.plan_step(t, res, prev, stage));
  self.last_planner_seconds = sp->planner_seconds;
  out.reserve(sp->micro_steps.size());
  for (std::size_t m = 0; m < sp->micro_steps.size(); ++m) {
    out.emplace_back(self.topo, E, sp->micro_steps[m]);
    out.back().planner_seconds = sp->planner_seconds;
    out.back().step = sp;
    out.back().index = m;
    out.back().strategy = self.opts.strategy;
  }
  return out;
}

/// Seconds per `plan_step` call measured inside C++ (the baseline for the Python-call overhead).
double bench_cpp_plan(PyPlanner &self, const RoLoads &loads, const PyPlacement *resident, int iters) {
  require(iters > 0, "iters must be positive");
  const int L = static_cast<int>(loads.shape(1)), E = static_cast<int>(loads.shape(2));
  nb::gil_scoped_release nogil;
  const std::lock_guard<std::mutex> turn(*self.mu);
  const fm::LoadTensor t = load_tensor(loads);
  fm::Planner &p = self.get(L, E);
  const fm::Placement *res = check_resident(resident, self.topo, L, E);
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t sink = 0;
  for (int i = 0; i < iters; ++i)
    sink += p.plan_step(t, res, {}, fm::Stage::update).micro_steps.size();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  require(sink > 0 || t.num_micro_steps() == 0, "bench: no plans");
  return s / iters;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch across ranks (foremoe.torch): a layer plan's split by source rank, one source's token map.

const fm::LayerPlan &layer_plan(const PyPlan &p, int layer, const char *who) {
  require(p.step != nullptr && p.index < p.step->micro_steps.size(), who, ": a plan without its step");
  require(layer >= 0 && layer < p.L, who, ": layer ", layer, " outside the plan's [0, ", p.L, ")");
  return p.step->micro_steps[p.index][static_cast<std::size_t>(layer)];
}

/// `Plan.source_split`: `[G * S, G]` tokens each physical slot takes from each source rank (`split_by_source`),
/// from the layer's `[E, G]` per-source loads.
nb::ndarray<nb::numpy, std::int64_t> plan_source_split(const PyPlan &p, nb::handle layer_arg, nb::handle loads_arg) {
  const fm::LayerPlan &lp = layer_plan(p, int_arg(layer_arg, "source_split: layer"), "source_split");
  // A NaN or a negative count is named here, by position, before any cast.
  const auto source_loads = int_array_arg<std::int64_t>(loads_arg, "source_split: source_loads", 0);
  require(source_loads.ndim() == 2, "source_split: source loads must be 2-D [experts, source ranks], got ",
          source_loads.ndim(), " dims");
  require(static_cast<int>(source_loads.shape(0)) == p.E && static_cast<int>(source_loads.shape(1)) == p.G,
          "source_split: source loads are [", source_loads.shape(0), ", ", source_loads.shape(1), "], expected [", p.E,
          ", ", p.G, "] (experts x source ranks)");
  std::vector<std::int64_t> out;
  {
    nb::gil_scoped_release nogil;
    out = fm::split_by_source(lp.placement, lp.slot_tokens, {source_loads.data(), source_loads.size()}, p.G,
                              p.topo.gpus_per_node);
  }
  return owned_array(std::move(out), {static_cast<std::size_t>(p.G) * p.S, static_cast<std::size_t>(p.G)});
}

using RoMap = nb::ndarray<nb::ro, const std::uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using RwIds32 = nb::ndarray<std::int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using RwCounts = nb::ndarray<std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// A dispatch layout as the dict `Plan.dispatch` returns (NumPy arrays over the layout's buffers).
nb::dict layout_dict(fm::DispatchLayout &&d, const fm::RoutedView &view) {
  auto vec1 = [](auto &&v) {
    const std::size_t m = v.size();
    return owned_array(std::move(v), {m});
  };
  nb::dict out;
  out["slots"] = owned_array(std::move(d.slots),
                             {static_cast<std::size_t>(view.num_tokens()), static_cast<std::size_t>(view.topk())});
  out["order"] = vec1(std::move(d.order));
  out["send_tokens"] = vec1(std::move(d.send_tokens));
  out["send_experts"] = vec1(std::move(d.send_experts));
  out["route_pos"] = vec1(std::move(d.route_pos));
  out["input_splits"] = vec1(std::move(d.input_splits));
  out["output_splits"] = vec1(std::move(d.output_splits));
  out["slot_counts"] = vec1(std::move(d.slot_counts));
  out["recv_perm"] = vec1(std::move(d.recv_perm));
  out["recv_inverse"] = vec1(std::move(d.recv_inverse));
  return out;
}

/// `Plan.dispatch`: rank `rank`'s `[T, 1, K]` ids mapped through the layer's placement with its column of the
/// `[G * S, G]` split (`source_split`), and everything `all_to_all_single` needs, in one pass each:
/// `slots` `[T, K]` int32 (-1 = no route); `order` the routed `token * K + k` sorted by physical slot (a counting
/// sort over the exact counts; token order inside a slot), the send order; `send_tokens` their tokens;
/// `input_splits` / `output_splits` `[G]` rows to / from each rank; `slot_counts` `[S]` rows per local slot;
/// `recv_perm` the received row of each position grouped by local slot (sources in rank order inside a slot)
/// and `recv_inverse` its inverse.
nb::dict plan_dispatch(const PyPlan &p, nb::handle layer_arg, const RoIds &ids, nb::handle split_arg,
                       nb::handle rank_arg, const std::string &rule_name) {
  const fm::TokenMapRule rule = fm::parse_token_map_rule(rule_name, "dispatch: rule");
  const fm::LayerPlan &lp = layer_plan(p, int_arg(layer_arg, "dispatch: layer"), "dispatch");
  const int rank = int_arg(rank_arg, "dispatch: rank");
  const auto split = int_array_arg<std::int64_t>(split_arg, "dispatch: split", 0);
  require(split.ndim() == 2, "dispatch: the split must be 2-D [slots, source ranks], got ", split.ndim(), " dims");
  const fm::RoutedView view = routed_view(ids, "dispatch");
  const std::size_t G = static_cast<std::size_t>(p.G), P = G * static_cast<std::size_t>(p.S);
  require(split.shape(0) == P && split.shape(1) == G, "dispatch: the split is [", split.shape(0), ", ", split.shape(1),
          "], expected [", P, ", ", G, "] (slots x source ranks, from source_split)");
  fm::DispatchLayout d;
  {
    nb::gil_scoped_release nogil;
    d = fm::dispatch_layout(lp.placement, {split.data(), split.size()}, view, rank, rule, p.topo.gpus_per_node);
  }
  return layout_dict(std::move(d), view);
}

/// `Plan.dispatch_loads`: `dispatch` with the split made here from the layer's `[E, G]` per-source loads (C order
/// int64: every rank's routed count of each expert), as `source_split` makes it; the same dict plus `split`
/// `[G * S, G]`. One call from the gathered counts to the layout (foremoe.torch's per-call path).
nb::dict plan_dispatch_loads(const PyPlan &p, int layer, const RoIds &ids, const RoLayerLoads &loads, int rank) {
  const fm::LayerPlan &lp = layer_plan(p, layer, "dispatch_loads");
  require(static_cast<int>(loads.shape(0)) == p.E && static_cast<int>(loads.shape(1)) == p.G,
          "dispatch_loads: source loads are [", loads.shape(0), ", ", loads.shape(1), "], expected [", p.E, ", ", p.G,
          "] (experts x source ranks)");
  const fm::RoutedView view = routed_view(ids, "dispatch_loads");
  fm::DispatchLayout d;
  std::vector<std::int64_t> split;
  {
    nb::gil_scoped_release nogil;
    d = fm::dispatch_from_loads(lp.placement, lp.slot_tokens, {loads.data(), loads.size()}, view, rank,
                                p.topo.gpus_per_node, fm::TokenMapRule::positional, &split);
  }
  nb::dict out = layout_dict(std::move(d), view);
  out["split"] = owned_array(std::move(split), {static_cast<std::size_t>(p.G) * p.S, static_cast<std::size_t>(p.G)});
  return out;
}

/// `routes_from_map`: Megatron's `[T, E]` routing map (bytes 0/1, C order; a bool tensor viewed as uint8) to
/// `ids` `[T, topk]` int32 (ascending, -1 padded) and `counts` `[E]` int64, both written in place (tensors or
/// arrays the caller allocated). Returns how many tokens have fewer than `topk` routes.
std::int64_t routes_from_map(const RoMap &map, int topk, RwIds32 ids, RwCounts counts) {
  require(ids.shape(0) == map.shape(0) && static_cast<int>(ids.shape(1)) == topk, "routes_from_map: ids are [",
          ids.shape(0), ", ", ids.shape(1), "], expected [", map.shape(0), ", ", topk, "]");
  std::int64_t short_tokens = 0;
  {
    nb::gil_scoped_release nogil;
    short_tokens = fm::routes_from_map({map.data(), map.size()}, static_cast<std::int64_t>(map.shape(0)),
                                       static_cast<int>(map.shape(1)), topk, {ids.data(), ids.size()},
                                       {counts.data(), counts.size()});
  }
  return short_tokens;
}

using RoI32 = nb::ndarray<nb::ro, const std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using RwRows = nb::ndarray<std::int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using RoFlags = nb::ndarray<nb::ro, const std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// `replica_sync`: the bookkeeping of foremoe.torch's `ExpertStorage` for one layer plan, the same on every rank.
/// `owners` `[E]` owner rank of every expert; `resident` `[G, S]` the expert in each storage row of every rank (-1
/// free; rows below a rank's owned count are its owner rows), updated in place to the plan's replicas: a replica
/// already resident stays (unless its owner's weights `changed`), the others take the lowest free rows in expert
/// order. Returns `moves` (the count, all ranks), `my_moves` `[n, 5]` (tag, expert, source, destination,
/// destination row) of those naming `rank`, sorted by expert then destination; `all_moves` `[moves, 4]` (expert,
/// source, destination, destination row) of every move in the same order; `reused`; `rows` `[S]` the storage
/// row of each of `rank`'s plan slots (-1 empty); `grads` `[m, 4]` (expert, holder, holder row, tag) of the replica
/// gradient transfers naming `rank` (replicas given tokens, sorted by expert then holder).
nb::dict replica_sync(const PyPlan &p, int layer, const RoI32 &owners, RwRows resident, const RoFlags &changed,
                      int rank) {
  const fm::LayerPlan &lp = layer_plan(p, layer, "replica_sync");
  require(static_cast<int>(resident.shape(0)) == p.G && static_cast<int>(resident.shape(1)) == p.S,
          "replica_sync: resident rows are [", resident.shape(0), ", ", resident.shape(1), "], expected [", p.G, ", ",
          p.S, "]");
  fm::ReplicaSync r;
  {
    nb::gil_scoped_release nogil;
    r = fm::replica_sync(lp, layer, {owners.data(), owners.size()}, {resident.data(), resident.size()},
                         {changed.data(), changed.size()}, rank);
  }
  nb::dict out;
  out["moves"] = r.moves;
  out["reused"] = r.reused;
  const std::size_t nm = r.my_moves.size() / 5, ng = r.grads.size() / 4;
  out["my_moves"] = owned_array(std::move(r.my_moves), {nm, 5});
  out["all_moves"] = owned_array(std::move(r.all_moves), {static_cast<std::size_t>(r.moves), 4});
  out["rows"] = owned_array(std::move(r.rows), {static_cast<std::size_t>(p.S)});
  out["grads"] = owned_array(std::move(r.grads), {ng, 4});
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Synthetic traces: keyword arguments (JSON text of `synthetic_settings_schema()` keys, the flags of `foremoe
// trace gen`) read by the same reader as the program, messages naming `where` ("synthetic_trace.topk").

nb::dict synthetic_trace(const std::string &config) {
  const fm::SyntheticConfig cfg =
      fm::config::read_synthetic(fm::json::parse(config, "synthetic_trace"), "synthetic_trace");
  fm::SyntheticTrace t;
  {
    nb::gil_scoped_release nogil;
    t = fm::generate_trace(cfg);
  }
  nb::dict out;
  out["routed_ids"] =
      owned_array(std::move(t.routed_ids), {static_cast<std::size_t>(t.num_tokens),
                                            static_cast<std::size_t>(t.num_layers), static_cast<std::size_t>(t.topk)});
  auto vec1 = [](std::vector<std::int64_t> &&v) {
    const std::size_t n = v.size();
    return owned_array(std::move(v), {n});
  };
  out["microbatch_offsets"] = vec1(std::move(t.microbatch_offsets));
  out["source_offsets"] = vec1(std::move(t.source_offsets));
  out["step_offsets"] = vec1(std::move(t.step_offsets));
  out["sequence_offsets"] = vec1(std::move(t.sequence_offsets));
  out["num_experts"] = t.num_experts;
  out["num_sources"] = cfg.num_gpus;
  return out;
}

nb::dict synthetic_loads(const std::string &config, bool by_source) {
  const fm::SyntheticConfig cfg =
      fm::config::read_synthetic(fm::json::parse(config, "synthetic_loads"), "synthetic_loads");
  auto *t = new fm::LoadTensor();
  std::vector<std::int64_t> steps;
  try {
    nb::gil_scoped_release nogil;
    *t = fm::generate_loads(cfg, &steps, by_source);
  } catch (...) {
    delete t;
    throw;
  }
  nb::capsule owner(t, [](void *p) noexcept { delete static_cast<fm::LoadTensor *>(p); });
  const std::size_t M = t->num_micro_steps(), L = t->num_layers(), E = t->num_experts();
  nb::dict out;
  const std::size_t shape[3] = {M, L, E};
  out["loads"] = nb::ndarray<nb::numpy, std::int64_t>(t->totals().data(), 3, shape, owner);
  out["loads_by_source"] = nb::none();
  if (t->has_sources()) {
    const std::size_t shape4[4] = {M, L, E, static_cast<std::size_t>(t->num_sources())};
    out["loads_by_source"] = nb::ndarray<nb::numpy, std::int64_t>(t->by_source().data(), 4, shape4, owner);
  }
  const std::size_t n = steps.size();
  out["step_offsets"] = owned_array(std::move(steps), {n});
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Schema-driven entry points: the same reader, defaults, messages and documents as the `foremoe` program.

using Flags = std::vector<std::pair<std::string, std::string>>;

/// The simulate settings from a config document (JSON text, named "config") and command-line style flags.
fm::config::SimulateSettings simulate_settings(const std::optional<std::string> &config, const Flags &flags) {
  const auto &schema = fm::config::simulate_schema();
  const fm::json::Value file = config ? fm::json::parse(*config, "config") : fm::json::Value(fm::json::Object{});
  const fm::json::Value cli = schema.flags_document(flags);
  const fm::config::Schema<fm::config::SimulateSettings>::Layer layers[] = {{&file, "config"}, {&cli, "--"}};
  return fm::config::simulate_settings(layers);
}

std::string simulate(const std::optional<std::string> &config, const Flags &flags, std::optional<RoLoads> loads_arr,
                     std::optional<RoI64> step_offsets) {
  const fm::config::SimulateSettings s = simulate_settings(config, flags);
  nb::gil_scoped_release nogil;
  fm::LoadTensor loads;
  std::vector<std::int64_t> steps;
  if (loads_arr) {
    loads = load_tensor(*loads_arr);
    const auto so = span_of(step_offsets);
    steps.assign(so.begin(), so.end());
  } else {
    require(!step_offsets, "simulate: step_offsets need loads (the generator makes its own)");
  }
  return fm::json::dump(
      fm::cli::run_simulate(s, loads_arr ? &loads : nullptr, steps, {}, nullptr, fm::cli::default_loads()));
}

/// (summary line, table or CSV) of a simulate document, as `foremoe simulate` prints them.
nb::tuple simulate_text(const std::optional<std::string> &config, const Flags &flags, const std::string &doc,
                        bool csv) {
  const fm::json::Value d = fm::json::parse(doc, "simulate document");
  const fm::config::SimulateSettings s = simulate_settings(config, flags);
  return nb::make_tuple(fm::config::simulate_summary(s, d),
                        csv ? fm::config::simulate_csv(d) : fm::config::simulate_table(d));
}

std::string options(const std::string &command) {
  if (command == "simulate") return fm::json::dump(fm::config::simulate_schema().describe());
  if (command == "plan") return fm::json::dump(fm::config::plan_schema().describe());
  if (command == "planner") return fm::json::dump(fm::config::planner_schema().describe());
  if (command == "synthetic") return fm::json::dump(fm::config::synthetic_settings_schema().describe());
  if (command == "count") return fm::json::dump(fm::config::count_schema().describe());
  if (command == "move") return fm::json::dump(fm::config::move_schema().describe());
  fail("options: unknown command '", command, "' (expected simulate, plan, planner, synthetic, count or move)");
}

std::string plan_settings(const Flags &flags) {
  fm::config::PlanSettings s;
  fm::config::plan_schema().read(s, fm::config::plan_schema().flags_document(flags), "--");
  return fm::json::dump(fm::config::plan_schema().write(s));
}

std::string plan_document(const std::vector<const PyPlan *> &plans) {
  require(!plans.empty(), "plan_document: no plans");
  const PyPlan &first = *plans.front();
  std::vector<std::vector<fm::LayerPlan>> micro;
  for (const PyPlan *p : plans) {
    require(p->step != nullptr, "plan_document: a plan without its step");
    micro.push_back(p->step->micro_steps[p->index]);
  }
  const fm::config::PlanHeader h{first.strategy, first.topo, first.L, first.E, first.planner_seconds};
  return fm::json::dump(fm::config::plan_document(h, micro));
}

// ---------------------------------------------------------------------------------------------------------------
// foremoe.megatron's per-call path (issue 28, "Performance"): the dispatch layout and the adapter's index arrays in
// one call after the counts are gathered, and the received rows regrouped by storage row after the replica sync.

using RoVec64 = nb::ndarray<nb::ro, const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// `adapter_dispatch`: `Plan.dispatch_loads`'s layout plus `plan/adapter_layout.hpp`'s `adapter_index` for a
/// `[T, prob_columns]` probability matrix, as a tuple (each NumPy array costs about a microsecond to hand over, so
/// the small fields travel packed and the large ones as they are, without a copy): `(small, order, send_tokens,
/// prob_index, route_pos, gather, recv_perm, recv_inverse, slots, send_experts)`; `small` is int64 `[padded,
/// input_splits (G), output_splits (G), slot_counts (S), split (G * S * G)]`; `gather` is `None` when no route is
/// unsent (it equals `route_pos` then); `slots` (`[T, K]`) and `send_experts` are int32, the rest int64.
nb::tuple adapter_dispatch(const PyPlan &p, int layer, const RoIds &ids, const RoLayerLoads &loads, int rank,
                           std::int64_t prob_columns) {
  const fm::LayerPlan &lp = layer_plan(p, layer, "adapter_dispatch");
  require(static_cast<int>(loads.shape(0)) == p.E && static_cast<int>(loads.shape(1)) == p.G,
          "adapter_dispatch: source loads are [", loads.shape(0), ", ", loads.shape(1), "], expected [", p.E, ", ", p.G,
          "] (experts x source ranks)");
  const fm::RoutedView view = routed_view(ids, "adapter_dispatch");
  fm::DispatchLayout d;
  fm::AdapterIndex a;
  std::vector<std::int64_t> small;
  {
    nb::gil_scoped_release nogil;
    std::vector<std::int64_t> split;
    d = fm::dispatch_from_loads(lp.placement, lp.slot_tokens, {loads.data(), loads.size()}, view, rank,
                                p.topo.gpus_per_node, fm::TokenMapRule::positional, &split);
    a = fm::adapter_index(d, prob_columns);
    small.reserve(1 + 2 * d.input_splits.size() + d.slot_counts.size() + split.size());
    small.push_back(a.padded ? 1 : 0);
    const std::vector<std::int64_t> *parts[] = {&d.input_splits, &d.output_splits, &d.slot_counts, &split};
    for (const std::vector<std::int64_t> *v : parts)
      small.insert(small.end(), v->begin(), v->end());
  }
  auto vec1 = [](auto &&v) {
    const std::size_t m = v.size();
    return nb::cast(owned_array(std::move(v), {m}));
  };
  const std::size_t n_small = small.size();
  nb::object gather = a.padded ? vec1(std::move(a.gather)) : nb::none();
  return nb::make_tuple(owned_array(std::move(small), {n_small}), vec1(std::move(d.order)),
                        vec1(std::move(d.send_tokens)), vec1(std::move(a.prob_index)), vec1(std::move(d.route_pos)),
                        gather, vec1(std::move(d.recv_perm)), vec1(std::move(d.recv_inverse)),
                        owned_array(std::move(d.slots), {static_cast<std::size_t>(view.num_tokens()),
                                                         static_cast<std::size_t>(view.topk())}),
                        vec1(std::move(d.send_experts)));
}

/// `group_by_storage_row`: `plan/adapter_layout.hpp`'s, as `(counts, recv_perm, recv_inverse, reordered)`.
nb::tuple group_by_storage_row(const RoVec64 &slot_counts, const RoVec64 &rows, std::int64_t rows_total,
                               const RoVec64 &recv_perm) {
  fm::RowGrouping g;
  {
    nb::gil_scoped_release nogil;
    g = fm::group_by_storage_row({slot_counts.data(), slot_counts.size()}, {rows.data(), rows.size()}, rows_total,
                                 {recv_perm.data(), recv_perm.size()});
  }
  const std::size_t nc = g.counts.size(), n = g.recv_perm.size();
  return nb::make_tuple(owned_array(std::move(g.counts), {nc}), owned_array(std::move(g.recv_perm), {n}),
                        owned_array(std::move(g.recv_inverse), {n}), g.reordered);
}

} // namespace

NB_MODULE(_core, m) {
  m.doc() = "ForeMoE C++ core (internal; use the `foremoe` package)";
  m.attr("__version__") = fm::version_string;

  nb::register_exception_translator([](const std::exception_ptr &p, void *) {
    try {
      std::rethrow_exception(p);
    } catch (const fm::Error &e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def(
      "_data_address", [](const RoIds &a) { return reinterpret_cast<std::uintptr_t>(a.data()); }, "a"_a,
      "Address the C++ side reads for `a` (equal to the array's own address when no copy was made).");

  m.def("count_loads", &count_loads, "routed_experts"_a, "microbatch_offsets"_a.none(), "num_experts"_a,
        "layer_map"_a.none(), "num_sources"_a, "source_offsets"_a.none(), "mask"_a.none());

  nb::class_<fm::Topology>(m, "Topology")
      .def(
          "__init__",
          [](fm::Topology *t, nb::handle nodes, nb::handle gpus_per_node, nb::handle slots) {
            fm::Topology topo{int_arg(nodes, "Topology: nodes"), int_arg(gpus_per_node, "Topology: gpus_per_node"),
                              int_arg(slots, "Topology: slots")};
            topo.validate();
            new (t) fm::Topology(topo);
          },
          "nodes"_a, "gpus_per_node"_a, "slots"_a,
          "The expert-parallel group: nodes x gpus_per_node GPUs, `slots` expert slots per GPU per layer.\n"
          "What moves cost on each path is the cost model's (`cost.move_*` settings), not part of the shape.")
      .def("__repr__",
           [](const fm::Topology &t) {
             return "Topology(" + std::to_string(t.num_nodes) + ", " + std::to_string(t.gpus_per_node) + ", " +
                    std::to_string(t.slots_per_gpu) + ")";
           })
      .def_ro("nodes", &fm::Topology::num_nodes)
      .def_ro("gpus_per_node", &fm::Topology::gpus_per_node)
      .def_ro("slots", &fm::Topology::slots_per_gpu)
      .def_prop_ro("num_gpus", &fm::Topology::num_gpus)
      .def(
          "validate",
          [](const fm::Topology &t, nb::handle e) {
            e.is_none() ? t.validate() : t.validate(int_arg(e, "Topology.validate: num_experts"));
          },
          "num_experts"_a.none() = nb::none());

  nb::class_<PyPlacement>(m, "Placement")
      .def_static("from_array", &placement_from_array, "topology"_a, "gpu_slots"_a, "num_experts"_a)
      .def_prop_ro("topology", [](const PyPlacement &p) { return p.topo; })
      .def_prop_ro("num_layers", [](const PyPlacement &p) { return p.placement.num_layers(); })
      .def_prop_ro("num_experts", [](const PyPlacement &p) { return p.num_experts; })
      .def_prop_ro("gpu_slots",
                   [](const PyPlacement &p) {
                     return owned_array(p.flat(), {static_cast<std::size_t>(p.placement.num_layers()),
                                                   static_cast<std::size_t>(p.topo.num_gpus()),
                                                   static_cast<std::size_t>(p.topo.slots_per_gpu)});
                   })
      .def("validate", [](const PyPlacement &p) { p.placement.validate(); })
      .def("__eq__", [](const PyPlacement &a, const PyPlacement &b) {
        return a.num_experts == b.num_experts && a.placement == b.placement;
      });

  nb::class_<PyPlan>(m, "Plan")
      .def_ro("num_layers", &PyPlan::L)
      .def_ro("num_gpus", &PyPlan::G)
      .def_ro("slots", &PyPlan::S)
      .def_ro("num_experts", &PyPlan::E)
      .def_ro("planner_seconds", &PyPlan::planner_seconds)
      .def_prop_ro("topology", [](const PyPlan &p) { return p.topo; })
      .def_prop_ro("placement", &PyPlan::placement)
#define FM_VIEW(name, field, ...)                                                                                      \
  .def_prop_ro(name, [](nb::handle self) {                                                                             \
    const PyPlan &p = nb::cast<const PyPlan &>(self);                                                                  \
    return view_array(p.field, {__VA_ARGS__}, self);                                                                   \
  })
      // clang-format off
      FM_VIEW("gpu_slots", gpu_slots, (size_t)p.L, (size_t)p.G, (size_t)p.S)
      FM_VIEW("phys_to_log", gpu_slots, (size_t)p.L, (size_t)p.G * p.S)
      FM_VIEW("slot_tokens", slot_tokens, (size_t)p.L, (size_t)p.G, (size_t)p.S)
      FM_VIEW("gpu_loads", gpu_loads, (size_t)p.L, (size_t)p.G)
      FM_VIEW("log_to_phys_offsets", l2p_offsets, (size_t)p.L, (size_t)p.E + 1)
      FM_VIEW("log_to_phys", l2p_phys, (size_t)p.L, (size_t)p.G * p.S)
      FM_VIEW("replica_count", replica_count, (size_t)p.L, (size_t)p.E)
      FM_VIEW("owner_gpu", owner_gpu, (size_t)p.L, (size_t)p.E)
      FM_VIEW("moves", moves, p.moves.size() / 5, (size_t)5)
      FM_VIEW("imbalance", imbalance, (size_t)p.L)
      FM_VIEW("max_gpu_load", max_gpu_load, (size_t)p.L)
  // clang-format on
#undef FM_VIEW
      .def_prop_ro("num_moves", [](const PyPlan &p) { return p.moves.size() / 5; })
      .def_ro("tolerance_met", &PyPlan::tolerance_met,
              "per layer: false where the asked-for imbalance tolerance "
              "was not met (the plan is then the best found)")
      .def("map_tokens", &plan_map_tokens, "routed_experts"_a, "layer_map"_a.none() = nb::none())
      .def("source_split", &plan_source_split, "layer"_a, "source_loads"_a)
      .def("dispatch_loads", &plan_dispatch_loads, "layer"_a, "routed_experts"_a, "source_loads"_a, "rank"_a)
      .def("dispatch", &plan_dispatch, "layer"_a, "routed_experts"_a, "split"_a, "rank"_a,
           "rule"_a = std::string(fm::to_string(fm::TokenMapRule::positional)))
      .def("transfers", &plan_transfers, "resident"_a.none() = nb::none(), "expert_bytes"_a,
           "max_chunk_bytes"_a = std::int64_t{64} << 20, "split_paths"_a = true, "host_mirror"_a = true,
           "allow_network"_a = true, "move"_a.none() = nb::none());

  nb::class_<fm::HeldGradients>(m, "HeldGradients")
      .def(nb::init<int, int, int>(), "layers"_a, "gpus"_a, "experts"_a)
      .def_prop_ro("num_layers", &fm::HeldGradients::num_layers)
      .def_prop_ro("num_gpus", &fm::HeldGradients::num_gpus)
      .def_prop_ro("num_experts", &fm::HeldGradients::num_experts)
      .def("count", &fm::HeldGradients::count, "layer"_a)
      .def("clear", &fm::HeldGradients::clear);

  nb::class_<PyPlanner>(m, "Planner")
      .def(nb::new_(&make_planner), "topology"_a, "options"_a)
      .def_prop_ro("topology", [](const PyPlanner &p) { return p.topo; })
      .def_prop_ro("strategy", [](const PyPlanner &p) { return p.opts.strategy; })
      .def_prop_ro("move_budget",
                   [](const PyPlanner &p) -> std::optional<int> {
                     if (p.opts.move_budget < 0) return std::nullopt;
                     return p.opts.move_budget;
                   })
      .def_prop_ro("threads", [](const PyPlanner &p) { return p.opts.num_threads; })
      .def_ro("last_planner_seconds", &PyPlanner::last_planner_seconds)
      .def("plan_step", &plan_step, "loads"_a, "resident"_a.none(), "previous_loads"_a.none(), "stage"_a,
           "owners"_a.none() = nb::none(), "held"_a.none() = nb::none())
      .def("_bench_cpp_plan", &bench_cpp_plan, "loads"_a, "resident"_a.none(), "iters"_a);

  m.def(
      "cli",
      [](const std::vector<std::string> &args) {
        nb::gil_scoped_release release;
        return foremoe::cli::run_cli(args);
      },
      "args"_a, "Runs the `foremoe` program on `args` (the words after `foremoe`); returns its exit status.");
  m.def("simulate", &simulate, "config"_a.none(), "flags"_a, "loads"_a.none(), "step_offsets"_a.none());
  m.def(
      "simulate_settings",
      [](const std::optional<std::string> &config, const Flags &flags) {
        return fm::json::dump(fm::config::simulate_schema().write(simulate_settings(config, flags)), 2);
      },
      "config"_a.none(), "flags"_a);
  m.def("simulate_text", &simulate_text, "config"_a.none(), "flags"_a, "doc"_a, "csv"_a);
  m.def("options", &options, "command"_a);
  m.def(
      "breakdown_parts",
      [] {
        std::vector<std::pair<std::string, std::string>> out;
        for (const fm::BreakdownPart &p : fm::breakdown_parts)
          out.emplace_back(std::string(p.name) + "_seconds", std::string(p.label));
        return out;
      },
      "The simulate breakdown's parts as (JSON key, label), in the order they are written and stacked.");
  m.def("trace_formats", &trace_formats, "The registered trace input formats in listing order, as dicts.");
  m.def(
      "detect_trace_format", [](const std::string &path) { return fm::detect_trace_format(path).name; }, "path"_a,
      "The format `--format auto` reads `path` as.");
  m.def("count_batch", &count_batch, "format"_a, "who"_a, "arrays"_a, "list_sizes"_a.none(), "mask"_a.none(),
        "micro_batches"_a.none(), "offsets"_a.none(), "num_experts"_a, "layer_map"_a.none(),
        "Loads of a trainer's in-memory routing (format of the C++ batch-format registry); device arrays as their "
        "layout give the parts to count there.");
  m.def("batch_formats", &batch_formats, "The registered in-memory trace formats.");
  m.def("read_trace", &read_trace, "path"_a, "format"_a, "data"_a.none(), "mask_path"_a.none(), "mask_data"_a.none(),
        "num_layers"_a, "topk"_a);
  m.def(
      "strategy_names",
      [] {
        std::vector<std::string> out;
        for (const fm::StrategyInfo *s : fm::strategies())
          out.push_back(s->name);
        return out;
      },
      "The registered planner strategies in listing order.");
  m.def(
      "sim_strategy_names",
      [] {
        std::vector<std::string> out;
        for (const fm::StrategyInfo *s : fm::strategies(true))
          out.push_back(s->name);
        return out;
      },
      "The strategies `simulate` accepts in listing order: the planner's and the simulator-only references "
      "(`ideal`).");
  m.def("plan_settings", &plan_settings, "flags"_a);
  m.def("plan_document", &plan_document, "plans"_a);
  m.def(
      "placement_document",
      [](const PyPlacement &p) { return fm::json::dump(fm::config::placement_document(p.topo, p.placement)); },
      "placement"_a);
  m.def(
      "read_placement",
      [](const std::string &text, const std::string &source, const fm::Topology &topo, int num_layers,
         int num_experts) {
        const fm::json::Value j = fm::json::parse(text, source);
        return PyPlacement{topo, num_experts, fm::config::read_placement(j, source, topo, num_layers, num_experts)};
      },
      "text"_a, "source"_a, "topology"_a, "num_layers"_a, "num_experts"_a);
  m.def("routes_from_map", &routes_from_map, "routing_map"_a, "topk"_a, "ids"_a, "counts"_a);
  m.def("replica_sync", &replica_sync, "plan"_a, "layer"_a, "owners"_a, "resident"_a, "changed"_a, "rank"_a);
  m.def("synthetic_trace", &synthetic_trace, "config"_a);
  m.def("synthetic_loads", &synthetic_loads, "config"_a, "by_source"_a);
  fm::python::bind_even_split(m);
  fm::python::bind_packing(m);
  fm::python::bind_runtime(m);

  // foremoe.megatron's per-call path (issue 28, "Performance").
  m.def("adapter_dispatch", &adapter_dispatch, "plan"_a, "layer"_a, "routed_experts"_a, "source_loads"_a, "rank"_a,
        "prob_columns"_a);
  m.def("group_by_storage_row", &group_by_storage_row, "slot_counts"_a, "rows"_a, "rows_total"_a, "recv_perm"_a);
}
