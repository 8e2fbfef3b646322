// Checks a zip archive's layout (see zip_layout.h): the end of central directory record (and its zip64
// form), each central directory header, each local header, each entry's data range. No libtorch here.
#include "zip_layout.h"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace dtrain::detail {

namespace {

constexpr uint32_t kEndSig = 0x06054b50, kEnd64Sig = 0x06064b50, kLocatorSig = 0x07064b50;
constexpr uint32_t kCentralSig = 0x02014b50, kLocalSig = 0x04034b50;
constexpr size_t kEndBytes = 22, kLocatorBytes = 20, kEnd64Bytes = 56, kCentralBytes = 46, kLocalBytes = 30;

// Little-endian fields at an offset the caller checked.
uint64_t le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(p[i]);
  return v;
}

struct Reader {
  const char* data;
  size_t size;
  bool has(uint64_t at, uint64_t n) const { return at <= size && n <= size - at; }
  uint64_t u(uint64_t at, int bytes) const { return le(data + at, bytes); }
};

// The central directory's offset, size and entry count, or a problem.
std::string directory(const Reader& z, uint64_t& offset, uint64_t& bytes, uint64_t& entries) {
  // The end record is within the last 64 KiB + 22 bytes (its comment is at most 65535 bytes).
  size_t end = std::string::npos;
  const size_t lowest = z.size > 65535 + kEndBytes ? z.size - 65535 - kEndBytes : 0;
  for (size_t at = z.size >= kEndBytes ? z.size - kEndBytes + 1 : 0; at-- > lowest;) {
    if (z.u(at, 4) == kEndSig) {
      end = at;
      break;
    }
  }
  if (end == std::string::npos) return "its zip archive has no end record (the file was cut short)";
  // PyTorch writes the archive alone: the end record (no comment) ends the file, and the central directory
  // ends where the zip64 end record (when there is one) or the end record begins. Bytes around them would
  // be read by libtorch's zip reader as it sees fit (a read past the buffer, found by fuzzing).
  if (end + kEndBytes + z.u(end + 20, 2) != z.size)
    return fmt::format("its zip archive's end record (at offset {}) is not at the end of the file ({} bytes)", end,
                       z.size);
  entries = z.u(end + 10, 2);
  bytes = z.u(end + 12, 4);
  offset = z.u(end + 16, 4);
  uint64_t directory_end = end;
  const bool zip64 = end >= kLocatorBytes && z.u(end - kLocatorBytes, 4) == kLocatorSig;
  if (zip64) {  // the locator precedes the end record and points at the zip64 end record
    const uint64_t at = z.u(end - kLocatorBytes + 8, 8);
    if (at > end - kLocatorBytes || end - kLocatorBytes - at < kEnd64Bytes || z.u(at, 4) != kEnd64Sig)
      return fmt::format("its zip64 end record (at offset {}) is missing or damaged", at);
    entries = z.u(at + 32, 8);
    bytes = z.u(at + 40, 8);
    offset = z.u(at + 48, 8);
    directory_end = at;
  } else if (entries == 0xffff || bytes == 0xffffffff || offset == 0xffffffff) {
    return "its zip archive's end record asks for a zip64 record that is not there";
  }
  if (!z.has(offset, bytes) || offset + bytes != directory_end)
    return fmt::format("its zip central directory ({} bytes at offset {}) does not end where its end record begins "
                       "({})",
                       bytes, offset, directory_end);
  if (entries > bytes / kCentralBytes)
    return fmt::format("its zip archive claims {} entries in a central directory of {} bytes", entries, bytes);
  return "";
}

}  // namespace

