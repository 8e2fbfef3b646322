// VideoReader and VideoWriter over FFmpeg's libraries (see video.h).
#include "milnce/video.h"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/imgutils.h>
#include <libavutil/log.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace milnce {

namespace {

using Clock = std::chrono::steady_clock;

std::string averror(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(code, buf, sizeof buf);
  return buf;
}

struct FormatCloser {
  void operator()(AVFormatContext* c) const { avformat_close_input(&c); }
};
struct CodecCloser {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct FrameCloser {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct PacketCloser {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsCloser {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};
using FramePtr = std::unique_ptr<AVFrame, FrameCloser>;
using PacketPtr = std::unique_ptr<AVPacket, PacketCloser>;

}  // namespace

struct VideoReader::Impl {
  std::string path;
  std::chrono::milliseconds patience;
  Clock::time_point deadline = Clock::time_point::max();
  std::unique_ptr<AVFormatContext, FormatCloser> fmt;
  std::unique_ptr<AVCodecContext, CodecCloser> codec;
  int stream = -1;
  AVRational time_base{1, 1};
  double start_time = 0;  // the stream's first timestamp, seconds
  VideoInfo info;
  FramePtr frame{av_frame_alloc()};
  PacketPtr packet{av_packet_alloc()};
  // The last decoded frame as rgb24 at the video's size, and the swscale contexts (kept between clips).
  std::vector<uint8_t> rgb;
  int stride = 0;  // of a row of rgb
  std::unique_ptr<SwsContext, SwsCloser> to_rgb, scale;

  [[noreturn]] void fail(const std::string& what) const { throw VideoError(fmt::format("video {}: {}", path, what)); }

  static int interrupt(void* self) { return Clock::now() > static_cast<Impl*>(self)->deadline ? 1 : 0; }

  void open() {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) fail(fmt::format("cannot open: {}", std::strerror(errno)));
    if (!S_ISREG(st.st_mode)) fail("not a regular file");
    AVFormatContext* raw = avformat_alloc_context();
    if (!raw) fail("out of memory");
    raw->interrupt_callback = {&Impl::interrupt, this};
    deadline = Clock::now() + patience;
    int rc = avformat_open_input(&raw, path.c_str(), nullptr, nullptr);  // frees raw on failure
    if (rc < 0) fail(fmt::format("cannot open as a video: {}", averror(rc)));
    fmt.reset(raw);
    if ((rc = avformat_find_stream_info(raw, nullptr)) < 0) fail(fmt::format("no stream information: {}", averror(rc)));
    const AVCodec* dec = nullptr;
    stream = av_find_best_stream(raw, AVMEDIA_TYPE_VIDEO, -1, -1, &dec, 0);
    if (stream < 0 || !dec) fail("no video stream with a decoder");
    AVStream* s = raw->streams[stream];
    codec.reset(avcodec_alloc_context3(dec));
    if (!codec) fail("out of memory");
    if ((rc = avcodec_parameters_to_context(codec.get(), s->codecpar)) < 0) fail(fmt::format("codec parameters: {}", averror(rc)));
    codec->thread_count = 1;  // one compute thread per loader thread
    if ((rc = avcodec_open2(codec.get(), dec, nullptr)) < 0) fail(fmt::format("cannot open the {} decoder: {}", dec->name, averror(rc)));
    if (codec->width <= 0 || codec->height <= 0) fail("the video stream has no frame size");
    time_base = s->time_base;
    start_time = s->start_time == AV_NOPTS_VALUE ? 0 : static_cast<double>(s->start_time) * av_q2d(time_base);
    info.width = codec->width;
    info.height = codec->height;
    info.codec = dec->name;
    info.frame_rate = s->avg_frame_rate.den ? av_q2d(s->avg_frame_rate) : 0;
    if (raw->duration > 0) info.duration = static_cast<double>(raw->duration) / AV_TIME_BASE;
    else if (s->duration > 0) info.duration = static_cast<double>(s->duration) * av_q2d(time_base);
    if (!(info.duration > 0)) fail("unknown duration");
  }

  // Seeks to the key frame at or before `t` seconds.
  void seek(double t) {
    const auto ts = static_cast<int64_t>(std::floor((t + start_time) / av_q2d(time_base)));
    int rc = av_seek_frame(fmt.get(), stream, ts, AVSEEK_FLAG_BACKWARD);
    if (rc < 0) rc = av_seek_frame(fmt.get(), stream, 0, AVSEEK_FLAG_BACKWARD);
    if (rc < 0) fail(fmt::format("cannot seek to {:.2f} s: {}", t, averror(rc)));
    avcodec_flush_buffers(codec.get());
  }

