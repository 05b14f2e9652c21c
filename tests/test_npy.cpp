#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/trace/npy.hpp"
#include "test_support.hpp"

using foremoe::Error;
using foremoe::NpyArray;
using foremoe::NpyDtype;
using foremoe::NpyKind;
using foremoe::NpyReadLimits;

#define CHECK_NPY_ERROR(expr, text) CHECK_THROWS_WITH_AS((void)(expr), doctest::Contains(text), Error)

namespace {

using Bytes = std::vector<std::byte>;
using Shape = std::vector<std::int64_t>;

constexpr NpyDtype all_dtypes[] = {{NpyKind::int_, 1},   {NpyKind::uint_, 1}, {NpyKind::int_, 2}, {NpyKind::uint_, 2},
                                   {NpyKind::int_, 4},   {NpyKind::uint_, 4}, {NpyKind::int_, 8}, {NpyKind::uint_, 8},
                                   {NpyKind::float_, 4}, {NpyKind::float_, 8}};

Bytes to_bytes(std::string_view s) {
  Bytes out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

std::string as_text(const Bytes &b) { return {reinterpret_cast<const char *>(b.data()), b.size()}; }

/// A hand-built image: magic, version, little-endian header length, `header` verbatim, then `data`.
Bytes make_image(int major, int minor, std::string_view header, const Bytes &data = {}) {
  std::string s = "\x93NUMPY";
  s += static_cast<char>(major);
  s += static_cast<char>(minor);
  const int num_len_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < num_len_bytes; ++i)
    s += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  s += header;
  Bytes out = to_bytes(s);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

/// A v1.0 image whose dict names `descr` and `shape` text verbatim.
Bytes image_with(std::string_view descr, std::string_view shape, const Bytes &data = {}) {
  const std::string header =
      "{'descr': '" + std::string{descr} + "', 'fortran_order': False, 'shape': " + std::string{shape} + ", }\n";
  return make_image(1, 0, header, data);
}

template <class T> Bytes le_bytes(std::initializer_list<T> values) {
  Bytes out;
  for (T v : values) {
    std::byte b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    if constexpr (std::endian::native == std::endian::big) std::reverse(std::begin(b), std::end(b));
    out.insert(out.end(), std::begin(b), std::end(b));
  }
  return out;
}

template <class T> Bytes be_bytes(std::initializer_list<T> values) {
  Bytes out = le_bytes(values);
  for (std::size_t i = 0; i < out.size(); i += sizeof(T))
    std::reverse(out.begin() + static_cast<std::ptrdiff_t>(i),
                 out.begin() + static_cast<std::ptrdiff_t>(i + sizeof(T)));
  return out;
}

NpyArray parse(const Bytes &b, const NpyReadLimits &limits = {}) { return foremoe::parse_npy(b, limits); }

std::int64_t product(const Shape &shape) {
  std::int64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}

Bytes random_bytes(std::size_t n, std::mt19937_64 &rng) {
  Bytes out(n);
  for (auto &b : out)
    b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

/// Fortran strides computed here rather than through the code under test.
Shape fortran_strides(const Shape &shape) {
  Shape s(shape.size());
  std::int64_t stride = 1;
  for (std::size_t k = 0; k < shape.size(); ++k) {
    s[k] = stride;
    stride *= shape[k];
  }
  return s;
}

/// `c_data` (C order) rearranged into Fortran order.
Bytes c_to_fortran(const Bytes &c_data, const Shape &shape, int item_bytes) {
  Bytes out(c_data.size());
  const Shape fs = fortran_strides(shape);
  const std::int64_t n = product(shape);
  Shape idx(shape.size(), 0);
  for (std::int64_t c = 0; c < n; ++c) {
    std::int64_t rem = c, f = 0;
    for (std::size_t k = shape.size(); k-- > 0;) {
      idx[k] = rem % shape[k];
      rem /= shape[k];
      f += idx[k] * fs[k];
    }
    std::memcpy(out.data() + f * item_bytes, c_data.data() + c * item_bytes, static_cast<std::size_t>(item_bytes));
  }
  return out;
}

struct TempDir : foremoe_test::TempDir {
  TempDir() : foremoe_test::TempDir("foremoe_test_npy_") {}
};

void write_file(const std::filesystem::path &p, const Bytes &b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char *>(b.data()), static_cast<std::streamsize>(b.size()));
}

} // namespace

TEST_CASE("NpyDtype: descr and of") {
  CHECK(NpyDtype::of<std::int8_t>() == NpyDtype{NpyKind::int_, 1});
  CHECK(NpyDtype::of<std::uint8_t>() == NpyDtype{NpyKind::uint_, 1});
  CHECK(NpyDtype::of<std::int64_t>() == NpyDtype{NpyKind::int_, 8});
  CHECK(NpyDtype::of<const std::uint32_t>() == NpyDtype{NpyKind::uint_, 4});
  CHECK(NpyDtype::of<float>() == NpyDtype{NpyKind::float_, 4});
  CHECK(NpyDtype::of<double>() == NpyDtype{NpyKind::float_, 8});
  CHECK(NpyDtype::of<std::uint16_t>().descr() == "<u2");
  CHECK(NpyDtype::of<std::uint16_t>().descr(true) == ">u2");
  CHECK(NpyDtype::of<std::int8_t>().descr(true) == "|i1");
  CHECK(NpyDtype::of<double>().descr() == "<f8");
  CHECK(NpyDtype::of<std::int32_t>() != NpyDtype::of<std::uint32_t>());
  CHECK_FALSE((NpyDtype{NpyKind::float_, 2}).valid());
  CHECK_NPY_ERROR((NpyDtype{NpyKind::int_, 3}).descr(), "item_bytes 3");
}

TEST_CASE("encode_npy writes NumPy's header layout") {
  const std::array<std::uint16_t, 12> values{};
  const Shape shape{3, 4};
  const Bytes image = foremoe::encode_npy(NpyDtype::of<std::uint16_t>(), shape, values.data());
  const std::string text = as_text(image);
  CHECK(text.substr(0, 8) == std::string("\x93NUMPY\x01\x00", 8));
  const std::size_t header_bytes = std::to_integer<std::size_t>(image[8]) | std::to_integer<std::size_t>(image[9]) << 8;
  CHECK((10 + header_bytes) % 64 == 0);
  CHECK(image.size() == 10 + header_bytes + 24);
  const std::string header = text.substr(10, header_bytes);
  const std::string dict = "{'descr': '<u2', 'fortran_order': False, 'shape': (3, 4), }";
  CHECK(header.substr(0, dict.size()) == dict);
  CHECK(header.back() == '\n');
  CHECK(header.find_first_not_of(' ', dict.size()) == header_bytes - 1);

  // NumPy's np.save(np.zeros(3, '<u2')) writes a 118-byte header: 128 bytes before the data.
  const Bytes small = foremoe::encode_npy(NpyDtype::of<std::uint16_t>(), Shape{3}, values.data());
  CHECK(as_text(small).substr(8, 2) == std::string("\x76\x00", 2));
  CHECK(as_text(small).find("'shape': (3,), }") != std::string::npos);

  const Bytes scalar = foremoe::encode_npy(NpyDtype::of<double>(), Shape{}, values.data(), true);
  CHECK(as_text(scalar).find("{'descr': '<f8', 'fortran_order': True, 'shape': (), }") == 10);

  // A header too long for the 16-bit length of 1.0 switches to 2.0, as NumPy does.
  const Shape many_dims(25000, 1);
  const Bytes long_header = foremoe::encode_npy(NpyDtype::of<std::uint8_t>(), many_dims, values.data());
  CHECK(std::to_integer<int>(long_header[6]) == 2);
  CHECK((long_header.size() - 1) % 64 == 0);
  CHECK(parse(long_header, NpyReadLimits{1 << 20, 25000, 1 << 20}).shape == many_dims);
  CHECK_NPY_ERROR(parse(long_header), "max_dims=8");

  for (int version : {2, 3}) {
    const Bytes v = foremoe::encode_npy(NpyDtype::of<std::uint8_t>(), Shape{5}, values.data(), false, version);
    CHECK(std::to_integer<int>(v[6]) == version);
    CHECK(std::to_integer<int>(v[7]) == 0);
    const std::size_t len = std::to_integer<std::size_t>(v[8]) | std::to_integer<std::size_t>(v[9]) << 8;
    CHECK((12 + len) % 64 == 0);
    CHECK(parse(v).as<std::uint8_t>().size() == 5);
  }
}

TEST_CASE("round trip: every dtype x order x shape, in memory and through files") {
  const TempDir dir;
  const std::vector<Shape> shapes{{}, {0}, {1}, {5}, {2, 3}, {3, 0, 2}, {2, 3, 4}, {1, 1, 1, 1}, {0, 0}};
  std::mt19937_64 rng(7);
  int file_idx = 0;
  for (const NpyDtype &dtype : all_dtypes) {
    for (const bool fortran : {false, true}) {
      for (const Shape &shape : shapes) {
        CAPTURE(dtype.descr());
        CAPTURE(fortran);
        CAPTURE(foremoe::detail::npy_shape_str(shape));
        const Bytes data = random_bytes(static_cast<std::size_t>(product(shape) * dtype.item_bytes), rng);
        const Bytes image = foremoe::encode_npy(dtype, shape, data.data(), fortran);
        const NpyArray a = parse(image);
        CHECK(a.dtype == dtype);
        CHECK(a.shape == shape);
        CHECK(a.fortran_order == fortran);
        CHECK(a.data == data);
        CHECK(a.num_elements() == product(shape));

        // Appended, not `"a" + std::to_string(..)`: g++ 12 -O3 -Wrestrict false positive (GCC PR 105651).
        std::string name = "a";
        name += std::to_string(file_idx++);
        name += ".npy";
        const auto path = dir.path / name;
        foremoe::write_npy(path, dtype, shape, data.data(), fortran);
        const NpyArray b = foremoe::read_npy(path);
        CHECK(b.dtype == dtype);
        CHECK(b.shape == shape);
        CHECK(b.fortran_order == fortran);
        CHECK(b.data == data);
        std::ifstream f(path, std::ios::binary);
        const std::string on_disk{std::istreambuf_iterator<char>(f), {}};
        CHECK(on_disk == as_text(image));
      }
    }
  }
  // The typed writers pick the dtype from T; no temporary file is left behind.
  const std::vector<float> floats{1.5f, -2.0f, 3.25f, 0.0f, 8.0f, 9.0f};
  foremoe::write_npy(dir.path / "f.npy", std::span<const float>{floats}, Shape{2, 3});
  const NpyArray f = foremoe::read_npy(dir.path / "f.npy");
  CHECK(f.dtype == NpyDtype::of<float>());
  CHECK(std::vector<float>(f.as<float>().begin(), f.as<float>().end()) == floats);
  const std::vector<std::int64_t> ints{-1, 2, -3};
  foremoe::write_npy(dir.path / "i.npy", ints, Shape{3});
  CHECK(foremoe::read_npy(dir.path / "i.npy").to_int64() == ints);
  CHECK_NPY_ERROR(foremoe::write_npy(dir.path / "bad.npy", ints, Shape{2, 2}), "3 elements given");
  int num_files = 0;
  for ([[maybe_unused]] const auto &entry : std::filesystem::directory_iterator(dir.path))
    ++num_files;
  CHECK(num_files == file_idx + 2);
}

TEST_CASE("hand-built images: versions 1.0, 2.0 and 3.0") {
  const Bytes data = le_bytes<std::int32_t>({1, -2, 300000});
  const std::string header = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }\n";
  for (int major : {1, 2, 3}) {
    CAPTURE(major);
    const NpyArray a = parse(make_image(major, 0, header, data));
    CHECK(a.dtype == NpyDtype::of<std::int32_t>());
    CHECK(a.to_int64() == std::vector<std::int64_t>{1, -2, 300000});
  }
  // Headers need no padding, no newline, and may be unaligned.
  CHECK(parse(make_image(1, 0, "{'descr':'<i4','fortran_order':False,'shape':(3,)}", data)).num_elements() == 3);
  // A 3.0 header is UTF-8; spaces around the dict are fine there too.
  CHECK(parse(make_image(3, 0, "  {\"descr\": \"<i4\", \"fortran_order\": False, \"shape\": (3,)}  \n", data))
            .num_elements() == 3);
}

