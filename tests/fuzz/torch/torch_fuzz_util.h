// Shared by the torch layer's libFuzzer harnesses (tests/fuzz/torch): a scratch directory of this process
// for the decoders that read files, and the input split into parts.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace dtrain::fuzz {

// The separator of the parts of an input (inputs of several files or messages); seeds are written so.
inline const std::string kPartSeparator("\n\0--part--\0\n", 12);

// The input cut at every kPartSeparator.
inline std::vector<std::string> splitParts(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t at = 0;
  for (;;) {
    const size_t next = s.find(kPartSeparator, at);
    if (next == std::string::npos) {
      parts.push_back(s.substr(at));
      return parts;
    }
    parts.push_back(s.substr(at, next - at));
    at = next + kPartSeparator.size();
  }
}

inline std::string joinParts(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? kPartSeparator : std::string()) + parts[i];
  return out;
}

// An empty directory of this process's own (the same one on every call; emptied each time), in /dev/shm
// where it exists: the harnesses write files for every input.
inline std::filesystem::path scratchDir() {
  static const std::filesystem::path base = [] {
    const char* shm = "/dev/shm";
    std::string tmpl = std::string(std::filesystem::is_directory(shm) ? shm : "/tmp") + "/dtrain-fuzz-XXXXXX";
    if (!::mkdtemp(tmpl.data())) std::abort();
    return std::filesystem::path(tmpl);
  }();
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(base, ec)) std::filesystem::remove_all(e.path(), ec);
  return base;
}

inline void writeFile(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace dtrain::fuzz
