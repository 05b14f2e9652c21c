#pragma once
/// @file
/// Shape of the MoE part of a model: what a planner and a cost model need.

#include <cstdint>
#include <string>
#include <string_view>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {

/// Storage type of expert weights.
enum class WeightDtype : std::uint8_t { bf16, fp16, fp32, fp8 };

/// Name as used in configs and on the command line ("bf16", "fp16", "fp32", "fp8").
[[nodiscard]] inline std::string_view to_string(WeightDtype d) noexcept {
  switch (d) {
  case WeightDtype::bf16: return "bf16";
  case WeightDtype::fp16: return "fp16";
  case WeightDtype::fp32: return "fp32";
  case WeightDtype::fp8: return "fp8";
  }
  return "?";
}

/// Parses a dtype name; throws `Error` naming the unknown value.
[[nodiscard]] inline WeightDtype parse_weight_dtype(std::string_view s) {
  if (s == "bf16" || s == "bfloat16") return WeightDtype::bf16;
  if (s == "fp16" || s == "float16" || s == "half") return WeightDtype::fp16;
  if (s == "fp32" || s == "float32") return WeightDtype::fp32;
  if (s == "fp8" || s == "fp8_block" || s == "e4m3") return WeightDtype::fp8;
  detail::fail("unknown weight dtype '", s, "' (expected bf16, fp16, fp32 or fp8)");
}

/// Bytes of one weight element.
[[nodiscard]] constexpr std::int64_t dtype_bytes(WeightDtype d) noexcept {
  switch (d) {
  case WeightDtype::fp32: return 4;
  case WeightDtype::fp8: return 1;
  default: return 2;
  }
}

/// The routed-expert part of an MoE model.
struct ModelSpec {
  int num_layers = 48;   ///< MoE layers (dense layers are not counted)
  int num_experts = 128; ///< routed experts per MoE layer
  int topk = 8;          ///< experts per token
  int hidden = 2048;     ///< model dimension H
  int expert_ffn = 768;  ///< per-expert FFN intermediate size I
  WeightDtype dtype = WeightDtype::bf16;
  /// Weight matrices per expert: 3 for a gated FFN (gate, up, down), 2 otherwise.
  int num_matrices = 3;
  /// fp8 block-scale tile edge (DeepSeek-style 128x128 float32 scales); 0 = none.
  int fp8_block = 128;

  /// Throws `Error` for non-positive sizes, topk > experts or an odd matrix count.
  void validate() const {
    detail::require(num_layers > 0, "ModelSpec: num_layers must be positive, got ", num_layers);
    detail::require(num_experts > 0, "ModelSpec: num_experts must be positive, got ", num_experts);
    detail::require(topk > 0 && topk <= num_experts, "ModelSpec: topk must be in [1, num_experts=", num_experts,
                    "], got ", topk);
    detail::require(hidden > 0, "ModelSpec: hidden must be positive, got ", hidden);
    detail::require(expert_ffn > 0, "ModelSpec: expert_ffn must be positive, got ", expert_ffn);
    detail::require(num_matrices == 2 || num_matrices == 3, "ModelSpec: num_matrices must be 2 or 3, got ",
                    num_matrices);
    detail::require(fp8_block >= 0, "ModelSpec: fp8_block must be >= 0, got ", fp8_block);
  }

  /// Bytes of one expert's weights (plus fp8 block scales), the unit of a move.
  [[nodiscard]] std::int64_t bytes_per_expert() const noexcept {
    const std::int64_t h = hidden, f = expert_ffn;
    std::int64_t bytes = num_matrices * h * f * dtype_bytes(dtype);
    if (dtype == WeightDtype::fp8 && fp8_block > 0) {
      const std::int64_t b = fp8_block;
      bytes += num_matrices * ((h + b - 1) / b) * ((f + b - 1) / b) * 4;
    }
    return bytes;
  }

  /// FLOPs of one token through one expert, forward (2 per multiply-add).
  [[nodiscard]] double flops_per_token() const noexcept {
    return 2.0 * num_matrices * static_cast<double>(hidden) * expert_ffn;
  }
};

/// Qwen3-30B-A3B: 48 MoE layers x 128 experts, top-8, H 2048, I 768, bf16.
[[nodiscard]] inline ModelSpec qwen3_30b_a3b() { return ModelSpec{48, 128, 8, 2048, 768, WeightDtype::bf16}; }

/// DeepSeek-V3: 58 MoE layers x 256 experts, top-8, H 7168, I 2048, fp8 by default.
[[nodiscard]] inline ModelSpec deepseek_v3(WeightDtype d = WeightDtype::fp8) {
  return ModelSpec{58, 256, 8, 7168, 2048, d};
}

/// Kimi K2 (moonshotai/Kimi-K2-Instruct config.json: 61 layers with `first_k_dense_replace` 1, so 60 MoE layers;
/// `n_routed_experts` 384, `num_experts_per_tok` 8, `hidden_size` 7168, `moe_intermediate_size` 2048; 60 x 384 x 3 x
/// 7168 x 2048 = 1.015T routed parameters of its 1.04T), fp8 by default as its released weights (block 128).
[[nodiscard]] inline ModelSpec kimi_k2(WeightDtype d = WeightDtype::fp8) {
  return ModelSpec{60, 384, 8, 7168, 2048, d};
}

} // namespace v0
} // namespace foremoe