  // The next decoded frame (its time in seconds from the video's start), or false at the end of the
  // stream. VideoError on a decoding error or past the deadline.
  bool nextFrame(double& time) {
    for (;;) {
      int rc = avcodec_receive_frame(codec.get(), frame.get());
      if (rc == 0) {
        const int64_t pts = frame->best_effort_timestamp != AV_NOPTS_VALUE ? frame->best_effort_timestamp : frame->pts;
        time = pts == AV_NOPTS_VALUE ? 0 : static_cast<double>(pts) * av_q2d(time_base) - start_time;
        return true;
      }
      if (rc == AVERROR_EOF) return false;
      if (rc != AVERROR(EAGAIN)) fail(fmt::format("decoding: {}", averror(rc)));
      if (Clock::now() > deadline) fail(fmt::format("decoding took longer than {} ms", patience.count()));
      rc = av_read_frame(fmt.get(), packet.get());
      if (rc == AVERROR_EOF) {
        avcodec_send_packet(codec.get(), nullptr);  // drain
        continue;
      }
      if (rc < 0) fail(fmt::format("reading: {}", averror(rc)));
      if (packet->stream_index == stream) {
        rc = avcodec_send_packet(codec.get(), packet.get());
        av_packet_unref(packet.get());
        if (rc < 0 && rc != AVERROR(EAGAIN) && rc != AVERROR_EOF) fail(fmt::format("decoding: {}", averror(rc)));
      } else {
        av_packet_unref(packet.get());
      }
    }
  }

  // f -> rgb (the video's size).
  void convert(const AVFrame* f) {
    if (f->width != info.width || f->height != info.height)
      fail(fmt::format("a frame of {}x{} in a video of {}x{}", f->width, f->height, info.width, info.height));
    to_rgb.reset(sws_getCachedContext(to_rgb.release(), f->width, f->height, static_cast<AVPixelFormat>(f->format),
                                      info.width, info.height, AV_PIX_FMT_RGB24, SWS_BILINEAR, nullptr, nullptr,
                                      nullptr));
    if (!to_rgb) fail(fmt::format("cannot convert pixel format {} to rgb24", f->format));
    // swscale's SIMD paths write whole vectors: rows padded to 64 bytes, and 64 spare bytes at the end.
    stride = (info.width * 3 + 63) / 64 * 64;
    rgb.assign(static_cast<size_t>(stride) * info.height + 64, 0);
    uint8_t* dst[1] = {rgb.data()};
    const int strides[1] = {stride};
    sws_scale(to_rgb.get(), f->data, f->linesize, 0, f->height, dst, strides);
  }

