// `foremoe._core`: bindings over the compiled runtime (`foremoe::runtime`): the transfer engine and the runtime's
// load counting and token mapping, on memory of any DLPack producer (torch tensors, NumPy arrays) without copies.
//
// Memory is borrowed, never converted: an array that is not C-contiguous, of the wrong dtype or on the wrong device
// is refused with a message naming it (a silent conversion would register a temporary). The engine keeps a
// reference to every array registered with it until it is destroyed, and is destroyed (its batches ended) before
// those references are dropped. Statuses other than ok become exceptions: `invalid_argument` -> ValueError,
// `timed_out` -> TimeoutError, the rest -> RuntimeError; tickets hand their status back as (code, message) for the
// Python side (`foremoe.torch.engine`) to interpret. Blocking calls release the GIL.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "foremoe/runtime/nccl.hpp"
#include "foremoe/runtime/node_mirror.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/token_map.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace fm = foremoe;
namespace rt = foremoe::runtime;

namespace foremoe::python {
namespace {

template <class... A> std::string str(const A &...a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

[[noreturn]] void raise(PyObject *type, const std::string &msg) {
  PyErr_SetString(type, msg.c_str());
  throw nb::python_error();
}

void check(const rt::Status &st) {
  if (st.ok()) return;
  const std::string msg = st.to_string();
  switch (st.code()) {
  case rt::StatusCode::invalid_argument: raise(PyExc_ValueError, msg);
  case rt::StatusCode::timed_out: raise(PyExc_TimeoutError, msg);
  default: raise(PyExc_RuntimeError, msg);
  }
}

nb::tuple status_tuple(const rt::Status &st) {
  return nb::make_tuple(std::string(rt::to_string(st.code())), st.message());
}

// ---------------------------------------------------------------------------------------------------------------
// Borrowed memory

using Array = nb::ndarray<>;

const char *device_name(std::int32_t type) {
  switch (type) {
  case nb::device::cpu::value: return "cpu";
  case nb::device::cuda::value: return "cuda";
  case nb::device::cuda_host::value: return "cuda_host";
  default: return "another device";
  }
}

std::string dtype_str(const nb::dlpack::dtype &d) {
  const char *kind = d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int)       ? "int"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)    ? "uint"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)   ? "float"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat)  ? "bfloat"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Complex) ? "complex"
                     : d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bool)    ? "bool"
                                                                                            : "other";
  return str(kind, static_cast<int>(d.bits));
}

std::string shape_str(const Array &a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.ndim(); ++i)
    s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

