// libFuzzer harness: raw video files as milnce reads them (apps/milnce/video.cc: VideoReader over FFmpeg's
// libavformat, libavcodec and libswscale). The input is one file's bytes; byte 0 also picks the clip
// (start 0-3 s, crop-only or crop-and-scale, flip) so the seek, the frame choice, the conversion and the
// placement into the clip are all reached. Every outcome must be a clip or a dtrain::Error naming the file
// (VideoError for what FFmpeg refuses, InvalidArgument for a crop larger than the video); anything else,
// and any sanitizer report in dtrain's code, is a finding. FFmpeg itself is Debian's (not instrumented;
// OSS-Fuzz fuzzes it): this harness checks what dtrain does with what FFmpeg returns.
#include <chrono>
#include <string>

#include "dtrain/comm/error.h"
#include "milnce/video.h"
#include "../fuzz_util.h"
#include "torch_fuzz_util.h"

namespace fuzz = dtrain::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto dir = fuzz::scratchDir();
  const auto path = dir / "clip.mp4";
  fuzz::writeFile(path, std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  try {
    milnce::VideoReader r(path.string(), std::chrono::seconds(5));
    milnce::ClipSpec c;
    c.start = data[0] & 3;
    c.frames = 4;
    c.fps = (data[0] & 4) ? 5 : 10;
    c.size = 16;
    c.crop_only = (data[0] & 8) == 0;
    c.flip = (data[0] & 16) != 0;
    c.x = (data[0] >> 5) / 7.0;
    c.y = 1 - c.x;
    int decoded = 0;
    const auto clip = r.readClip(c, &decoded);
    if (clip.size() != 3u * 4 * 16 * 16 || decoded < 1 || decoded > 4) fuzz::die("a clip of the wrong size");
  } catch (const dtrain::Error&) {
  } catch (const std::exception& e) {
    fuzz::die(std::string("not a dtrain::Error: ") + e.what());
  }
  return 0;
}
