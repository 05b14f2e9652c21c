#pragma once
/// @file
/// Test doubles of the transfer engine, installed for trainers' own tests and chaos drills but not part of the
/// umbrella header: a seeded fault injector that wraps any transport, and a host fabric that joins engines of one
/// process standing for engines of separate processes (the host backend's stand-in for NCCL).

#include <cstdint>
#include <memory>

#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// Faults the fault-injecting decorator adds to a backend (`EngineOptions::faults`, or `make_fault_transport`).
/// Decisions are a hash of `seed` and the chunk's identity (layer, move, offset, path, attempt), so a schedule
/// replays exactly.
struct FaultSchedule {
  double fail_probability = 0.0;    ///< the copy reports an error
  double corrupt_probability = 0.0; ///< the copy "succeeds" with one byte dropped (only verification sees it)
  double delay_probability = 0.0;   ///< the copy is held back by `delay_us`
  int delay_us = 0;
  bool fail_path[transfer::num_paths] = {false, false, false}; ///< every copy over this path fails
  std::uint64_t seed = 0;
};

/// Wraps `inner` in the fault injector. `host_memory`: received peer bytes are host memory the injector may
/// corrupt directly (the host backend); otherwise only failures and delays are injected on paired transfers.
[[nodiscard]] std::unique_ptr<Transport>
make_fault_transport(std::unique_ptr<Transport> inner, std::shared_ptr<const FaultSchedule> faults, bool host_memory);

/// Joins engines of one process that stand for engines in separate processes: the host backend's stand-in for
/// NCCL, with NCCL's matching rule (sends and receives between two GPUs pair up in the order they are posted).
/// Tests and examples use it to run the multi-process (SPMD) protocol on one CPU (`PeerOptions::host_fabric`).
class HostFabric {
public:
  HostFabric();
  struct Impl;
  [[nodiscard]] const std::shared_ptr<Impl> &impl() const noexcept { return impl_; }

private:
  std::shared_ptr<Impl> impl_;
};

} // namespace runtime
} // namespace v0
} // namespace foremoe