TEST_CASE("big-endian data is swapped to native on read") {
  {
    const NpyArray a = parse(image_with(">u2", "(2,)", be_bytes<std::uint16_t>({0x0102, 0xfffe})));
    CHECK(a.dtype == NpyDtype::of<std::uint16_t>());
    CHECK(a.as<std::uint16_t>()[0] == 0x0102);
    CHECK(a.as<std::uint16_t>()[1] == 0xfffe);
  }
  {
    const NpyArray a = parse(image_with(">i4", "(2,)", be_bytes<std::int32_t>({-5, 0x01020304})));
    CHECK(a.to_int64() == std::vector<std::int64_t>{-5, 0x01020304});
  }
  {
    const NpyArray a = parse(image_with(">i8", "(1,)", be_bytes<std::int64_t>({-0x0102030405060708})));
    CHECK(a.as<std::int64_t>()[0] == -0x0102030405060708);
  }
  {
    const NpyArray a = parse(image_with(">f4", "(2,)", be_bytes<float>({1.5f, -0.25f})));
    CHECK(a.to_doubles() == std::vector<double>{1.5, -0.25});
  }
  {
    const NpyArray a = parse(image_with(">f8", "(2, 1)", be_bytes<double>({3.0e300, -7.5})));
    CHECK(a.to_doubles() == std::vector<double>{3.0e300, -7.5});
  }
  {
    const NpyArray a = parse(image_with(">u1", "(2,)", le_bytes<std::uint8_t>({7, 200})));
    CHECK(a.to_int64() == std::vector<std::int64_t>{7, 200});
  }
  // '=' is the machine's order, which is what le_bytes produces on little-endian machines.
  if constexpr (std::endian::native == std::endian::little) {
    const NpyArray a = parse(image_with("=u4", "(2,)", le_bytes<std::uint32_t>({0xdeadbeef, 1})));
    CHECK(a.as<std::uint32_t>()[0] == 0xdeadbeef);
  }
  for (const char *descr : {"|u1", "<u1", "=i1", "|i1", ">i1"})
    CHECK(parse(image_with(descr, "(1,)", Bytes{std::byte{0x80}})).num_elements() == 1);
}

