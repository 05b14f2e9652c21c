#include "synthetic_options.hpp"

#include <string>

namespace foremoe::cli {

std::vector<OptionSpec> synthetic_options(const SyntheticConfig &d) {
  auto s = [](auto v) { return std::to_string(v); };
  auto f = [](double v) {
    std::string t = std::to_string(v);
    while (t.size() > 1 && t.back() == '0') t.pop_back();
    if (!t.empty() && t.back() == '.') t.pop_back();
    return t;
  };
  return {
      {"preset", "NAME", "model shape: qwen3-30b-a3b (48 x 128, top-8) or deepseek-v3 (58 x 256, top-8)", "qwen3-30b-a3b"},
      {"seed", "N", "random seed; the trace is a deterministic function of it", s(d.seed)},
      {"layers", "N", "MoE layers", ""},
      {"experts", "N", "routed experts per layer", ""},
      {"topk", "N", "experts per token", ""},
      {"steps", "N", "RL steps", s(d.num_steps)},
      {"prompts", "N", "GRPO prompts per step", s(d.prompts_per_step)},
      {"responses", "N", "responses per prompt (group size)", s(d.responses_per_prompt)},
      {"prompt-mean", "TOKENS", "mean prompt length", f(d.prompt_length.mean)},
      {"response-mean", "TOKENS", "mean response length", f(d.response_length.mean)},
      {"max-length", "TOKENS", "longest prompt or response", s(d.response_length.max_tokens)},
      {"gpus", "N", "data-parallel ranks packing micro-batches (and EP GPUs for the GPU skew)", s(d.num_gpus)},
      {"microbatch-tokens", "N", "per-GPU micro-batch token budget (dynamic batch size)", s(d.microbatch_tokens_per_gpu)},
      {"skew", "X", "power-law exponent of expert popularity (0 = uniform)", ""},
      {"persistence", "P", "probability a token keeps each expert of the previous token", f(d.persistence)},
      {"topics", "N", "topics with their own expert preferences", s(d.num_topics)},
  };
}

SyntheticConfig synthetic_config(const Args &a, SyntheticConfig c) {
  const std::string preset = a.str("preset");
  if (preset == "deepseek-v3") {
    const SyntheticConfig ds = SyntheticConfig::deepseek_v3();
    c.num_layers = ds.num_layers;
    c.num_experts = ds.num_experts;
    c.topk = ds.topk;
    c.skew = ds.skew;
  } else if (preset != "qwen3-30b-a3b") {
    throw UsageError{"--preset must be qwen3-30b-a3b or deepseek-v3, got '" + preset + "'"};
  }
  constexpr std::int64_t big = std::int64_t{1} << 30;
  c.seed = static_cast<std::uint64_t>(a.integer("seed", 0, std::numeric_limits<std::int64_t>::max()));
  if (a.has("layers")) c.num_layers = static_cast<int>(a.integer("layers", 1, 4096));
  if (a.has("experts")) c.num_experts = static_cast<int>(a.integer("experts", 1, 32767));
  if (a.has("topk")) c.topk = static_cast<int>(a.integer("topk", 1, 1024));
  c.num_steps = static_cast<int>(a.integer("steps", 1, 1 << 16));
  c.prompts_per_step = static_cast<int>(a.integer("prompts", 1, 1 << 24));
  c.responses_per_prompt = static_cast<int>(a.integer("responses", 1, 1 << 16));
  c.prompt_length.mean = a.real("prompt-mean", 1, 1 << 28);
  c.response_length.mean = a.real("response-mean", 1, 1 << 28);
  const int max_len = static_cast<int>(a.integer("max-length", 1, 1 << 28));
  c.prompt_length.max_tokens = max_len;
  c.response_length.max_tokens = max_len;
  c.prompt_length.min_tokens = std::min(c.prompt_length.min_tokens, max_len);
  c.response_length.min_tokens = std::min(c.response_length.min_tokens, max_len);
  c.num_gpus = static_cast<int>(a.integer("gpus", 1, 1 << 20));
  c.microbatch_tokens_per_gpu = a.integer("microbatch-tokens", 1, big);
  if (a.has("skew")) c.skew = a.real("skew", 0, 100);
  c.persistence = a.real("persistence", 0, 1);
  c.num_topics = static_cast<int>(a.integer("topics", 1, 1 << 16));
  c.topics_per_prompt = std::min(c.topics_per_prompt, c.num_topics);
  c.validate();
  return c;
}

} // namespace foremoe::cli