bool c_contiguous(const Array &a) {
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

/// Where an array must live: the host (CPU memory, pinned or not) or CUDA device `cuda_device`.
struct Where {
  bool cuda = false;
  int cuda_device = 0;
};

/// Checks that `a` (named `what`) is C-contiguous, non-empty and lives where `w` says.
void check_memory(const Array &a, const std::string &what, Where w) {
  if (a.ndim() == 0 || a.size() == 0) raise(PyExc_ValueError, str(what, " is empty (shape ", shape_str(a), ")"));
  if (!c_contiguous(a))
    raise(PyExc_ValueError, str(what, " must be C-contiguous (shape ", shape_str(a),
                                "; a copy would be registered in its place: pass .contiguous() and keep it)"));
  const std::int32_t dev = a.device_type();
  if (w.cuda) {
    if (dev != nb::device::cuda::value)
      raise(PyExc_ValueError,
            str(what, " must be on CUDA device ", w.cuda_device, " (CUDA backend), got ", device_name(dev), " memory"));
    if (a.device_id() != w.cuda_device)
      raise(PyExc_ValueError,
            str(what, " is on CUDA device ", a.device_id(), ", the engine drives it on device ", w.cuda_device));
  } else if (dev != nb::device::cpu::value && dev != nb::device::cuda_host::value) {
    raise(PyExc_ValueError, str(what, " must be in host memory (CPU tensor), got ", device_name(dev), " memory"));
  }
}

/// Bytes of one row of `a` along dimension `dim` (the product of the later dimensions times the item size).
std::int64_t row_bytes(const Array &a, std::size_t dim) {
  std::int64_t n = static_cast<std::int64_t>(a.itemsize());
  for (std::size_t i = dim + 1; i < a.ndim(); ++i)
    n *= static_cast<std::int64_t>(a.shape(i));
  return n;
}

bool is_dtype(const Array &a, nb::dlpack::dtype_code code, int bits) {
  return a.dtype().code == static_cast<std::uint8_t>(code) && a.dtype().bits == bits && a.dtype().lanes == 1;
}

// ---------------------------------------------------------------------------------------------------------------
// Options: every field is one property below; `EngineOptions(**fields)` and `EngineOptions.fields()` read them
// from the class itself, so a field is declared in exactly one place.

rt::Backend backend_of(const std::string &name) {
  if (name == "host") return rt::Backend::host;
  if (name == "cuda") return rt::Backend::cuda;
  raise(PyExc_ValueError, str("EngineOptions: backend must be 'host' or 'cuda', got '", name, "'"));
}
std::string backend_name(rt::Backend b) { return b == rt::Backend::cuda ? "cuda" : "host"; }

std::vector<std::string> property_names(nb::handle cls) {
  std::vector<std::string> out;
  nb::handle property = reinterpret_cast<PyObject *>(&PyProperty_Type);
  nb::object members = cls.attr("__dict__"); // a mappingproxy: iterated by key
  for (nb::handle k : members)
    if (nb::isinstance(members[k], property)) out.push_back(nb::cast<std::string>(k));
  return out;
}

/// The type a field's setter takes, from its nanobind signature: "def (self, arg: int, /) -> None" -> "int".
std::string setter_type(nb::handle cls, const std::string &key) {
  nb::object prop = cls.attr("__dict__")[key.c_str()];
  nb::object sig = nb::getattr(prop.attr("fset"), "__nb_signature__", nb::none());
  if (sig.is_none()) return {};
  const std::string s = nb::cast<std::string>(sig[0][0]);
  const std::size_t start = s.find(": ", s.find("self"));
  const std::size_t stop = s.rfind(") ->");
  if (start == std::string::npos || stop == std::string::npos || stop < start + 2) return {};
  std::string t = s.substr(start + 2, stop - start - 2);
  if (t.size() > 3 && t.compare(t.size() - 3, 3, ", /") == 0) t.resize(t.size() - 3);
  return t;
}

std::string short_repr(nb::handle v) {
  std::string r = nb::cast<std::string>(nb::repr(v));
  if (r.size() > 60) r = r.substr(0, 57) + "...";
  return str(nb::type_name(v.type()).c_str(), " ", r);
}

/// Sets the field `key` to `v`, naming it when `v` does not fit (nanobind's own message names neither the field
/// nor the type it takes). An integer field takes what the package's integer check takes (foremoe/_args.py: no
/// 8.7 -> 8, an integral float such as 8.0 accepted).
void set_field(nb::handle self, const std::string &key, nb::handle v) {
  try {
    nb::setattr(self, key.c_str(), v);
    return;
  } catch (nb::python_error &e) {
    if (!e.matches(PyExc_TypeError)) throw;
  }
  const std::string where = str(nb::cast<std::string>(self.type().attr("__name__")), ": ", key);
  const std::string want = setter_type(self.type(), key);
  if (want == "int") {
    nb::object i = nb::module_::import_("foremoe._args")
                       .attr("integer")(v, where.c_str(), std::numeric_limits<std::int64_t>::min(),
                                        std::numeric_limits<std::int64_t>::max());
    try {
      nb::setattr(self, key.c_str(), i);
      return;
    } catch (nb::python_error &e) {
      if (!e.matches(PyExc_TypeError)) throw;
    }
    raise(PyExc_ValueError, str(where, " = ", nb::cast<std::string>(nb::repr(i)),
                                " does not fit the option's C++ "
                                "integer type"));
  }
  raise(PyExc_TypeError,
        str(where, " must be ", want.empty() ? std::string("another type") : want, ", got ", short_repr(v)));
}

void set_fields(nb::handle self, const nb::kwargs &kw) {
  const std::vector<std::string> names = property_names(self.type());
  for (auto [k, v] : kw) {
    const std::string key = nb::cast<std::string>(k);
    if (std::find(names.begin(), names.end(), key) == names.end()) {
      std::string all;
      for (const std::string &n : names)
        all += (all.empty() ? "" : ", ") + n;
      raise(PyExc_ValueError,
            str(nb::type_name(self.type()).c_str(), ": unknown option '", key, "' (options: ", all, ")"));
    }
    set_field(self, key, v);
  }
}

std::string repr_fields(nb::handle self) {
  std::string s = str(nb::type_name(self.type()).c_str(), "(");
  bool first = true;
  for (const std::string &n : property_names(self.type())) {
    s += (first ? "" : ", ") + n + "=" + nb::cast<std::string>(nb::repr(self.attr(n.c_str())));
    first = false;
  }
  return s + ")";
}

/// A class of options whose fields are its properties: `T(**fields)`, `T.fields()` and a repr listing them.
template <class T> nb::class_<T> options_class(nb::handle scope, const char *name, const char *doc) {
  nb::class_<T> c(scope, name, doc);
  c.def("__init__",
        [](nb::pointer_and_handle<T> self, const nb::kwargs &kw) {
          new (self.p) T();
          nb::inst_mark_ready(self.h); // the fields' setters need a ready instance
          set_fields(self.h, kw);
        })
      .def_static(
          "fields", [] { return property_names(nb::type<T>()); }, "The option names, in order.")
      .def("__repr__", [](nb::handle self) { return repr_fields(self); });
  return c;
}

transfer::Path path_of(const std::string &name) {
  for (int p = 0; p < transfer::num_paths; ++p)
    if (transfer::to_string(static_cast<transfer::Path>(p)) == name) return static_cast<transfer::Path>(p);
  raise(PyExc_ValueError, str("unknown path '", name, "' (expected nvlink, pcie or network)"));
}

// ---------------------------------------------------------------------------------------------------------------
// Engine and tickets

struct PyTicket {
  rt::Ticket ticket;
  rt::Backend backend = rt::Backend::host;
};

nb::list telemetry_list(const rt::Ticket &t) {
  nb::list out;
  for (const rt::MoveTelemetry &m : t.telemetry()) {
    nb::dict d;
    d["move"] = m.move_idx;
    d["path"] = std::string(transfer::to_string(m.path));
    d["num_bytes"] = m.num_bytes;
    d["start_seconds"] = m.start_seconds;
    d["end_seconds"] = m.end_seconds;
    d["gb_per_s"] = m.gb_per_s;
    d["num_chunks"] = m.num_chunks;
    d["attempts"] = m.attempts;
    d["ok"] = m.ok;
    d["verified"] = m.verified;
    d["remote"] = m.remote;
    d["verify_failures"] = m.verify_failures;
    d["fallback"] = m.fallback;
    out.append(d);
  }
  return out;
}

std::chrono::milliseconds millis(double seconds, const char *what) {
  if (!(seconds > 0) || seconds > 1e7) raise(PyExc_ValueError, str(what, " must be positive seconds, got ", seconds));
  return std::chrono::milliseconds(std::max<std::int64_t>(1, static_cast<std::int64_t>(seconds * 1000.0 + 0.5)));
}

struct PyNodeMirror;

/// One rank's NCCL communicator (`rt::NcclCommunicator`), handed to one engine, which closes it after itself.
struct PyNccl {
  rt::NcclCommunicator comm;
  std::chrono::milliseconds close_timeout{0}; ///< the timeout it was created with bounds its close too
  bool taken = false;                         ///< an engine owns it
  /// Finalizes and destroys it, bounded by `close_timeout`. Its status is dropped: one that did not finalize in
  /// time (a rank that died) was aborted, and either way nothing of it is left.
  void close() {
    const auto deadline = std::chrono::steady_clock::now() + close_timeout;
    nb::gil_scoped_release nogil;
    (void)comm.close(deadline);
  }
};

/// The engine's paired transfers run by a Python callable (foremoe.torch.engine's `_GroupBridge`: point-to-point
/// over a `torch.distributed` group). GIL rules:
/// - the engine's progress thread only queues a group here (`post`) and never touches Python;
/// - one worker thread of this bridge posts every queued group (runner.post, GIL held) and then waits for them in
///   posting order (runner.finish: torch releases the GIL inside `Work.wait`, so the waits leave Python threads
///   free); it holds no GIL while it waits for the next groups;
/// - every Python call that may wait for the engine (ticket `wait`, `submit`, the engine's destruction) releases
///   the GIL, so a Python thread that waits on a ticket never holds what the worker needs;
/// - `close` (GIL released) waits for the worker, which every group leaves within the runner's deadline; the
///   runner reference is dropped afterwards, with the GIL held (`drop_runner`).
class PyBridge final : public rt::PeerBridge {
public:
  explicit PyBridge(nb::object runner) : runner_(std::move(runner)), worker_([this] { work(); }) {}
  ~PyBridge() override { close(); } // the owner called close() and drop_runner() already
  void post(std::span<rt::PeerOp> ops, Done done) override {
    {
      std::lock_guard lock(mu_);
      if (!stop_) {
        groups_.push_back({ops, std::move(done)});
        cv_.notify_all();
        return;
      }
    }
    done({rt::StatusCode::aborted, "bridge: the engine's process group bridge is closed"});
  }
  /// Runs the queued groups, then stops the worker (call without the GIL).
  void close() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }
  /// Drops the runner (call with the GIL, after `close`).
  void drop_runner() { runner_ = nb::object(); }

private:
  struct Posted {
    std::span<rt::PeerOp> ops;
    Done done;
  };
  // Posts every queued group, then waits for them in order (the engine's rounds overlap on the wire).
  void work() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !groups_.empty(); });
      if (groups_.empty()) return;
      std::deque<Posted> batch;
      batch.swap(groups_);
      lock.unlock();
      std::vector<std::pair<rt::Status, nb::object>> started;
      {
        const bool alive = Py_IsInitialized() != 0;
        std::optional<nb::gil_scoped_acquire> gil;
        if (alive) gil.emplace();
        for (Posted &g : batch) {
          started.emplace_back(rt::Status::success(), nb::object());
          if (!alive) {
            started.back().first = {rt::StatusCode::aborted, "bridge: the Python interpreter has ended"};
            continue;
          }
          started.back().first = call([&] { started.back().second = runner_.attr("post")(items(g.ops)); });
        }
      }
      for (std::size_t i = 0; i < batch.size(); ++i) {
        rt::Status st = started[i].first;
        if (st.ok() && Py_IsInitialized() == 0)
          st = {rt::StatusCode::aborted, "bridge: the Python interpreter has ended"};
        if (st.ok()) {
          nb::gil_scoped_acquire gil;
          st = call([&] { headers(batch[i].ops, runner_.attr("finish")(started[i].second)); });
          started[i].second = nb::object();
        }
        batch[i].done(std::move(st));
      }
      lock.lock();
    }
  }
  // The operations as the runner takes them: (send, local GPU, peer GPU, a NumPy view of the bytes, header).
  static nb::list items(std::span<rt::PeerOp> ops) {
    nb::list out;
    for (rt::PeerOp &op : ops) {
      const std::size_t shape[1] = {static_cast<std::size_t>(op.num_bytes)};
      // A view of the engine's memory, not a copy (receives write through it); the engine keeps it until `done`.
      nb::object view =
          nb::cast(nb::ndarray<nb::numpy, std::uint8_t>(op.buf, 1, shape, nb::handle()), nb::rv_policy::reference);
      out.append(nb::make_tuple(op.send, op.local_gpu, op.peer_gpu, view, op.header[0], op.header[1]));
    }
    return out;
  }
  // The runner's headers of the receives, in order, into `ops`.
  static void headers(std::span<rt::PeerOp> ops, nb::handle got) {
    const nb::list h = nb::cast<nb::list>(got);
    std::size_t k = 0;
    for (rt::PeerOp &op : ops) {
      if (op.send) continue;
      if (k >= h.size()) throw std::runtime_error("the runner answered too few headers");
      const auto v = nb::cast<std::pair<std::uint64_t, std::uint64_t>>(h[k++]);
      op.header[0] = v.first;
      op.header[1] = v.second;
    }
  }
  // Runs `f` (GIL held); a Python exception becomes the status: TimeoutError -> timed_out, else device_error.
  template <class F> static rt::Status call(F &&f) {
    try {
      f();
      return rt::Status::success();
    } catch (nb::python_error &e) {
      return {e.matches(PyExc_TimeoutError) ? rt::StatusCode::timed_out : rt::StatusCode::device_error,
              nb::cast<std::string>(nb::str(e.value()))}; // the runner's message, without the traceback
    } catch (const std::exception &e) {
      return {rt::StatusCode::device_error, std::string("bridge: ") + e.what()};
    }
  }

  nb::object runner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Posted> groups_;
  bool stop_ = false;
  std::thread worker_; // last: starts once the rest is built
};

