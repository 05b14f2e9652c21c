// The JSON value/parser/writer and the option schemas: every key of every schema accepts its default and
// refuses a wrong type and an out-of-range value with a message naming the key; documents round-trip.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "foremoe/config/documents.hpp"
#include "foremoe/config/options.hpp"
#include "foremoe/core/json.hpp"
#include "foremoe/trace/packed_loads.hpp"
#include "run_simulate.hpp" // tools/: synthetic_cache_key

namespace fm = foremoe;
namespace json = foremoe::json;
namespace config = foremoe::config;
namespace cli = foremoe::cli;

namespace {

std::string error_of(auto &&f) {
  try {
    f();
  } catch (const fm::Error &e) {
    return e.what();
  }
  return "";
}

// A random document: nested objects and arrays of every kind, with awkward strings and doubles.
json::Value random_value(std::mt19937_64 &rng, int depth) {
  std::uniform_int_distribution<int> kind(0, depth > 3 ? 4 : 6);
  switch (kind(rng)) {
  case 0: return json::Value(nullptr);
  case 1: return json::Value(rng() % 2 == 0);
  case 2: return json::Value(static_cast<std::int64_t>(rng()));
  case 3: {
    double d = 0;
    do {
      const std::uint64_t bits = rng();
      std::memcpy(&d, &bits, sizeof d);
    } while (!std::isfinite(d));
    return json::Value(rng() % 3 == 0 ? d : std::ldexp(static_cast<double>(rng() % 100000), -7));
  }
  case 4: {
    std::string s;
    const int n = static_cast<int>(rng() % 8);
    for (int i = 0; i < n; ++i) {
      const char pool[] = "ab\"\\/\n\t\x01 \xc3\xa9z";
      s += pool[rng() % (sizeof pool - 1)];
    }
    return json::Value(s);
  }
  case 5: {
    json::Value a = json::Array{};
    const int n = static_cast<int>(rng() % 5);
    for (int i = 0; i < n; ++i)
      a.push_back(random_value(rng, depth + 1));
    return a;
  }
  default: {
    json::Value o = json::Object{};
    const int n = static_cast<int>(rng() % 5);
    for (int i = 0; i < n; ++i)
      o["k" + std::to_string(i) + (rng() % 2 ? "\"x" : "")] = random_value(rng, depth + 1);
    return o;
  }
  }
}

// A value of `o`'s type outside its range, or a wrong-typed value when the type has no range.
template <class T> json::Value out_of_range(const config::Option<T> &o) {
  if (o.type == config::Type::integer)
    return o.int_max < INT64_MAX ? json::Value(o.int_max + 1) : json::Value(o.int_min - 1);
  if (o.type == config::Type::number) return json::Value(o.max * 2 + 1);
  if (o.type == config::Type::choice) return json::Value("no-such-" + o.key);
  return json::Value();
}

template <class T> json::Value wrong_type(const config::Option<T> &o) {
  switch (o.type) {
  case config::Type::integer: return json::Value(1.5); // a non-integer number
  case config::Type::number: return json::Value("1");
  case config::Type::boolean: return json::Value(1);
  default: return json::Value(true);
  }
}

// Walks every key of `schema`: its default is accepted (and reads back equal), a wrong type and an
// out-of-range value are refused naming "config.<key>".
template <class T> void walk_schema(const config::Schema<T> &schema) {
  const T defaults{};
  const json::Value doc = schema.write(defaults);
  for (const auto &o : schema.options()) {
    CAPTURE(o.key);
    json::Value one = json::Object{};
    config::Schema<T>::slot(one, o.key) = o.get(defaults);
    T t{};
    CHECK(error_of([&] { schema.read(t, one); }) == "");
    CHECK(schema.write(t) == doc);

    config::Schema<T>::slot(one, o.key) = wrong_type(o);
    const std::string type_msg = error_of([&] { schema.read(t, one); });
    CHECK(type_msg.find("config." + o.key + ": expected ") == 0);

    const json::Value bad = out_of_range(o);
    if (!bad.is_null()) {
      config::Schema<T>::slot(one, o.key) = bad;
      const std::string range_msg = error_of([&] { schema.read(t, one); });
      CHECK(range_msg.find("config." + o.key + ": must be ") == 0);
      CHECK(range_msg.find(o.range_text()) != std::string::npos);
    }
  }
}

} // namespace

