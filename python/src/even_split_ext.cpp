// `_core.even_split_rebalance`, what `foremoe.rebalance_experts(split="even")` calls. Its own translation unit:
// python/CMakeLists.txt compiles it for speed (-O3) where nanobind compiles the rest of the module for size (-Os),
// which makes this search about 1.5x slower.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <vector>

#include "foremoe/plan/even_split.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace foremoe::python {
namespace {

using RoWeights = nb::ndarray<nb::ro, const double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

/// phy2log `[L, num_physical]` (int64): EPLB's contract planned for the even token split (plan/even_split.hpp).
nb::ndarray<nb::numpy, std::int64_t> rebalance_even(const RoWeights &weights, int num_physical, int num_groups,
                                                    int num_nodes, int num_gpus) {
  const int L = static_cast<int>(weights.shape(0)), E = static_cast<int>(weights.shape(1));
  auto *out = new std::vector<std::int64_t>();
  nb::capsule owner(out, [](void *p) noexcept { delete static_cast<std::vector<std::int64_t> *>(p); });
  {
    nb::gil_scoped_release nogil;
    const auto layers = foremoe::even_split_rebalance({weights.data(), weights.size()}, L, E, num_physical, num_groups,
                                                      num_nodes, num_gpus);
    out->reserve(static_cast<std::size_t>(L) * num_physical + 1); // + 1: a non-null data pointer when empty
    for (const auto &layer : layers)
      out->insert(out->end(), layer.phys_to_log.begin(), layer.phys_to_log.end());
  }
  const std::size_t shape[2] = {static_cast<std::size_t>(L), static_cast<std::size_t>(num_physical)};
  return nb::ndarray<nb::numpy, std::int64_t>(out->data(), 2, shape, owner);
}

} // namespace

void bind_even_split(nb::module_ &m) {
  m.def("even_split_rebalance", &rebalance_even, "weights"_a, "num_physical"_a, "num_groups"_a, "num_nodes"_a,
        "num_gpus"_a);
}

} // namespace foremoe::python