class PyEngine {
public:
  /// `runner`: not None, the engine's paired transfers run through it (`PyBridge`). `nccl_comms`: not None, one
  /// `NcclCommunicator` or None per GPU (`peers.nccl_comm_of_gpu`); the engine owns them and closes them after
  /// itself.
  PyEngine(rt::EngineOptions o, nb::object runner, nb::object nccl_comms) : opts_(std::move(o)) {
    if (!runner.is_none()) {
      bridge_ = std::make_shared<PyBridge>(std::move(runner));
      opts_.peers.bridge = bridge_;
    }
    if (!nccl_comms.is_none()) take_comms(nccl_comms);
    rt::Status st;
    {
      nb::gil_scoped_release nogil;
      st = rt::TransferEngine::create(opts_, engine_);
    }
    if (!st.ok()) close();
    check(st);
  }
  ~PyEngine() { close(); }
  /// Ends the engine: batches end (bounded by their deadlines) and, with a bridge, every paired transfer it was
  /// given (bounded by the runner's deadline) before the borrowed memory is given back.
  void close() {
    {
      nb::gil_scoped_release nogil;
      engine_.reset();
      if (bridge_) bridge_->close();
    }
    if (bridge_) bridge_->drop_runner();
    opts_.peers.bridge = nullptr;
    bridge_.reset();
    // The communicators after the engine: its progress thread called them until it was destroyed.
    for (nb::handle c : comms_)
      nb::cast<PyNccl &>(c).close();
    comms_.clear();
    opts_.peers.nccl_comm_of_gpu.clear();
  }
  bool closed() const { return engine_ == nullptr; }
  PyEngine(const PyEngine &) = delete;
  PyEngine &operator=(const PyEngine &) = delete;

  rt::EngineOptions options() const {
    rt::EngineOptions o = opts_;
    o.peers.bridge = nullptr; // the bridge stays the engine's
    return o;
  }

  void register_slots(int layer, int gpu, const Array &a, int num_buffers) {
    const std::string what = str("register_slots: layer ", layer, " GPU ", gpu, " slots ", shape_str(a));
    check_gpu(gpu, what);
    check_memory(a, what, slot_memory(gpu));
    const int S = opts_.topology.slots_per_gpu;
    const std::size_t slot_dim = num_buffers == 2 ? 1 : 0;
    if (num_buffers != 1 && num_buffers != 2)
      raise(PyExc_ValueError, str(what, ": num_buffers must be 1 or 2, got ", num_buffers));
    if (a.ndim() <= slot_dim || (num_buffers == 2 && a.shape(0) != 2) ||
        a.shape(slot_dim) != static_cast<std::size_t>(S))
      raise(PyExc_ValueError, str(what, ": expected ", num_buffers == 2 ? "[2, " : "[", S,
                                  ", ...] (buffers x slots x an expert's bytes) for ", S, " slots per GPU"));
    rt::SlotRegion r{a.data(), row_bytes(a, slot_dim), S, num_buffers, num_buffers == 2 ? row_bytes(a, 0) : 0};
    check(eng().register_slots(layer, gpu, r));
    keep_.push_back(a);
  }