TEST_CASE("json: random documents are written and read back equal, compact and pretty") {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 500; ++i) {
    const json::Value v = random_value(rng, 0);
    CAPTURE(json::dump(v));
    CHECK(json::parse(json::dump(v)) == v);
    CHECK(json::parse(json::dump(v, 2)) == v);
    CHECK(json::dump(json::parse(json::dump(v))) == json::dump(v));
  }
}

TEST_CASE("json: doubles are the shortest form that reads back, integers stay integers") {
  CHECK(json::format_double(0.1) == "0.1");
  CHECK(json::format_double(1500.0) == "1500.0");
  CHECK(json::format_double(1e-7) == "1e-07");
  CHECK(json::format_double(1.0 / 3.0) == "0.3333333333333333");
  CHECK(json::parse("3").is_integer());
  CHECK_FALSE(json::parse("3.0").is_integer());
  CHECK_FALSE(json::parse("3e0").is_integer());
  CHECK(json::parse("-9223372036854775808").as_integer() == INT64_MIN);
  CHECK(error_of([] { (void)json::parse("18446744073709551615", "f"); }) ==
        "f:1:1: integer 18446744073709551615 is outside the int64 range");
}

TEST_CASE("json: duplicate keys and malformed input are errors naming line and column") {
  CHECK(error_of([] { (void)json::parse("{\"a\": 1,\n \"a\": 2}", "x.json"); }) == "x.json:2:2: duplicate key 'a'");
  CHECK(error_of([] { (void)json::parse("{\"a\": {\"b\": 1, \"b\": 1}}", "x"); }).find("duplicate key 'b'") !=
        std::string::npos);
  for (const char *bad : {"", "{", "[1,", "[1 2]", "{\"a\" 1}", "nul", "01", "1.", "-", "\"\\x\"", "\"abc", "[1]x",
                          "NaN", "1e999", "{'a': 1}", "[\"\\ud800\"]", "// c\n1"})
    CHECK_MESSAGE(error_of([&] { (void)json::parse(bad, "in"); }).rfind("in:", 0) == 0, bad);
  // Deep nesting is refused, not a stack overflow.
  CHECK(error_of([] { (void)json::parse(std::string(100000, '['), "deep"); }).find("nesting deeper") !=
        std::string::npos);
}

TEST_CASE("json: random byte mutations of a document never crash the parser") {
  const std::string base = json::dump(config::simulate_schema().write(config::SimulateSettings{}), 2);
  std::mt19937_64 rng(11);
  int refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string s = base;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % s.size();
      switch (rng() % 3) {
      case 0: s[at] = static_cast<char>(rng() % 256); break;
      case 1: s.erase(at, 1 + rng() % 3); break;
      default: s.insert(at, 1, "{}[]\",:0e-."[rng() % 12]);
      }
      if (s.empty()) s.assign(1, 'x'); // not `s = "x"`: g++ 12 -O3 -Wrestrict false positive (GCC PR 105651)
    }
    try {
      (void)json::parse(s, "m");
    } catch (const fm::Error &) {
      ++refused;
    }
  }
  CHECK(refused > 1000);
}

TEST_CASE("schema: every key of every schema accepts its default, refuses a wrong type and a bad value") {
  walk_schema(config::simulate_schema());
  walk_schema(config::plan_schema());
  walk_schema(config::planner_schema());
  walk_schema(config::topology_schema());
  walk_schema(config::synthetic_schema());
  walk_schema(config::synthetic_settings_schema());
}

