#pragma once
/// @file
/// Strict, bounded reader and writer for NumPy's `.npy` format (versions 1.0, 2.0 and 3.0), restricted to the
/// integer and IEEE float dtypes that load traces use.
///
/// The reader treats every file as hostile: sizes are checked for overflow and against `NpyReadLimits` before any
/// allocation, the header dict is parsed by a small strict parser rather than evaluated, and a data section whose
/// length disagrees with the shape in either direction is rejected. Every failure throws `foremoe::Error`.

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"

namespace foremoe {
inline namespace v0 {

/// Element kinds the NPY reader accepts; bool, complex, strings and objects are rejected.
enum class NpyKind : std::uint8_t { int_, uint_, float_ };

/// A supported NPY element type: signed or unsigned integers of 1, 2, 4 or 8 bytes, or float of 4 or 8 bytes.
struct NpyDtype {
  NpyKind kind = NpyKind::uint_;
  int item_bytes = 1;

  /// Whether this is one of the ten supported dtypes.
  [[nodiscard]] constexpr bool valid() const noexcept {
    switch (kind) {
    case NpyKind::int_:
    case NpyKind::uint_: return item_bytes == 1 || item_bytes == 2 || item_bytes == 4 || item_bytes == 8;
    case NpyKind::float_: return item_bytes == 4 || item_bytes == 8;
    }
    return false;
  }

  /// NumPy's descr string, e.g. `<u2`; 1-byte items use `|` as NumPy writes them.
  [[nodiscard]] std::string descr(bool big_endian = false) const {
    detail::require(valid(), "NpyDtype: unsupported kind ", static_cast<int>(kind), " with item_bytes ", item_bytes);
    const char order = item_bytes == 1 ? '|' : big_endian ? '>' : '<';
    const char kind_char = kind == NpyKind::int_ ? 'i' : kind == NpyKind::uint_ ? 'u' : 'f';
    return std::string{order, kind_char, static_cast<char>('0' + item_bytes)};
  }

  /// The dtype of C++ arithmetic type `T` (bool excluded: NumPy's bool is not a supported dtype).
  template <class T> [[nodiscard]] static constexpr NpyDtype of() noexcept {
    using U = std::remove_cv_t<T>;
    static_assert(std::is_arithmetic_v<U> && !std::is_same_v<U, bool>, "NpyDtype::of: T must be an integer or float");
    if constexpr (std::is_floating_point_v<U>) {
      static_assert(std::numeric_limits<U>::is_iec559 && (sizeof(U) == 4 || sizeof(U) == 8),
                    "NpyDtype::of: only 4- and 8-byte IEEE floats are supported");
      return {NpyKind::float_, static_cast<int>(sizeof(U))};
    } else {
      static_assert(sizeof(U) == 1 || sizeof(U) == 2 || sizeof(U) == 4 || sizeof(U) == 8);
      return {std::is_signed_v<U> ? NpyKind::int_ : NpyKind::uint_, static_cast<int>(sizeof(U))};
    }
  }

  friend constexpr bool operator==(const NpyDtype &, const NpyDtype &) = default;
};

/// Bounds the reader enforces before it allocates anything.
struct NpyReadLimits {
  std::int64_t max_bytes = std::int64_t{16} << 30; ///< data section
  int max_dims = 8;
  std::int64_t max_header_bytes = 1 << 20; ///< the dict text after the length field
};

namespace detail {

inline constexpr unsigned char npy_magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
inline constexpr int npy_align = 64; // NumPy pads magic + length + header to this, so data can be mmapped aligned

/// `s` made printable and short, for messages that quote bytes from an untrusted file.
[[nodiscard]] inline std::string npy_escape(std::string_view s, std::size_t max_chars = 48) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i == max_chars) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

[[nodiscard]] inline std::string npy_shape_str(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

/// Elements and bytes of an array.
struct NpySize {
  std::int64_t num_elements = 0;
  std::int64_t num_bytes = 0;
};

/// Sizes `shape` of `dtype`, throwing on negative dims or when the bytes of the nonzero dims overflow int64.
/// Zero dims are skipped for the overflow test (NumPy's rule), which also keeps every stride representable.
/// `prefix` starts every message (e.g. "NpyArray: ").
[[nodiscard]] inline NpySize npy_size(std::span<const std::int64_t> shape, const NpyDtype &dtype,
                                      std::string_view prefix = {}) {
  require(dtype.valid(), prefix, "unsupported dtype kind ", static_cast<int>(dtype.kind), " with item_bytes ",
          dtype.item_bytes);
  std::int64_t nonzero_bytes = dtype.item_bytes;
  bool has_zero = false;
  for (const std::int64_t dim : shape) {
    // Not require(): its arguments are evaluated even on success, and the shape text would make this quadratic.
    if (dim < 0) fail(prefix, "negative dimension ", dim, " in shape ", npy_shape_str(shape));
    if (dim == 0) {
      has_zero = true;
      continue;
    }
    if (__builtin_mul_overflow(nonzero_bytes, dim, &nonzero_bytes))
      fail(prefix, "shape ", npy_shape_str(shape), " of ", dtype.descr(),
           " overflows: its size in bytes exceeds int64");
  }
  if (has_zero) return {};
  return {nonzero_bytes / dtype.item_bytes, nonzero_bytes};
}

/// Calls `f(T{})` with the C++ type of `dtype`.
template <class F> decltype(auto) npy_visit(const NpyDtype &dtype, F &&f) {
  switch (dtype.kind) {
  case NpyKind::int_:
    switch (dtype.item_bytes) {
    case 1: return f(std::int8_t{});
    case 2: return f(std::int16_t{});
    case 4: return f(std::int32_t{});
    case 8: return f(std::int64_t{});
    default: break;
    }
    break;
  case NpyKind::uint_:
    switch (dtype.item_bytes) {
    case 1: return f(std::uint8_t{});
    case 2: return f(std::uint16_t{});
    case 4: return f(std::uint32_t{});
    case 8: return f(std::uint64_t{});
    default: break;
    }
    break;
  case NpyKind::float_:
    if (dtype.item_bytes == 4) return f(float{});
    if (dtype.item_bytes == 8) return f(double{});
    break;
  }
  fail("unsupported dtype kind ", static_cast<int>(dtype.kind), " with item_bytes ", dtype.item_bytes);
}

/// Reverses the bytes of each `item_bytes`-wide item in place.
inline void npy_byteswap(std::byte *data, std::size_t num_bytes, int item_bytes) noexcept {
  const auto swap_all = [&](auto word, auto swap) {
    for (std::size_t i = 0; i + sizeof(word) <= num_bytes; i += sizeof(word)) {
      std::memcpy(&word, data + i, sizeof(word));
      word = swap(word);
      std::memcpy(data + i, &word, sizeof(word));
    }
  };
  switch (item_bytes) {
  case 2: swap_all(std::uint16_t{}, [](std::uint16_t w) { return __builtin_bswap16(w); }); break;
  case 4: swap_all(std::uint32_t{}, [](std::uint32_t w) { return __builtin_bswap32(w); }); break;
  case 8: swap_all(std::uint64_t{}, [](std::uint64_t w) { return __builtin_bswap64(w); }); break;
  default: break;
  }
}

inline void npy_check_limits(const NpyReadLimits &limits) {
  require(limits.max_bytes >= 0, "NpyReadLimits::max_bytes must be >= 0, got ", limits.max_bytes);
  require(limits.max_dims >= 0, "NpyReadLimits::max_dims must be >= 0, got ", limits.max_dims);
  require(limits.max_header_bytes >= 0, "NpyReadLimits::max_header_bytes must be >= 0, got ", limits.max_header_bytes);
}

/// What the fixed-size start of a file says.
struct NpyPreamble {
  int major = 0;
  std::int64_t header_offset = 0; ///< where the dict text starts
  std::int64_t header_bytes = 0;
};

/// Reads magic, version and header length from `head` (the first up to 12 bytes of a `file_bytes`-byte file).
[[nodiscard]] inline NpyPreamble npy_parse_preamble(std::span<const std::byte> head, std::int64_t file_bytes,
                                                    const NpyReadLimits &limits) {
  const auto byte_at = [&](std::size_t i) { return static_cast<unsigned>(head[i]); };
  const std::string_view head_text{reinterpret_cast<const char *>(head.data()), head.size()};
  for (std::size_t i = 0; i < std::min<std::size_t>(head.size(), 6); ++i)
    if (byte_at(i) != npy_magic[i])
      fail("bad magic: expected \\x93NUMPY, got '", npy_escape(head_text.substr(0, 6)), "'");
  require(file_bytes >= 10, "truncated: ", file_bytes, " bytes is shorter than the 10-byte NPY preamble");
  NpyPreamble pre;
  pre.major = static_cast<int>(byte_at(6));
  const unsigned minor = byte_at(7);
  require((pre.major == 1 || pre.major == 2 || pre.major == 3) && minor == 0, "unsupported format version ", pre.major,
          ".", minor, " (supported: 1.0, 2.0, 3.0)");
  if (pre.major == 1) {
    pre.header_offset = 10;
    pre.header_bytes = static_cast<std::int64_t>(byte_at(8) | byte_at(9) << 8);
  } else {
    require(file_bytes >= 12, "truncated: ", file_bytes, " bytes is shorter than the 12-byte NPY ", pre.major,
            ".0 preamble");
    pre.header_offset = 12;
    pre.header_bytes = static_cast<std::int64_t>(std::uint32_t{byte_at(8)} | std::uint32_t{byte_at(9)} << 8 |
                                                 std::uint32_t{byte_at(10)} << 16 | std::uint32_t{byte_at(11)} << 24);
  }
  require(pre.header_bytes <= limits.max_header_bytes, "header length ", pre.header_bytes,
          " exceeds the limit max_header_bytes=", limits.max_header_bytes);
  require(pre.header_bytes <= file_bytes - pre.header_offset, "header length ", pre.header_bytes,
          " runs past the end of the file (", file_bytes, " bytes, header starts at ", pre.header_offset, ")");
  return pre;
}

/// What the header dict says, validated.
struct NpyHeader {
  NpyDtype dtype;
  std::string descr;       ///< as written in the file
  bool swap_bytes = false; ///< the file's byte order differs from the machine's
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
  NpySize size;
};

/// Maps a descr string to a supported dtype and whether its data needs byte swapping.
inline void npy_parse_descr(std::string_view descr, NpyHeader &out) {
  const std::string shown = npy_escape(descr);
  const char order = descr.empty() ? '\0' : descr.front();
  require(order == '<' || order == '>' || order == '|' || order == '=', "descr '", shown,
          "' lacks a byte-order character ('<', '>', '|' or '=')");
  const std::string_view type = descr.substr(1);
  require(type.empty() || (type.front() != 'b' && type.front() != '?'), "bool descr '", shown,
          "' is not supported; store it as '|u1'");
  NpyDtype dtype{NpyKind::uint_, 0};
  if (type.size() == 2 && type[1] >= '1' && type[1] <= '8') {
    dtype.item_bytes = type[1] - '0';
    if (type[0] == 'i')
      dtype.kind = NpyKind::int_;
    else if (type[0] == 'u')
      dtype.kind = NpyKind::uint_;
    else if (type[0] == 'f')
      dtype.kind = NpyKind::float_;
    else
      dtype.item_bytes = 0;
  }
  require(dtype.valid(), "unsupported dtype descr '", shown,
          "' (supported: i1 u1 i2 u2 i4 u4 i8 u8 f4 f8 with byte order '<', '>', '|' or '=')");
  require(order != '|' || dtype.item_bytes == 1, "descr '", shown,
          "' is invalid: byte order '|' only applies to 1-byte items");
  const bool file_big = order == '>' || (order == '=' && std::endian::native == std::endian::big);
  out.dtype = dtype;
  out.descr = std::string{descr};
  out.swap_bytes = dtype.item_bytes > 1 && file_big != (std::endian::native == std::endian::big);
}

/// Strict parser for the header: a Python dict literal with exactly the keys 'descr', 'fortran_order' and 'shape'.
class NpyHeaderParser {
public:
  NpyHeaderParser(std::string_view text, const NpyReadLimits &limits) : text_(text), limits_(limits) {}

  [[nodiscard]] NpyHeader parse() {
    NpyHeader out;
    bool seen[3] = {false, false, false};
    static constexpr std::string_view keys[3] = {"descr", "fortran_order", "shape"};
    skip_space();
    expect('{', "'{' opening the header dict");
    skip_space();
    while (!consume('}')) {
      const std::string_view key = parse_string("a quoted dict key");
      const auto it = std::find(std::begin(keys), std::end(keys), key);
      if (it == std::end(keys)) fail("unknown key '", npy_escape(key), "' in the header dict");
      const auto key_idx = static_cast<std::size_t>(it - std::begin(keys));
      if (seen[key_idx]) fail("duplicate key '", key, "' in the header dict");
      seen[key_idx] = true;
      skip_space();
      expect(':', "':' after a dict key");
      skip_space();
      if (key_idx == 0)
        parse_descr_value(out);
      else if (key_idx == 1)
        out.fortran_order = parse_bool();
      else
        parse_shape(out.shape);
      skip_space();
      if (consume(',')) {
        skip_space();
        continue;
      }
      expect('}', "',' or '}' after a dict value");
      break;
    }
    skip_space();
    if (pos_ != text_.size())
      fail("unexpected '", npy_escape(text_.substr(pos_)), "' after the header dict at offset ", pos_);
    for (std::size_t i = 0; i < 3; ++i)
      require(seen[i], "header dict lacks the key '", keys[i], "'");
    out.size = npy_size(out.shape, out.dtype);
    if (out.size.num_bytes > limits_.max_bytes)
      fail("shape ", npy_shape_str(out.shape), " of ", out.descr, " needs ", out.size.num_bytes,
           " bytes, above the limit max_bytes=", limits_.max_bytes);
    return out;
  }

private:
  std::string_view text_;
  const NpyReadLimits &limits_;
  std::size_t pos_ = 0;

  [[nodiscard]] bool at_end() const noexcept { return pos_ >= text_.size(); }
  [[nodiscard]] char peek() const noexcept { return at_end() ? '\0' : text_[pos_]; }

  void skip_space() noexcept {
    while (!at_end() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }

  bool consume(char c) noexcept {
    if (at_end() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }

  [[noreturn]] void fail_expected(const char *what) const {
    if (at_end()) fail("header ends at offset ", pos_, " where ", what, " was expected");
    fail("expected ", what, " at offset ", pos_, " of the header, got '", npy_escape(text_.substr(pos_, 16)), "'");
  }

  void expect(char c, const char *what) {
    if (!consume(c)) fail_expected(what);
  }

  /// A quoted string without escapes; NumPy never writes any in the keys or descrs it accepts.
  [[nodiscard]] std::string_view parse_string(const char *what) {
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail_expected(what);
    const std::size_t begin = ++pos_;
    while (!at_end() && text_[pos_] != quote) {
      if (text_[pos_] == '\\' || text_[pos_] == '\n')
        fail("escape or newline inside a string at offset ", pos_, " of the header");
      ++pos_;
    }
    if (at_end()) fail("unterminated string starting at offset ", begin - 1, " of the header");
    return text_.substr(begin, pos_++ - begin);
  }

  /// A bare token (number or name), up to the next delimiter.
  [[nodiscard]] std::string_view parse_word() {
    const std::size_t begin = pos_;
    while (!at_end()) {
      const char c = text_[pos_];
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == '.' ||
            c == '+' || c == '-'))
        break;
      ++pos_;
    }
    return text_.substr(begin, pos_ - begin);
  }

  void parse_descr_value(NpyHeader &out) {
    if (peek() == '[') fail("structured dtypes (a list as 'descr') are not supported");
    npy_parse_descr(parse_string("a quoted string as 'descr'"), out);
  }

  [[nodiscard]] bool parse_bool() {
    const std::size_t begin = pos_;
    const std::string_view word = parse_word();
    if (word == "True") return true;
    if (word == "False") return false;
    pos_ = begin;
    if (word.empty()) fail_expected("True or False as 'fortran_order'");
    fail("'fortran_order' must be True or False, got '", npy_escape(word), "'");
  }

  [[nodiscard]] std::int64_t parse_dim() {
    const std::string_view word = parse_word();
    if (word.empty()) fail_expected("a dimension");
    const std::string shown = npy_escape(word);
    const bool negative = word.front() == '-';
    const std::string_view digits = negative ? word.substr(1) : word;
    const bool all_digits =
        !digits.empty() && std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    require(all_digits, "dimension '", shown, "' is not a non-negative integer");
    require(!negative, "negative dimension ", shown, " in 'shape'");
    require(digits.size() == 1 || digits.front() != '0', "dimension '", shown, "' has a leading zero");
    std::int64_t value = 0;
    for (const char c : digits)
      if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, c - '0', &value))
        fail("dimension ", shown, " does not fit int64");
    return value;
  }

  void parse_shape(std::vector<std::int64_t> &shape) {
    if (peek() == '[') fail("'shape' must be a tuple, got a list at offset ", pos_);
    expect('(', "a tuple as 'shape'");
    skip_space();
    bool trailing_comma = false;
    while (!consume(')')) {
      if (static_cast<std::int64_t>(shape.size()) >= limits_.max_dims)
        fail("'shape' has more than max_dims=", limits_.max_dims, " dimensions");
      shape.push_back(parse_dim());
      skip_space();
      trailing_comma = consume(',');
      skip_space();
      if (!trailing_comma) {
        expect(')', "',' or ')' in 'shape'");
        break;
      }
    }
    // `(3)` is the integer 3 in Python, not a tuple, and NumPy rejects it.
    if (shape.size() == 1 && !trailing_comma)
      fail("'shape' (", shape[0], ") is not a tuple; a 1-d shape is written (", shape[0], ",)");
  }
};

/// Checks that the data section after the header holds exactly what the shape needs.
inline void npy_check_data_bytes(std::int64_t data_bytes, const NpyHeader &header) {
  if (data_bytes < header.size.num_bytes)
    fail("truncated data: file has ", data_bytes, " data bytes, shape ", npy_shape_str(header.shape), " of ",
         header.descr, " needs ", header.size.num_bytes);
  if (data_bytes > header.size.num_bytes)
    fail("file has ", data_bytes, " data bytes, shape ", npy_shape_str(header.shape), " of ", header.descr,
         " needs only ", header.size.num_bytes, " (", data_bytes - header.size.num_bytes, " trailing byte(s))");
}

/// The preamble and header dict text of an array, padded as NumPy pads them.
[[nodiscard]] inline std::string npy_encode_header(const NpyDtype &dtype, std::span<const std::int64_t> shape,
                                                   bool fortran_order, int version, std::string_view prefix) {
  require(version >= 1 && version <= 3, prefix, "version must be 1, 2 or 3, got ", version);
  (void)npy_size(shape, dtype, prefix);
  std::string dict =
      "{'descr': '" + dtype.descr() + "', 'fortran_order': " + (fortran_order ? "True" : "False") + ", 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) dict += ", ";
    dict += std::to_string(shape[i]);
  }
  dict += shape.size() == 1 ? ",), }" : "), }";
  const auto wrap = [&](int major) {
    const std::size_t prefix_bytes = major == 1 ? 10 : 12;
    const std::size_t text_bytes = dict.size() + 1; // + '\n'
    // Like NumPy: at least one space, so a header that is already aligned still gets a full block.
    const std::size_t pad_bytes = npy_align - (prefix_bytes + text_bytes) % npy_align;
    return text_bytes + pad_bytes;
  };
  std::size_t header_bytes = wrap(version);
  if (version == 1 && header_bytes > 0xffff) {
    version = 2;
    header_bytes = wrap(version);
  }
  if (header_bytes > 0xffffffffu)
    fail(prefix, "header of shape ", npy_shape_str(shape), " needs ", header_bytes, " bytes, above the format's 4 GiB");
  std::string out(reinterpret_cast<const char *>(npy_magic), sizeof(npy_magic));
  out += static_cast<char>(version);
  out += '\0';
  const int num_len_bytes = version == 1 ? 2 : 4;
  for (int i = 0; i < num_len_bytes; ++i)
    out += static_cast<char>((header_bytes >> (8 * i)) & 0xff);
  out += dict;
  out.append(header_bytes - dict.size() - 1, ' ');
  out += '\n';
  return out;
}

