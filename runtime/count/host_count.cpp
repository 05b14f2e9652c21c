// Host backend of load counting: micro-steps split across the threads of the
// workspace's pool, each running the header-only counter on its share.

#include <algorithm>
#include <cstring>
#include <vector>

#include "../backends.hpp"
#include "foremoe/trace/count.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

Status host_count_loads(const CountRequest &req, int num_moe_layers, std::int64_t *out, ThreadPool &pool) {
  std::vector<std::int64_t> whole;
  std::span<const std::int64_t> mb = req.microbatch_offsets;
  if (mb.empty()) {
    whole = {0, req.num_tokens};
    mb = whole;
  }
  const int num_micro_steps = static_cast<int>(mb.size() - 1);
  const std::size_t per_step = static_cast<std::size_t>(num_moe_layers) * req.num_experts;
  const int workers = std::max(1, std::min(pool.num_threads(), num_micro_steps));
  const std::size_t id_bytes = static_cast<std::size_t>(id_dtype_bytes(req.dtype));
  const std::size_t token_ids = static_cast<std::size_t>(req.num_layers) * req.topk;

  std::vector<std::string> errors(workers);
  pool.parallel_for(static_cast<std::size_t>(workers), [&](std::size_t block, int) {
    const int w = static_cast<int>(block);
    // Contiguous blocks of micro-steps per worker keep their ids contiguous too.
    const int m0 = static_cast<int>(static_cast<std::int64_t>(num_micro_steps) * w / workers);
    const int m1 = static_cast<int>(static_cast<std::int64_t>(num_micro_steps) * (w + 1) / workers);
    if (m0 == m1) return;
    try {
      const std::int64_t t0 = mb[m0], t1 = mb[m1];
      std::vector<std::int64_t> local(mb.begin() + m0, mb.begin() + m1 + 1);
      for (auto &o : local)
        o -= t0;
      const auto *base =
          static_cast<const unsigned char *>(req.ids) + static_cast<std::size_t>(t0) * token_ids * id_bytes;
      RoutedView view(base, req.dtype, t1 - t0, req.num_layers, req.topk);
      CountOptions opts;
      opts.num_experts = req.num_experts;
      if (!req.layer_map.empty())
        opts.layer_map = LayerMap(std::vector<int>(req.layer_map.begin(), req.layer_map.end()));
      opts.microbatch_offsets = local;
      const LoadTensor part = ::foremoe::count_loads(view, opts);
      std::memcpy(out + static_cast<std::size_t>(m0) * per_step, part.totals().data(),
                  part.totals().size() * sizeof(std::int64_t));
    } catch (const std::exception &e) {
      // Token indices in the message are relative to the worker's first token.
      errors[w] =
          ::foremoe::detail::concat("micro-steps [", m0, ", ", m1, ") starting at token ", mb[m0], ": ", e.what());
    }
  });
  for (const auto &e : errors)
    if (!e.empty()) return {StatusCode::invalid_argument, e};
  return Status::success();
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