TEST_CASE("header dict: key order, whitespace, quotes and trailing commas") {
  const Bytes data = le_bytes<std::uint8_t>({1, 2, 3, 4, 5, 6});
  const std::string entries[3] = {"'descr': '<u1'", "'fortran_order': True", "'shape': (2, 3)"};
  int order[3] = {0, 1, 2};
  int num_orders = 0;
  do {
    for (const char *sep : {", ", ",", " ,\n\t ", " , "}) {
      for (const char *tail : {"", ", ", ",", " ,\n"}) {
        const std::string header = std::string{"{"} + entries[order[0]] + sep + entries[order[1]] + sep +
                                   entries[order[2]] + tail + "}" + std::string(7, ' ') + "\n";
        CAPTURE(header);
        const NpyArray a = parse(make_image(1, 0, header, data));
        CHECK(a.fortran_order);
        CHECK(a.shape == Shape{2, 3});
        CHECK(a.dtype == NpyDtype::of<std::uint8_t>());
      }
    }
    ++num_orders;
  } while (std::next_permutation(std::begin(order), std::end(order)));
  CHECK(num_orders == 6);

  const std::string spaced = "{ \"shape\" :\t(\n2 ,3 , ) ,\r\n \"descr\":\"<u1\" , 'fortran_order':False }";
  CHECK(parse(make_image(1, 0, spaced, data)).shape == Shape{2, 3});
  CHECK(
      parse(make_image(1, 0, "{'descr':'<u1','fortran_order':False,'shape':( )}", Bytes{std::byte{9}})).shape.empty());
  CHECK(parse(make_image(1, 0, "{'descr':'<u1','fortran_order':False,'shape':(6 ,)}", data)).shape == Shape{6});
}