  /// The split layout: one contiguous `[slots, ...]` (or `[2, slots, ...]`) array per `EngineOptions::tensors`
  /// entry, tensor `i` of slot `s` in row `s` of `parts[i]`.
  void register_slots_split(int layer, int gpu, const std::vector<Array> &parts, int num_buffers) {
    const std::string what = str("register_slots: layer ", layer, " GPU ", gpu);
    check_gpu(gpu, what);
    if (num_buffers != 1 && num_buffers != 2)
      raise(PyExc_ValueError, str(what, ": num_buffers must be 1 or 2, got ", num_buffers));
    check_parts(parts.size(), what);
    const int S = opts_.topology.slots_per_gpu;
    const std::size_t slot_dim = num_buffers == 2 ? 1 : 0;
    rt::SlotRegion r;
    r.num_slots = S;
    r.num_buffers = num_buffers;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Array &a = parts[i];
      const std::string tw = str(what, " tensor ", i, " ", shape_str(a));
      check_memory(a, tw, slot_memory(gpu));
      if (a.ndim() <= slot_dim || (num_buffers == 2 && a.shape(0) != 2) ||
          a.shape(slot_dim) != static_cast<std::size_t>(S))
        raise(PyExc_ValueError,
              str(tw, ": expected ", num_buffers == 2 ? "[2, " : "[", S, ", ...] (",
                  num_buffers == 2 ? "buffers x " : "", "slots x the tensor's bytes) for ", S, " slots per GPU"));
      r.tensors.push_back({a.data(), row_bytes(a, slot_dim), num_buffers == 2 ? row_bytes(a, 0) : 0});
    }
    check(eng().register_slots(layer, gpu, r));
    keep_.insert(keep_.end(), parts.begin(), parts.end());
  }

  /// `node_mirror`: None, or the `NodeMirror` segment `a` lies in (checked; the engine then never reads it stale).
  void register_mirror(int layer, int node, const Array &a, nb::object node_mirror) {
    const std::string what = str("register_mirror: layer ", layer, " node ", node, " mirror ", shape_str(a));
    check_memory(a, what, Where{});
    if (a.shape(0) != static_cast<std::size_t>(opts_.num_experts))
      raise(PyExc_ValueError, str(what, ": expected [", opts_.num_experts, ", ...] (one row per expert)"));
    rt::MirrorRegion r{a.data(), row_bytes(a, 0), opts_.num_experts};
    r.node_mirror = segment_of(node_mirror, what);
    check(eng().register_mirror(layer, node, r));
    keep_.push_back(a);
    if (!node_mirror.is_none()) keep_mirrors_.push_back(std::move(node_mirror));
  }

  /// The split layout: one contiguous `[experts, ...]` array per `EngineOptions::tensors` entry; with
  /// `node_mirror`, views that lie inside that segment's payload.
  void register_mirror_split(int layer, int node, const std::vector<Array> &parts, nb::object node_mirror) {
    const std::string what = str("register_mirror: layer ", layer, " node ", node);
    check_parts(parts.size(), what);
    rt::MirrorRegion r;
    r.num_experts = opts_.num_experts;
    r.node_mirror = segment_of(node_mirror, what);
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Array &a = parts[i];
      const std::string tw = str(what, " tensor ", i, " ", shape_str(a));
      check_memory(a, tw, Where{});
      if (a.shape(0) != static_cast<std::size_t>(opts_.num_experts))
        raise(PyExc_ValueError, str(tw, ": expected [", opts_.num_experts, ", ...] (one row per expert)"));
      r.tensors.push_back({a.data(), row_bytes(a, 0)});
    }
    check(eng().register_mirror(layer, node, r));
    keep_.insert(keep_.end(), parts.begin(), parts.end());
    if (!node_mirror.is_none()) keep_mirrors_.push_back(std::move(node_mirror));
  }

  /// Node `node`'s mirror of `layer` as a node-shared segment (`NodeMirror`): its payload holds one row per
  /// expert; the engine never reads it while it is stale. The segment is kept alive by the engine.
  void register_node_mirror(int layer, int node, nb::object mirror);

  // The gradient type of `a` (`rt::GradType`), or a ValueError naming its dtype.
  static rt::GradType grad_type_of(const Array &a, const std::string &what) {
    if (is_dtype(a, nb::dlpack::dtype_code::Float, 32)) return rt::GradType::f32;
    if (is_dtype(a, nb::dlpack::dtype_code::Float, 64)) return rt::GradType::f64;
    if (is_dtype(a, nb::dlpack::dtype_code::Float, 16)) return rt::GradType::f16;
    if (is_dtype(a, nb::dlpack::dtype_code::Bfloat, 16)) return rt::GradType::bf16;
    raise(PyExc_ValueError,
          str(what, ": gradients must be float32, float64, bfloat16 or float16, got ", dtype_str(a.dtype())));
  }

  /// The packed layout: one `[slots, ...]` array; an expert's gradient is its row's first `grad_bytes` bytes.
  void register_grads(int layer, int gpu, const Array &a, std::optional<std::int64_t> grad_bytes) {
    const std::string what = str("register_grads: layer ", layer, " GPU ", gpu, " gradients ", shape_str(a));
    check_gpu(gpu, what);
    check_memory(a, what, slot_memory(gpu));
    const rt::GradType type = grad_type_of(a, what);
    const int S = opts_.topology.slots_per_gpu;
    if (a.ndim() == 0 || a.shape(0) != static_cast<std::size_t>(S))
      raise(PyExc_ValueError, str(what, ": expected [", S, ", ...] for ", S, " slots per GPU"));
    const std::int64_t row = row_bytes(a, 0);
    rt::SlotRegion r{a.data(), row, S, 1, 0};
    check(eng().register_grads(layer, gpu, r, rt::GradLayout{type, {grad_bytes.value_or(row)}}));
    keep_.push_back(a);
  }

  /// The split layout: one `[slots, ...]` array per `EngineOptions::tensors` entry, all of one dtype; tensor `i`'s
  /// gradient of an expert is its whole row.
  void register_grads_split(int layer, int gpu, const std::vector<Array> &parts) {
    const std::string what = str("register_grads: layer ", layer, " GPU ", gpu);
    check_gpu(gpu, what);
    check_parts(parts.size(), what);
    const int S = opts_.topology.slots_per_gpu;
    rt::SlotRegion r;
    r.num_slots = S;
    rt::GradLayout layout;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Array &a = parts[i];
      const std::string tw = str(what, " tensor ", i, " ", shape_str(a));
      check_memory(a, tw, slot_memory(gpu));
      const rt::GradType type = grad_type_of(a, tw);
      if (i > 0 && type != layout.type)
        raise(PyExc_ValueError, str(tw, ": gradients of one layer have one dtype, got ", rt::to_string(type), " after ",
                                    rt::to_string(layout.type), " for tensor 0"));
      layout.type = type;
      if (a.ndim() == 0 || a.shape(0) != static_cast<std::size_t>(S))
        raise(PyExc_ValueError,
              str(tw, ": expected [", S, ", ...] (slots x the tensor's gradient) for ", S, " slots per GPU"));
      r.tensors.push_back({a.data(), row_bytes(a, 0), 0});
      layout.tensor_bytes.push_back(row_bytes(a, 0));
    }
    check(eng().register_grads(layer, gpu, r, layout));
    keep_.insert(keep_.end(), parts.begin(), parts.end());
  }

  void set_resident(int layer, nb::ndarray<nb::ro, const std::int32_t, nb::c_contig, nb::device::cpu> gpu_slots) {
    const int G = opts_.topology.num_gpus(), S = opts_.topology.slots_per_gpu;
    if (gpu_slots.ndim() != 2 || gpu_slots.shape(0) != static_cast<std::size_t>(G) ||
        gpu_slots.shape(1) != static_cast<std::size_t>(S))
      raise(PyExc_ValueError,
            str("set_resident: layer ", layer, " placement must be [", G, ", ", S, "] (GPUs x slots)"));
    LayerPlacement p(G, S, opts_.num_experts);
    std::copy(gpu_slots.data(), gpu_slots.data() + gpu_slots.size(), p.phys_to_log().begin());
    check(eng().set_resident(layer, p));
  }

  nb::ndarray<nb::numpy, std::int32_t> resident(int layer) const {
    check_layer(layer, "resident");
    const LayerPlacement p = eng().resident(layer);
    auto *v = new std::vector<std::int32_t>(p.phys_to_log().begin(), p.phys_to_log().end());
    nb::capsule owner(v, [](void *q) noexcept { delete static_cast<std::vector<std::int32_t> *>(q); });
    const std::size_t shape[2] = {static_cast<std::size_t>(p.num_gpus()), static_cast<std::size_t>(p.slots_per_gpu())};
    return {v->data(), 2, shape, owner};
  }

  PyTicket submit(int layer, nb::ndarray<nb::ro, const std::int32_t, nb::c_contig, nb::device::cpu> moves,
                  nb::handle sources_ready, nb::handle slots_free, int dst_buffer, double timeout) {
    check_layer(layer, "submit");
    if (moves.ndim() != 2 || (moves.shape(1) != 4 && moves.size() != 0))
      raise(PyExc_ValueError, str("submit: moves must be [N, 4] int32 (expert, src_gpu, dst_gpu, dst_slot), got ",
                                  moves.ndim(), " dims"));
    const int G = opts_.topology.num_gpus(), S = opts_.topology.slots_per_gpu;
    std::vector<Move> mv(moves.ndim() == 2 ? moves.shape(0) : 0);
    for (std::size_t i = 0; i < mv.size(); ++i) {
      const std::int32_t *r = moves.data() + i * 4;
      mv[i] = {r[0], r[1], r[2], r[3]};
      if (r[0] < 0 || r[0] >= opts_.num_experts || r[2] < 0 || r[2] >= G || r[3] < 0 || r[3] >= S ||
          (r[1] != host_mirror && (r[1] < 0 || r[1] >= G)))
        raise(PyExc_ValueError,
              str("submit: layer ", layer, " move ", i, " (expert ", r[0], ", src_gpu ", r[1], ", dst_gpu ", r[2],
                  ", dst_slot ", r[3], ") is outside ", opts_.num_experts, " experts x ", G, " GPUs x ", S, " slots"));
    }
    rt::MoveBatch b;
    b.layer = layer;
    b.moves = mv;
    b.sources_ready = gate(sources_ready, "sources_ready");
    b.slots_free = gate(slots_free, "slots_free");
    b.dst_buffer = dst_buffer;
    b.timeout = millis(timeout, "submit: timeout");
    return start(b, &rt::TransferEngine::submit);
  }

  using RoI32 = nb::ndarray<nb::ro, const std::int32_t, nb::c_contig, nb::device::cpu>;
  /// `returns` (`[n * 2]`: (GPU, expert) pairs) and `held` (`[gpus * experts]`): the held-gradient rule's
  /// selection (`ReduceBatch::select`), given when either is.
  PyTicket submit_reduce(int layer, RoI32 owner_gpu, nb::handle grads_ready, double timeout,
                         std::optional<RoI32> returns, std::optional<RoI32> held) {
    check_layer(layer, "submit_reduce");
    rt::ReduceBatch b;
    b.layer = layer;
    b.owner_gpu = {owner_gpu.data(), owner_gpu.size()};
    b.grads_ready = gate(grads_ready, "grads_ready");
    b.timeout = millis(timeout, "submit_reduce: timeout");
    std::vector<rt::ReplicaRef> pairs;
    b.select = returns.has_value() || held.has_value();
    if (returns) {
      if (returns->size() % 2 != 0)
        raise(PyExc_ValueError,
              str("submit_reduce: returns has ", returns->size(), " values, not (gpu, expert) pairs"));
      for (std::size_t i = 0; i < returns->size(); i += 2)
        pairs.push_back({returns->data()[i], returns->data()[i + 1]});
      b.returns = pairs;
    }
    if (held) b.held = {held->data(), held->size()};
    return start(b, &rt::TransferEngine::submit_reduce);
  }

  rt::TransferEngine &engine() { return eng(); }

  void check_layer(int layer, const char *who) const {
    if (layer < 0 || layer >= opts_.num_layers)
      raise(PyExc_ValueError, str(who, ": layer ", layer, " outside [0, ", opts_.num_layers, ")"));
  }