  // rgb, cropped (and scaled) as `c` says, into output frame k of `out` ([3, frames, size, size]).
  void place(const ClipSpec& c, int k, std::vector<uint8_t>& out, std::vector<uint8_t>& square) {
    const int s = c.size, w = info.width, h = info.height;
    const uint8_t* src = nullptr;
    int src_stride = 0;
    if (c.crop_only) {
      const int x0 = static_cast<int>(std::floor((w - s) * c.x)), y0 = static_cast<int>(std::floor((h - s) * c.y));
      src = rgb.data() + static_cast<size_t>(y0) * stride + static_cast<size_t>(x0) * 3;
      src_stride = stride;
    } else {
      const int m = std::min(w, h);
      const int x0 = static_cast<int>(std::floor((w - m) * c.x)), y0 = static_cast<int>(std::floor((h - m) * c.y));
      scale.reset(sws_getCachedContext(scale.release(), m, m, AV_PIX_FMT_RGB24, s, s, AV_PIX_FMT_RGB24, SWS_BILINEAR,
                                       nullptr, nullptr, nullptr));
      if (!scale) fail("cannot scale");
      src_stride = (s * 3 + 63) / 64 * 64;
      square.assign(static_cast<size_t>(src_stride) * s + 64, 0);
      const uint8_t* in[1] = {rgb.data() + static_cast<size_t>(y0) * stride + static_cast<size_t>(x0) * 3};
      const int in_stride[1] = {stride};
      uint8_t* dst[1] = {square.data()};
      const int dst_stride[1] = {src_stride};
      sws_scale(scale.get(), in, in_stride, 0, m, dst, dst_stride);
      src = square.data();
    }
    const size_t plane = static_cast<size_t>(c.frames) * s * s;
    uint8_t* base = out.data() + static_cast<size_t>(k) * s * s;
    for (int y = 0; y < s; ++y) {
      const uint8_t* row = src + static_cast<size_t>(y) * src_stride;
      for (int x = 0; x < s; ++x) {
        const int from = c.flip ? s - 1 - x : x;
        const size_t at = static_cast<size_t>(y) * s + x;
        base[at] = row[from * 3];
        base[plane + at] = row[from * 3 + 1];
        base[2 * plane + at] = row[from * 3 + 2];
      }
    }
  }
};

VideoReader::VideoReader(const std::string& path, std::chrono::milliseconds deadline) : impl_(std::make_unique<Impl>()) {
  // FFmpeg's own messages ("moov atom not found") go to stderr from every loader thread; what failed
  // reaches the caller as a VideoError naming the file. DTRAIN_FFMPEG_LOG=1 keeps them.
  static std::once_flag quiet;
  std::call_once(quiet, [] {
    if (!std::getenv("DTRAIN_FFMPEG_LOG")) av_log_set_level(AV_LOG_FATAL);
  });
  impl_->path = path;
  impl_->patience = deadline;
  if (!impl_->frame || !impl_->packet) impl_->fail("out of memory");
  impl_->open();
}

VideoReader::~VideoReader() = default;

const VideoInfo& VideoReader::info() const { return impl_->info; }

std::vector<uint8_t> VideoReader::readClip(const ClipSpec& c, int* decoded) {
  auto& d = *impl_;
  if (c.frames <= 0 || c.size <= 0 || !(c.fps > 0) || !(c.start >= 0) || c.x < 0 || c.x > 1 || c.y < 0 || c.y > 1)
    throw dtrain::InvalidArgument(fmt::format("video {}: bad clip (start {}, {} frames at {} fps, size {}, crop at {}, {})",
                                              d.path, c.start, c.frames, c.fps, c.size, c.x, c.y));
  if (c.crop_only && (c.size > d.info.width || c.size > d.info.height))
    throw dtrain::InvalidArgument(fmt::format("video {}: a {}x{} crop of a {}x{} video", d.path, c.size, c.size,
                                              d.info.width, d.info.height));
  d.deadline = Clock::now() + d.patience;
  std::vector<uint8_t> out(static_cast<size_t>(3) * c.frames * c.size * c.size, 0);
  std::vector<uint8_t> square;
  d.seek(c.start);
  // Slot k shows the last frame at or before start + k / fps: each decoded frame fills the slots before
  // it with the frame before it (the first frame fills the slots before itself). Only frames that fill a
  // slot are converted.
  int k = 0, filled = 0;
  bool have_prev = false;
  double time = 0;
  auto slotTime = [&](int i) { return c.start + i / c.fps; };
  const double eps = 1e-6;
  FramePtr prev(av_frame_alloc());
  if (!prev) d.fail("out of memory");
  while (k < c.frames && d.nextFrame(time)) {
    if (time > slotTime(k) + eps) {
      d.convert(have_prev ? prev.get() : d.frame.get());
      for (; k < c.frames && slotTime(k) + eps < time; ++k, ++filled) d.place(c, k, out, square);
    }
    av_frame_unref(prev.get());
    av_frame_move_ref(prev.get(), d.frame.get());
    have_prev = true;
  }
  // The stream ended: the last frame shows for one frame interval (or to the container's end, if later),
  // zeros after it.
  const double last_time = time;
  const double end = std::max(d.info.duration, last_time + (d.info.frame_rate > 0 ? 1 / d.info.frame_rate : 0));
  if (have_prev && k < c.frames && slotTime(k) + eps < end) {
    d.convert(prev.get());
    for (; k < c.frames && slotTime(k) + eps < end; ++k, ++filled) d.place(c, k, out, square);
  }
  if (filled == 0)
    d.fail(fmt::format("no frame decoded for a clip at {:.2f} s (the video lasts {:.2f} s)", c.start, d.info.duration));
  if (decoded) *decoded = filled;
  return out;
}

// ---- VideoWriter ----

struct VideoWriter::Impl {
  std::string path;
  int width = 0, height = 0;
  int64_t next_pts = 0;
  bool finished = false;
  AVFormatContext* fmt = nullptr;
  std::unique_ptr<AVCodecContext, CodecCloser> codec;
  AVStream* stream = nullptr;
  FramePtr frame{av_frame_alloc()};
  PacketPtr packet{av_packet_alloc()};
  std::unique_ptr<SwsContext, SwsCloser> to_yuv;

  [[noreturn]] void fail(const std::string& what) const { throw VideoError(fmt::format("video {}: {}", path, what)); }

  ~Impl() {
    if (fmt) {
      if (fmt->pb) avio_closep(&fmt->pb);
      avformat_free_context(fmt);
    }
  }