TEST_CASE("Fortran order: strides and to_c_order") {
  // a[i][j] = 10 * i + j stored column by column.
  NpyArray f{NpyDtype::of<std::int32_t>(), {2, 3}, true, le_bytes<std::int32_t>({0, 10, 1, 11, 2, 12})};
  CHECK(f.strides_elements() == Shape{1, 2});
  const NpyArray c = f.to_c_order();
  CHECK_FALSE(c.fortran_order);
  CHECK(c.shape == Shape{2, 3});
  CHECK(c.strides_elements() == Shape{3, 1});
  CHECK(std::vector<std::int32_t>(c.as<std::int32_t>().begin(), c.as<std::int32_t>().end()) ==
        std::vector<std::int32_t>{0, 1, 2, 10, 11, 12});
  CHECK(f.to_doubles() == std::vector<double>{0, 1, 2, 10, 11, 12});
  CHECK(f.to_int64() == std::vector<std::int64_t>{0, 1, 2, 10, 11, 12});
  // The raw view keeps the file's order.
  CHECK(f.as<std::int32_t>()[1] == 10);

  NpyArray three{NpyDtype::of<std::uint8_t>(), {3, 4, 5}, false, Bytes(60)};
  CHECK(three.strides_elements() == Shape{20, 5, 1});
  three.fortran_order = true;
  CHECK(three.strides_elements() == Shape{1, 3, 12});
  three.shape = {2, 0, 3};
  three.data.clear();
  CHECK(three.strides_elements() == Shape{1, 2, 2});
  CHECK(three.to_c_order().data.empty());

  std::mt19937_64 rng(11);
  const Shape shape{3, 4, 2, 5};
  const Bytes c_data = random_bytes(120 * 8, rng);
  const NpyArray g{NpyDtype::of<double>(), shape, true, c_to_fortran(c_data, shape, 8)};
  CHECK(g.to_c_order().data == c_data);
}

