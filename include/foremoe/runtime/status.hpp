#pragma once
/// @file
/// Status values returned by the compiled runtime (it never throws across its API).

#include <string>
#include <string_view>
#include <utility>

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// Outcome of a runtime call; `in_progress` is a normal answer of polls.
enum class StatusCode : int {
  ok = 0,
  in_progress,
  invalid_argument,
  unavailable, ///< backend not compiled in or no device present
  timed_out,
  aborted,
  device_error, ///< a CUDA or NCCL call failed
  internal,
};

[[nodiscard]] constexpr std::string_view to_string(StatusCode c) noexcept {
  switch (c) {
  case StatusCode::ok: return "ok";
  case StatusCode::in_progress: return "in_progress";
  case StatusCode::invalid_argument: return "invalid_argument";
  case StatusCode::unavailable: return "unavailable";
  case StatusCode::timed_out: return "timed_out";
  case StatusCode::aborted: return "aborted";
  case StatusCode::device_error: return "device_error";
  case StatusCode::internal: return "internal";
  }
  return "?";
}

/// A code plus a message naming what went wrong.
class [[nodiscard]] Status {
public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  [[nodiscard]] static Status success() { return {}; }

  [[nodiscard]] bool ok() const noexcept { return code_ == StatusCode::ok; }
  [[nodiscard]] StatusCode code() const noexcept { return code_; }
  [[nodiscard]] const std::string &message() const noexcept { return message_; }
  [[nodiscard]] std::string to_string() const {
    std::string s(runtime::to_string(code_));
    if (!message_.empty()) s += ": " + message_;
    return s;
  }

private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

} // namespace runtime
} // namespace v0
} // namespace foremoe