/// Reads exactly `num_bytes` into `dst` or throws naming `what`.
inline void npy_read_exactly(std::FILE *file, void *dst, std::size_t num_bytes, const char *what) {
  if (num_bytes == 0) return;
  errno = 0;
  if (std::fread(dst, 1, num_bytes, file) != num_bytes)
    fail("short read of the ", what, " (", num_bytes, " bytes)",
         std::ferror(file) ? std::string{": "} + std::strerror(errno) : std::string{": file shrank?"});
}

} // namespace detail

/// An n-d array read from or written to an NPY file.
struct NpyArray {
  NpyDtype dtype;                  ///< after reading, `data` is in the machine's byte order
  std::vector<std::int64_t> shape; ///< empty for a 0-d array (one element)
  bool fortran_order = false;      ///< `data` is kept in the file's element order
  std::vector<std::byte> data;     ///< num_elements() * dtype.item_bytes

  /// Product of `shape` (1 for 0-d); throws on negative or overflowing dims.
  [[nodiscard]] std::int64_t num_elements() const { return detail::npy_size(shape, dtype, "NpyArray: ").num_elements; }

  /// Element strides of `shape` in the array's own order (C: last dim contiguous; Fortran: first dim contiguous).
  [[nodiscard]] std::vector<std::int64_t> strides_elements() const {
    (void)detail::npy_size(shape, dtype, "NpyArray: ");
    std::vector<std::int64_t> strides(shape.size());
    std::int64_t stride = 1;
    const std::size_t nd = shape.size();
    for (std::size_t i = 0; i < nd; ++i) {
      const std::size_t k = fortran_order ? i : nd - 1 - i;
      strides[k] = stride;
      stride *= shape[k] == 0 ? 1 : shape[k]; // products of nonzero dims were checked by npy_size
    }
    return strides;
  }