TEST_CASE("to_doubles and to_int64 convert every dtype") {
  CHECK(parse(image_with("<i1", "(3,)", le_bytes<std::int8_t>({-128, 0, 127}))).to_doubles() ==
        std::vector<double>{-128, 0, 127});
  CHECK(parse(image_with("<u8", "(2,)", le_bytes<std::uint64_t>({0, 1ull << 40}))).to_int64() ==
        std::vector<std::int64_t>{0, std::int64_t{1} << 40});
  CHECK(parse(image_with("<i2", "()", le_bytes<std::int16_t>({-300}))).to_int64() == std::vector<std::int64_t>{-300});
  CHECK(parse(image_with("<u4", "(1,)", le_bytes<std::uint32_t>({4000000000u}))).to_doubles() ==
        std::vector<double>{4e9});
  CHECK_NPY_ERROR(parse(image_with("<f4", "(1,)", le_bytes<float>({1.0f}))).to_int64(), "<f4");
  CHECK_NPY_ERROR(parse(image_with("<u8", "(2,)", le_bytes<std::uint64_t>({1, ~0ull}))).to_int64(),
                  "18446744073709551615");
  CHECK_NPY_ERROR(parse(image_with("<u2", "(1,)", le_bytes<std::uint16_t>({1}))).as<std::int16_t>(), "<i2");
}

TEST_CASE("property: random round trips, byte orders and transposes") {
  const int num_iters = 300 * foremoe_test::seed_multiplier();
  std::mt19937_64 rng(20240611);
  for (int iter = 0; iter < num_iters; ++iter) {
    const NpyDtype dtype = all_dtypes[rng() % std::size(all_dtypes)];
    Shape shape(rng() % 6);
    for (auto &d : shape)
      d = static_cast<std::int64_t>(rng() % 5);
    if (rng() % 4 == 0 && !shape.empty()) shape[rng() % shape.size()] = static_cast<std::int64_t>(rng() % 40);
    const bool fortran = rng() % 2 == 0;
    const int version = 1 + static_cast<int>(rng() % 3);
    CAPTURE(iter);
    CAPTURE(dtype.descr());
    CAPTURE(foremoe::detail::npy_shape_str(shape));
    CAPTURE(fortran);
    CAPTURE(version);
    const Bytes data = random_bytes(static_cast<std::size_t>(product(shape) * dtype.item_bytes), rng);
    Bytes image = foremoe::encode_npy(dtype, shape, data.data(), fortran, version);
    REQUIRE(std::to_integer<int>(image[6]) == version);
    const std::size_t prefix_bytes = version == 1 ? 10 : 12;
    REQUIRE((image.size() - data.size()) % 64 == 0);

    const NpyArray a = parse(image);
    REQUIRE(a.dtype == dtype);
    REQUIRE(a.shape == shape);
    REQUIRE(a.fortran_order == fortran);
    REQUIRE(a.data == data);

    // Re-encoding what was read gives the same image.
    REQUIRE(foremoe::encode_npy(a.dtype, a.shape, a.data.data(), a.fortran_order, version) == image);

    // The same values stored big-endian read back identically.
    if constexpr (std::endian::native == std::endian::little) {
      if (dtype.item_bytes > 1) {
        const std::size_t header_end = image.size() - data.size();
        const std::string text = as_text(image).substr(prefix_bytes, header_end - prefix_bytes);
        const std::size_t at = text.find("'<");
        REQUIRE(at != std::string::npos);
        image[prefix_bytes + at + 1] = std::byte{'>'};
        for (std::size_t i = header_end; i < image.size(); i += static_cast<std::size_t>(dtype.item_bytes))
          std::reverse(image.begin() + static_cast<std::ptrdiff_t>(i),
                       image.begin() + static_cast<std::ptrdiff_t>(i) + dtype.item_bytes);
        REQUIRE(parse(image).data == data);
      }
    }

    // Interpreting the data as Fortran order and transposing matches an independent index computation.
    if (fortran) {
      Bytes c_data(data.size());
      const Shape fs = fortran_strides(shape);
      const std::int64_t n = product(shape);
      for (std::int64_t c = 0; c < n; ++c) {
        std::int64_t rem = c, f = 0;
        for (std::size_t k = shape.size(); k-- > 0;) {
          f += (rem % shape[k]) * fs[k];
          rem /= shape[k];
        }
        std::memcpy(c_data.data() + c * dtype.item_bytes, data.data() + f * dtype.item_bytes,
                    static_cast<std::size_t>(dtype.item_bytes));
      }
      REQUIRE(a.to_c_order().data == c_data);
      REQUIRE(a.to_doubles().size() == static_cast<std::size_t>(n));
    }
  }
}

