// Calls into the header library and (when built) the compiled runtime and checks the answers.
#include <foremoe/foremoe.hpp>
#include <foremoe/version.hpp>
#if defined(FOREMOE_CONSUMER_RUNTIME)
#include <foremoe/runtime/runtime.hpp>
#endif

#include <cstdio>
#include <vector>

int main() {
  const std::vector<std::int16_t> ids{0, 1, 1, 2, 2, 3, -1, 3}; // [4 tokens][1 layer][2]
  foremoe::CountOptions opts;
  opts.num_experts = 4;
  const auto loads = foremoe::count_loads(std::span<const std::int16_t>(ids), 4, 1, 2, opts);
  const std::vector<std::int64_t> want{1, 2, 2, 2};
  for (int e = 0; e < 4; ++e)
    if (loads.at(0, 0, e) != want[e]) return std::printf("header count wrong at expert %d\n", e), 1;
#if defined(FOREMOE_CONSUMER_RUNTIME)
  std::vector<std::int64_t> out(4, -1);
  foremoe::runtime::CountRequest req;
  req.ids = ids.data();
  req.dtype = foremoe::IdDtype::i16;
  req.num_tokens = 4;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 4;
  const auto st = foremoe::runtime::count_loads(foremoe::runtime::Backend::host, req, out);
  if (!st.ok()) return std::printf("runtime: %s\n", st.to_string().c_str()), 1;
  if (out != want) return std::printf("runtime count wrong\n"), 1;
  const bool cuda = foremoe::runtime::build_info().cuda_compiled;
#if defined(FOREMOE_CONSUMER_EXPECT_CUDA)
  if (cuda != bool(FOREMOE_CONSUMER_EXPECT_CUDA))
    return std::printf("runtime cuda_compiled is %d, expected %d\n", int(cuda), FOREMOE_CONSUMER_EXPECT_CUDA), 1;
#endif
  std::printf("foremoe %s consumer ok (cuda compiled: %d)\n", foremoe::version_string, int(cuda));
#else
  std::printf("foremoe %s consumer ok (header-only)\n", foremoe::version_string);
#endif
  return 0;
}
