#pragma once
// Replica-gradient test support: gradient memory of every GPU in any `GradType`, packed or split (one buffer per
// tensor, random padding), a random resident placement, and the expected owner gradients after a reduction,
// computed independently of the engine and of `foremoe/runtime/grad_add.hpp`: float32 / float64 add natively,
// bfloat16 / float16 round the float32 sum to the nearest representable value (ties to the even pattern) found in
// a table of every value of the format, decoded with `std::ldexp`.

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "foremoe/core/placement.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe_test {

namespace rt = foremoe::runtime;

// Every non-negative pattern of a 16-bit format up to infinity, by value (patterns are monotone in value).
struct Half16 {
  int mant_bits = 10, bias = 15;
  std::uint16_t inf = 0x7c00;
  std::vector<double> value; // [pattern] for 0 .. inf (inf: the next power of two, for the rounding rule)
  Half16(int mb, int b, std::uint16_t i) : mant_bits(mb), bias(b), inf(i) {
    for (std::uint32_t p = 0; p <= inf; ++p) {
      const std::uint32_t e = p >> mant_bits, m = p & ((1u << mant_bits) - 1u);
      value.push_back(
          e == 0 ? std::ldexp(static_cast<double>(m), 1 - bias - mant_bits)
                 : std::ldexp(static_cast<double>(m + (1u << mant_bits)), static_cast<int>(e) - bias - mant_bits));
    }
  }
  [[nodiscard]] float decode(std::uint16_t h) const {
    const double v = (h & 0x7fffu) == inf ? HUGE_VAL : value[h & 0x7fffu];
    return static_cast<float>((h & 0x8000u) ? -v : v);
  }
  [[nodiscard]] std::uint16_t encode(float f) const {
    const double a = std::fabs(static_cast<double>(f));
    const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    auto it = std::upper_bound(value.begin(), value.end(), a); // first value > a
    if (it == value.end()) return sign | inf;
    auto hi = static_cast<std::uint16_t>(it - value.begin()), lo = static_cast<std::uint16_t>(hi - 1);
    const double dl = a - value[lo], dh = value[hi] - a;
    if (dl < dh || (dl == dh && lo % 2 == 0)) return sign | lo;
    return sign | hi;
  }
};
inline const Half16 &f16_ref() {
  static const Half16 h(10, 15, 0x7c00);
  return h;
}
inline const Half16 &bf16_ref() {
  static const Half16 h(7, 127, 0x7f80);
  return h;
}

// dst += src for one element of `type`, independently of the engine.
inline void ref_add(rt::GradType type, std::byte *dst, const std::byte *src) {
  switch (type) {
  case rt::GradType::f32: {
    float a, b;
    std::memcpy(&a, dst, 4), std::memcpy(&b, src, 4);
    a += b;
    std::memcpy(dst, &a, 4);
    return;
  }
  case rt::GradType::f64: {
    double a, b;
    std::memcpy(&a, dst, 8), std::memcpy(&b, src, 8);
    a += b;
    std::memcpy(dst, &a, 8);
    return;
  }
  case rt::GradType::bf16:
  case rt::GradType::f16: {
    const Half16 &h = type == rt::GradType::f16 ? f16_ref() : bf16_ref();
    std::uint16_t a, b;
    std::memcpy(&a, dst, 2), std::memcpy(&b, src, 2);
    a = h.encode(h.decode(a) + h.decode(b));
    std::memcpy(dst, &a, 2);
    return;
  }
  }
}

// A random finite value of `type` at `p` (magnitudes spread over several binades, some exact ties for 16-bit).
inline void random_value(std::mt19937_64 &rng, rt::GradType type, std::byte *p) {
  std::normal_distribution<double> nd(0.0, 1.0);
  const double x = std::ldexp(nd(rng), std::uniform_int_distribution<int>(-6, 6)(rng));
  switch (type) {
  case rt::GradType::f32: {
    const auto f = static_cast<float>(x);
    std::memcpy(p, &f, 4);
    return;
  }
  case rt::GradType::f64: std::memcpy(p, &x, 8); return;
  case rt::GradType::bf16:
  case rt::GradType::f16: {
    const Half16 &h = type == rt::GradType::f16 ? f16_ref() : bf16_ref();
    const std::uint16_t v = h.encode(static_cast<float>(x));
    std::memcpy(p, &v, 2);
    return;
  }
  }
}