TEST_CASE("rejects: every truncated prefix of a valid file") {
  const std::array<std::uint16_t, 6> values{1, 2, 3, 4, 5, 6};
  for (int version : {1, 2}) {
    const Bytes image = foremoe::encode_npy(NpyDtype::of<std::uint16_t>(), Shape{2, 3}, values.data(), true, version);
    for (std::size_t n = 0; n < image.size(); ++n) {
      CAPTURE(n);
      CHECK_THROWS_AS((void)foremoe::parse_npy(std::span<const std::byte>{image.data(), n}), Error);
    }
    CHECK(parse(image).num_elements() == 6);
  }
  CHECK_NPY_ERROR(parse(Bytes{}), "truncated");
  CHECK_NPY_ERROR(parse(to_bytes(std::string("\x93NUMPY\x02\x00\x10", 9))), "truncated");
}

TEST_CASE("rejects: mutated bytes never crash") {
  const std::array<std::int32_t, 4> values{1, -2, 3, -4};
  const Bytes image = foremoe::encode_npy(NpyDtype::of<std::int32_t>(), Shape{2, 2}, values.data());
  const std::byte probes[] = {std::byte{0},    std::byte{0xff}, std::byte{'('}, std::byte{')'}, std::byte{','},
                              std::byte{'\''}, std::byte{'9'},  std::byte{'-'}, std::byte{' '}, std::byte{'}'}};
  int num_accepted = 0;
  for (std::size_t i = 0; i < image.size(); ++i) {
    for (const std::byte probe : probes) {
      Bytes mutated = image;
      mutated[i] = probe;
      try {
        const NpyArray a = parse(mutated, NpyReadLimits{1 << 16, 8, 1 << 12});
        (void)a.to_doubles();
        ++num_accepted;
      } catch (const Error &) {
      }
    }
  }
  CHECK(num_accepted > 0);
}

TEST_CASE("rejects: bad preamble") {
  const std::string good = "{'descr': '<u1', 'fortran_order': False, 'shape': (1,), }\n";
  Bytes bad_magic = make_image(1, 0, good, Bytes{std::byte{1}});
  bad_magic[1] = std::byte{'X'};
  CHECK_NPY_ERROR(parse(bad_magic), "bad magic");
  CHECK_NPY_ERROR(parse(bad_magic), "\\x93XUMPY");
  CHECK_NPY_ERROR(parse(to_bytes("PK\x03\x04 not an npy file")), "bad magic");
  CHECK_NPY_ERROR(parse(make_image(4, 0, good, Bytes{std::byte{1}})), "version 4.0");
  CHECK_NPY_ERROR(parse(make_image(1, 1, good, Bytes{std::byte{1}})), "version 1.1");
  CHECK_NPY_ERROR(parse(make_image(0, 0, good, Bytes{std::byte{1}})), "version 0.0");

  // The length field claims more header than the file holds.
  Bytes long_header = make_image(1, 0, good, Bytes{std::byte{1}});
  long_header[8] = std::byte{0x34};
  long_header[9] = std::byte{0x12};
  CHECK_NPY_ERROR(parse(long_header), "header length 4660");
  Bytes huge_v2 = make_image(2, 0, good, Bytes{std::byte{1}});
  huge_v2[11] = std::byte{0xff};
  CHECK_NPY_ERROR(parse(huge_v2), "exceeds the limit max_header_bytes=1048576");
  CHECK_NPY_ERROR(parse(make_image(1, 0, good, Bytes{std::byte{1}}), NpyReadLimits{1 << 20, 8, 16}),
                  "max_header_bytes=16");
  CHECK_NPY_ERROR(parse(make_image(1, 0, good), NpyReadLimits{-1, 8, 16}), "max_bytes must be >= 0");
}