std::string zipLayoutProblem(const char* data, size_t size, std::vector<ZipEntry>* out) {
  const Reader z{data, size};
  uint64_t dir_offset = 0, dir_bytes = 0, entries = 0;
  std::string problem = directory(z, dir_offset, dir_bytes, entries);
  if (!problem.empty()) return problem;
  uint64_t at = dir_offset;
  for (uint64_t i = 0; i < entries; ++i) {
    if (!z.has(at, kCentralBytes) || at + kCentralBytes > dir_offset + dir_bytes || z.u(at, 4) != kCentralSig)
      return fmt::format("its zip central directory is damaged at entry {} (offset {})", i, at);
    const uint64_t method = z.u(at + 10, 2), name_len = z.u(at + 28, 2), extra_len = z.u(at + 30, 2),
                   comment_len = z.u(at + 32, 2);
    uint64_t csize = z.u(at + 20, 4), usize = z.u(at + 24, 4), local = z.u(at + 42, 4);
    const uint64_t next = at + kCentralBytes + name_len + extra_len + comment_len;
    if (next > dir_offset + dir_bytes) return fmt::format("its zip central directory is damaged at entry {}", i);
    const std::string name(data + at + kCentralBytes, name_len);
    // zip64 sizes and offset: in the extra field (id 1), in this order, for the fields that say 0xffffffff.
    for (uint64_t e = at + kCentralBytes + name_len; e + 4 <= at + kCentralBytes + name_len + extra_len;) {
      const uint64_t id = z.u(e, 2), len = z.u(e + 2, 2);
      uint64_t f = e + 4;
      if (id == 1) {
        for (uint64_t* field : {&usize, &csize, &local}) {
          if (*field != 0xffffffff) continue;
          if (f + 8 > e + 4 + len || f + 8 > next) return fmt::format("its zip entry '{}' has a short zip64 field", name);
          *field = z.u(f, 8);
          f += 8;
        }
      }
      e += 4 + len;
    }
    // PyTorch's writer sets bits 3 (sizes in a data descriptor) and 11 (UTF-8 names); 1-2 only qualify a
    // compression method. Encrypted (0, 6), patched (5) or masked (13) entries make libtorch's reader fail
    // in its constructor, where libtorch 1.13 leaks its zip reader (found by fuzzing): refused here first.
    const uint64_t flags = z.u(at + 8, 2);
    if (flags & ~uint64_t{0x080E})
      return fmt::format("its zip entry '{}' uses zip features PyTorch does not write (flags {:#06x}: encrypted or "
                         "patched data)", name, flags);
    if (method != 0 || csize != usize)
      return fmt::format("its zip entry '{}' is compressed (method {}, {} bytes for {}); PyTorch stores entries as they are",
                         name, method, csize, usize);
    const auto crc = static_cast<uint32_t>(z.u(at + 16, 4));
    if (!z.has(local, kLocalBytes) || z.u(local, 4) != kLocalSig)
      return fmt::format("its zip entry '{}' has no local header at offset {}", name, local);
    const uint64_t start = local + kLocalBytes + z.u(local + 26, 2) + z.u(local + 28, 2);
    if (start > dir_offset || csize > dir_offset - start)
      return fmt::format("its zip entry '{}' claims {} bytes at offset {}, past the central directory at {} (the "
                         "file was cut or changed)",
                         name, csize, start, dir_offset);
    // libtorch's reader checks it too, but only as it reads each record, and libtorch 1.13 then leaked its
    // zip reader (found by fuzzing): every entry's CRC-32 is checked before libtorch reads any.
    uint64_t computed = ::crc32(0L, Z_NULL, 0);
    for (uint64_t done = 0; done < csize;) {
      const auto n = static_cast<uInt>(std::min<uint64_t>(csize - done, 1u << 30));
      computed = ::crc32(computed, reinterpret_cast<const Bytef*>(data + start + done), n);
      done += n;
    }
    if (computed != crc)
      return fmt::format("its zip entry '{}' fails its CRC-32 check (stored {:08x}, computed {:08x}): the file "
                         "changed on disk or in transit",
                         name, crc, computed);
    if (out) out->push_back({name, start, csize});
    at = next;
  }
  return "";
}

std::string pickleLengthProblem(const char* data, size_t size) { return walkPickle(data, size, nullptr); }