  /// The elements as `T`, in the array's own order; throws unless `T` matches `dtype` and `data` matches `shape`.
  template <class T> [[nodiscard]] std::span<const T> as() const {
    if (NpyDtype::of<T>() != dtype)
      detail::fail("NpyArray::as: requested ", NpyDtype::of<T>().descr(), " but the array holds ",
                   dtype.valid() ? dtype.descr() : std::string{"an invalid dtype"});
    const auto n = checked_size().num_elements;
    // vector storage comes from operator new, aligned for every supported T.
    return {reinterpret_cast<const T *>(data.data()), static_cast<std::size_t>(n)};
  }

  /// A copy in C order (a Fortran array is transposed; a C array is copied as is).
  [[nodiscard]] NpyArray to_c_order() const {
    const auto size = checked_size();
    if (!fortran_order) return *this;
    NpyArray out{dtype, shape, false, std::vector<std::byte>(data.size())};
    if (shape.size() <= 1 || size.num_elements == 0) {
      out.data = data;
      return out;
    }
    const std::vector<std::int64_t> src_strides = strides_elements();
    const std::size_t nd = shape.size();
    const auto item = static_cast<std::size_t>(dtype.item_bytes);
    std::vector<std::int64_t> idx(nd, 0);
    std::int64_t src = 0;
    for (std::int64_t dst = 0; dst < size.num_elements; ++dst) {
      std::memcpy(out.data.data() + static_cast<std::size_t>(dst) * item,
                  data.data() + static_cast<std::size_t>(src) * item, item);
      for (std::size_t k = nd; k-- > 0;) { // advance the C-order index, last dim fastest
        if (++idx[k] < shape[k]) {
          src += src_strides[k];
          break;
        }
        src -= (shape[k] - 1) * src_strides[k];
        idx[k] = 0;
      }
    }
    return out;
  }