TEST_CASE("schema: the simulate config covers the 23 cost keys, every section, and reads its own output") {
  int cost_keys = 0;
  for (const auto &o : config::simulate_schema().options())
    cost_keys += o.key.starts_with("cost.");
  CHECK(cost_keys == 23);
  {
    // The all-to-all model: hierarchical by default, flat on request, anything else refused by name.
    CHECK(config::SimulateSettings{}.sim.cost.a2a.model == fm::A2aModel::hierarchical);
    json::Value doc = json::Object{};
    doc["cost"]["a2a_model"] = "flat";
    doc["cost"]["a2a_inter_per_message_us"] = 3.5;
    const config::Schema<config::SimulateSettings>::Layer l[] = {{&doc, "config"}};
    const config::SimulateSettings s = config::simulate_settings(l);
    CHECK(s.sim.cost.a2a.model == fm::A2aModel::flat);
    CHECK(s.sim.cost.a2a.inter_per_message_us == 3.5);
    doc["cost"]["a2a_model"] = "mesh";
    std::string msg;
    try {
      (void)config::simulate_settings(l);
    } catch (const fm::Error &e) {
      msg = e.what();
    }
    CHECK(msg.find("config.cost.a2a_model: must be one of hierarchical, flat, got 'mesh'") != std::string::npos);
  }
  for (const char *preset : {"qwen3-30b-a3b", "deepseek-v3", "kimi-k2"}) {
    json::Value p = json::Object{};
    p["preset"] = preset;
    const config::Schema<config::SimulateSettings>::Layer l[] = {{&p, "config"}};
    const config::SimulateSettings s = config::simulate_settings(l);
    const json::Value printed = config::simulate_schema().write(s);
    const config::Schema<config::SimulateSettings>::Layer back[] = {{&printed, "config"}};
    CHECK(config::simulate_schema().write(config::simulate_settings(back)) == printed);
  }
}

TEST_CASE("schema: unknown keys, sections that are not objects, narrowing and bindings are refused") {
  const auto &s = config::simulate_schema();
  config::SimulateSettings t;
  auto read = [&](const char *text) { return error_of([&] { s.read(t, json::parse(text, "f")); }); };
  CHECK(read(R"({"model": {"layerz": 4}})").find("config.model: unknown key 'layerz' (known: layers, experts") == 0);
  CHECK(read(R"({"modle": {}})").find("config: unknown key 'modle'") == 0);
  CHECK(read(R"({"model": 4})") == "config.model: expected an object, got 4");
  CHECK(read(R"({"model": {"layers": 4294967300}})") == "config.model.layers: must be in [1, 4096], got 4294967300");
  CHECK(read(R"({"model": {"layers": 3.7}})") == "config.model.layers: expected an integer, got 3.7");
  CHECK(read(R"({"model": {"layers": true}})") == "config.model.layers: expected an integer, got true");
  CHECK(read(R"({"batch": {"persistence": 2}})") == "config.batch.persistence: must be in [0, 1], got 2");
  CHECK(read(R"({"model": {"dtype": "int4"}})") ==
        "config.model.dtype: must be one of bf16, fp16, fp32, fp8, got 'int4'");
  CHECK(read(R"({"batch": {"prompt_mean": 64}})") == ""); // integers are fine for number options
  CHECK(t.batch.prompt_length.mean == 64.0);
  fm::PlannerOptions p;
  CHECK(error_of([&] {
          config::planner_schema().read(p, json::parse(R"({"strategy": "best"})"), "Planner");
        }).find("Planner.strategy: unknown strategy 'best'") == 0);
}

