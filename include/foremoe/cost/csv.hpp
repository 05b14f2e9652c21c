#pragma once
/// @file
/// A minimal CSV table reader for the calibration files: header by column name, errors name the line.

#include <charconv>
#include <cstddef>
#include <istream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// One CSV file read whole: the header and the data rows, split on commas (no quoting: the
/// calibration files have none). `line_of(i)` is the 1-based file line of data row `i`.
class CsvTable {
public:
  /// Reads `in`; `source` names the input in messages. Throws `Error` for an empty input or a row whose
  /// field count differs from the header's.
  CsvTable(std::istream &in, std::string source) : source_(std::move(source)) {
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      auto fields = split(line);
      if (header_.empty()) {
        header_ = std::move(fields);
        continue;
      }
      require(fields.size() == header_.size(), source_, ":", lineno, ": expected ", header_.size(), " fields, got ",
              fields.size());
      rows_.push_back(std::move(fields));
      lines_.push_back(lineno);
    }
    require(!header_.empty(), source_, ": empty CSV (no header line)");
  }

  [[nodiscard]] std::size_t size() const noexcept { return rows_.size(); }
  [[nodiscard]] int line_of(std::size_t row) const noexcept { return lines_[row]; }
  [[nodiscard]] const std::string &source() const noexcept { return source_; }

  /// Index of column `name`; throws `Error` naming the column when the header lacks it.
  [[nodiscard]] std::size_t column(std::string_view name) const {
    for (std::size_t i = 0; i < header_.size(); ++i)
      if (header_[i] == name) return i;
    fail(source_, ":1: missing column '", name, "'");
  }

  [[nodiscard]] const std::string &text(std::size_t row, std::size_t col) const { return rows_[row][col]; }

  /// Field as an integer; throws `Error` naming file, line and column on a malformed value.
  [[nodiscard]] long long integer(std::size_t row, std::size_t col) const {
    const std::string &s = rows_[row][col];
    long long v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    require(ec == std::errc{} && p == s.data() + s.size(), source_, ":", lines_[row], ": column '", header_[col],
            "': expected an integer, got '", s, "'");
    return v;
  }

  /// Field as a finite number; throws `Error` naming file, line and column on a malformed value.
  [[nodiscard]] double number(std::size_t row, std::size_t col) const {
    const std::string &s = rows_[row][col];
    std::size_t used = 0;
    double v = 0;
    bool ok = !s.empty();
    if (ok) {
      try {
        v = std::stod(s, &used);
      } catch (const std::exception &) {
        ok = false;
      }
    }
    ok = ok && used == s.size() && v == v && v - v == 0.0;
    require(ok, source_, ":", lines_[row], ": column '", header_[col], "': expected a finite number, got '", s, "'");
    return v;
  }

  /// Throws `Error` "source:line: what" for data row `row`.
  template <class... Parts> [[noreturn]] void fail_at(std::size_t row, Parts &&...parts) const {
    fail(source_, ":", lines_[row], ": ", std::forward<Parts>(parts)...);
  }

private:
  static std::vector<std::string> split(const std::string &line) {
    std::vector<std::string> out;
    std::size_t start = 0;
    for (;;) {
      const std::size_t comma = line.find(',', start);
      std::string f = line.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      while (!f.empty() && (f.back() == ' ' || f.back() == '\t'))
        f.pop_back();
      std::size_t b = 0;
      while (b < f.size() && (f[b] == ' ' || f[b] == '\t'))
        ++b;
      out.push_back(f.substr(b));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return out;
  }

  std::string source_;
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
  std::vector<int> lines_;
};

/// Opens `path` and reads it as a `CsvTable`; throws `Error` naming the path when it cannot be opened.
[[nodiscard]] inline CsvTable read_csv_file(const std::string &path) {
  std::istringstream in(files::read_file(path, files::max_document_bytes, "a CSV file")); // a regular file only
  return CsvTable(in, path);
}

} // namespace detail
} // namespace v0
} // namespace foremoe
