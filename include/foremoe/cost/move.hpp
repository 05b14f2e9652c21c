#pragma once
/// @file
/// The one model of expert moves: the paths a move's bytes can take (`MovePath`) and what each costs
/// (`MoveParams`). The transfer planner (its split between GPU-direct and the host mirror, its round estimates),
/// `foremoe plan --expert-bytes`, the runtime's transfer engine and the simulator all price a move with
/// `move_seconds` on these parameters; there is no second table of link rates.

#include <cmath>
#include <cstdint>
#include <string_view>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {

/// How an expert's bytes travel to the GPU that receives them. `nvlink` and `network` are GPU-direct (a peer copy
/// inside a node, NCCL send/recv over the NIC across nodes); `pcie` is CPU-assisted (the node's pinned host mirror
/// to the device). The numeric values index per-path arrays (`path_bytes`, the runtime's streams) and the names
/// are what JSON, CSV and Python print.
enum class MovePath : std::uint8_t { nvlink = 0, pcie = 1, network = 2 };
inline constexpr int num_move_paths = 3;

[[nodiscard]] constexpr std::string_view to_string(MovePath p) noexcept {
  switch (p) {
  case MovePath::nvlink: return "nvlink";
  case MovePath::pcie: return "pcie";
  case MovePath::network: return "network";
  }
  return "?";
}

/// One path an expert's weights can take: bandwidth (GB/s, 1e9 bytes per second, one direction) and fixed
/// latency (us).
struct PathParams {
  double gb_per_s = 1.0;
  double latency_us = 0.0;
};

/// Expert moves, per path. Achieved rates, not port peaks. Defaults: NVLink peer copy by copy engines (~75% of the
/// 450 GB/s port), NCCL send/recv over one 400 Gb/s NIC (~80% of 50 GB/s), pinned host memory over PCIe Gen5 x16
/// (~50 GB/s of 63). The fields keep the names of their config keys (`cost.move_intra_*`, `cost.move_inter_*`,
/// `cost.move_host_*`): `gpu_intra` is `MovePath::nvlink`, `gpu_inter` is `MovePath::network`, `host` is
/// `MovePath::pcie`.
///
/// A GPU's NIC and its host-mirror reads both reach it over its one PCIe Gen5 x16 link (the NIC sits behind the
/// same PCIe switch: GPUDirect RDMA writes into HBM through it), so the bytes a GPU receives on the two paths share
/// `pcie_ingress_gb_per_s`. 55 GB/s is an assumption, not a measurement: 87% of the link's 63.0 GB/s per
/// direction (PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b encoding), the packet and flow-control overhead of
/// 256-byte payloads.
struct MoveParams {
  PathParams gpu_intra{340.0, 10.0};   ///< MovePath::nvlink: GPU-direct inside a node (NVLink copy engine)
  PathParams gpu_inter{40.0, 25.0};    ///< MovePath::network: GPU-direct across nodes (NCCL over the NIC)
  PathParams host{50.0, 10.0};         ///< MovePath::pcie: CPU-assisted host -> device (pinned PCIe)
  double pcie_ingress_gb_per_s = 55.0; ///< one GPU's PCIe ingress, shared by its NIC and host-mirror moves

  void validate() const {
    auto check = [](const PathParams &p, const char *name) {
      detail::require(std::isfinite(p.gb_per_s) && p.gb_per_s > 0, "CostParams.move.", name,
                      ".gb_per_s must be positive and finite, got ", p.gb_per_s);
      detail::require(std::isfinite(p.latency_us) && p.latency_us >= 0, "CostParams.move.", name,
                      ".latency_us must be >= 0, got ", p.latency_us);
    };
    check(gpu_intra, "gpu_intra");
    check(gpu_inter, "gpu_inter");
    check(host, "host");
    detail::require(std::isfinite(pcie_ingress_gb_per_s) && pcie_ingress_gb_per_s > 0,
                    "CostParams.move.pcie_ingress_gb_per_s must be positive and finite, got ", pcie_ingress_gb_per_s);
  }
};

[[nodiscard]] inline const PathParams &path_params(const MoveParams &p, MovePath path) noexcept {
  switch (path) {
  case MovePath::nvlink: return p.gpu_intra;
  case MovePath::network: return p.gpu_inter;
  default: return p.host;
  }
}

/// Seconds to move `bytes` on `path` with the link to itself: latency + bytes / bandwidth (0 for 0 bytes).
[[nodiscard]] inline double move_seconds(const MoveParams &p, MovePath path, double bytes) {
  detail::require(bytes >= 0 && std::isfinite(bytes), "move_seconds: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return 0.0;
  const PathParams &pp = path_params(p, path);
  return pp.latency_us * 1e-6 + bytes / (pp.gb_per_s * 1e9);
}

} // namespace v0
} // namespace foremoe