TEST_CASE("schema: precedence is defaults < preset < config file < explicit flags") {
  const auto &s = config::simulate_schema();
  const json::Value file = json::parse(R"({"preset": "deepseek-v3", "batch": {"seed": 7, "steps": 3}})");
  const json::Value none = s.flags_document({});
  const std::pair<std::string, std::string> seed_flag[] = {{"seed", "9"}};
  const json::Value flags = s.flags_document(seed_flag);
  using L = config::Schema<config::SimulateSettings>::Layer;
  const L a[] = {{&file, "config"}, {&none, "--"}};
  const config::SimulateSettings x = config::simulate_settings(a);
  CHECK(x.batch.seed == 7); // the file's seed holds when no --seed is given
  CHECK(x.batch.num_steps == 3);
  CHECK(x.sim.model.num_experts == 256); // the preset came first
  const L b[] = {{&file, "config"}, {&flags, "--"}};
  CHECK(config::simulate_settings(b).batch.seed == 9);
  const std::pair<std::string, std::string> bad[] = {{"slots", "0"}};
  CHECK(error_of([&] { (void)s.flags_document(bad); }) == "--slots must be in [1, 16384], got 0");
  const std::pair<std::string, std::string> nan[] = {{"skew", "x"}};
  CHECK(error_of([&] { (void)s.flags_document(nan); }) == "--skew expects a number, got 'x'");
  const std::pair<std::string, std::string> no[] = {{"no-reowning-free", ""}};
  const json::Value nf = s.flags_document(no);
  const L c[] = {{&nf, "--"}};
  CHECK_FALSE(config::simulate_settings(c).sim.planner.reowning_free);
  // Every planner option but the strategy and the gradient factor is a simulate option of the same key, from the
  // planner's schema (one definition: same help, same range).
  for (const auto &po : config::planner_schema().options()) {
    if (po.key == "strategy" || po.key == "gradient_bytes_factor") continue;
    const auto &so = s.key("sim." + po.key);
    CHECK_MESSAGE(so.help == po.help, po.key);
    CHECK_MESSAGE(so.flag == po.flag, po.key);
  }
  const std::pair<std::string, std::string> ex[] = {{"exact-split", "true"}, {"eplb-num-groups", "4"}};
  const json::Value exd = s.flags_document(ex);
  const L e[] = {{&exd, "--"}};
  const auto es = config::simulate_settings(e);
  CHECK(es.sim.planner.exact_split);
  CHECK(es.sim.planner.eplb_num_groups == 4);
  // The EPLB interval is a planner option (the strategy keeps its window); simulate's key and flag stay
  // `sim.eplb_interval` / `--eplb-interval`, where it stood before, so old config files still read.
  const json::Value old_file = json::parse(R"({"sim": {"eplb_interval": 3}})");
  const L of[] = {{&old_file, "config"}};
  CHECK(config::simulate_settings(of).sim.planner.eplb_interval == 3);
  CHECK(s.key("sim.eplb_interval").int_min == 1);
  fm::PlannerOptions po;
  CHECK(error_of([&] { config::planner_schema().read(po, json::parse(R"({"eplb_interval": 0})"), "Planner"); }) ==
        "Planner.eplb_interval: must be in [1, 65536], got 0");
}

TEST_CASE("schema: the generator's options are one schema; simulate's batch section reuses its entries") {
  const auto &syn = config::synthetic_schema();
  int batch = 0;
  for (const auto &o : config::simulate_schema().options()) {
    if (!o.key.starts_with("batch.")) continue;
    // simulate's choice of generator and where it keeps the generated loads, not generator options
    if (o.key == "batch.workload" || o.key == "batch.cache") continue;
    const auto &g = syn.key(o.key.substr(6));
    CHECK(o.flag == g.flag);
    if (o.key == "batch.steps") // simulate counts its steps; the warm-up ones come in front
      CHECK(o.help.find("warm-up") != std::string::npos);
    else
      CHECK(o.help == g.help);
    CHECK(o.range_text() == g.range_text());
    ++batch;
  }
  CHECK(batch == 15);
  // Flags as `trace gen` gives them: the preset first (the MoE shape), explicit keys over it.
  const auto &s = config::synthetic_settings_schema();
  const std::pair<std::string, std::string> flags[] = {
      {"layers", "3"}, {"preset", "deepseek-v3"}, {"topics", "2"}, {"max-length", "20"}};
  const fm::SyntheticConfig c = config::read_synthetic(s.flags_document(flags), "--");
  CHECK(c.num_layers == 3);
  CHECK(c.num_experts == 256);
  CHECK(c.skew == fm::SyntheticConfig::deepseek_v3().skew);
  CHECK(c.route_groups == 8); // the preset's group limit
  CHECK(c.route_max_groups == 4);
  CHECK(c.topics_per_prompt == 2);           // capped by topics
  CHECK(c.prompt_length.max_tokens == 20);   // max_length bounds both lengths
  CHECK(c.response_length.min_tokens == 16); // ... and lowers the shortest ones to it only where needed
  CHECK(c.prompt_length.min_tokens == 20);
  CHECK(error_of([&] {
          (void)config::read_synthetic(json::parse(R"({"num_layers": 2})"), "synthetic_trace");
        }).find("synthetic_trace: unknown key 'num_layers' (known: preset, seed, layers,") == 0);
  CHECK(error_of([&] {
          (void)config::read_synthetic(json::parse(R"({"experts": 4, "topk": 5})"), "x");
        }).find("SyntheticConfig: topk 5 exceeds num_experts 4") == 0);
  CHECK(error_of([&] { (void)config::read_synthetic(json::parse(R"({"popularity": "flat"})"), "x"); }) ==
        "x.popularity: must be one of lognormal, zipf, got 'flat'");
  // Defaults come from the command's own config (trace stats generates a smaller trace).
  fm::SyntheticConfig d;
  d.prompts_per_step = 64;
  CHECK(config::read_synthetic(json::Value(json::Object{}), "--", d).prompts_per_step == 64);
}

