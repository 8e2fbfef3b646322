// Video files through FFmpeg's libraries (libavformat, libavcodec, libswscale): VideoReader decodes clips
// the way the MIL-NCE reference's loader asks ffmpeg for them (seek, fps, crop or crop-and-scale,
// horizontal flip, rgb24), VideoWriter encodes frames into an mp4 (for `milnce gen-video`).
// No libtorch here: a clip is plain bytes.
//
// \code
//   milnce::VideoReader r("videos/v000001.mp4");        // VideoError naming the file if it will not open
//   milnce::ClipSpec c;
//   c.start = 3.0;  c.frames = 16;  c.fps = 10;  c.size = 64;   // crop_only, x/y in [0, 1), flip
//   std::vector<uint8_t> clip = r.readClip(c);          // [3, frames, size, size], zeros past the end
// \endcode
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/error.h"

namespace milnce {

// A video that cannot be opened or decoded (missing, not a video, corrupt, truncated, too small for the
// crop, over its deadline). The message names the file and what failed.
class VideoError : public dtrain::Error {
 public:
  using dtrain::Error::Error;
};

struct VideoInfo {
  int width = 0, height = 0;
  double duration = 0;   // seconds (the container's, else the stream's)
  double frame_rate = 0;  // the stream's average frame rate
  std::string codec;
};

// One clip, as the reference's HT100M_DataLoader._get_video asks ffmpeg for it:
//   ffmpeg -ss start -t frames/fps+0.1 -i FILE -vf fps=F,crop[,scale][,hflip] -pix_fmt rgb24
// Output frame k (k < frames) shows the last decoded frame whose time is <= start + k / fps (the first
// frame when the clip starts before it); frames past the end of the video are zeros, as the reference
// pads them.
struct ClipSpec {
  double start = 0;  // seconds
  int frames = 16;
  double fps = 10;
  int size = 64;     // the clip is size x size
  // true: a size x size window at ((W - size) * x, (H - size) * y), floored (the reference's crop_only);
  // false: the largest centred-by-(x, y) square, min(W, H) on a side, scaled to size x size (bilinear).
  bool crop_only = true;
  double x = 0.5, y = 0.5;  // in [0, 1]: 0.5 is the centre crop of evaluation
  bool flip = false;        // horizontal flip
};

class VideoReader {
 public:
  // Opens `path` (a regular file) and its best video stream's decoder (one thread). Every FFmpeg call
  // after this is bounded by `deadline` per readClip (an interrupt callback): a damaged file fails
  // rather than stalls. VideoError naming the file on failure.
  explicit VideoReader(const std::string& path, std::chrono::milliseconds deadline = std::chrono::seconds(30));
  ~VideoReader();
  VideoReader(const VideoReader&) = delete;
  VideoReader& operator=(const VideoReader&) = delete;

  const VideoInfo& info() const;
  // The clip, uint8 [3, frames, size, size] (channel-major, as the reference permutes it); `decoded`, when
  // given, receives how many output frames came from the video (the rest are zeros). VideoError on a
  // decoding failure or when no frame at all could be decoded; InvalidArgument on a bad spec (or a
  // crop_only window larger than the video).
  std::vector<uint8_t> readClip(const ClipSpec& spec, int* decoded = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Encodes rgb24 frames of width x height (even) at `fps` into an mp4 (MPEG-4 part 2, yuv420p, a key frame
// every second so a seek lands near its target). VideoError naming the file on failure.
class VideoWriter {
 public:
  VideoWriter(const std::string& path, int width, int height, int fps);
  ~VideoWriter();  // finishes the file if finish() was not called (errors then are lost: call finish())
  VideoWriter(const VideoWriter&) = delete;
  VideoWriter& operator=(const VideoWriter&) = delete;
  void write(const uint8_t* rgb);  // one frame, height rows of width * 3 bytes
  void finish();                   // flushes the encoder and writes the trailer

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace milnce
