/// @file
/// libFuzzer target for the placement reader (`--resident`): any input must either be accepted or throw
/// foremoe::Error. An accepted placement must be valid, and writing it and reading it back gives the same slots.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "foremoe/config/documents.hpp"
#include "foremoe/core/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  namespace fm = foremoe;
  // A small fixed shape keeps runs cheap; the first byte picks one of a few so sizes vary too.
  static const fm::Topology shapes[] = {{1, 2, 3}, {2, 2, 2}, {1, 1, 4}};
  static const int experts[] = {4, 6, 3};
  if (size == 0) return 0;
  const int pick = data[0] % 3;
  const fm::Topology &topo = shapes[pick];
  const int num_experts = experts[pick];
  const int num_layers = 1 + (data[0] / 3) % 2;
  const std::string_view text(reinterpret_cast<const char *>(data + 1), size - 1);
  fm::Placement p;
  try {
    p = fm::config::read_placement(fm::json::parse(text, "fuzz"), "fuzz", topo, num_layers, num_experts);
  } catch (const fm::Error &) {
    return 0;
  }
  p.validate(); // accepted means valid; a throw here escapes and is reported as a bug
  const fm::json::Value written = fm::config::placement_document(topo, p);
  const fm::Placement back = fm::config::read_placement(written, "again", topo, num_layers, num_experts);
  for (int l = 0; l < num_layers; ++l)
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int k = 0; k < topo.slots_per_gpu; ++k)
        if (back.layer(l).slot(g, k) != p.layer(l).slot(g, k)) std::abort();
  return 0;
}
