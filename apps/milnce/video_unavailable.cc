// VideoReader and VideoWriter in a build without FFmpeg's development libraries (CMake found no
// libavformat, libavcodec, libswscale and libavutil: apps/milnce/CMakeLists.txt). Raw video is then
// unavailable: opening a reader or a writer says so, naming what to install; everything else works.
#include <fmt/format.h>

#include "milnce/video.h"

namespace milnce {

namespace {
[[noreturn]] void unavailable(const std::string& path) {
  throw dtrain::InvalidArgument(fmt::format(
      "video {}: this milnce was built without FFmpeg's libraries, so it cannot read or write video; install "
      "libavformat-dev libavcodec-dev libswscale-dev libavutil-dev (scripts/setup.sh does) and rebuild",
      path));
}
}  // namespace

struct VideoReader::Impl {};
struct VideoWriter::Impl {};

VideoReader::VideoReader(const std::string& path, std::chrono::milliseconds /*deadline*/) { unavailable(path); }
VideoReader::~VideoReader() = default;
const VideoInfo& VideoReader::info() const { unavailable(""); }
std::vector<uint8_t> VideoReader::readClip(const ClipSpec& /*spec*/, int* /*decoded*/) { unavailable(""); }

VideoWriter::VideoWriter(const std::string& path, int /*width*/, int /*height*/, int /*fps*/) { unavailable(path); }
VideoWriter::~VideoWriter() = default;
void VideoWriter::write(const uint8_t* /*rgb*/) { unavailable(""); }
void VideoWriter::finish() { unavailable(""); }

}  // namespace milnce
