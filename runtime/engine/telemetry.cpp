// Ending a batch: per-move telemetry and the final status naming what failed.

#include <algorithm>
#include <chrono>
#include <string>

#include "engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

void EngineImpl::end(TicketImpl &t) {
  std::vector<MoveTelemetry> tel;
  std::string failed;
  int num_failed = 0;
  auto note = [&](int idx, bool ok, const char *what, int expert, int gpu) {
    if (ok) return;
    if (++num_failed <= 8)
      failed += foremoe::detail::concat(num_failed > 1 ? ", " : "", what, " ", idx, " (expert ", expert, " on GPU ",
                                        gpu, ")");
  };
  if (t.kind == TicketImpl::Kind::moves) {
    for (std::size_t i = 0; i < t.moves.size(); ++i) {
      const MoveRun &mr = t.moves[i];
      MoveTelemetry m;
      m.move_idx = static_cast<int>(i);
      int best = 0;
      for (int p = 1; p < transfer::num_paths; ++p)
        if (mr.path_bytes[p] > mr.path_bytes[best]) best = p;
      m.path = static_cast<transfer::Path>(best);
      m.num_bytes = t.plan.expert_bytes;
      m.start_seconds = std::max(0.0, mr.start);
      m.end_seconds = mr.end;
      m.gb_per_s = mr.end > m.start_seconds ? static_cast<double>(m.num_bytes) / (mr.end - m.start_seconds) / 1e9 : 0;
      m.attempts = mr.attempts;
      m.num_chunks = static_cast<int>(mr.chunk_idx.size());
      m.ok = mr.finished && !mr.failed;
      m.verified = mr.checked;
      m.remote = mr.remote;
      m.verify_failures = mr.verify_rounds;
      if (m.ok && !mr.remote)
        for (int ci : mr.chunk_idx)
          m.fallback = m.fallback || (t.chunks[ci].fell_back && t.chunks[ci].c.path == transfer::Path::pcie);
      tel.push_back(m);
      if (!mr.remote) note(static_cast<int>(i), m.ok, "move", t.plan.moves[i].expert, t.plan.moves[i].dst_gpu);
    }
  } else {
    for (std::size_t i = 0; i < t.reduces.size(); ++i) {
      const ReduceRun &r = t.reduces[i];
      MoveTelemetry m;
      m.move_idx = static_cast<int>(i);
      m.path = r.copy.c.path;
      m.num_bytes = r.copy.c.num_bytes;
      m.start_seconds = std::max(0.0, r.start);
      m.end_seconds = r.end;
      m.gb_per_s = r.end > m.start_seconds ? static_cast<double>(m.num_bytes) / (r.end - m.start_seconds) / 1e9 : 0;
      m.attempts = r.copy.attempts;
      m.num_chunks = 1;
      m.ok = r.ok;
      m.remote = !local_[r.owner];
      // Its own staged copy checked out (it may still be unadded: all or nothing, another replica of its expert
      // failed).
      m.verified = opts_.verify && !m.remote && r.copy.done();
      m.verify_failures = r.verify_rounds;
      tel.push_back(m);
      if (!m.remote) note(static_cast<int>(i), m.ok, "reduction", r.expert, r.gpu);
    }
  }
  Status st;
  TicketState ts = TicketState::done;
  if (t.draining && t.drain_reason != StatusCode::ok && (num_failed > 0 || !t.gated)) {
    ts = t.drain_reason == StatusCode::aborted     ? TicketState::aborted
         : t.drain_reason == StatusCode::timed_out ? TicketState::timed_out
                                                   : TicketState::failed;
    if (t.final_status.code() == StatusCode::in_progress)
      st = {
          t.drain_reason,
          foremoe::detail::concat(
              "layer ", t.layer, ": batch ", ts == TicketState::aborted ? "aborted" : "timed out",
              ts == TicketState::timed_out
                  ? foremoe::detail::concat(
                        " (deadline ", std::chrono::duration_cast<std::chrono::milliseconds>(t.deadline - t.t0).count(),
                        " ms after submit)")
                  : std::string(),
              t.gated ? "" : " before its gates opened", num_failed ? "; unfinished: " : "", failed, peer_waiting(t),
              t.peer_error.empty() ? "" : "; ", t.peer_error)};
    else
      st = t.final_status;
  } else if (num_failed > 0) {
    ts = TicketState::failed;
    st = {StatusCode::device_error,
          foremoe::detail::concat("layer ", t.layer, ": ", num_failed, " of ", tel.size(),
                                  " failed on every path: ", failed, num_failed > 8 ? ", ..." : "",
                                  t.peer_error.empty() ? "" : "; ", t.peer_error)};
  }
  if (t.flag != nullptr) *t.flag = t.flag_value; // releases streams waiting in enqueue_wait, also on failure
  {
    // The state changes under the ticket's lock so that a waiter cannot miss the notification.
    std::lock_guard lock(t.mu);
    t.telemetry = std::move(tel);
    t.final_status = st;
    t.after.clear();
    t.state.store(static_cast<int>(ts), std::memory_order_release);
  }
  t.cv.notify_all();
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