TEST_CASE("documents: placements round-trip and the reader is strict") {
  const fm::Topology topo{1, 2, 2};
  fm::Placement p(topo, 1, 3);
  p.layer(0).slot(0, 0) = 0;
  p.layer(0).slot(0, 1) = 2;
  p.layer(0).slot(1, 0) = 1;
  const json::Value doc = config::placement_document(topo, p);
  CHECK(config::read_placement(json::parse(json::dump(doc)), "pl", topo, 1, 3) == p);
  auto refuse = [&](const std::string &text) {
    return error_of([&] { (void)config::read_placement(json::parse(text, "pl"), "pl", topo, 1, 3); });
  };
  CHECK(refuse(R"({"nodes": 1, "gpus_per_node": 2, "slots": 2, "layers": [{"gpu_slots": [[0, 2], [1, -1]]}]})") ==
        "pl: missing key 'num_experts'");
  CHECK(refuse(R"({"nodes": 1, "gpus_per_node": 2, "slots": 2, "num_experts": 3, "x": 1, "layers": []})")
            .find("pl: unknown key 'x'") == 0);
  CHECK(refuse(R"({"nodes": 1, "gpus_per_node": 2, "slots": 2, "num_experts": 3,
                   "layers": [{"gpu_slots": [[0, 2.7], [1, -1]]}]})") ==
        "pl.layers[0].gpu_slots[0][1]: expected an integer, got 2.7");
  CHECK(refuse(R"({"nodes": 1, "gpus_per_node": 2, "slots": 2, "num_experts": 3,
                   "layers": [{"gpu_slots": [[0, true], [1, -1]]}]})") ==
        "pl.layers[0].gpu_slots[0][1]: expected an integer, got true");
}

// --- the load cache -----------------------------------------------------------------------------------------------

using fm::Error;
using fm::LoadCache;
using fm::LoadTensor;
using fm::PopularityModel;
using fm::synthetic_stream_version;
using fm::SyntheticConfig;

namespace {

std::filesystem::path fresh_dir(const char *name) {
  std::filesystem::path d = std::filesystem::temp_directory_path() /
                            (std::string("foremoe-test-") + name + "-" + std::to_string(std::random_device{}()));
  std::filesystem::remove_all(d);
  return d;
}

LoadTensor random_loads(std::mt19937_64 &rng, int sources) {
  LoadTensor t(static_cast<int>(rng() % 5), 1 + static_cast<int>(rng() % 4), 1 + static_cast<int>(rng() % 9), sources);
  for (int m = 0; m < t.num_micro_steps(); ++m)
    for (int l = 0; l < t.num_layers(); ++l)
      for (int e = 0; e < t.num_experts(); ++e) {
        std::int64_t sum = 0;
        for (int s = 0; s < sources; ++s)
          sum += t.at(m, l, e, s) = static_cast<std::int64_t>(rng() % 1000);
        t.at(m, l, e) = sources > 0 ? sum : static_cast<std::int64_t>(rng() % 100000);
      }
  return t;
}

} // namespace

