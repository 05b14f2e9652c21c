// The registry of transports by name. In-tree backends (one folder each under runtime/transports/) are added by
// the generated `register_builtin_transports`, which names every folder's registration function: the registry
// references them, so a static link keeps them (self-registering static objects would be dropped by the linker).

#include <algorithm>
#include <map>
#include <mutex>

#include "foremoe/core/error.hpp"
#include "transport_util.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {
namespace detail {

void register_builtin_transports(); // generated from the transport folders

namespace {
struct Registry {
  std::mutex mu;
  std::map<std::string, TransportFactory, std::less<>> factories;
};
Registry &registry() {
  static Registry r;
  return r;
}
Registry &ready_registry() {
  static const bool builtins = (register_builtin_transports(), true);
  (void)builtins;
  return registry();
}
std::string names_of(const Registry &r) {
  std::string s;
  for (const auto &[name, f] : r.factories)
    s += (s.empty() ? "" : ", ") + name;
  return s.empty() ? "none" : s;
}
} // namespace

void add_builtin_transport(const char *name, TransportFactory factory) {
  Registry &r = registry();
  std::lock_guard lock(r.mu);
  r.factories.emplace(name, std::move(factory));
}

} // namespace detail

Status register_transport(std::string name, TransportFactory factory) {
  if (name.empty()) return {StatusCode::invalid_argument, "register_transport: empty name"};
  if (!factory) return {StatusCode::invalid_argument, "register_transport: empty factory for \"" + name + "\""};
  detail::Registry &r = detail::ready_registry();
  std::lock_guard lock(r.mu);
  if (r.factories.count(name) != 0)
    return {StatusCode::invalid_argument, "register_transport: \"" + name + "\" is already registered"};
  r.factories.emplace(std::move(name), std::move(factory));
  return Status::success();
}

std::vector<std::string> registered_transports() {
  detail::Registry &r = detail::ready_registry();
  std::lock_guard lock(r.mu);
  std::vector<std::string> out;
  for (const auto &[name, f] : r.factories)
    out.push_back(name);
  return out;
}

Status make_transport(std::string_view name, const EngineOptions &opts, std::unique_ptr<Transport> &out) {
  detail::Registry &r = detail::ready_registry();
  TransportFactory f;
  {
    std::lock_guard lock(r.mu);
    auto it = r.factories.find(name);
    if (it == r.factories.end()) {
      if (name == "cuda")
        return {StatusCode::unavailable,
                "TransferEngine: this runtime was built without CUDA (transports: " + detail::names_of(r) + ")"};
      return {StatusCode::invalid_argument, foremoe::detail::concat("TransferEngine: no transport named \"", name,
                                                                    "\"; registered: ", detail::names_of(r))};
    }
    f = it->second; // called outside the lock: a factory may register or look up others
  }
  out.reset();
  if (Status st = f(opts, out); !st.ok()) return st;
  if (out == nullptr)
    return {StatusCode::internal, foremoe::detail::concat("TransferEngine: transport \"", name, "\" made nothing")};
  return Status::success();
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
