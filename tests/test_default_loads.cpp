// The default batch's loads built into `foremoe` and the Python extension (tools/default_loads.bin) are exactly what
// the generator makes of the default settings today, and `run_simulate` takes them for the default batch only.
// Regenerating the batch takes as long as a first run used to (seconds optimised).

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "default_loads.hpp"
#include "foremoe/config/documents.hpp"
#include "foremoe/trace/packed_loads.hpp"
#include "foremoe/trace/synthetic.hpp"
#include "run_simulate.hpp"

namespace fm = foremoe;
namespace config = foremoe::config;
namespace cli = foremoe::cli;

namespace {

config::SimulateSettings default_settings() { return config::simulate_settings({}); }

} // namespace

TEST_CASE("default loads: the built-in entry is the generator's output for the default batch, byte for byte") {
  const cli::SimulateBatch batch = cli::simulate_batch(default_settings());
  std::vector<std::int64_t> steps;
  const fm::LoadTensor loads =
      fm::generate_loads(batch.config, &steps, batch.by_source,
                         {.num_threads = 0, .progress = {}, .ranks_per_source = batch.ranks_per_source});
  const std::string fresh = fm::pack_loads(batch.key, loads, steps);
  const std::span<const unsigned char> built_in = fm::cli::default_loads();
  const bool same = std::string(reinterpret_cast<const char *>(built_in.data()), built_in.size()) == fresh;
  if (!same) {
    // The fix is the file this writes: copy it over tools/default_loads.bin and rebuild.
    const std::filesystem::path out = std::filesystem::absolute("default_loads.bin");
    std::ofstream(out, std::ios::binary).write(fresh.data(), static_cast<std::streamsize>(fresh.size()));
    FAIL_CHECK("tools/default_loads.bin (", built_in.size(), " bytes built in) is not the default batch's packed ",
               "loads; the generator's (", fresh.size(), " bytes) are in ", out.string(),
               ": copy them over tools/default_loads.bin");
  }
  // Unpacked, it is the generator's loads value for value.
  const std::optional<fm::CachedLoads> back = fm::unpack_loads(built_in, batch.key);
  REQUIRE(back.has_value());
  CHECK(back->step_offsets == steps);
  CHECK(back->loads.num_sources() == loads.num_sources());
  CHECK(std::equal(back->loads.totals().begin(), back->loads.totals().end(), loads.totals().begin(),
                   loads.totals().end()));
  CHECK(std::equal(back->loads.by_source().begin(), back->loads.by_source().end(), loads.by_source().begin(),
                   loads.by_source().end()));
}

TEST_CASE("default loads: run_simulate takes a packed entry for its own batch only, with the same results") {
  const std::span<const unsigned char> built_in = fm::cli::default_loads();
  REQUIRE_FALSE(built_in.empty());
  cli::LoadsReport rep;
  {
    config::SimulateSettings s = default_settings();
    s.strategies = "static";
    s.cache = "off";           // the built-in entry is no cache: it is used with the cache off too
    s.best_deployment = false; // its batches are others (counted by source), not built in
    (void)cli::run_simulate(s, nullptr, {}, {}, &rep, built_in);
    CHECK(rep.built_in);
    CHECK_FALSE(rep.from_cache);
    CHECK(rep.cache_file.empty());
  }
  // A small batch: generated when the entry is another batch's; given its own entry, the same document.
  const fm::json::Value small_doc = fm::json::parse(R"({"model": {"layers": 4, "experts": 16, "topk": 2},
      "topology": {"nodes": 2, "gpus_per_node": 2, "slots": 5},
      "batch": {"steps": 2, "prompts": 8, "responses": 4, "prompt_mean": 64, "response_mean": 128, "cache": "off"}})",
                                                    "small");
  const config::Schema<config::SimulateSettings>::Layer layers[] = {{&small_doc, "config"}};
  const config::SimulateSettings s = config::simulate_settings(layers);
  const cli::SimulateBatch small = cli::simulate_batch(s);
  CHECK_FALSE(fm::unpack_loads(built_in, small.key).has_value());
  const fm::json::Value generated = cli::run_simulate(s, nullptr, {}, {}, &rep, built_in);
  CHECK_FALSE(rep.built_in);
  std::vector<std::int64_t> steps;
  const fm::LoadTensor loads =
      fm::generate_loads(small.config, &steps, small.by_source,
                         {.num_threads = 1, .progress = {}, .ranks_per_source = small.ranks_per_source});
  const std::string packed = fm::pack_loads(small.key, loads, steps);
  const fm::json::Value unpacked = cli::run_simulate(
      s, nullptr, {}, {}, &rep,
      std::span<const unsigned char>(reinterpret_cast<const unsigned char *>(packed.data()), packed.size()));
  CHECK(rep.built_in);
  // Planning wall time differs between runs; everything else follows from the loads and must agree.
  const auto without_times = [](fm::json::Value d) {
    for (fm::json::Value &r : d["strategies"].as_array())
      std::erase_if(r.as_object(), [](const fm::json::Member &m) {
        return m.first == "planner_seconds" || m.first == "planner_critical_seconds" ||
               m.first == "step_with_planner_seconds";
      });
    std::erase_if(d["best_deployment"].as_object(),
                  [](const fm::json::Member &m) { return m.first == "search_seconds"; }); // wall time
    return d;
  };
  CHECK(without_times(generated) == without_times(unpacked));
}