// Gradient memory of `gpus` GPUs x `slots` slots: packed (one buffer per GPU, a random stride) or split (one
// buffer per GPU and tensor, each its own random stride).
struct GradWorld {
  rt::GradLayout layout;
  bool split = false;
  int gpus = 0, slots = 0;
  std::vector<std::int64_t> stride;        // per tensor (split) or [0] (packed)
  std::vector<std::vector<std::byte>> mem; // [gpu * tensors + ti] (split) or [gpu] (packed)
  [[nodiscard]] int tensors() const { return static_cast<int>(layout.tensor_bytes.size()); }
  [[nodiscard]] std::int64_t esize() const { return rt::grad_type_bytes(layout.type); }

  // `num_tensors` tensors of 1..`max_elems` elements each (a packed world has one of their sum).
  void build(std::mt19937_64 &rng, rt::GradType type, bool split_, int gpus_, int slots_, int num_tensors,
             int max_elems = 300) {
    layout.type = type, split = split_, gpus = gpus_, slots = slots_;
    layout.tensor_bytes.clear();
    std::int64_t sum = 0;
    for (int i = 0; i < num_tensors; ++i) {
      const std::int64_t b = esize() * std::uniform_int_distribution<std::int64_t>(1, max_elems)(rng);
      sum += b;
      if (split) layout.tensor_bytes.push_back(b);
    }
    if (!split) layout.tensor_bytes = {sum};
    stride.clear();
    for (std::int64_t b : layout.tensor_bytes)
      stride.push_back(b + esize() * std::uniform_int_distribution<std::int64_t>(0, 5)(rng));
    mem.clear();
    for (int g = 0; g < gpus; ++g)
      for (int ti = 0; ti < tensors(); ++ti) {
        std::vector<std::byte> m(static_cast<std::size_t>(stride[ti] * slots));
        for (auto &b : m)
          b = static_cast<std::byte>(rng()); // padding: random bytes no reduction may touch
        mem.push_back(std::move(m));
      }
    for (int g = 0; g < gpus; ++g)
      for (int s = 0; s < slots; ++s)
        for (int ti = 0; ti < tensors(); ++ti)
          for (std::int64_t i = 0; i < layout.tensor_bytes[ti]; i += esize())
            random_value(rng, type, row(g, s, ti) + i);
  }
  [[nodiscard]] std::byte *row(int g, int s, int ti) {
    return mem[static_cast<std::size_t>(g) * static_cast<std::size_t>(tensors()) + static_cast<std::size_t>(ti)]
               .data() +
           s * stride[ti];
  }
  [[nodiscard]] rt::SlotRegion region(int g) {
    if (!split) return {mem[static_cast<std::size_t>(g)].data(), stride[0], slots, 1, 0};
    rt::SlotRegion r{nullptr, 0, slots, 1, 0};
    for (int ti = 0; ti < tensors(); ++ti)
      r.tensors.push_back({row(g, 0, ti), stride[ti], 0});
    return r;
  }
};

// A random resident placement: every expert once on a random GPU (its owner), the other slots random replicas
// (at most one copy per GPU) or empty.
inline foremoe::LayerPlacement random_owned(std::mt19937_64 &rng, int gpus, int slots, int experts,
                                            std::vector<std::int32_t> &owner) {
  foremoe::LayerPlacement p(gpus, slots, experts);
  owner.assign(static_cast<std::size_t>(experts), -1);
  std::vector<int> free_slots;
  for (int x = 0; x < gpus * slots; ++x)
    free_slots.push_back(x);
  std::shuffle(free_slots.begin(), free_slots.end(), rng);
  for (int e = 0; e < experts; ++e) {
    const int x = free_slots[static_cast<std::size_t>(e)];
    p.slot(x / slots, x % slots) = e;
    owner[static_cast<std::size_t>(e)] = x / slots;
  }
  for (std::size_t i = static_cast<std::size_t>(experts); i < free_slots.size(); ++i) {
    const int x = free_slots[i];
    const auto e = static_cast<std::int32_t>(std::uniform_int_distribution<int>(-1, experts - 1)(rng));
    if (e >= 0 && !p.holds(x / slots, e)) p.slot(x / slots, x % slots) = e;
  }
  return p;
}