std::string walkPickle(const char* data, size_t size,
                       const std::function<void(unsigned char op, uint64_t start, uint64_t end)>& each) {
  const Reader p{data, size};
  // Per opcode: the bytes of its fixed argument, or of the length before its payload (negative: a signed
  // length), or 'l' for an argument ending with a newline ('2': two of them).
  struct Arg {
    int fixed = 0, length = 0;
    char line = 0;
  };
  Arg args[256];
  bool known[256] = {};
  auto set = [&](unsigned char op, Arg a) { args[op] = a, known[op] = true; };
  static const unsigned char kNoArgument[] = {'(', '.', '0', '1', '2', 'N', 'Q', 'R', 'a', 'b', 'd', '}', 'e', 'l',
                                             ']', 'o', 's', 't', ')', 'u', 0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8f,
                                             0x90, 0x91, 0x92, 0x93, 0x94, 0x97, 0x98};
  static const unsigned char kLine[] = {'F', 'I', 'L', 'P', 'S', 'V', 'g', 'p'};
  for (unsigned char op : kNoArgument) set(op, {});
  for (unsigned char op : kLine) set(op, {0, 0, 'l'});
  for (unsigned char op : {'c', 'i'}) set(op, {0, 0, '2'});
  for (auto [op, n] : {std::pair<unsigned char, int>{'J', 4}, {'K', 1}, {'M', 2}, {'h', 1}, {'j', 4}, {'q', 1}, {'r', 4},
                       {'G', 8}, {0x80, 1}, {0x82, 1}, {0x83, 2}, {0x84, 4}})
    set(op, {n, 0, 0});
  for (auto [op, n] : {std::pair<unsigned char, int>{'T', -4}, {'U', 1}, {'X', 4}, {0x8a, 1}, {0x8b, -4}, {'B', 4},
                       {'C', 1}, {0x8c, 1}, {0x8d, 8}, {0x8e, 8}, {0x95, 8}, {0x96, 8}})
    set(op, {0, n, 0});
  uint64_t memo = 0;  // memo entries so far: picklers number them 0, 1, 2, ...
  uint64_t start = 0;  // the opcode before `at`, reported to `each` once its argument is read
  auto done = [&](uint64_t end) {
    if (each) each(static_cast<unsigned char>(data[start]), start, end);
  };
  for (uint64_t at = 0; at < size;) {
    const auto op = static_cast<unsigned char>(data[at]);
    start = at;
    if (!known[op] || op == '.') {
      if (op == '.') done(at + 1);
      return "";
    }
    const Arg a = args[op];
    ++at;
    if (op == 'p' || op == 0x94) ++memo;  // PUT (its index on a line), MEMOIZE
    if (a.line) {
      for (int lines = a.line == '2' ? 2 : 1; lines > 0; --lines) {
        const void* nl = std::memchr(data + at, '\n', size - at);
        if (!nl) return fmt::format("its pickle's opcode {:#04x} at offset {} has no end of line", op, at - 1);
        at = static_cast<uint64_t>(static_cast<const char*>(nl) - data) + 1;
      }
      done(at);
      continue;
    }
    const int n = a.fixed ? a.fixed : a.length < 0 ? -a.length : a.length;
    if (!p.has(at, static_cast<uint64_t>(n)))
      return fmt::format("its pickle ends inside opcode {:#04x} at offset {}", op, at - 1);
    uint64_t len = p.u(at, n);
    at += static_cast<uint64_t>(n);
    // BINPUT, LONG_BINPUT: libtorch's unpickler reserves room up to twice the index (a 4-byte index asked
    // it for 30 GB, found by fuzzing); an index past the entries so far is no pickler's.
    if (op == 'q' || op == 'r') {
      if (len > memo)
        return fmt::format("its pickle memoizes at index {} after {} entries (offset {})", len, memo, at - n - 1);
      ++memo;
    }
    if (a.fixed || op == 0x95) {  // a frame's length covers the opcodes that follow: read them
      done(at);
      continue;
    }
    if (a.length < 0 && (len & 0x80000000u)) return fmt::format("its pickle has a negative length at offset {}", at - n - 1);
    if (!p.has(at, len))
      return fmt::format("its pickle claims {} bytes for opcode {:#04x} at offset {}, with {} bytes left", len, op,
                         at - n - 1, size - at);
    at += len;
    done(at);
  }
  return "";
}

}  // namespace dtrain::detail