TEST_CASE("rejects: unsupported descrs name the descr") {
  const Bytes eight(8);
  CHECK_NPY_ERROR(parse(image_with("<c8", "(1,)", eight)), "'<c8'");
  CHECK_NPY_ERROR(parse(image_with("|O", "(1,)", eight)), "'|O'");
  CHECK_NPY_ERROR(parse(image_with("<f2", "(1,)", eight)), "'<f2'");
  CHECK_NPY_ERROR(parse(image_with("<U10", "(1,)", eight)), "'<U10'");
  CHECK_NPY_ERROR(parse(image_with("|S8", "(1,)", eight)), "'|S8'");
  CHECK_NPY_ERROR(parse(image_with("<M8[ns]", "(1,)", eight)), "'<M8[ns]'");
  CHECK_NPY_ERROR(parse(image_with("<i16", "(1,)", eight)), "'<i16'");
  CHECK_NPY_ERROR(parse(image_with("<i3", "(1,)", eight)), "'<i3'");
  CHECK_NPY_ERROR(parse(image_with("", "(1,)", eight)), "descr ''");
  CHECK_NPY_ERROR(parse(image_with("u2", "(1,)", eight)), "'u2' lacks a byte-order");
  CHECK_NPY_ERROR(parse(image_with("|b1", "(1,)", eight)), "bool descr '|b1'");
  CHECK_NPY_ERROR(parse(image_with("|u2", "(1,)", eight)), "'|u2' is invalid");
  CHECK_NPY_ERROR(parse(image_with("<u\xff", "(1,)", eight)), "'<u\\xff'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': [('a', '<u1')], 'fortran_order': False, 'shape': (1,)}")),
                  "structured");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': 3, 'fortran_order': False, 'shape': (1,)}")), "'descr'");
}

TEST_CASE("rejects: bad shapes and sizes name the value") {
  const Bytes two(2);
  CHECK_NPY_ERROR(parse(image_with("<u2", "(-1,)", two)), "negative dimension -1");
  CHECK_NPY_ERROR(parse(image_with("<u2", "(1152921504606846976,)", two)), "1152921504606846976");
  CHECK_NPY_ERROR(parse(image_with("<u2", "(1152921504606846976,)", two)), "max_bytes");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(4294967296, 4294967296)", two)), "[4294967296, 4294967296]");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(4294967296, 4294967296)", two)), "overflows");
  // A zero dim does not excuse an overflowing product of the others (NumPy's rule).
  CHECK_NPY_ERROR(parse(image_with("<u1", "(0, 4294967296, 4294967296)", two)), "overflows");
  CHECK_NPY_ERROR(parse(image_with("<u8", "(2305843009213693952,)", two)), "overflows");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(99999999999999999999,)", two)), "99999999999999999999 does not fit");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(2.0,)", two)), "'2.0'");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(2L,)", two)), "'2L'");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(0x2,)", two)), "'0x2'");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(02,)", two)), "'02' has a leading zero");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(2)", two)), "(2) is not a tuple");
  CHECK_NPY_ERROR(parse(image_with("<u1", "[2]", two)), "list");
  CHECK_NPY_ERROR(parse(image_with("<u1", "2", two)), "a tuple as 'shape'");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(,)", two)), "a dimension");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(1, 2", two)), "expected a dimension");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False, 'shape': (1 2)}", two)),
                  "',' or ')'");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(1, 1, 1)", Bytes(1)), NpyReadLimits{1 << 20, 2, 1 << 20}), "max_dims=2");
  CHECK_NPY_ERROR(parse(image_with("<u1", "(3, 4)", Bytes(12)), NpyReadLimits{10, 8, 1 << 20}),
                  "needs 12 bytes, above the limit max_bytes=10");
}

TEST_CASE("rejects: malformed header dicts") {
  const Bytes one(1);
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False}", one)), "lacks the key 'shape'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'shape': (1,), 'fortran_order': False}", one)), "lacks the key 'descr'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'shape': (1,)}", one)), "lacks the key 'fortran_order'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{}", one)), "lacks the key");
  CHECK_NPY_ERROR(
      parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False, 'shape': (1,), 'descr': '<u1'}", one)),
      "duplicate key 'descr'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False, 'shape': (1,), 'foo': 1}", one)),
                  "unknown key 'foo'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': 1, 'shape': (1,)}", one)), "got '1'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': true, 'shape': (1,)}", one)), "got 'true'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False, 'shape': (1,)} x", one)),
                  "unexpected 'x'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False, 'shape': (1,),, }", one)),
                  "a quoted dict key");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1' 'fortran_order': False, 'shape': (1,)}", one)), "',' or '}'");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'shape': (1,), 'fortran_order': False, 'descr': '<u1", one)),
                  "unterminated string");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<\\u1', 'fortran_order': False, 'shape': (1,)}", one)), "escape");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "{'descr': '<u1', 'fortran_order': False, 'shape': (1,)", one)),
                  "header ends");
  CHECK_NPY_ERROR(parse(make_image(1, 0, "'descr': '<u1'", one)), "'{'");
  CHECK_NPY_ERROR(
      parse(make_image(1, 0, std::string("{'descr': '<u1', 'fortran_order': False, 'shape': (1,)}") + '\0', one)),
      "\\x00");
}

