#pragma once
/// @file
/// The node-shared host mirror (DESIGN.md, "host mirror"): one POSIX shared-memory segment per node and layer that
/// every local rank of the node maps, instead of one private copy per rank. The node's first local rank creates it,
/// the others open it; a small header (magic, format version, payload size, a generation counter and a ready
/// flag) is checked on open, so a segment of another size, another program or another format version is refused
/// with an error naming it. Optionally pinned with `cudaHostRegister` (CUDA builds only), so that host-to-device
/// copies from it run on the copy engines.
///
/// Refreshing is collective over the node's local ranks: each writes its share of the payload between
/// `begin_refresh` and `end_refresh`, with a barrier that every local rank passes after its writes and before any
/// `end_refresh`. The generation is even when the payload is consistent and odd while a refresh writes it (or when
/// one was interrupted); 0 means never filled. A rank's mirror is stale when the generation is not the one its own
/// last `end_refresh` (or its `create` / `open`) saw, when it is odd, or when it is 0. Writes between two refreshes
/// are not tracked: write the payload only inside a refresh.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "foremoe/runtime/status.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// What identifies a node mirror segment and how to map it.
struct NodeMirrorOptions {
  /// The same on every rank of the job and different between jobs sharing a node: 1 to `max_job_key_chars`
  /// letters, digits, '_' or '-'.
  std::string job_key;
  int node = 0;                   ///< the node's index in the job (>= 0)
  int layer = 0;                  ///< which mirror of the job on that node, e.g. the MoE layer (>= 0)
  std::int64_t payload_bytes = 0; ///< the mirror's bytes (all experts' weights of the layer), > 0
  bool pin = false;               ///< `cudaHostRegister` the mapping (CUDA builds; `unavailable` without CUDA)
  /// `open`: how long to wait for the creator (segment present, sized and marked ready); 0: fail at once.
  std::chrono::milliseconds open_timeout{0};

  static constexpr std::size_t max_job_key_chars = 200;
};

/// The segment's header is the first page of the segment; the payload starts at `node_mirror_header_bytes`.
inline constexpr std::uint64_t node_mirror_magic = 0x524f5252494d4d46ULL; ///< "FMMIRROR" read little-endian
inline constexpr std::uint32_t node_mirror_format_version = 1;
inline constexpr std::int64_t node_mirror_header_bytes = 4096;

/// The segment name for `options` (`/foremoe.<job_key>.n<node>.l<layer>`), or `invalid_argument` naming the bad
/// key, node or layer.
[[nodiscard]] Status node_mirror_name(const NodeMirrorOptions &options, std::string &out);

/// Bytes of host memory one node mirror of `payload_bytes` takes on its node (the header page plus the payload
/// rounded up to whole pages), or -1 when `payload_bytes` is not positive or the size overflows.
[[nodiscard]] std::int64_t node_mirror_segment_bytes(std::int64_t payload_bytes) noexcept;

/// One local rank's mapping of its node's mirror segment. Not thread-safe; one object per process and segment.
class NodeMirror {
public:
  /// Creates the segment (the node's first local rank): fails with `invalid_argument` when one of that name exists
  /// already (another job with the same key, or a segment left by a process that died: its message names the file
  /// to remove). The payload starts zeroed, at generation 0.
  [[nodiscard]] static Status create(const NodeMirrorOptions &options, std::unique_ptr<NodeMirror> &out);
  /// Opens the segment another local rank created, checking its header against `options` (magic, version,
  /// payload size, ready flag); waits up to `options.open_timeout` for the creator.
  [[nodiscard]] static Status open(const NodeMirrorOptions &options, std::unique_ptr<NodeMirror> &out);
  /// Unregisters and unmaps; the creator also removes the name (if `unlink` did not already).
  ~NodeMirror();
  NodeMirror(const NodeMirror &) = delete;
  NodeMirror &operator=(const NodeMirror &) = delete;

  /// The payload, `payload_bytes` long, page-aligned.
  [[nodiscard]] std::span<std::byte> payload() const noexcept { return {data_, static_cast<std::size_t>(bytes_)}; }
  [[nodiscard]] std::int64_t payload_bytes() const noexcept { return bytes_; }
  /// Host memory the segment takes on the node (counted once per node, whatever the number of local ranks).
  [[nodiscard]] std::int64_t segment_bytes() const noexcept { return node_mirror_segment_bytes(bytes_); }
  [[nodiscard]] const std::string &name() const noexcept { return name_; }
  [[nodiscard]] bool is_creator() const noexcept { return creator_; }
  [[nodiscard]] bool pinned() const noexcept { return pinned_; }

  /// The shared generation counter (acquire load).
  [[nodiscard]] std::uint64_t generation() const noexcept;
  /// The generation this rank saw at its last `end_refresh`, or at `create` / `open` (rounded down to even: a
  /// refresh under way when this rank opened is one it joins).
  [[nodiscard]] std::uint64_t seen_generation() const noexcept { return seen_; }
  /// Whether the payload may not be read as this rank's current mirror: never filled (0), a refresh under way or
  /// interrupted (odd), or a refresh this rank did not take part in (not `seen_generation`).
  [[nodiscard]] bool stale() const noexcept;
  /// Marks a refresh as under way (generation `seen` -> `seen + 1`; a local rank that comes second finds
  /// `seen + 1` already). `aborted` naming both generations when the counter is neither: this rank missed a
  /// refresh of the others, or they missed one of its.
  [[nodiscard]] Status begin_refresh();
  /// Ends the refresh begun by `begin_refresh` (`seen + 1` -> `seen + 2`; a rank that comes second finds it
  /// done), after a barrier every local rank passed once its writes were done, and records the new generation
  /// as seen. `aborted` naming the generations when the counter moved otherwise.
  [[nodiscard]] Status end_refresh();
  /// Removes the segment's name once every local rank has mapped it (the mappings stay valid), so that nothing is
  /// left behind when a process dies. Idempotent; only the creator removes the name, others do nothing.
  [[nodiscard]] Status unlink();

private:
  NodeMirror() = default;
  std::string name_;
  void *map_ = nullptr; // the whole segment, header first
  std::int64_t map_bytes_ = 0;
  std::byte *data_ = nullptr; // the payload
  std::int64_t bytes_ = 0;
  std::uint64_t seen_ = 0;
  bool creator_ = false;
  bool linked_ = false; // the creator has not removed the name yet
  bool pinned_ = false;
};

} // namespace runtime
} // namespace v0
} // namespace foremoe
