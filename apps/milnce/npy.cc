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

at::Tensor readNpy(const std::string& path) {
  const std::string s = readFile(path);
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
  offset += header_len;

  const std::string descr = npyHeaderValue(path, header, "descr");
  const std::string order = npyHeaderValue(path, header, "fortran_order");
  const std::vector<int64_t> shape = parseShape(path, npyHeaderValue(path, header, "shape"));
  if (order != "True" && order != "False") fail(path, fmt::format("bad .npy fortran_order '{}'", order));
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