  /// Every element as double, in C order; 64-bit integers above 2^53 round.
  [[nodiscard]] std::vector<double> to_doubles() const {
    return converted<double>([](auto v) { return static_cast<double>(v); });
  }

  /// Every element as int64, in C order; throws for float dtypes and for uint64 values above INT64_MAX.
  [[nodiscard]] std::vector<std::int64_t> to_int64() const {
    if (dtype.kind == NpyKind::float_)
      detail::fail("NpyArray::to_int64: dtype ", dtype.descr(), " is not an integer dtype");
    std::size_t idx = 0;
    return converted<std::int64_t>([&idx](auto v) {
      if constexpr (std::is_same_v<decltype(v), std::uint64_t>)
        detail::require(v <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
                        "NpyArray::to_int64: uint64 value ", v, " at C-order index ", idx, " does not fit int64");
      ++idx;
      return static_cast<std::int64_t>(v);
    });
  }

private:
  [[nodiscard]] detail::NpySize checked_size() const {
    const auto size = detail::npy_size(shape, dtype, "NpyArray: ");
    if (static_cast<std::int64_t>(data.size()) != size.num_bytes)
      detail::fail("NpyArray: data has ", data.size(), " bytes, shape ", detail::npy_shape_str(shape), " of ",
                   dtype.descr(), " needs ", size.num_bytes);
    return size;
  }

