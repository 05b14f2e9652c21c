#pragma once
/// @file
/// Test doubles of the transfer engine, installed for trainers' own tests and chaos drills but not part of the
/// umbrella header: a seeded fault injector that wraps any transport, and a host fabric that joins engines of one
/// process standing for engines of separate processes (the host backend's stand-in for NCCL).

#include <cstdint>
#include <memory>
#include <span>

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
  /// The probabilities act only on paired transfers with other processes (the bytes that cross between ranks),
  /// never on a process's own copies (from its node's host mirror, between its own GPUs): the schedule of a
  /// trainer whose network fails while its host memory does not (foremoe.torch's replica moves). Last, so that
  /// aggregate initialisers written before it keep their meaning.
  bool paired_only = false;
  /// The injector leaves replica-gradient reductions alone (their copies and paired transfers; `fail_path` too),
  /// acting on moves only, and reductions do not advance the batch serial that fault decisions hash, so the
  /// decisions on moves are those of an engine that runs no reductions. With `EngineOptions::verify` a reduction's
  /// corrupted bytes are caught (never added), but one from another process can only fail the batch, not be retried:
  /// a trainer that injects faults into its moves and reduces gradients on the same engine sets this (foremoe.torch
  /// does), so that its steps do not fail on faults meant for the moves.
  /// Last, so that aggregate initialisers written before it keep their meaning.
  bool spare_reductions = false;
};

/// The injector's decisions about one operation, each drawn on its own.
enum class FaultDecision : std::uint64_t { fail = 1, corrupt = 2, delay = 3 };

/// The injector's uniform draw in [0, 1) for decision `d` about the operation whose identity is `key`: a function
/// of `f.seed`, `key` and `d` alone, so a schedule replays exactly, on every rank. Trainers' own move paths that
/// inject faults with a `FaultSchedule` (foremoe.torch's replica moves) draw through it, so one schedule means the
/// same everywhere.
[[nodiscard]] double fault_draw(const FaultSchedule &f, std::uint64_t key, FaultDecision d) noexcept;

/// The identity key of an operation named by a tuple of integers (e.g. sync, layer, move): folded with a 64-bit
/// mix, so tuples that differ in any place or order get unrelated keys.
[[nodiscard]] std::uint64_t fault_key(std::span<const std::uint64_t> identity) noexcept;

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