private:
  /// Submits `b` with `fn` (GIL released).
  template <class Batch>
  PyTicket start(const Batch &b, rt::Status (rt::TransferEngine::*fn)(const Batch &, rt::Ticket &)) {
    PyTicket t{{}, opts_.backend};
    rt::TransferEngine &e = eng();
    rt::Status st;
    {
      nb::gil_scoped_release nogil;
      st = (e.*fn)(b, t.ticket);
    }
    check(st);
    return t;
  }
  rt::TransferEngine &eng() const {
    if (!engine_) raise(PyExc_RuntimeError, "TransferEngine: the engine was closed");
    return *engine_;
  }
  void check_parts(std::size_t n, const std::string &what) const {
    if (n != opts_.tensors.size())
      raise(PyExc_ValueError, str(what, ": ", n, " tensors given, the engine has ", opts_.tensors.size(),
                                  " (EngineOptions.tensors): give one tensor per entry"));
  }
  /// The segment of a `foremoe._core.NodeMirror`, or null for None.
  static const rt::NodeMirror *segment_of(nb::handle node_mirror, const std::string &what);

  void check_gpu(int gpu, const std::string &what) const {
    if (gpu < 0 || gpu >= opts_.topology.num_gpus())
      raise(PyExc_ValueError, str(what, ": GPU ", gpu, " outside [0, ", opts_.topology.num_gpus(), ")"));
  }
  Where slot_memory(int gpu) const {
    if (opts_.backend != rt::Backend::cuda) return {};
    const auto &map = opts_.cuda_device_of_gpu;
    return {true, map.empty() ? gpu : map[static_cast<std::size_t>(gpu)]};
  }
  rt::Gate gate(nb::handle h, const char *name) const {
    rt::Gate g;
    if (h.is_none()) return g;
    if (nb::isinstance<rt::HostEvent>(h)) {
      if (opts_.backend != rt::Backend::host)
        raise(PyExc_ValueError, str("submit: ", name, " is a HostEvent, but the engine runs the CUDA backend"));
      g.host = nb::cast<rt::HostEvent *>(h);
      return g;
    }
    if (nb::isinstance<nb::int_>(h)) {
      if (opts_.backend != rt::Backend::cuda)
        raise(PyExc_ValueError, str("submit: ", name, " is a CUDA event handle, but the engine runs the host backend"));
      const auto v = nb::cast<std::uintptr_t>(h);
      if (v == 0) raise(PyExc_ValueError, str("submit: ", name, " is a null CUDA event (record it first)"));
      g.cuda_event = reinterpret_cast<void *>(v);
      return g;
    }
    raise(PyExc_TypeError, str("submit: ", name, " must be None, a HostEvent or a CUDA event handle, got ",
                               nb::type_name(h.type()).c_str()));
  }

  void take_comms(nb::handle list) {
    const int G = opts_.topology.num_gpus();
    if (!nb::isinstance<nb::list>(list) || static_cast<int>(nb::len(list)) != G)
      raise(PyExc_ValueError, str("TransferEngine: nccl_comms must be a list of ", G,
                                  " entries (an NcclCommunicator or None per GPU), got ", nb::repr(list).c_str()));
    std::vector<void *> handles(static_cast<std::size_t>(G), nullptr);
    for (int g = 0; g < G; ++g) {
      nb::handle c = nb::borrow<nb::list>(list)[static_cast<std::size_t>(g)];
      if (c.is_none()) continue;
      if (!nb::isinstance<PyNccl>(c))
        raise(PyExc_ValueError, str("TransferEngine: nccl_comms[", g,
                                    "] must be a foremoe._core.NcclCommunicator or "
                                    "None, got ",
                                    nb::type_name(c.type()).c_str()));
      PyNccl &p = nb::cast<PyNccl &>(c);
      if (!p.comm.valid() || p.taken)
        raise(PyExc_ValueError,
              str("TransferEngine: nccl_comms[", g, "] is ", p.taken ? "owned by another engine" : "closed",
                  " (each engine needs a communicator of its own)"));
      handles[static_cast<std::size_t>(g)] = p.comm.handle();
    }
    for (nb::handle c : nb::borrow<nb::list>(list))
      if (!c.is_none()) {
        nb::cast<PyNccl &>(c).taken = true;
        comms_.push_back(nb::borrow(c));
      }
    opts_.peers.nccl_comm_of_gpu = std::move(handles);
  }

  rt::EngineOptions opts_;
  std::vector<nb::object> comms_;        // NCCL communicators: closed after the engine is destroyed
  std::vector<Array> keep_;              // declared before the engine: released after it is destroyed
  std::vector<nb::object> keep_mirrors_; // node mirror segments, released after the engine too
  std::shared_ptr<PyBridge> bridge_;
  std::unique_ptr<rt::TransferEngine> engine_;
};

// ---------------------------------------------------------------------------------------------------------------
// count_loads and map_tokens of the runtime, on the backend of the memory they are given

Where where_of(const Array &a) {
  return {a.device_type() == nb::device::cuda::value, a.device_type() == nb::device::cuda::value ? a.device_id() : 0};
}
rt::Backend backend_at(Where w) { return w.cuda ? rt::Backend::cuda : rt::Backend::host; }

IdDtype id_dtype(const Array &ids, const char *who) {
  const auto d = ids.dtype();
  if (d.lanes == 1 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int)) {
    switch (d.bits) {
    case 8: return IdDtype::i8;
    case 16: return IdDtype::i16;
    case 32: return IdDtype::i32;
    case 64: return IdDtype::i64;
    default: break;
    }
  } else if (d.lanes == 1 && d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt)) {
    if (d.bits == 8) return IdDtype::u8;
    if (d.bits == 16) return IdDtype::u16;
  }
  raise(PyExc_ValueError,
        str(who, ": routed ids must be int8, uint8, int16, uint16, int32 or int64, got ", dtype_str(d)));
}

using HostI64 = nb::ndarray<nb::ro, const std::int64_t, nb::c_contig, nb::device::cpu>;
using HostI32 = nb::ndarray<nb::ro, const std::int32_t, nb::c_contig, nb::device::cpu>;

std::span<const std::int64_t> span_of(const std::optional<HostI64> &a) {
  return a ? std::span<const std::int64_t>(a->data(), a->size()) : std::span<const std::int64_t>{};
}

void check_ids(const Array &ids, const char *who) {
  check_memory(ids, str(who, ": routed ids ", shape_str(ids)), where_of(ids));
  if (ids.ndim() != 3)
    raise(PyExc_ValueError, str(who, ": routed ids must be [tokens, layers, topk], got ", shape_str(ids)));
}

void check_out(const Array &out, const Array &ids, nb::dlpack::dtype_code code, int bits, const char *who) {
  const Where w = where_of(ids);
  check_memory(out, str(who, ": out ", shape_str(out)), w);
  if (!is_dtype(out, code, bits))
    raise(PyExc_ValueError, str(who, ": out must be int", bits, ", got ", dtype_str(out.dtype())));
}

/// The backend of `ids`' memory; with a workspace, it must be the workspace's.
rt::Backend backend_for(const Array &ids, const rt::Workspace *ws, const char *who) {
  const rt::Backend b = backend_at(where_of(ids));
  if (ws != nullptr && ws->backend() != b)
    raise(PyExc_ValueError, str(who, ": the routed ids are ", b == rt::Backend::cuda ? "CUDA" : "host",
                                " memory, the workspace is for the ", backend_name(ws->backend()), " backend"));
  return b;
}

/// A request over `ids` (`[tokens, layers, topk]`) writing `out` (int`out_bits`), both checked.
template <class Request> Request request(const Array &ids, const Array &out, int out_bits, const char *who) {
  check_ids(ids, who);
  check_out(out, ids, nb::dlpack::dtype_code::Int, out_bits, who);
  Request req;
  req.ids = ids.data();
  req.dtype = id_dtype(ids, who);
  req.num_tokens = static_cast<std::int64_t>(ids.shape(0));
  req.num_layers = static_cast<int>(ids.shape(1));
  req.topk = static_cast<int>(ids.shape(2));
  return req;
}