TEST_CASE("load cache: entries round-trip exactly, per key; damaged or foreign entries are misses") {
  const std::filesystem::path dir = fresh_dir("cache");
  const LoadCache cache(dir);
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int sources = trial % 2 == 0 ? 0 : 1 + static_cast<int>(rng() % 4);
    const LoadTensor t = random_loads(rng, sources);
    const std::vector<std::int64_t> steps = {0, t.num_micro_steps()};
    const std::string key = "key " + std::to_string(trial);
    CHECK_FALSE(cache.read(key).has_value());
    REQUIRE(cache.write(key, t, steps) == LoadCache::Write::written);
    const auto back = cache.read(key);
    REQUIRE(back.has_value());
    CHECK(back->step_offsets == steps);
    CHECK(back->loads.num_sources() == sources);
    CHECK(std::vector<std::int64_t>(back->loads.totals().begin(), back->loads.totals().end()) ==
          std::vector<std::int64_t>(t.totals().begin(), t.totals().end()));
    CHECK(std::vector<std::int64_t>(back->loads.by_source().begin(), back->loads.by_source().end()) ==
          std::vector<std::int64_t>(t.by_source().begin(), t.by_source().end()));
    CHECK_FALSE(cache.read(key + " ").has_value()); // another key misses
    // One flipped byte anywhere, or a cut, makes the entry a miss, never an error or other loads.
    const std::filesystem::path f = cache.file_of(key);
    const auto size = static_cast<std::int64_t>(std::filesystem::file_size(f));
    std::string bytes = config::read_text(f);
    const auto at = static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(size));
    std::string flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    config::write_text(f, flipped);
    CHECK_FALSE(cache.read(key).has_value());
    config::write_text(f, bytes.substr(0, at));
    CHECK_FALSE(cache.read(key).has_value());
    config::write_text(f, bytes + "x");
    CHECK_FALSE(cache.read(key).has_value());
    REQUIRE(cache.write(key, t, steps) == LoadCache::Write::written); // rewritten in place
    CHECK(cache.read(key).has_value());
  }
  // The key's hash names the file; a different key with the same file (a collision) is compared in full.
  CHECK(cache.file_of("a").parent_path() == dir);
  CHECK(cache.file_of("a") != cache.file_of("b"));
  CHECK(LoadCache().read("a") == std::nullopt);
  CHECK(LoadCache().write("a", LoadTensor(1, 1, 1), {0, 1}) == LoadCache::Write::disabled);
  CHECK(LoadCache("/proc/foremoe-no-such-cache").write("a", LoadTensor(1, 1, 1), {0, 1}) == LoadCache::Write::failed);
  std::filesystem::remove_all(dir);
}

TEST_CASE("packed loads: entries round-trip exactly, per key; damaged, foreign or invalid entries are misses") {
  std::mt19937_64 rng(11);
  const auto bytes_of = [](const std::string &s) {
    return std::span<const unsigned char>(reinterpret_cast<const unsigned char *>(s.data()), s.size());
  };
  for (int trial = 0; trial < 60; ++trial) {
    const int sources = trial % 2 == 0 ? 0 : 1 + static_cast<int>(rng() % 4);
    LoadTensor t = random_loads(rng, sources);
    if (sources == 0) // large values and large swings between micro-steps take the varints' long forms (up to
                      // 2^36 per entry: at most 36 of them in a layer stay within the 2^42 bound on a layer's sum)
      for (std::int64_t &v : t.totals())
        if (rng() % 4 == 0) v = static_cast<std::int64_t>(rng() >> (28 + rng() % 36));
    std::vector<std::int64_t> steps = {0};
    for (int m = 1; m < t.num_micro_steps(); ++m)
      if (rng() % 2 == 0) steps.push_back(m);
    steps.push_back(t.num_micro_steps());
    const std::string key = "key\n" + std::to_string(trial);
    const std::string packed = fm::pack_loads(key, t, steps);
    const auto back = fm::unpack_loads(bytes_of(packed), key);
    REQUIRE(back.has_value());
    CHECK(back->step_offsets == steps);
    CHECK(back->loads.num_micro_steps() == t.num_micro_steps());
    CHECK(back->loads.num_layers() == t.num_layers());
    CHECK(back->loads.num_experts() == t.num_experts());
    CHECK(back->loads.num_sources() == sources);
    CHECK(std::vector<std::int64_t>(back->loads.totals().begin(), back->loads.totals().end()) ==
          std::vector<std::int64_t>(t.totals().begin(), t.totals().end()));
    CHECK(std::vector<std::int64_t>(back->loads.by_source().begin(), back->loads.by_source().end()) ==
          std::vector<std::int64_t>(t.by_source().begin(), t.by_source().end()));
    CHECK(fm::pack_loads(key, back->loads, back->step_offsets) == packed); // one encoding per entry
    CHECK_FALSE(fm::unpack_loads(bytes_of(packed), key + " ").has_value());
    CHECK_FALSE(fm::unpack_loads(bytes_of(packed), "key " + std::to_string(trial)).has_value());
    // One flipped bit anywhere, a cut or a byte more makes the entry a miss, never an error or other loads.
    const auto at = static_cast<std::size_t>(rng() % packed.size());
    std::string damaged = packed;
    damaged[at] = static_cast<char>(damaged[at] ^ (1 << (rng() % 8)));
    CHECK_FALSE(fm::unpack_loads(bytes_of(damaged), key).has_value());
    CHECK_FALSE(fm::unpack_loads(bytes_of(packed.substr(0, at)), key).has_value());
    CHECK_FALSE(fm::unpack_loads(bytes_of(packed + "x"), key).has_value());
  }
  // Loads that LoadTensor::validate refuses pack, but never come back.
  LoadTensor negative(2, 1, 3);
  negative.at(1, 0, 2) = -5;
  CHECK_FALSE(fm::unpack_loads(bytes_of(fm::pack_loads("k", negative, {0, 2})), "k").has_value());
  CHECK_FALSE(fm::unpack_loads({}, "k").has_value());
}