  template <class Out, class Convert> [[nodiscard]] std::vector<Out> converted(Convert convert) const {
    const NpyArray c_order_copy = fortran_order && shape.size() > 1 ? to_c_order() : NpyArray{};
    const NpyArray &src = fortran_order && shape.size() > 1 ? c_order_copy : *this;
    const auto n = static_cast<std::size_t>(src.checked_size().num_elements);
    std::vector<Out> out;
    out.reserve(n);
    detail::npy_visit(dtype, [&](auto zero) {
      using T = decltype(zero);
      for (std::size_t i = 0; i < n; ++i) {
        T v;
        std::memcpy(&v, src.data.data() + i * sizeof(T), sizeof(T));
        out.push_back(convert(v));
      }
    });
    return out;
  }
};

namespace detail {

/// `parse_npy` without the caller's name in the messages.
[[nodiscard]] inline NpyArray npy_parse(std::span<const std::byte> bytes, const NpyReadLimits &limits) {
  npy_check_limits(limits);
  const auto file_bytes = static_cast<std::int64_t>(bytes.size());
  const NpyPreamble pre = npy_parse_preamble(bytes.first(std::min<std::size_t>(bytes.size(), 12)), file_bytes, limits);
  const std::string_view text{reinterpret_cast<const char *>(bytes.data()) + pre.header_offset,
                              static_cast<std::size_t>(pre.header_bytes)};
  NpyHeader header = NpyHeaderParser{text, limits}.parse();
  const std::int64_t data_offset = pre.header_offset + pre.header_bytes;
  npy_check_data_bytes(file_bytes - data_offset, header);
  NpyArray out{header.dtype, std::move(header.shape), header.fortran_order, {}};
  const auto data = bytes.subspan(static_cast<std::size_t>(data_offset));
  out.data.assign(data.begin(), data.end());
  if (header.swap_bytes) npy_byteswap(out.data.data(), out.data.size(), out.dtype.item_bytes);
  return out;
}

/// The header of an NPY file open at its start, checked against the file's size and `limits`; the stream is
/// left at the first data byte.
struct NpyFileHeader {
  NpyHeader header;
  std::int64_t data_bytes = 0; ///< bytes after the header (checked against the header's size)
};

[[nodiscard]] inline NpyFileHeader npy_read_header(std::FILE *file, std::uint64_t raw_size,
                                                   const NpyReadLimits &limits) {
  npy_check_limits(limits);
  require(raw_size <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), "file size ", raw_size,
          " exceeds int64");
  const auto file_bytes = static_cast<std::int64_t>(raw_size);
  std::byte head[12] = {};
  const auto head_bytes = static_cast<std::size_t>(std::min<std::int64_t>(file_bytes, 12));
  npy_read_exactly(file, head, head_bytes, "preamble");
  const NpyPreamble pre = npy_parse_preamble(std::span<const std::byte>{head, head_bytes}, file_bytes, limits);
  // header_bytes was checked against both the file size and max_header_bytes before this allocation.
  std::string text(static_cast<std::size_t>(pre.header_bytes), '\0');
  if (std::fseek(file, static_cast<long>(pre.header_offset), SEEK_SET) != 0)
    fail("cannot seek to the header: ", std::strerror(errno));
  npy_read_exactly(file, text.data(), text.size(), "header");
  NpyFileHeader out{NpyHeaderParser{text, limits}.parse(), file_bytes - pre.header_offset - pre.header_bytes};
  npy_check_data_bytes(out.data_bytes, out.header);
  return out;
}