void count_loads(const Array &ids, const Array &out, int num_experts, std::optional<HostI64> microbatch_offsets,
                 std::optional<std::vector<int>> layer_map, int num_threads, std::uintptr_t stream, int timeout_ms,
                 rt::Workspace *ws) {
  auto req = request<rt::CountRequest>(ids, out, 64, "count_loads");
  req.num_experts = num_experts;
  req.microbatch_offsets = span_of(microbatch_offsets);
  if (layer_map) req.layer_map = *layer_map;
  const rt::Backend backend = backend_for(ids, ws, "count_loads");
  const std::span<std::int64_t> dst{static_cast<std::int64_t *>(out.data()), out.size()};
  rt::Status st;
  {
    nb::gil_scoped_release nogil;
    st = ws != nullptr ? rt::count_loads_async(*ws, req, dst, reinterpret_cast<void *>(stream), num_threads)
                       : rt::count_loads(backend, req, dst, num_threads, reinterpret_cast<void *>(stream), timeout_ms);
  }
  check(st);
}

void map_tokens(const Array &ids, const Array &out, int layer_idx, int num_experts, HostI32 slot_expert,
                HostI64 slot_tokens, int num_sources, std::optional<HostI64> source_offsets, std::uintptr_t stream,
                int timeout_ms, rt::Workspace *ws) {
  auto req = request<rt::MapRequest>(ids, out, 32, "map_tokens");
  req.layer_idx = layer_idx;
  req.num_experts = num_experts;
  req.slot_expert = {slot_expert.data(), slot_expert.size()};
  req.slot_tokens = {slot_tokens.data(), slot_tokens.size()};
  req.num_sources = num_sources;
  req.source_offsets = span_of(source_offsets);
  const rt::Backend backend = backend_for(ids, ws, "map_tokens");
  const std::span<std::int32_t> dst{static_cast<std::int32_t *>(out.data()), out.size()};
  rt::Status st;
  {
    nb::gil_scoped_release nogil;
    st = ws != nullptr ? rt::map_tokens_async(*ws, req, dst, reinterpret_cast<void *>(stream))
                       : rt::map_tokens(backend, req, dst, reinterpret_cast<void *>(stream), timeout_ms);
  }
  check(st);
}

// ---------------------------------------------------------------------------------------------------------------
// Node-shared host mirror

/// Unmapped when the last reference goes (the arrays of `array()` hold one).
struct PyNodeMirror {
  std::unique_ptr<rt::NodeMirror> mirror;
  [[nodiscard]] rt::NodeMirror &get() const { return *mirror; }
};

rt::NodeMirrorOptions mirror_options(const std::string &job_key, int node, int layer, std::int64_t payload_bytes,
                                     bool pin, double open_timeout) {
  if (!(open_timeout >= 0) || open_timeout > 1e7)
    raise(PyExc_ValueError, str("NodeMirror.open: open_timeout must be seconds >= 0, got ", open_timeout));
  rt::NodeMirrorOptions o;
  o.job_key = job_key, o.node = node, o.layer = layer, o.payload_bytes = payload_bytes, o.pin = pin;
  o.open_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(open_timeout * 1000.0 + 0.5));
  return o;
}

void PyEngine::register_node_mirror(int layer, int node, nb::object mirror) {
  if (!nb::isinstance<PyNodeMirror>(mirror))
    raise(PyExc_ValueError, str("register_node_mirror: layer ", layer, " node ", node,
                                ": expected a foremoe._core.NodeMirror, got ", nb::type_name(mirror.type()).c_str()));
  const rt::NodeMirror &m = nb::cast<const PyNodeMirror &>(mirror).get();
  rt::MirrorRegion region;
  check(rt::node_mirror_region(m, opts_.num_experts, region));
  check(eng().register_mirror(layer, node, region));
  keep_mirrors_.push_back(std::move(mirror));
}

const rt::NodeMirror *PyEngine::segment_of(nb::handle node_mirror, const std::string &what) {
  if (node_mirror.is_none()) return nullptr;
  if (!nb::isinstance<PyNodeMirror>(node_mirror))
    raise(PyExc_ValueError, str(what, ": node_mirror must be a foremoe._core.NodeMirror, got ",
                                nb::type_name(node_mirror.type()).c_str()));
  return &nb::cast<const PyNodeMirror &>(node_mirror).get();
}

PyNodeMirror make_node_mirror(const rt::NodeMirrorOptions &o, bool create) {
  PyNodeMirror out;
  rt::Status st;
  {
    nb::gil_scoped_release nogil; // open may wait for the creator
    st = create ? rt::NodeMirror::create(o, out.mirror) : rt::NodeMirror::open(o, out.mirror);
  }
  check(st);
  return out;
}

void bind_node_mirror(nb::module_ &m) {
  nb::class_<PyNodeMirror>(m, "NodeMirror",
                           "One local rank's mapping of its node's shared host mirror (foremoe::runtime::NodeMirror; "
                           "internal: see foremoe.torch.moves.NodeMirror).")
      .def_static(
          "create",
          [](const std::string &job_key, int node, int layer, std::int64_t payload_bytes, bool pin) {
            return make_node_mirror(mirror_options(job_key, node, layer, payload_bytes, pin, 0.0), true);
          },
          "job_key"_a, "node"_a, "layer"_a, "payload_bytes"_a, "pin"_a = false)
      .def_static(
          "open",
          [](const std::string &job_key, int node, int layer, std::int64_t payload_bytes, bool pin,
             double open_timeout) {
            return make_node_mirror(mirror_options(job_key, node, layer, payload_bytes, pin, open_timeout), false);
          },
          "job_key"_a, "node"_a, "layer"_a, "payload_bytes"_a, "pin"_a = false, "open_timeout"_a = 0.0)
      .def_prop_ro("name", [](const PyNodeMirror &p) { return p.get().name(); })
      .def_prop_ro("payload_bytes", [](const PyNodeMirror &p) { return p.get().payload_bytes(); })
      .def_prop_ro("segment_bytes", [](const PyNodeMirror &p) { return p.get().segment_bytes(); })
      .def_prop_ro("is_creator", [](const PyNodeMirror &p) { return p.get().is_creator(); })
      .def_prop_ro("pinned", [](const PyNodeMirror &p) { return p.get().pinned(); })
      .def_prop_ro("generation", [](const PyNodeMirror &p) { return p.get().generation(); })
      .def_prop_ro("seen_generation", [](const PyNodeMirror &p) { return p.get().seen_generation(); })
      .def("stale", [](const PyNodeMirror &p) { return p.get().stale(); })
      .def("begin_refresh", [](const PyNodeMirror &p) { check(p.get().begin_refresh()); })
      .def("end_refresh", [](const PyNodeMirror &p) { check(p.get().end_refresh()); })
      .def("unlink", [](const PyNodeMirror &p) { check(p.get().unlink()); })
      .def(
          "array",
          [](nb::handle self) {
            const rt::NodeMirror &mir = nb::cast<const PyNodeMirror &>(self).get();
            const std::size_t shape[1] = {static_cast<std::size_t>(mir.payload_bytes())};
            // The array keeps this object (and so the mapping) alive.
            return nb::ndarray<nb::numpy, std::uint8_t>(mir.payload().data(), 1, shape, self);
          },
          "The payload as a writable uint8 NumPy array over the shared mapping (no copy).");
  m.def("node_mirror_segment_bytes", &rt::node_mirror_segment_bytes, "payload_bytes"_a,
        "Host bytes one node mirror of `payload_bytes` takes on its node (-1 for a size out of range).");
}

