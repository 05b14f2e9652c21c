// `_core.pack_micro_batches` and `_core.pack_by_tokens`, what `foremoe.pack_micro_batches` calls
// (plan/packing.hpp). Compiled at -O3 like even_split_ext.cpp: the packer is arithmetic over histogram rows.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "foremoe/plan/packing.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace foremoe::python {
namespace {

template <class T, std::size_t N>
using RoArray = nb::ndarray<nb::ro, const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;

/// An int32 NumPy array over a vector it owns.
nb::ndarray<nb::numpy, std::int32_t> int32_array(std::vector<std::int32_t> v) {
  auto *out = new std::vector<std::int32_t>(std::move(v));
  nb::capsule owner(out, [](void *p) noexcept { delete static_cast<std::vector<std::int32_t> *>(p); });
  const std::size_t shape[1] = {out->size()};
  out->reserve(out->size() + 1); // a non-null data pointer when empty
  return nb::ndarray<nb::numpy, std::int32_t>(out->data(), 1, shape, owner);
}

nb::tuple pack(const RoArray<std::int64_t, 1> &lengths, const RoArray<std::int64_t, 3> &histograms,
               std::int64_t micro_steps, std::int64_t ranks, std::int64_t token_budget,
               const std::optional<RoArray<std::int32_t, 2>> &gpu_of, std::int64_t gpus,
               const std::optional<RoArray<std::int32_t, 1>> &start_micro_step,
               const std::optional<RoArray<std::int32_t, 1>> &start_rank, int max_passes, std::int64_t search_work) {
  detail::require(histograms.shape(0) == lengths.shape(0), "pack_micro_batches: histograms hold ", histograms.shape(0),
                  " sequences, lengths ", lengths.shape(0));
  PackingInput in;
  in.layers = static_cast<std::int64_t>(histograms.shape(1));
  in.experts = static_cast<std::int64_t>(histograms.shape(2));
  in.lengths = {lengths.data(), lengths.size()};
  in.histograms = {histograms.data(), histograms.size()};
  const PackingShape shape{micro_steps, ranks, token_budget};
  PackingOptions opt;
  if (gpu_of) {
    detail::require(static_cast<std::int64_t>(gpu_of->shape(0)) == in.layers &&
                        static_cast<std::int64_t>(gpu_of->shape(1)) == in.experts,
                    "pack_micro_batches: gpu_of has shape [", gpu_of->shape(0), ", ", gpu_of->shape(1),
                    "], expected [layers, experts] = [", in.layers, ", ", in.experts, "]");
    opt.gpu_of = {gpu_of->data(), gpu_of->size()};
    opt.gpus = gpus;
  }
  opt.max_passes = max_passes;
  opt.search_work = search_work;
  Packing start;
  if (start_micro_step)
    start.micro_step.assign(start_micro_step->data(), start_micro_step->data() + start_micro_step->size());
  if (start_rank) start.rank.assign(start_rank->data(), start_rank->data() + start_rank->size());
  Packing out;
  {
    nb::gil_scoped_release nogil;
    out = pack_by_routing(in, shape, opt, start); // an empty start: pack_by_tokens
  }
  const double before = out.start_deviation, after = out.deviation;
  return nb::make_tuple(int32_array(std::move(out.micro_step)), int32_array(std::move(out.rank)), before, after);
}

nb::tuple by_tokens(const RoArray<std::int64_t, 1> &lengths, std::int64_t micro_steps, std::int64_t ranks,
                    std::int64_t token_budget) {
  Packing p = pack_by_tokens({lengths.data(), lengths.size()}, {micro_steps, ranks, token_budget});
  return nb::make_tuple(int32_array(std::move(p.micro_step)), int32_array(std::move(p.rank)));
}

} // namespace

void bind_packing(nb::module_ &m) {
  m.def("pack_micro_batches", &pack, "lengths"_a, "histograms"_a, "micro_steps"_a, "ranks"_a, "token_budget"_a,
        "gpu_of"_a.none(), "gpus"_a, "start_micro_step"_a.none(), "start_rank"_a.none(), "max_passes"_a,
        "search_work"_a);
  m.def("pack_by_tokens", &by_tokens, "lengths"_a, "micro_steps"_a, "ranks"_a, "token_budget"_a);
}

} // namespace foremoe::python