TEST_CASE("rejects: data section disagreeing with the shape") {
  CHECK_NPY_ERROR(parse(image_with("<u2", "(2, 3)", Bytes(10))),
                  "file has 10 data bytes, shape [2, 3] of <u2 needs 12");
  CHECK_NPY_ERROR(parse(image_with("<u2", "(2, 3)", Bytes(13))), "1 trailing byte(s)");
  CHECK_NPY_ERROR(parse(image_with("<u2", "(0,)", Bytes(2))), "2 trailing byte(s)");
  CHECK_NPY_ERROR(parse(image_with("<u2", "()", Bytes{})), "needs 2");
}

TEST_CASE("read_npy and write_npy: file errors name the path") {
  const TempDir dir;
  const auto missing = dir.path / "missing.npy";
  CHECK_NPY_ERROR(foremoe::read_npy(missing), missing.string().c_str());
  CHECK_NPY_ERROR(foremoe::read_npy(missing), "No such file or directory");
  CHECK_NPY_ERROR(foremoe::read_npy(dir.path), "is a folder, not a file");

  const auto no_dir = dir.path / "no_such_dir" / "out.npy";
  const std::uint8_t one = 1;
  CHECK_NPY_ERROR(foremoe::write_npy(no_dir, NpyDtype::of<std::uint8_t>(), Shape{1}, &one), no_dir.string().c_str());
  CHECK_NPY_ERROR(foremoe::write_npy(no_dir, NpyDtype::of<std::uint8_t>(), Shape{1}, &one),
                  "No such file or directory");

  const auto truncated = dir.path / "truncated.npy";
  write_file(truncated, image_with("<u2", "(2, 3)", Bytes(10)));
  CHECK_NPY_ERROR(foremoe::read_npy(truncated), truncated.string().c_str());
  CHECK_NPY_ERROR(foremoe::read_npy(truncated), "file has 10 data bytes");

  // A tiny file claiming 8 GiB (below the 16 GiB default limit) fails on its size, before any allocation.
  const auto liar = dir.path / "liar.npy";
  write_file(liar, image_with("|u1", "(8589934592,)", Bytes(3)));
  CHECK_NPY_ERROR(foremoe::read_npy(liar), "needs 8589934592");
  write_file(liar, image_with("<u2", "(1152921504606846976,)", Bytes(3)));
  CHECK_NPY_ERROR(foremoe::read_npy(liar), "1152921504606846976");

  const auto trailing = dir.path / "trailing.npy";
  write_file(trailing, image_with("<u2", "(2,)", Bytes(5)));
  CHECK_NPY_ERROR(foremoe::read_npy(trailing), "1 trailing byte(s)");

  const auto short_header = dir.path / "short_header.npy";
  write_file(short_header, to_bytes(std::string("\x93NUMPY\x01\x00\xff\x00{'descr'", 17)));
  CHECK_NPY_ERROR(foremoe::read_npy(short_header), "header length 255");
}

TEST_CASE("NpyArray accessors and encode_npy validate their inputs") {
  NpyArray a{NpyDtype::of<std::uint16_t>(), {2, 3}, false, Bytes(11)};
  CHECK_NPY_ERROR(a.as<std::uint16_t>(), "data has 11 bytes");
  CHECK_NPY_ERROR(a.to_c_order(), "needs 12");
  a.shape = {-2, 3};
  CHECK_NPY_ERROR(a.num_elements(), "negative dimension -2");
  a.dtype = NpyDtype{NpyKind::float_, 2};
  CHECK_NPY_ERROR(a.to_doubles(), "item_bytes 2");

  const std::uint8_t byte = 0;
  CHECK_NPY_ERROR(foremoe::encode_npy(NpyDtype{NpyKind::int_, 16}, Shape{1}, &byte), "item_bytes 16");
  CHECK_NPY_ERROR(foremoe::encode_npy(NpyDtype::of<std::uint8_t>(), Shape{-1}, &byte), "-1");
  CHECK_NPY_ERROR(foremoe::encode_npy(NpyDtype::of<std::uint8_t>(), Shape{1}, nullptr), "data is null");
  CHECK_NPY_ERROR(foremoe::encode_npy(NpyDtype::of<std::uint8_t>(), Shape{1}, &byte, false, 4), "version");
  CHECK(foremoe::encode_npy(NpyDtype::of<std::uint8_t>(), Shape{0}, nullptr).size() == 128);
}
