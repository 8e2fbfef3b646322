// MIL-NCE data: .npy files (data.h), version 1.0, little-endian, C order.
#include "milnce/data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <cstring>
#include <string>

#include "dtrain/comm/error.h"
#include "milnce/data_util.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .npy code assumes a little-endian host");

namespace milnce {
using namespace detail;  // NOLINT(google-build-using-namespace): the data files' shared helpers
using dtrain::InvalidArgument;

namespace {

// ---- .npy ----

struct NpyType {
  const char* descr;
  at::ScalarType type;
  size_t size;
};
constexpr NpyType kNpyTypes[] = {{"<f4", at::kFloat, 4}, {"<f8", at::kDouble, 8}, {"<i4", at::kInt, 4},
                                 {"<i8", at::kLong, 8},  {"|u1", at::kByte, 1},   {"<u1", at::kByte, 1}};

// The value after `'key':` in a .npy header dict, up to the end of the value (a quoted string, a
// parenthesised tuple or a bare word).
std::string npyHeaderValue(const std::string& path, const std::string& header, const std::string& key) {
  size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) k = header.find("\"" + key + "\"");
  if (k == std::string::npos) fail(path, fmt::format("bad .npy header (no '{}'): {}", key, header));
  size_t i = header.find(':', k + key.size() + 2);
  if (i == std::string::npos) fail(path, fmt::format("bad .npy header: {}", header));
  ++i;
  while (i < header.size() && header[i] == ' ') ++i;
  if (i >= header.size()) fail(path, fmt::format("bad .npy header: {}", header));
  size_t j;
  if (header[i] == '\'' || header[i] == '"') {
    j = header.find(header[i], i + 1);
    if (j == std::string::npos) fail(path, fmt::format("bad .npy header: {}", header));
    return header.substr(i + 1, j - i - 1);
  }
  if (header[i] == '(') {
    j = header.find(')', i);
    if (j == std::string::npos) fail(path, fmt::format("bad .npy header: {}", header));
    return header.substr(i + 1, j - i - 1);
  }
  j = i;
  while (j < header.size() && header[j] != ',' && header[j] != '}' && header[j] != ' ') ++j;
  return header.substr(i, j - i);
}

std::vector<int64_t> parseShape(const std::string& path, const std::string& tuple) {
  std::vector<int64_t> shape;
  size_t i = 0;
  while (i < tuple.size()) {
    while (i < tuple.size() && (tuple[i] == ' ' || tuple[i] == ',')) ++i;
    if (i >= tuple.size()) break;
    size_t j = i;
    while (j < tuple.size() && std::isdigit(static_cast<unsigned char>(tuple[j]))) ++j;
    if (j == i || j - i > 15) fail(path, fmt::format("bad .npy shape ({})", tuple));
    shape.push_back(std::stoll(tuple.substr(i, j - i)));
    i = j;
    while (i < tuple.size() && tuple[i] == ' ') ++i;
    if (i < tuple.size() && tuple[i] != ',') fail(path, fmt::format("bad .npy shape ({})", tuple));
  }
  return shape;
}

}  // namespace

// ---- .npy ----

namespace {

// A .npy file's header: its dtype, order and shape, and where its data starts.
struct NpyHeader {
  std::string descr, order;
  std::vector<int64_t> shape;
  size_t offset = 0;
};

NpyHeader readNpyHeader(const std::string& path, const std::string& s) {
  if (s.size() < 10 || s.compare(0, 6, "\x93NUMPY") != 0) fail(path, "not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(s[6]);
  size_t header_len, offset;
  if (major == 1) {
    header_len = static_cast<unsigned char>(s[8]) | static_cast<size_t>(static_cast<unsigned char>(s[9])) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (s.size() < 12) fail(path, "truncated .npy header");
    header_len = 0;
    for (int i = 3; i >= 0; --i) header_len = header_len << 8 | static_cast<unsigned char>(s[8 + i]);
    offset = 12;
  } else {
    fail(path, fmt::format("unsupported .npy format version {}.{}", major, static_cast<int>(s[7])));
  }
  if (s.size() < offset + header_len) fail(path, "truncated .npy header");
  const std::string header = s.substr(offset, header_len);
  NpyHeader h;
  h.offset = offset + header_len;
  h.descr = npyHeaderValue(path, header, "descr");
  h.order = npyHeaderValue(path, header, "fortran_order");
  h.shape = parseShape(path, npyHeaderValue(path, header, "shape"));
  if (h.order != "True" && h.order != "False") fail(path, fmt::format("bad .npy fortran_order '{}'", h.order));
  return h;
}

// Appends code point c as UTF-8.
void appendUtf8(std::string& out, uint32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xc0 | c >> 6);
    out += static_cast<char>(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xe0 | c >> 12);
    out += static_cast<char>(0x80 | (c >> 6 & 0x3f));
    out += static_cast<char>(0x80 | (c & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | c >> 18);
    out += static_cast<char>(0x80 | (c >> 12 & 0x3f));
    out += static_cast<char>(0x80 | (c >> 6 & 0x3f));
    out += static_cast<char>(0x80 | (c & 0x3f));
  }
}

}  // namespace