/// The header of the NPY file at `path` (a regular file: see `files::open_input`), without its data.
[[nodiscard]] inline NpyHeader npy_read_file_header(const std::filesystem::path &path, const NpyReadLimits &limits) {
  files::OpenInput in = files::open_input(path);
  return npy_read_header(in.file.get(), in.size, limits).header;
}

/// The array of the NPY file `in` (open at its start, from `files::open_input`).
[[nodiscard]] inline NpyArray npy_read_open(const files::OpenInput &in, const NpyReadLimits &limits) {
  NpyFileHeader h = npy_read_header(in.file.get(), in.size, limits);
  NpyArray out{h.header.dtype, std::move(h.header.shape), h.header.fortran_order, {}};
  out.data.resize(static_cast<std::size_t>(h.header.size.num_bytes));
  npy_read_exactly(in.file.get(), out.data.data(), out.data.size(), "data");
  require(std::fgetc(in.file.get()) == EOF, "the file grew while it was read");
  if (h.header.swap_bytes) npy_byteswap(out.data.data(), out.data.size(), out.dtype.item_bytes);
  return out;
}

/// Writes `num_bytes` of native-order items as little-endian.
inline void npy_write_le(std::FILE *f, const std::byte *data, std::size_t num_bytes, int item_bytes) {
  const auto write = [&](const void *p, std::size_t n) {
    if (n > 0 && std::fwrite(p, 1, n, f) != n) fail("write failed: ", std::strerror(errno));
  };
  if constexpr (std::endian::native == std::endian::little) {
    (void)item_bytes;
    write(data, num_bytes);
  } else {
    std::vector<std::byte> chunk;
    for (std::size_t begin = 0; begin < num_bytes; begin += std::size_t{1} << 20) {
      const std::size_t n = std::min(num_bytes - begin, std::size_t{1} << 20);
      chunk.assign(data + begin, data + begin + n);
      npy_byteswap(chunk.data(), n, item_bytes);
      write(chunk.data(), n);
    }
  }
}

} // namespace detail