TEST_CASE("load cache: settings") {
  CHECK_FALSE(LoadCache::from_setting("off").enabled());
  CHECK(LoadCache::from_setting("/x/y").dir() == std::filesystem::path("/x/y"));
  CHECK_THROWS_WITH_AS(static_cast<void>(LoadCache::from_setting("")), doctest::Contains("setting is empty"), Error);
}

TEST_CASE("load cache: the batch key changes with every generator input") {
  // A field added to SyntheticConfig must join synthetic_cache_key (tools/run_simulate.hpp); this size is
  // the struct's on x86-64 with the fields the key lists today.
  static_assert(sizeof(SyntheticConfig) == 192 || sizeof(void *) != 8,
                "SyntheticConfig changed: add the new field to synthetic_cache_key, then update this size");
  const SyntheticConfig base;
  const std::string k0 = cli::synthetic_cache_key(base, false, 1);
  std::vector<SyntheticConfig> changed;
  const auto with = [&](auto edit) {
    SyntheticConfig c = base;
    edit(c);
    changed.push_back(c);
  };
  with([](SyntheticConfig &c) { c.seed = 2; });
  with([](SyntheticConfig &c) { c.num_layers = 47; });
  with([](SyntheticConfig &c) { c.num_experts = 127; });
  with([](SyntheticConfig &c) { c.topk = 7; });
  with([](SyntheticConfig &c) { c.num_steps = 3; });
  with([](SyntheticConfig &c) { c.prompts_per_step = 511; });
  with([](SyntheticConfig &c) { c.responses_per_prompt = 7; });
  with([](SyntheticConfig &c) { c.prompt_length.mean = std::nextafter(c.prompt_length.mean, 1e9); });
  with([](SyntheticConfig &c) { c.prompt_length.sigma = 0.61; });
  with([](SyntheticConfig &c) { c.prompt_length.min_tokens = 31; });
  with([](SyntheticConfig &c) { c.prompt_length.max_tokens = 8191; });
  with([](SyntheticConfig &c) { c.response_length.mean = 1501; });
  with([](SyntheticConfig &c) { c.response_length.sigma = 0.81; });
  with([](SyntheticConfig &c) { c.response_length.min_tokens = 15; });
  with([](SyntheticConfig &c) { c.response_length.max_tokens = 8191; });
  with([](SyntheticConfig &c) { c.num_topics = 31; });
  with([](SyntheticConfig &c) { c.topics_per_prompt = 2; });
  with([](SyntheticConfig &c) { c.topic_concentration = 0.51; });
  with([](SyntheticConfig &c) { c.topic_mix_concentration = 1.01; });
  with([](SyntheticConfig &c) { c.response_topic_weight = 0.51; });
  with([](SyntheticConfig &c) { c.popularity = PopularityModel::zipf; });
  with([](SyntheticConfig &c) { c.skew = std::nextafter(c.skew, 1.0); });
  with([](SyntheticConfig &c) { c.skew_layer_sigma = 0.21; });
  with([](SyntheticConfig &c) { c.persistence = 0.61; });
  with([](SyntheticConfig &c) { c.num_gpus = 63; });
  with([](SyntheticConfig &c) { c.microbatch_tokens_per_gpu = 16383; });
  with([](SyntheticConfig &c) { c.packing = foremoe::BatchPacking::tokens; });
  with([](SyntheticConfig &c) { c.packing = foremoe::BatchPacking::routing; });
  with([](SyntheticConfig &c) {
    c.packing = foremoe::BatchPacking::routing;
    c.packing_ranks = 8;
  });
  with([](SyntheticConfig &c) {
    c.route_groups = 8;
    c.route_max_groups = 4;
  });
  with([](SyntheticConfig &c) {
    c.route_groups = 8;
    c.route_max_groups = 3;
  });
  with([](SyntheticConfig &c) {
    c.route_groups = 4;
    c.route_max_groups = 3;
  });
  with([](SyntheticConfig &c) { c.coactivation = 0.5; });
  with([](SyntheticConfig &c) {
    c.coactivation = 0.5;
    c.coactivation_clusters = 8;
  });
  // Clusters without co-activation (the same ids as the default) keep the default's key.
  SyntheticConfig clusters_only = base;
  clusters_only.coactivation_clusters = 8;
  CHECK(cli::synthetic_cache_key(clusters_only, false, 1) == k0);
  // No limit (the same ids as the default) keeps the default's key.
  SyntheticConfig unlimited = base;
  unlimited.route_groups = 8;
  CHECK(cli::synthetic_cache_key(unlimited, false, 1) == k0);
  std::vector<std::string> keys = {k0, cli::synthetic_cache_key(base, true, 1),
                                   cli::synthetic_cache_key(base, true, 2)};
  for (const SyntheticConfig &c : changed)
    keys.push_back(cli::synthetic_cache_key(c, false, 1));
  CHECK(cli::synthetic_cache_key(base, false, 1) == k0);
  std::sort(keys.begin(), keys.end());
  CHECK(std::adjacent_find(keys.begin(), keys.end()) == keys.end());
  CHECK(k0.find("stream=" + std::to_string(synthetic_stream_version)) != std::string::npos);
}

