/// @file
/// libFuzzer target for the JSON reader and the simulate config: any input must either be accepted or throw
/// foremoe::Error. Accepted documents must round-trip (dump, parse, equal), and accepted settings must write a
/// config that reads back to the same settings (what `simulate --print-config` promises).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "foremoe/config/options.hpp"
#include "foremoe/core/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  namespace fm = foremoe;
  const std::string_view text(reinterpret_cast<const char *>(data), size);
  fm::json::Value doc;
  try {
    doc = fm::json::parse(text, "fuzz");
  } catch (const fm::Error &) {
    return 0;
  }
  // The writer's output is JSON the reader accepts and reads back equal, compact or indented.
  for (const int indent : {-1, 2})
    if (!(fm::json::parse(fm::json::dump(doc, indent), "again") == doc)) std::abort();

  using Settings = fm::config::SimulateSettings;
  const auto &schema = fm::config::simulate_schema();
  Settings settings;
  try {
    const fm::config::Schema<Settings>::Layer layers[] = {{&doc, "config"}};
    settings = fm::config::simulate_settings(layers);
  } catch (const fm::Error &) {
    return 0;
  }
  const fm::json::Value written = schema.write(settings);
  const fm::config::Schema<Settings>::Layer again[] = {{&written, "config"}};
  const Settings reread = fm::config::simulate_settings(again); // must not throw: it is our own output
  if (!(schema.write(reread) == written)) std::abort();
  return 0;
}