/// Parses an NPY image held in memory; the result's data is in the machine's byte order.
[[nodiscard]] inline NpyArray parse_npy(std::span<const std::byte> bytes, const NpyReadLimits &limits = {}) {
  try {
    return detail::npy_parse(bytes, limits);
  } catch (const Error &e) {
    detail::fail("parse_npy: ", e.what());
  }
}

/// Reads an NPY file; checks the header against the file size and `limits` before allocating the data.
[[nodiscard]] inline NpyArray read_npy(const std::filesystem::path &path, const NpyReadLimits &limits = {}) {
  const files::OpenInput in = files::open_input(path); // its errors name the path
  try {
    return detail::npy_read_open(in, limits);
  } catch (const Error &e) {
    detail::fail("read_npy ", path, ": ", e.what());
  }
}

/// The NPY image of native-order `data` (written little-endian), version `version` unless the header needs 2.0.
[[nodiscard]] inline std::vector<std::byte> encode_npy(const NpyDtype &dtype, std::span<const std::int64_t> shape,
                                                       const void *data, bool fortran_order = false, int version = 1) {
  const std::string header = detail::npy_encode_header(dtype, shape, fortran_order, version, "encode_npy: ");
  const auto num_bytes = static_cast<std::size_t>(detail::npy_size(shape, dtype).num_bytes);
  if (data == nullptr && num_bytes > 0)
    detail::fail("encode_npy: data is null for shape ", detail::npy_shape_str(shape), " of ", dtype.descr(), " (",
                 num_bytes, " bytes)");
  std::vector<std::byte> out(header.size() + num_bytes);
  std::memcpy(out.data(), header.data(), header.size());
  if (num_bytes > 0) {
    std::memcpy(out.data() + header.size(), data, num_bytes);
    if constexpr (std::endian::native == std::endian::big)
      detail::npy_byteswap(out.data() + header.size(), num_bytes, dtype.item_bytes);
  }
  return out;
}