// Checks `w` after a reduction of `p` (owners `owner`) from `before`: each expert's owner rows hold its own
// gradient plus every returned replica's, added in the engine's order (replicas by GPU ascending), or (only where
// `may_fail`) unchanged; returned replicas are zero where `select` and their expert's additions were applied;
// everything else, padding included, is as before. Returns how many experts were applied (`unapplied` counts the
// others that had replicas).
inline int check_reduced(GradWorld &w, const GradWorld &before, const foremoe::LayerPlacement &p,
                         const std::vector<std::int32_t> &owner, bool may_fail, bool select,
                         const std::vector<rt::ReplicaRef> &returns, const std::string &what,
                         int *unapplied = nullptr) {
  GradWorld want = before;
  int applied = 0;
  for (int e = 0; e < static_cast<int>(owner.size()); ++e) {
    const int o = owner[static_cast<std::size_t>(e)];
    int os = -1;
    for (int s = 0; s < w.slots; ++s)
      if (p.slot(o, s) == e) os = s;
    std::vector<std::pair<int, int>> reps;
    for (int g = 0; g < w.gpus; ++g)
      for (int s = 0; s < w.slots; ++s)
        if (g != o && p.slot(g, s) == e &&
            (!select || std::find(returns.begin(), returns.end(), rt::ReplicaRef{g, e}) != returns.end()))
          reps.emplace_back(g, s);
    if (reps.empty()) continue;
    GradWorld full = want; // the full sum, in order
    for (auto [g, s] : reps)
      for (int ti = 0; ti < w.tensors(); ++ti)
        for (std::int64_t i = 0; i < w.layout.tensor_bytes[ti]; i += w.esize())
          ref_add(w.layout.type, full.row(o, os, ti) + i, want.row(g, s, ti) + i);
    bool is_full = true, is_before = true;
    for (int ti = 0; ti < w.tensors(); ++ti) {
      const auto n = static_cast<std::size_t>(w.layout.tensor_bytes[ti]);
      is_full = is_full && std::memcmp(w.row(o, os, ti), full.row(o, os, ti), n) == 0;
      is_before = is_before && std::memcmp(w.row(o, os, ti), want.row(o, os, ti), n) == 0;
    }
    CHECK_MESSAGE((is_full || (may_fail && is_before)), what, ": expert ", e, " owner GPU ", o,
                  " holds neither the ordered sum of its ", reps.size(), " replicas nor its own gradient");
    const bool done = is_full;
    applied += done;
    if (unapplied != nullptr) *unapplied += !done;
    if (done)
      for (int ti = 0; ti < w.tensors(); ++ti)
        std::memcpy(want.row(o, os, ti), full.row(o, os, ti), static_cast<std::size_t>(w.layout.tensor_bytes[ti]));
    for (auto [g, s] : reps)
      for (int ti = 0; ti < w.tensors() && select; ++ti) {
        const auto n = static_cast<std::size_t>(w.layout.tensor_bytes[ti]);
        if (done) std::memset(want.row(g, s, ti), 0, n);
      }
  }
  for (std::size_t k = 0; k < w.mem.size(); ++k)
    CHECK_MESSAGE(w.mem[k] == want.mem[k], what, ": gradient memory ", k, " differs from the expected bytes");
  return applied;
}

// Submits `b` on every engine (one per process, each from its own thread, as SPMD trainers do) and waits.
template <class Engines>
std::vector<rt::Status> reduce_everywhere(Engines &engines, const rt::ReduceBatch &b,
                                          std::chrono::milliseconds wait = std::chrono::seconds(10)) {
  std::vector<rt::Status> st(engines.size());
  std::vector<std::thread> procs;
  for (std::size_t q = 0; q < engines.size(); ++q)
    procs.emplace_back([&, q] {
      rt::Ticket t;
      st[q] = engines[q]->submit_reduce(b, t);
      if (st[q].ok()) st[q] = t.wait_for(wait);
    });
  for (auto &t : procs)
    t.join();
  return st;
}

} // namespace foremoe_test