std::vector<std::string> readNpyStrings(const std::string& path) {
  const std::string s = readFile(path);
  const NpyHeader h = readNpyHeader(path, s);
  if (h.shape.size() != 1) fail(path, fmt::format("want a 1-d array of strings, got shape ({})", fmt::join(h.shape, ", ")));
  // '<U8': 8 UTF-32LE code units per string; '|S8': 8 bytes. Both are padded with NULs.
  const bool unicode = h.descr.size() > 2 && (h.descr[0] == '<' || h.descr[0] == '|' || h.descr[0] == '=') &&
                       h.descr[1] == 'U';
  const bool bytes = h.descr.size() > 2 && h.descr[0] == '|' && h.descr[1] == 'S';
  if (!unicode && !bytes)
    fail(path, fmt::format("unsupported dtype '{}' for strings (want numpy's fixed-width '<U' or '|S'{})", h.descr,
                           h.descr == "|O" ? "; this array holds Python objects (pickled): save it with "
                                             "np.save(path, np.array(words, dtype=str))"
                                           : ""));
  int64_t width = 0;
  try {
    width = std::stoll(h.descr.substr(2));
  } catch (const std::exception&) {
    fail(path, fmt::format("bad string dtype '{}'", h.descr));
  }
  const int64_t unit = unicode ? 4 : 1;
  if (width < 1 || width > (1 << 20)) fail(path, fmt::format("bad string dtype '{}'", h.descr));
  const int64_t n = h.shape[0];
  if (n < 0 || n > std::numeric_limits<int64_t>::max() / width / unit ||
      s.size() - h.offset != static_cast<size_t>(n * width * unit))
    fail(path, fmt::format(".npy data is {} bytes, {} strings of {} need {}", s.size() - h.offset, n, h.descr,
                           n * width * unit));
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(n));
  const char* p = s.data() + h.offset;
  for (int64_t i = 0; i < n; ++i, p += width * unit) {
    std::string w;
    for (int64_t k = 0; k < width; ++k) {
      uint32_t c = 0;
      if (unicode) std::memcpy(&c, p + 4 * k, 4);
      else c = static_cast<unsigned char>(p[k]);
      if (c == 0) break;
      if (unicode && (c > 0x10ffff || (c >= 0xd800 && c < 0xe000)))
        fail(path, fmt::format("string {} holds an invalid code point U+{:X}", i, c));
      appendUtf8(w, c);
    }
    out.push_back(std::move(w));
  }
  return out;
}

at::Tensor readNpy(const std::string& path) {
  const std::string s = readFile(path);
  const NpyHeader h = readNpyHeader(path, s);
  const std::string& descr = h.descr;
  const std::string& order = h.order;
  const std::vector<int64_t>& shape = h.shape;
  size_t offset = h.offset;
  const NpyType* type = nullptr;
  for (const auto& t : kNpyTypes)
    if (descr == t.descr) type = &t;
  if (!type) fail(path, fmt::format("unsupported .npy dtype '{}' (want <f4 <f8 <i4 <i8 |u1)", descr));

  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d != 0 && numel > std::numeric_limits<int64_t>::max() / d / 8) fail(path, "bad .npy shape (too large)");
    numel *= d;
  }
  const size_t bytes = static_cast<size_t>(numel) * type->size;
  if (s.size() - offset != bytes)
    fail(path, fmt::format(".npy data is {} bytes, shape ({}) of {} needs {}", s.size() - offset,
                           fmt::join(shape, ", "), descr, bytes));

  const bool fortran = order == "True";
  std::vector<int64_t> stored = shape;  // Fortran order: the transpose is C-ordered
  if (fortran) std::reverse(stored.begin(), stored.end());
  at::Tensor t = at::empty(stored, at::TensorOptions().dtype(type->type));
  if (bytes) std::memcpy(t.data_ptr(), s.data() + offset, bytes);
  if (fortran && t.dim() > 1) {
    std::vector<int64_t> perm(static_cast<size_t>(t.dim()));
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(perm.size() - 1 - i);
    t = t.permute(perm).contiguous();
  }
  return t;
}

void writeNpy(const std::string& path, const at::Tensor& tensor) {
  const NpyType* type = nullptr;
  for (const auto& t : kNpyTypes)
    if (tensor.scalar_type() == t.type) {
      type = &t;
      break;
    }
  if (!type) throw InvalidArgument(fmt::format("milnce: writeNpy {}: unsupported dtype {}", path, typeStr(tensor.scalar_type())));
  const at::Tensor t = tensor.cpu().contiguous();
  std::string shape;
  for (int64_t d : t.sizes()) shape += fmt::format("{}, ", d);
  if (t.dim() > 1) shape.resize(shape.size() - 2);  // (3, 4); a 1-d shape keeps its comma: (3,)
  else if (t.dim() == 1) shape.resize(shape.size() - 1);
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", type->descr, shape);
  // Pad with spaces and a newline so that the data starts at a multiple of 64 bytes, as numpy does.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  out += header;
  out.append(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * type->size);
  writeFile(path, out);
}

}  // namespace milnce