/// The writer of an NPY image of native-order `data` for `files::OutputSet` (to write several files together).
[[nodiscard]] inline files::OutputSet::Writer npy_writer(const NpyDtype &dtype, std::span<const std::int64_t> shape,
                                                         const void *data, bool fortran_order = false) {
  std::string header = detail::npy_encode_header(dtype, shape, fortran_order, 1, "");
  const auto num_bytes = static_cast<std::size_t>(detail::npy_size(shape, dtype).num_bytes);
  if (data == nullptr && num_bytes > 0)
    detail::fail("data is null for shape ", detail::npy_shape_str(shape), " of ", dtype.descr());
  return [header = std::move(header), data, num_bytes, item = dtype.item_bytes](std::FILE *f) {
    detail::npy_write_le(f, reinterpret_cast<const std::byte *>(header.data()), header.size(), 1);
    detail::npy_write_le(f, static_cast<const std::byte *>(data), num_bytes, item);
  };
}

/// Writes native-order `data` as an NPY file (through `files::write_file`: staged beside the target and renamed
/// into place, so that readers never see a partial file; a non-regular target such as /dev/null written in place).
inline void write_npy(const std::filesystem::path &path, const NpyDtype &dtype, std::span<const std::int64_t> shape,
                      const void *data, bool fortran_order = false) {
  try {
    files::write_file(path, npy_writer(dtype, shape, data, fortran_order));
  } catch (const Error &e) {
    detail::fail("write_npy: ", e.what());
  }
}

/// Writes `data` (C order) of shape `shape`; the dtype follows `T`.
template <class T>
void write_npy(const std::filesystem::path &path, std::span<const T> data, std::span<const std::int64_t> shape) {
  constexpr NpyDtype dtype = NpyDtype::of<T>();
  const auto size = detail::npy_size(shape, dtype, "write_npy: ");
  if (static_cast<std::int64_t>(data.size()) != size.num_elements)
    detail::fail("write_npy ", path, ": ", data.size(), " elements given, shape ", detail::npy_shape_str(shape),
                 " needs ", size.num_elements);
  write_npy(path, dtype, shape, data.data(), false);
}

/// `write_npy` for a vector, which does not deduce through `std::span<const T>`.
template <class T, class Alloc>
void write_npy(const std::filesystem::path &path, const std::vector<T, Alloc> &data,
               std::span<const std::int64_t> shape) {
  write_npy(path, std::span<const T>{data}, shape);
}

} // namespace v0
} // namespace foremoe