void bind_nccl(nb::module_ &m) {
  m.def(
      "nccl_unique_id",
      [] {
        rt::NcclUniqueId id{};
        check(rt::nccl_unique_id(id));
        return nb::bytes(id.data(), id.size());
      },
      "A new NCCL unique id (bytes), made by one rank for every rank's NcclCommunicator.");
  nb::class_<PyNccl>(m, "NcclCommunicator",
                     "One rank's NCCL communicator (foremoe::runtime::NcclCommunicator; internal: "
                     "foremoe.torch.TransferEngine(backend='cuda', group=...) makes one per rank).")
      .def(
          "__init__",
          [](PyNccl *self, const nb::bytes &unique_id, int num_ranks, int rank, int cuda_device, double timeout) {
            const auto ms = millis(timeout, "NcclCommunicator: timeout");
            const std::span<const char> id(unique_id.c_str(), unique_id.size());
            rt::NcclCommunicator comm;
            rt::Status st;
            {
              nb::gil_scoped_release nogil; // waits for every rank to join
              st = rt::NcclCommunicator::create(id, num_ranks, rank, cuda_device, std::chrono::steady_clock::now() + ms,
                                                comm);
            }
            check(st);
            new (self) PyNccl{std::move(comm), ms, false};
          },
          "unique_id"_a, "num_ranks"_a, "rank"_a, "cuda_device"_a, "timeout"_a)
      .def_prop_ro("valid", [](const PyNccl &p) { return p.comm.valid(); })
      .def_prop_ro("handle", [](const PyNccl &p) { return reinterpret_cast<std::uintptr_t>(p.comm.handle()); })
      .def_prop_ro("num_ranks", [](const PyNccl &p) { return p.comm.num_ranks(); })
      .def_prop_ro("rank", [](const PyNccl &p) { return p.comm.rank(); })
      .def_prop_ro("cuda_device", [](const PyNccl &p) { return p.comm.cuda_device(); })
      .def("close", &PyNccl::close, "Finalizes and destroys it (aborted past its timeout); idempotent.")
      .def("abort", [](PyNccl &p) { p.comm.abort(); });
}

} // namespace

