#pragma once
// Internal helpers shared by the engine and the in-tree transports (the interface itself is the public
// foremoe/runtime/transport.hpp).

#include <cstdint>
#include <memory>

#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

/// Adds an in-tree transport to the registry; called by the generated `register_builtin_transports`, before any
/// lookup. Each folder `runtime/transports/<name>/` defines `register_builtin_transport_<name>()` calling it.
void add_builtin_transport(const char *name, TransportFactory factory);

/// Wraps `inner` so that paired transfers run over `bridge` (`PeerOptions::bridge`); everything else is `inner`'s.
[[nodiscard]] std::unique_ptr<Transport> make_bridge_transport(std::unique_ptr<Transport> inner,
                                                               std::shared_ptr<PeerBridge> bridge);

/// Whether other processes drive some GPUs of the group (`local_gpus` distinct and in range, as `create` checks).
[[nodiscard]] inline bool multi_process(const EngineOptions &o) noexcept {
  return !o.peers.local_gpus.empty() && static_cast<int>(o.peers.local_gpus.size()) < o.topology.num_gpus();
}

/// The fault injector's switch (`FaultSchedule::spare_reductions`): while `spare(true)` is in effect, the copies and
/// paired transfers started get no injected fault. Called from the engine's progress thread only, around the
/// operations of a reduction it starts.
class FaultControl {
public:
  virtual void spare(bool on) noexcept = 0;

protected:
  ~FaultControl() = default;
};

/// 64-bit mix used by checksums and fault decisions.
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
