// MIL-NCE data: CSV files (data.h), read with the line of every row kept for error messages.
#include "milnce/data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)

#include <string>
#include <vector>

#include "dtrain/comm/error.h"
#include "milnce/data_util.h"

namespace milnce {
using namespace detail;  // NOLINT(google-build-using-namespace): the data files' shared helpers
using dtrain::InvalidArgument;

// ---- CSV ----

size_t CsvTable::column(const std::string& name) const {
  for (size_t i = 0; i < header.size(); ++i)
    if (header[i] == name) return i;
  fail(path, fmt::format("no column '{}' in header ({})", name, fmt::join(header, ",")));
}

CsvTable readCsv(const std::string& path) {
  std::string s = readFile(path);
  if (s.compare(0, 3, "\xEF\xBB\xBF") == 0) s.erase(0, 3);  // UTF-8 byte order mark
  CsvTable t;
  t.path = path;

  enum State { kFieldStart, kUnquoted, kQuoted, kAfterQuote } state = kFieldStart;
  std::vector<std::string> fields;
  std::string field;
  int64_t line = 1, row_line = 1;
  bool row_content = false;  // anything but an empty line so far
  bool have_header = false;

  auto endRow = [&] {
    if (row_content) {
      fields.push_back(std::move(field));
      if (!have_header) {
        t.header = std::move(fields);
        have_header = true;
      } else {
        if (fields.size() != t.header.size())
          failAt(path, row_line,
                 fmt::format("{} fields, expected {} (header: {})", fields.size(), t.header.size(),
                             fmt::join(t.header, ",")));
        t.rows.push_back(std::move(fields));
        t.lines.push_back(row_line);
      }
    }
    fields.clear();
    field.clear();
    row_content = false;
    state = kFieldStart;
  };

  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (!row_content && state == kFieldStart && fields.empty()) row_line = line;
    const bool eol = c == '\n' || c == '\r';
    switch (state) {
      case kQuoted:
        if (c == '"') {
          if (i + 1 < s.size() && s[i + 1] == '"') {
            field += '"';
            ++i;
          } else {
            state = kAfterQuote;
          }
        } else {
          field += c;
          if (c == '\n' || (c == '\r' && !(i + 1 < s.size() && s[i + 1] == '\n'))) ++line;
        }
        continue;
      case kAfterQuote:
        if (c != ',' && !eol)
          failAt(path, line, fmt::format("unexpected '{}' after a closing quote", c));
        break;
      default:
        break;
    }
    if (eol) {
      if (c == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
      endRow();
      ++line;
    } else if (c == ',') {
      fields.push_back(std::move(field));
      field.clear();
      row_content = true;
      state = kFieldStart;
    } else if (c == '"' && state == kFieldStart) {
      row_content = true;
      state = kQuoted;
    } else {
      field += c;  // a quote inside an unquoted field is literal, as in Python's csv
      row_content = true;
      state = kUnquoted;
    }
  }
  if (state == kQuoted) failAt(path, row_line, "unterminated quoted field");
  endRow();
  if (t.header.empty()) fail(path, "empty file (no header)");
  return t;
}

void writeCsv(const std::string& path, const std::vector<std::string>& header,
              const std::vector<std::vector<std::string>>& rows) {
  std::string out;
  auto put = [&out](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size(); ++i) {
      const std::string& f = row[i];
      if (i) out += ',';
      if (f.find_first_of(",\"\r\n") != std::string::npos || (row.size() == 1 && f.empty())) {
        out += '"';
        for (char c : f) out += c == '"' ? std::string("\"\"") : std::string(1, c);
        out += '"';
      } else {
        out += f;
      }
    }
    out += '\n';
  };
  put(header);
  for (const auto& r : rows) {
    if (r.size() != header.size())
      throw InvalidArgument(fmt::format("milnce: writeCsv {}: a row has {} fields, the header {}", path, r.size(),
                                        header.size()));
    put(r);
  }
  writeFile(path, out);
}

}  // namespace milnce
