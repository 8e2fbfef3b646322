// The layout of a zip archive as torch.save and torch::pickle_save write it, and of the pickle inside it
// (internal), checked before libtorch's readers see the bytes: they trust the sizes the bytes claim (a
// damaged 8 KB checkpoint made libtorch 1.13's unpickler reserve 1.6 GB for one string), so every entry
// must lie inside the file and every length in the pickle inside its entry first.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::detail {

struct ZipEntry {
  std::string name;
  uint64_t offset = 0;  // of its data in the archive
  uint64_t size = 0;
};

// "" when the archive's end record, its central directory (zip64 included) and every entry's local
// header and data lie inside the `size` bytes at `data`, no entry is encrypted or patched (general-purpose
// flags other than PyTorch's), and every entry is stored (not compressed) with
// equal compressed and uncompressed sizes, as PyTorch writes them, and matches its CRC-32; otherwise what is wrong, for an error
// message ("its zip archive has no end record (the file was cut short)", "entry 'archive/data/0' claims
// 2147483648 bytes at offset 4096, past the central directory at 8011", ...).
// `entries`, when given, receives every entry (after a "" answer).
std::string zipLayoutProblem(const char* data, size_t size, std::vector<ZipEntry>* entries = nullptr);

// "" when every length-prefixed argument of the pickle opcodes in the `size` bytes at `data` (strings,
// bytes, long integers, frames) fits in what follows it, every line argument ends and every memo index
// follows the ones before (0, 1, 2, ...: libtorch reserves memory by it); otherwise what is
// wrong ("a string of 1660944394 bytes at offset 120, with 7800 bytes left"). It reads opcodes up to STOP
// or the first opcode it does not know, and judges nothing else (the unpickler does).
std::string pickleLengthProblem(const char* data, size_t size);

// pickleLengthProblem's walk, calling `each` (when set) with every opcode read whole, STOP included: its
// byte and where it and its argument start and end.
std::string walkPickle(const char* data, size_t size,
                       const std::function<void(unsigned char op, uint64_t start, uint64_t end)>& each);

}  // namespace dtrain::detail