TEST_CASE("schema: the overlap, LM head and optimizer settings reach SimConfig; presets set the vocabulary") {
  using L = config::Schema<config::SimulateSettings>::Layer;
  const config::SimulateSettings d = config::simulate_settings({});
  CHECK(d.sim.a2a_overlap == 0.0); // Megatron-core's defaults: no EP all-to-all overlap, no grad-reduce overlap
  CHECK(d.sim.dp_grad_overlap == 0.0);
  CHECK(d.sim.dense.vocab == 151936.0); // Qwen3-30B-A3B's vocab_size
  CHECK(d.sim.optimizer_traffic_bytes_per_param == 30.0);
  const json::Value ds = json::parse(R"({"preset": "deepseek-v3"})");
  const L dl[] = {{&ds, "config"}};
  CHECK(config::simulate_settings(dl).sim.dense.vocab == 129280.0); // DeepSeek-V3's vocab_size
  CHECK(config::simulate_settings(dl).batch.route_max_groups == 4); // its node-limited routing reaches the batch
  const json::Value kimi = json::parse(R"({"preset": "kimi-k2"})");
  const L kl[] = {{&kimi, "config"}};
  const config::SimulateSettings k = config::simulate_settings(kl);
  CHECK(k.sim.dense.vocab == 163840.0); // Kimi K2's vocab_size
  CHECK(k.sim.model.num_layers == 60);  // 61 layers, first_k_dense_replace 1
  CHECK(k.sim.model.num_experts == 384);
  CHECK(k.batch.num_experts == 384);
  CHECK_FALSE(k.batch.group_limited()); // n_group 1
  const json::Value file = json::parse(
      R"({"model": {"vocab": 0}, "sim": {"a2a_overlap": 0.5, "dp_grad_overlap": 1, "optimizer_traffic_bytes_per_param": 16}})");
  const std::pair<std::string, std::string> flag[] = {{"a2a-overlap", "0.75"}};
  const json::Value flags = config::simulate_schema().flags_document(flag);
  const L a[] = {{&file, "config"}, {&flags, "--"}};
  const config::SimulateSettings x = config::simulate_settings(a);
  CHECK(x.sim.a2a_overlap == 0.75); // the flag over the file
  CHECK(x.sim.dp_grad_overlap == 1.0);
  CHECK(x.sim.dense.vocab == 0.0);
  CHECK(x.sim.optimizer_traffic_bytes_per_param == 16.0);
  const std::pair<std::string, std::string> bad[] = {{"dp-grad-overlap", "2"}};
  CHECK(error_of([&] { (void)config::simulate_schema().flags_document(bad); }) ==
        "--dp-grad-overlap must be in [0, 1], got 2");
}