  // Sends `f` (nullptr: flush) and writes every packet the encoder has.
  void encode(AVFrame* f) {
    int rc = avcodec_send_frame(codec.get(), f);
    if (rc < 0) fail(fmt::format("encoding: {}", averror(rc)));
    for (;;) {
      rc = avcodec_receive_packet(codec.get(), packet.get());
      if (rc == AVERROR(EAGAIN) || rc == AVERROR_EOF) return;
      if (rc < 0) fail(fmt::format("encoding: {}", averror(rc)));
      // Every frame lasts one frame interval: without a duration the mp4 muxer's edit list ends the video
      // at its last frame's start, and decoders drop that frame.
      if (packet->duration <= 0) packet->duration = 1;
      av_packet_rescale_ts(packet.get(), codec->time_base, stream->time_base);
      packet->stream_index = stream->index;
      rc = av_interleaved_write_frame(fmt, packet.get());
      if (rc < 0) fail(fmt::format("writing: {}", averror(rc)));
    }
  }
};

VideoWriter::VideoWriter(const std::string& path, int width, int height, int fps) : impl_(std::make_unique<Impl>()) {
  auto& d = *impl_;
  d.path = path;
  d.width = width;
  d.height = height;
  if (width <= 0 || height <= 0 || width % 2 || height % 2 || fps <= 0)
    throw dtrain::InvalidArgument(fmt::format("video {}: {}x{} at {} fps (even sizes, positive rate)", path, width, height, fps));
  int rc = avformat_alloc_output_context2(&d.fmt, nullptr, "mp4", path.c_str());
  if (rc < 0 || !d.fmt) d.fail(fmt::format("no mp4 muxer: {}", averror(rc)));
  const AVCodec* enc = avcodec_find_encoder(AV_CODEC_ID_MPEG4);
  if (!enc) d.fail("FFmpeg has no MPEG-4 encoder");
  d.stream = avformat_new_stream(d.fmt, nullptr);
  d.codec.reset(avcodec_alloc_context3(enc));
  if (!d.stream || !d.codec || !d.frame || !d.packet) d.fail("out of memory");
  d.codec->width = width;
  d.codec->height = height;
  d.codec->time_base = AVRational{1, fps};
  d.codec->framerate = AVRational{fps, 1};
  d.codec->gop_size = fps;  // a key frame every second
  d.codec->max_b_frames = 0;
  d.codec->pix_fmt = AV_PIX_FMT_YUV420P;
  d.codec->thread_count = 1;
  d.codec->flags |= AV_CODEC_FLAG_QSCALE;
  d.codec->global_quality = FF_QP2LAMBDA * 3;  // high quality: small frames, sharp shapes
  if (d.fmt->oformat->flags & AVFMT_GLOBALHEADER) d.codec->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  if ((rc = avcodec_open2(d.codec.get(), enc, nullptr)) < 0) d.fail(fmt::format("cannot open the encoder: {}", averror(rc)));
  if ((rc = avcodec_parameters_from_context(d.stream->codecpar, d.codec.get())) < 0) d.fail(averror(rc));
  d.stream->time_base = d.codec->time_base;
  if ((rc = avio_open(&d.fmt->pb, path.c_str(), AVIO_FLAG_WRITE)) < 0) d.fail(fmt::format("cannot create: {}", averror(rc)));
  if ((rc = avformat_write_header(d.fmt, nullptr)) < 0) d.fail(fmt::format("writing the header: {}", averror(rc)));
  d.frame->format = AV_PIX_FMT_YUV420P;
  d.frame->width = width;
  d.frame->height = height;
  if ((rc = av_frame_get_buffer(d.frame.get(), 0)) < 0) d.fail(averror(rc));
  d.to_yuv.reset(sws_getContext(width, height, AV_PIX_FMT_RGB24, width, height, AV_PIX_FMT_YUV420P, SWS_BILINEAR,
                                nullptr, nullptr, nullptr));
  if (!d.to_yuv) d.fail("cannot convert rgb24 to yuv420p");
}

VideoWriter::~VideoWriter() {
  try {
    finish();
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): a destructor must not throw; finish() reports
  }
}

void VideoWriter::write(const uint8_t* rgb) {
  auto& d = *impl_;
  if (d.finished) d.fail("write after finish");
  int rc = av_frame_make_writable(d.frame.get());
  if (rc < 0) d.fail(averror(rc));
  const uint8_t* src[1] = {rgb};
  const int stride[1] = {d.width * 3};
  sws_scale(d.to_yuv.get(), src, stride, 0, d.height, d.frame->data, d.frame->linesize);
  d.frame->pts = d.next_pts++;
  d.encode(d.frame.get());
}

void VideoWriter::finish() {
  auto& d = *impl_;
  if (d.finished) return;
  d.finished = true;
  d.encode(nullptr);
  const int rc = av_write_trailer(d.fmt);
  if (rc < 0) d.fail(fmt::format("writing the trailer: {}", averror(rc)));
  avio_closep(&d.fmt->pb);
}

}  // namespace milnce