void bind_runtime(nb::module_ &m) {
  bind_node_mirror(m);
  bind_nccl(m);
  options_class<rt::FaultSchedule>(m, "FaultSchedule",
                                   "The seeded fault injector's schedule (a test double): each chunk copy fails, is "
                                   "truncated (caught only with `verify`) or delayed with these probabilities, decided "
                                   "by a hash of `seed` and the chunk, so a schedule replays exactly.")
      .def_rw("fail_probability", &rt::FaultSchedule::fail_probability, "a copy reports an error")
      .def_rw("corrupt_probability", &rt::FaultSchedule::corrupt_probability,
              "a copy 'succeeds' with one byte dropped (only verification sees it)")
      .def_rw("delay_probability", &rt::FaultSchedule::delay_probability, "a copy is held back by delay_us")
      .def_rw("delay_us", &rt::FaultSchedule::delay_us)
      .def_prop_rw(
          "fail_paths",
          [](const rt::FaultSchedule &f) {
            std::vector<std::string> out;
            for (int p = 0; p < transfer::num_paths; ++p)
              if (f.fail_path[p]) out.emplace_back(transfer::to_string(static_cast<transfer::Path>(p)));
            return out;
          },
          [](rt::FaultSchedule &f, const std::vector<std::string> &names) {
            std::fill(std::begin(f.fail_path), std::end(f.fail_path), false);
            for (const std::string &n : names)
              f.fail_path[static_cast<int>(path_of(n))] = true;
          },
          "paths over which every copy fails (nvlink, pcie, network)")
      .def_rw("paired_only", &rt::FaultSchedule::paired_only,
              "the probabilities act only on paired transfers with other processes, never on a process's own "
              "copies (host mirror, its own GPUs)")
      .def_rw("spare_reductions", &rt::FaultSchedule::spare_reductions,
              "the injector leaves replica-gradient reductions alone and they do not advance the serial that "
              "decisions hash: the decisions on moves are an engine's without reductions (with verify a "
              "reduction's corrupted bytes are caught, but one from another process fails the batch rather than "
              "being retried)")
      .def_rw("seed", &rt::FaultSchedule::seed)
      .def(
          "draw",
          [](const rt::FaultSchedule &f, const std::vector<std::uint64_t> &identity, const std::string &decision) {
            rt::FaultDecision d{};
            if (decision == "fail")
              d = rt::FaultDecision::fail;
            else if (decision == "corrupt")
              d = rt::FaultDecision::corrupt;
            else if (decision == "delay")
              d = rt::FaultDecision::delay;
            else
              raise(PyExc_ValueError,
                    str("FaultSchedule.draw: unknown decision '", decision, "' (fail, corrupt or delay)"));
            return rt::fault_draw(f, rt::fault_key(identity), d);
          },
          nb::arg("identity"), nb::arg("decision"),
          "The injector's uniform draw in [0, 1) for `decision` ('fail', 'corrupt' or 'delay') about the operation "
          "named by the integers `identity` (foremoe::runtime::fault_draw of fault_key(identity)): the same on "
          "every rank and every run for a seed.");

  options_class<rt::EngineOptions>(
      m, "EngineOptions",
      "Options of a TransferEngine (`foremoe::runtime::EngineOptions`): "
      "EngineOptions(topology=..., num_experts=..., tensors=... or expert_bytes=..., ...).")
      .def_prop_rw(
          "backend", [](const rt::EngineOptions &o) { return backend_name(o.backend); },
          [](rt::EngineOptions &o, const std::string &b) { o.backend = backend_of(b); }, "'host' or 'cuda'")
      .def_rw("transport", &rt::EngineOptions::transport, "a registered transport's name; empty: the backend's")
      .def_rw("topology", &rt::EngineOptions::topology, "the EP group (GPUs 0 .. num_gpus-1)")
      .def_rw("num_layers", &rt::EngineOptions::num_layers)
      .def_rw("num_experts", &rt::EngineOptions::num_experts)
      .def_prop_rw(
          "tensors",
          [](const rt::EngineOptions &o) {
            std::vector<std::pair<std::int64_t, std::int64_t>> out;
            for (const rt::TensorSpan &t : o.tensors)
              out.emplace_back(t.offset_bytes, t.num_bytes);
            return out;
          },
          [](rt::EngineOptions &o,
             const std::vector<std::variant<std::int64_t, std::pair<std::int64_t, std::int64_t>>> &v) {
            o.tensors.clear();
            std::int64_t next = 0; // a bare size: packed right after the previous tensor
            for (const auto &x : v) {
              const rt::TensorSpan t = std::holds_alternative<std::int64_t>(x)
                                           ? rt::TensorSpan{next, std::get<std::int64_t>(x)}
                                           : rt::TensorSpan{std::get<1>(x).first, std::get<1>(x).second};
              o.tensors.push_back(t);
              next = t.offset_bytes + t.num_bytes;
            }
          },
          "an expert's weight tensors inside a slot, as (offset_bytes, num_bytes), or as num_bytes (right after the "
          "previous one); a move carries their bytes. Split regions (a list of per-tensor tensors given to "
          "register_slots / register_mirror) place each tensor themselves and ignore the offsets")
      .def_prop_rw(
          "expert_bytes",
          [](const rt::EngineOptions &o) {
            std::int64_t n = 0;
            for (const rt::TensorSpan &t : o.tensors)
              n += t.num_bytes;
            return n;
          },
          [](rt::EngineOptions &o, std::int64_t n) {
            o.tensors = {{0, n}};
          },
          "bytes a move carries (the sum of `tensors`); setting it makes one tensor at offset 0")
      .def_prop_rw(
          "max_chunk_bytes", [](const rt::EngineOptions &o) { return o.planning.max_chunk_bytes; },
          [](rt::EngineOptions &o, std::int64_t v) { o.planning.max_chunk_bytes = v; },
          "transfer planning: pieces of one path are cut to at most this (the retry unit)")
      .def_prop_rw(
          "align_bytes", [](const rt::EngineOptions &o) { return o.planning.align_bytes; },
          [](rt::EngineOptions &o, std::int64_t v) { o.planning.align_bytes = v; },
          "transfer planning: chunk boundaries are multiples of this")
      .def_prop_rw(
          "split_paths", [](const rt::EngineOptions &o) { return o.planning.split_paths; },
          [](rt::EngineOptions &o, bool v) { o.planning.split_paths = v; },
          "transfer planning: split a move across GPU-direct and the mirror")
      .def_prop_rw(
          "host_mirror", [](const rt::EngineOptions &o) { return o.planning.host_mirror; },
          [](rt::EngineOptions &o, bool v) { o.planning.host_mirror = v; },
          "transfer planning: read from the nodes' host mirrors (where registered)")
      .def_prop_rw(
          "allow_network", [](const rt::EngineOptions &o) { return o.planning.allow_network; },
          [](rt::EngineOptions &o, bool v) { o.planning.allow_network = v; },
          "transfer planning: read from another node's GPU when the node has no source")
      .def_rw("max_attempts", &rt::EngineOptions::max_attempts, "copies per chunk, alternating paths")
      .def_rw("verify", &rt::EngineOptions::verify, "checksum every moved expert against its source")
      .def_rw("host_threads_per_path", &rt::EngineOptions::host_threads_per_path, "host backend copy workers")
      .def_prop_rw(
          "local_gpus", [](const rt::EngineOptions &o) { return o.peers.local_gpus; },
          [](rt::EngineOptions &o, const std::vector<int> &v) { o.peers.local_gpus = v; },
          "multi-process use: the GPUs this engine drives; empty: all (foremoe.torch sets it from group=)")
      .def_rw("cuda_device_of_gpu", &rt::EngineOptions::cuda_device_of_gpu,
              "CUDA: the device ordinal of each GPU; empty: the identity")
      .def_prop_rw(
          "nccl_rank_of_gpu", [](const rt::EngineOptions &o) { return o.peers.nccl_rank_of_gpu; },
          [](rt::EngineOptions &o, const std::vector<int> &v) { o.peers.nccl_rank_of_gpu = v; },
          "CUDA multi-process use: each GPU's rank in the NCCL communicators; empty: the identity")
      .def_prop_rw(
          "faults",
          [](const rt::EngineOptions &o) -> std::optional<rt::FaultSchedule> {
            if (!o.faults) return std::nullopt;
            return *o.faults;
          },
          [](rt::EngineOptions &o, std::optional<rt::FaultSchedule> f) {
            o.faults = f ? std::make_shared<const rt::FaultSchedule>(*f) : nullptr;
          },
          nb::arg("faults").none(), "a FaultSchedule: wrap the transport in the seeded fault injector (tests)");

  nb::class_<rt::HostEvent>(m, "HostEvent", "A gate of the host backend: a flag the engine waits for.")
      .def(nb::init<>())
      .def("set", &rt::HostEvent::set)
      .def("is_set", &rt::HostEvent::is_set);

  nb::class_<PyTicket>(m, "Ticket", "One submitted batch (internal: foremoe.torch.engine.Ticket interprets it).")
      .def_prop_ro("state", [](const PyTicket &t) { return std::string(rt::to_string(t.ticket.state())); })
      .def("status", [](const PyTicket &t) { return status_tuple(t.ticket.poll()); })
      .def(
          "wait",
          [](const PyTicket &t, double timeout) {
            const auto ms = millis(timeout, "wait: timeout");
            rt::Status st;
            {
              nb::gil_scoped_release nogil;
              st = t.ticket.wait_for(ms);
            }
            return status_tuple(st);
          },
          "timeout"_a)
      .def("abort", [](const PyTicket &t) { t.ticket.abort(); })
      .def(
          "enqueue_wait",
          [](const PyTicket &t, std::uintptr_t stream) {
            return status_tuple(t.ticket.enqueue_wait(reinterpret_cast<void *>(stream)));
          },
          "stream"_a)
      .def("telemetry", [](const PyTicket &t) { return telemetry_list(t.ticket); })
      .def_prop_ro("backend", [](const PyTicket &t) { return backend_name(t.backend); });

  nb::class_<PyEngine>(m, "TransferEngine", "The runtime's transfer engine (internal: see foremoe.torch.engine).")
      .def(nb::init<rt::EngineOptions, nb::object, nb::object>(), "options"_a, "runner"_a.none() = nb::none(),
           "nccl_comms"_a.none() = nb::none())
      .def("close", &PyEngine::close)
      .def_prop_ro("closed", &PyEngine::closed)
      .def_prop_ro("options", &PyEngine::options)
      .def("register_slots", &PyEngine::register_slots, "layer"_a, "gpu"_a, "slots"_a, "num_buffers"_a = 1)
      .def("register_slots_split", &PyEngine::register_slots_split, "layer"_a, "gpu"_a, "tensors"_a,
           "num_buffers"_a = 1)
      .def("register_mirror", &PyEngine::register_mirror, "layer"_a, "node"_a, "mirror"_a,
           "node_mirror"_a.none() = nb::none())
      .def("register_mirror_split", &PyEngine::register_mirror_split, "layer"_a, "node"_a, "tensors"_a,
           "node_mirror"_a.none() = nb::none())
      .def("register_node_mirror", &PyEngine::register_node_mirror, "layer"_a, "node"_a, "mirror"_a)
      .def("register_grads", &PyEngine::register_grads, "layer"_a, "gpu"_a, "grads"_a,
           "grad_bytes"_a.none() = nb::none())
      .def("register_grads_split", &PyEngine::register_grads_split, "layer"_a, "gpu"_a, "tensors"_a)
      .def("set_resident", &PyEngine::set_resident, "layer"_a, "gpu_slots"_a)
      .def("resident", &PyEngine::resident, "layer"_a)
      .def("submit", &PyEngine::submit, "layer"_a, "moves"_a, "sources_ready"_a.none(), "slots_free"_a.none(),
           "dst_buffer"_a, "timeout"_a)
      .def("submit_reduce", &PyEngine::submit_reduce, "layer"_a, "owner_gpu"_a, "grads_ready"_a.none(), "timeout"_a,
           "returns"_a.none() = nb::none(), "held"_a.none() = nb::none())
      .def(
          "valid_expert",
          [](PyEngine &e, int layer, int gpu, int slot) { return e.engine().valid_expert(layer, gpu, slot); },
          "layer"_a, "gpu"_a, "slot"_a)
      .def(
          "last_plan",
          [](PyEngine &e, int layer) {
            e.check_layer(layer, "last_plan");
            const transfer::TransferPlan p = e.engine().last_plan(layer);
            nb::dict d;
            d["expert_bytes"] = p.expert_bytes;
            d["num_moves"] = p.moves.size();
            d["num_chunks"] = p.chunks.size();
            d["num_rounds"] = p.num_rounds;
            d["est_seconds"] = p.est_seconds;
            d["link_bound_seconds"] = p.link_bound_seconds;
            nb::dict pb;
            for (int q = 0; q < transfer::num_paths; ++q)
              pb[std::string(transfer::to_string(static_cast<transfer::Path>(q))).c_str()] = p.path_bytes[q];
            d["path_bytes"] = pb;
            return d;
          },
          "layer"_a)
      .def("stats", [](PyEngine &e) {
        const rt::EngineStats s = e.engine().stats();
        nb::dict d;
        d["allocations"] = s.allocations;
        d["batches"] = s.batches;
        return d;
      });

  m.def(
      "runtime_build_info",
      [] {
        const rt::BuildInfo b = rt::build_info();
        nb::dict d;
        d["cuda_compiled"] = b.cuda_compiled;
        d["nccl_compiled"] = b.nccl_compiled;
        d["num_devices"] = b.num_devices;
        d["cuda_architectures"] = b.cuda_architectures;
        return d;
      },
      "How the compiled runtime in this extension was built and which devices it sees.");
  nb::class_<rt::Workspace>(m, "Workspace",
                            "State of the asynchronous count_loads / map_tokens on one stream (reused scratch, "
                            "errors reported by check).")
      .def(
          "__init__", [](rt::Workspace *w, const std::string &backend) { new (w) rt::Workspace(backend_of(backend)); },
          "backend"_a)
      .def_prop_ro("backend", [](const rt::Workspace &w) { return backend_name(w.backend()); })
      .def_prop_ro("allocations", &rt::Workspace::allocations)
      .def(
          "check",
          [](rt::Workspace &w, int timeout_ms) {
            rt::Status st;
            {
              nb::gil_scoped_release nogil;
              st = w.check(timeout_ms);
            }
            return status_tuple(st);
          },
          "timeout_ms"_a);
  m.def("runtime_count_loads", &count_loads, "ids"_a, "out"_a, "num_experts"_a, "microbatch_offsets"_a.none(),
        "layer_map"_a.none(), "num_threads"_a, "stream"_a, "timeout_ms"_a, "workspace"_a.none());
  m.def("runtime_map_tokens", &map_tokens, "ids"_a, "out"_a, "layer_idx"_a, "num_experts"_a, "slot_expert"_a,
        "slot_tokens"_a, "num_sources"_a, "source_offsets"_a.none(), "stream"_a, "timeout_ms"_a, "workspace"_a.none());
}

} // namespace foremoe::python
