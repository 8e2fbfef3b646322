// The raw-video path of the MIL-NCE job: S3D-G against a Python port of the reference (state_dict loaded
// by name, outputs within 1e-5; its width rounding and refusals), FFmpeg decoding (timing, seeks between
// key frames, crops, flips, padding, broken files) and encoding (its refusals), the prefetching loader
// (skips and counts broken videos, its retry budget, batches independent of its threads) and a 2-rank
// `milnce train --raw-video` on generated videos with a corrupt, a truncated and a missing file.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/checkpoint.h"
#include "harness.h"
#include "milnce/data.h"
#include "milnce/s3dg.h"
#include "milnce/video.h"
#include "milnce/video_loader.h"
#include "milnce_test_util.h"

namespace {

namespace fs = std::filesystem;
using dtrain::test::runCommand;
using dtrain::test::TempDir;

// Runs tests/milnce/s3dg_reference.py into dir with `args`; returns its output line.
std::string pythonReference(const std::string& dir, const std::string& args) {
  auto [rc, out] = runCommand(fmt::format("{} {}/tests/milnce/s3dg_reference.py {} {}", dtrain::test::pythonPath(),
                                          DTRAIN_SOURCE_DIR, dir, args),
                              240);
  EXPECT_EQ(rc, 0) << out;
  return out;
}

double maxAbsDiff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// The full-width S3D-G of the reference, with its text module: the state_dict Python's torch.save wrote
// (an OrderedDict) loads by name, strictly, and the outputs agree within 1e-5 on the same clip.
TEST(S3DG, TheReferenceStateDictLoadsByNameAndTheOutputsMatchPython) {
  TempDir dir;
  const std::string line = pythonReference(dir.path(), "--width 1.0 --frames 8 --size 32 --vocab 50");
  milnce::S3DOptions o;
  o.num_embeddings = 51;
  milnce::S3D net(o);
  dtrain::loadStateDict(*net, dir.path() + "/state_dict.pt");  // strict: every name on both sides
  net->eval();
  torch::NoGradGuard no_grad;
  const auto out = net->forward(milnce::readNpy(dir.path() + "/clip.npy"));
  const at::Tensor want = milnce::readNpy(dir.path() + "/video_embedding.npy");
  ASSERT_EQ(out.video_embedding.sizes(), want.sizes());
  EXPECT_LT(maxAbsDiff(out.video_embedding, want), 1e-5) << line;
  EXPECT_LT(maxAbsDiff(out.mixed_5c, milnce::readNpy(dir.path() + "/mixed_5c.npy")), 1e-5) << line;
  // The embedding depends on the clip (a wrong space-to-depth order would still be a function of it, but
  // not this one): flipping it moves the output by more than the tolerance.
  const auto flipped = net->forward(milnce::readNpy(dir.path() + "/clip.npy").flip({4}));
  EXPECT_GT(maxAbsDiff(flipped.video_embedding, want), 1e-4);
  const at::Tensor text = net->text_module->forward(milnce::readNpy(dir.path() + "/tokens.npy"));
  const at::Tensor want_text = milnce::readNpy(dir.path() + "/text_embedding.npy");
  EXPECT_LT(maxAbsDiff(text, want_text) / want_text.abs().max().item<double>(), 1e-5) << line;
}

// The width multiplier and the paper's conv1 (no space to depth) match the port too.
TEST(S3DG, ANarrowModelWithoutSpaceToDepthMatchesPythonToo) {
  TempDir dir;
  const std::string line = pythonReference(dir.path(), "--width 0.25 --frames 8 --size 32 --no-space-to-depth --embed 64");
  milnce::S3DOptions o;
  o.width = 0.25;
  o.space_to_depth = false;
  o.num_classes = 64;
  milnce::S3D net(o);
  dtrain::loadStateDict(*net, dir.path() + "/state_dict.pt");
  net->eval();
  torch::NoGradGuard no_grad;
  const auto out = net->forward(milnce::readNpy(dir.path() + "/clip.npy"));
  EXPECT_LT(maxAbsDiff(out.video_embedding, milnce::readNpy(dir.path() + "/video_embedding.npy")), 1e-5) << line;
}

// What does not fit is refused naming the parameter, before anything is copied; so is a file that is not
// a state dict, and a value that is not a tensor.
TEST(S3DG, AStateDictThatDoesNotFitIsRefusedByName) {
  TempDir dir;
  pythonReference(dir.path(), "--width 0.25 --frames 8 --size 32");
  milnce::S3D full{milnce::S3DOptions{}};
  const at::Tensor before = full->conv1->conv1->weight.clone();
  const std::string err = dtrain::test::errorOf([&] { dtrain::loadStateDict(*full, dir.path() + "/state_dict.pt"); });
  EXPECT_NE(err.find("state_dict.pt"), std::string::npos) << err;
  EXPECT_NE(err.find("has shape"), std::string::npos) << err;
  EXPECT_TRUE(torch::equal(before, full->conv1->conv1->weight));
  std::ofstream(dir.path() + "/not.pt") << "not a torch file";
  EXPECT_NE(dtrain::test::errorOf([&] { dtrain::readStateDict(dir.path() + "/not.pt"); }).find("not a torch.save file"),
            std::string::npos);
  dtrain::test::runPython(fmt::format("import torch\ntorch.save({{'w': torch.ones(2), 'n': 3}}, '{}/mixed.pt')\n",
                                      dir.path()));
  const std::string mixed = dtrain::test::errorOf([&] { dtrain::readStateDict(dir.path() + "/mixed.pt"); });
  EXPECT_NE(mixed.find("'n' is a"), std::string::npos) << mixed;
}

// The width multiplier rounds each channel count to the nearest (half up), at least 4, and leaves it as it
// is at 1.0 (the parity tests above use 0.25, where every count of S3D-G divides exactly). A width outside
// (0, 4], a clip that is not [B, 3, T, H, W] and, with space to depth, an odd T, H or W are refused by name.
TEST(S3DG, TheWidthRoundsChannelCountsAndBadOptionsOrShapesAreRefused) {
  EXPECT_EQ(milnce::scaledChannels(64, 1.0), 64);
  EXPECT_EQ(milnce::scaledChannels(100, 0.125), 13);  // 12.5
  EXPECT_EQ(milnce::scaledChannels(192, 0.3), 58);    // 57.6
  EXPECT_EQ(milnce::scaledChannels(200, 0.3), 60);
  EXPECT_EQ(milnce::scaledChannels(16, 0.125), 4);    // 2, at least 4
  for (double width : {0.0, -1.0, 4.5}) {
    milnce::S3DOptions o;
    o.width = width;
    const std::string err = dtrain::test::errorOf([&] { milnce::S3D net(o); });
    EXPECT_NE(err.find(fmt::format("width multiplier {} is not in (0, 4]", width)), std::string::npos) << err;
  }
  milnce::S3DOptions o;
  o.width = 0.125;
  o.num_classes = 8;
  milnce::S3D net(o);
  torch::NoGradGuard no_grad;
  auto refusal = [&](const at::Tensor& clip) {  // InvalidArgument's message (libtorch's own error is not one)
    try {
      net->forward(clip);
    } catch (const dtrain::InvalidArgument& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not an InvalidArgument: ") + e.what();
    }
    return std::string("accepted");
  };
  const std::string odd = refusal(torch::zeros({1, 3, 5, 32, 32}));
  EXPECT_NE(odd.find("space to depth needs an even number of frames, height and width; got T=5 H=32 W=32"),
            std::string::npos) << odd;
  const std::string odd_w = refusal(torch::zeros({1, 3, 8, 32, 31}));
  EXPECT_NE(odd_w.find("got T=8 H=32 W=31"), std::string::npos) << odd_w;
  const std::string gray = refusal(torch::zeros({1, 1, 8, 32, 32}));
  EXPECT_NE(gray.find("expected a video [B, 3, T, H, W], got 1x1x8x32x32"), std::string::npos) << gray;
  EXPECT_EQ(net->forward(torch::zeros({2, 3, 8, 32, 32})).video_embedding.sizes(), (std::vector<int64_t>{2, 8}));
}

// A video of known frames: frame f is split at the middle, left half grey level 8f, right half 255 - 8f.
std::string writeKnownVideo(const std::string& path, int frames, int size, int fps) {
  milnce::VideoWriter w(path, size, size, fps);
  std::vector<uint8_t> rgb(static_cast<size_t>(size) * size * 3);
  for (int f = 0; f < frames; ++f) {
    for (int y = 0; y < size; ++y)
      for (int x = 0; x < size; ++x)
        for (int c = 0; c < 3; ++c)
          rgb[(static_cast<size_t>(y) * size + x) * 3 + c] = static_cast<uint8_t>(x < size / 2 ? 8 * f : 255 - 8 * f);
    w.write(rgb.data());
  }
  w.finish();
  return path;
}

// Mean of output frame k's left (or right) half, channel 0, of a [3, T, S, S] clip.
double halfMean(const std::vector<uint8_t>& clip, int k, int size, bool left) {
  double sum = 0;
  int n = 0;
  for (int y = 4; y < size - 4; ++y)
    for (int x = left ? 2 : size / 2 + 2; x < (left ? size / 2 - 2 : size - 2); ++x, ++n)
      sum += clip[(static_cast<size_t>(k) * size + y) * size + x];
  return sum / n;
}

TEST(Video, TheReaderDecodesWhatTheWriterWroteAtTheAskedTimes) {
  TempDir dir;
  const std::string path = writeKnownVideo(dir.path() + "/known.mp4", 30, 48, 10);  // 3 s at 10 fps
  milnce::VideoReader r(path);
  EXPECT_EQ(r.info().width, 48);
  EXPECT_NEAR(r.info().duration, 3.0, 0.11);
  milnce::ClipSpec c;
  c.start = 1.0;  // frame 10 on
  c.frames = 8;
  c.fps = 5;      // every other frame: 10, 12, ..., 24
  c.size = 32;
  c.x = 0.5, c.y = 0.5;
  int decoded = 0;
  auto clip = r.readClip(c, &decoded);
  ASSERT_EQ(clip.size(), 3u * 8 * 32 * 32);
  EXPECT_EQ(decoded, 8);
  for (int k = 0; k < 8; ++k) {
    EXPECT_NEAR(halfMean(clip, k, 32, true), 8 * (10 + 2 * k), 4) << "frame " << k;
    EXPECT_NEAR(halfMean(clip, k, 32, false), 255 - 8 * (10 + 2 * k), 4) << "frame " << k;
  }
  // Flipped: the halves swap. Crop-and-scale sees the same halves.
  c.flip = true;
  clip = r.readClip(c);
  EXPECT_NEAR(halfMean(clip, 0, 32, false), 80, 4);
  c.flip = false;
  c.crop_only = false;
  clip = r.readClip(c);
  EXPECT_NEAR(halfMean(clip, 0, 32, true), 80, 6);
  // Past the end: the last frame while the video lasts, zeros after it (as the reference pads).
  c.crop_only = true;
  c.start = 2.5;
  c.fps = 10;
  clip = r.readClip(c, &decoded);
  EXPECT_EQ(decoded, 5);
  EXPECT_NEAR(halfMean(clip, 4, 32, true), 8 * 29, 4);
  EXPECT_EQ(halfMean(clip, 5, 32, true), 0);
  // A crop larger than the video is a bad request, not a decoding failure.
  c.size = 64;
  EXPECT_THROW(r.readClip(c), dtrain::InvalidArgument);
}

// x places the crop window across (y down): at x = 0 its columns are the video's 0-31, so its left half
// is the video's left (level 80 at 1 s) and its right half straddles the middle; at x = 1 (columns 16-47)
// the left half straddles and the right half is the video's right (175). A clip that starts after the
// video ends has no frame: a VideoError, not a clip of zeros. The writer takes even sizes and a positive
// rate only, and no frame after finish().
TEST(Video, TheCropFollowsXAClipPastTheEndFailsAndTheWriterRefusesBadInput) {
  TempDir dir;
  const std::string path = writeKnownVideo(dir.path() + "/known.mp4", 30, 48, 10);
  milnce::VideoReader r(path);
  milnce::ClipSpec c;
  c.start = 1.0;
  c.frames = 1;
  c.size = 32;
  c.y = 0.5;
  c.x = 0;
  auto clip = r.readClip(c);
  EXPECT_NEAR(halfMean(clip, 0, 32, true), 80, 4);
  EXPECT_NEAR(halfMean(clip, 0, 32, false), (80 + 175) / 2.0, 12);
  c.x = 1;
  clip = r.readClip(c);
  EXPECT_NEAR(halfMean(clip, 0, 32, true), (80 + 175) / 2.0, 12);
  EXPECT_NEAR(halfMean(clip, 0, 32, false), 175, 4);
  c.start = 10;
  const std::string past = dtrain::test::errorOf([&] { r.readClip(c); });
  EXPECT_NE(past.find("known.mp4: no frame decoded for a clip at 10.00 s"), std::string::npos) << past;
  for (const auto& bad : std::vector<std::tuple<int, int, int>>{{33, 32, 10}, {32, 31, 10}, {32, 32, 0}}) {
    const auto [w, h, fps] = bad;
    const std::string err = dtrain::test::errorOf(
        [&] { milnce::VideoWriter(dir.path() + "/bad.mp4", std::get<0>(bad), std::get<1>(bad), std::get<2>(bad)); });
    EXPECT_NE(err.find(fmt::format("{}x{} at {} fps (even sizes, positive rate)", w, h, fps)), std::string::npos)
        << err;
  }
  milnce::VideoWriter done(dir.path() + "/done.mp4", 32, 32, 10);
  std::vector<uint8_t> rgb(32 * 32 * 3, 100);
  done.write(rgb.data());
  done.finish();
  const std::string late = dtrain::test::errorOf([&] { done.write(rgb.data()); });
  EXPECT_NE(late.find("done.mp4: write after finish"), std::string::npos) << late;
}

// The file's bytes, and a 32-bit big-endian field of an mp4 box in them.
std::string fileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}
uint32_t bigEndian32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<uint8_t>(b[at + i]);
  return v;
}

// A clip that starts between two key frames (one a second here) shows the frames of its own times: the
// seek lands on the key frame before the start and decodes on from there (not on the next key frame). And
// a container whose header ends the video before its last frame's interval (mvhd's duration set to 2.5 s;
// the frames run to 2.9 s, each lasting 0.1 s) still shows that last frame for its interval: 5 frames of
// a clip at 2.5 s, then zeros, as with the true duration.
TEST(Video, AClipBetweenKeyFramesAndTheLastFrameOfAContainerThatEndsEarly) {
  TempDir dir;
  const std::string path = writeKnownVideo(dir.path() + "/known.mp4", 30, 48, 10);
  milnce::ClipSpec c;
  c.start = 1.5;  // frames 15, 16, 17
  c.frames = 3;
  c.fps = 10;
  c.size = 32;
  {
    milnce::VideoReader r(path);
    const auto clip = r.readClip(c);
    for (int k = 0; k < 3; ++k) EXPECT_NEAR(halfMean(clip, k, 32, true), 8 * (15 + k), 4) << "frame " << k;
  }
  std::string bytes = fileBytes(path);
  const size_t mvhd = bytes.find("mvhd");
  ASSERT_NE(mvhd, std::string::npos);
  ASSERT_EQ(bytes[mvhd + 4], 0) << "mvhd version 1 (64-bit times)";
  const uint32_t timescale = bigEndian32(bytes, mvhd + 16), shorter = timescale / 2 * 5;  // 2.5 s
  ASSERT_GT(bigEndian32(bytes, mvhd + 20), shorter);
  for (size_t i = 0; i < 4; ++i) bytes[mvhd + 20 + i] = static_cast<char>(shorter >> (24 - 8 * i));
  const std::string cut = dir.path() + "/ends-early.mp4";
  std::ofstream(cut, std::ios::binary) << bytes;
  milnce::VideoReader r(cut);
  ASSERT_NEAR(r.info().duration, 2.5, 0.01);
  c.start = 2.5;
  c.frames = 8;
  int decoded = 0;
  const auto clip = r.readClip(c, &decoded);
  EXPECT_EQ(decoded, 5);
  EXPECT_NEAR(halfMean(clip, 4, 32, true), 8 * 29, 4);
  EXPECT_EQ(halfMean(clip, 5, 32, true), 0);
}

TEST(Video, MissingCorruptAndTruncatedFilesAreVideoErrorsNamingTheFile) {
  TempDir dir;
  const std::string good = writeKnownVideo(dir.path() + "/good.mp4", 30, 32, 10);
  auto errorOf = [](const std::string& path) {
    try {
      milnce::VideoReader r(path);
      milnce::ClipSpec c;
      c.size = 32;
      r.readClip(c);
    } catch (const milnce::VideoError& e) {
      return std::string(e.what());
    }
    return std::string("no VideoError");
  };
  EXPECT_NE(errorOf(dir.path() + "/missing.mp4").find("missing.mp4: cannot open"), std::string::npos);
  EXPECT_NE(errorOf(dir.path()).find("not a regular file"), std::string::npos);
  std::ofstream(dir.path() + "/noise.mp4") << std::string(5000, '\x5a');
  EXPECT_NE(errorOf(dir.path() + "/noise.mp4").find("noise.mp4"), std::string::npos);
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(dir.path() + "/cut.mp4", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  EXPECT_NE(errorOf(dir.path() + "/cut.mp4").find("cut.mp4"), std::string::npos);
}

// A small generated video data set (32x32 at 10 fps, 12 training videos).
std::string smallVideoData(const std::string& dir) {
  milnce::GenOptions g;
  g.out = dir;
  g.video = true;
  g.video_size = 32;
  g.videos = 12;
  g.eval_videos = 2;
  g.concepts = 6;
  g.min_segments = 3;
  g.max_segments = 4;
  milnce::generateData(g);
  return dir;
}

milnce::LoaderOptions smallClips() {
  milnce::LoaderOptions lo;
  lo.frames = 4;
  lo.size = 24;
  return lo;
}

TEST(GenVideo, WritesRealVideosWithCaptionsThatNameWhatIsSeen) {
  TempDir dir;
  smallVideoData(dir.path());
  const auto ds = milnce::Dataset::load(dir.path());
  EXPECT_TRUE(ds.raw_video);
  ASSERT_EQ(ds.videos.size(), 12u);
  EXPECT_EQ(ds.vocab.count("red"), 1u);
  EXPECT_EQ(ds.vocab.count("circle"), 1u);
  milnce::VideoReader r(ds.videos[0].file);
  EXPECT_EQ(r.info().width, 32);
  EXPECT_GT(r.info().duration, 3 * 3.0 - 0.5);
  // Deterministic: the same seed writes the same files.
  TempDir again;
  smallVideoData(again.path());
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  };
  EXPECT_EQ(read(dir.path() + "/videos/vid_00003.mp4"), read(again.path() + "/videos/vid_00003.mp4"));
  EXPECT_EQ(read(dir.path() + "/captions/vid_00003.csv"), read(again.path() + "/captions/vid_00003.csv"));
}

// Breaks three videos of a data set: one corrupt, one truncated, one missing.
std::vector<std::string> breakThree(const milnce::Dataset& ds) {
  std::vector<std::string> broken{ds.videos[1].file, ds.videos[4].file, ds.videos[7].file};
  std::ofstream(broken[0], std::ios::binary | std::ios::trunc) << std::string(20000, '\x33');
  fs::resize_file(broken[1], fs::file_size(broken[1]) / 3);
  fs::remove(broken[2]);
  return broken;
}

TEST(VideoLoader, SkipsAndCountsBrokenVideosAndItsBatchesDoNotDependOnItsThreads) {
  TempDir dir;
  smallVideoData(dir.path());
  const auto ds = milnce::Dataset::load(dir.path());
  const auto broken = breakThree(ds);
  std::vector<std::vector<int64_t>> batches{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}};
  auto epoch = [&](int threads) {
    milnce::VideoLoaderOptions vo;
    vo.threads = threads;
    vo.prefetch = 2;
    milnce::VideoLoader loader(ds, smallClips(), vo);
    loader.start(batches, 7);
    std::vector<milnce::Batch> out;
    for (size_t i = 0; i < batches.size(); ++i) out.push_back(loader.next());
    EXPECT_THROW(loader.next(), dtrain::InvalidArgument);  // past the end of the epoch
    return std::make_pair(out, loader.takeStats());
  };
  auto [one, s1] = epoch(1);
  auto [three, s3] = epoch(3);
  ASSERT_EQ(one.size(), 3u);
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_EQ(one[i].video.sizes(), (std::vector<int64_t>{4, 3, 4, 24, 24}));
    EXPECT_TRUE(torch::equal(one[i].video, three[i].video)) << "batch " << i;
    EXPECT_TRUE(torch::equal(one[i].text, three[i].text)) << "batch " << i;
  }
  EXPECT_GE(s1.failures, 3);
  EXPECT_EQ(s1.failures, s3.failures);
  EXPECT_EQ(s1.clips, 12);
  std::string named;
  for (const auto& f : s1.failed) named += f + "\n";
  for (const auto& b : broken) EXPECT_NE(named.find(b), std::string::npos) << named;
  // The evaluation windows of a broken eval video are zeros, counted.
  int64_t failed = 0;
  fs::remove(ds.eval_videos[0].file);
  for (const auto& c : ds.eval_clips)
    if (c.video_index == 0) {
      const auto w = milnce::evalClipWindows(ds, c, 2, smallClips(), &failed);
      EXPECT_EQ(w.sum().item<int64_t>(), 0);
    }
  EXPECT_GE(failed, 2);
}

// VideoLoaderOptions::max_retries: a sample whose video fails is drawn from up to max_retries other videos,
// then the batch fails. With every video missing, sample 0 of batch 0 is tried on exactly 1 + max_retries
// videos: the error says how many failed in a row, and the epoch's counts have that many failures and no
// clip. One thread and a prefetch of one: batch 0 is the only batch decoded, and nothing after its error.
TEST(VideoLoader, MaxRetriesBoundsTheVideosTriedForASample) {
  TempDir dir;
  smallVideoData(dir.path());
  const auto ds = milnce::Dataset::load(dir.path());
  for (const auto& v : ds.videos) fs::remove(v.file);
  for (int retries : {0, 1, 3}) {
    milnce::VideoLoaderOptions vo;
    vo.threads = 1;
    vo.prefetch = 1;
    vo.max_retries = retries;
    vo.timeout = dtrain::test::scaled(std::chrono::milliseconds(30000));
    milnce::VideoLoader loader(ds, smallClips(), vo);
    loader.start({{0, 1, 2}, {3, 4, 5}}, 7);
    std::string err = "no VideoError";
    try {
      loader.next();
    } catch (const milnce::VideoError& e) {
      err = e.what();
    }
    const std::string want = fmt::format("batch 0 sample 0: {} videos in a row failed to decode", retries + 1);
    EXPECT_NE(err.find(want), std::string::npos) << "max_retries " << retries << ": " << err;
    EXPECT_NE(err.find("cannot open"), std::string::npos) << err;
    const auto s = loader.takeStats();
    EXPECT_EQ(s.failures, retries + 1) << "max_retries " << retries;
    EXPECT_EQ(s.clips, 0) << "max_retries " << retries;
    EXPECT_EQ(s.batches, 0) << "max_retries " << retries;
    EXPECT_GE(s.failed.size(), 1u);
    EXPECT_LE(s.failed.size(), static_cast<size_t>(retries + 1));  // distinct files among the tries
  }
  // A negative budget is refused, naming it.
  milnce::VideoLoaderOptions bad;
  bad.max_retries = -1;
  EXPECT_NE(dtrain::test::errorOf([&] { milnce::VideoLoader(ds, smallClips(), bad); }).find("max_retries >= 0"),
            std::string::npos);
}

// `milnce train --raw-video` on 2 ranks (dtrain-run) over videos of which three are broken: training goes
// on, the skipped clips are counted at the epoch's end and in metrics.jsonl, and the loss is finite.
TEST(RawVideoTraining, TwoRanksTrainThroughBrokenVideosAndReportThem) {
  TempDir dir;
  smallVideoData(dir.path() + "/data");
  breakThree(milnce::Dataset::load(dir.path() + "/data"));
  const std::string run = dir.path() + "/run";
  auto [rc, out] = runCommand(
      fmt::format("env OMP_NUM_THREADS=1 {0}/dtrain-run --standalone --nproc-per-node 2 {0}/milnce train --raw-video "
                  "--data {1}/data --out {2} --epochs 2 --batch 3 --frames 4 --size 24 --s3d-width 0.125 --embed 16 "
                  "--eval-windows 1 --progress lines --progress-every 1 2>&1",
                  DTRAIN_BIN_DIR, dir.path(), run),
      280);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find(" ms compute "), std::string::npos) << out;  // the progress line's decode and compute times
  EXPECT_NE(out.find("skipped (videos that failed to decode)"), std::string::npos) << out;
  EXPECT_NE(out.find("after training (2 epochs)"), std::string::npos) << out;
  std::ifstream f(run + "/metrics.jsonl");
  int data_records = 0;
  double skipped = 0;
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "data") ++data_records, skipped += j["skipped"].get<double>();
    if (j["kind"] == "step") {
      EXPECT_TRUE(std::isfinite(j["loss"].get<double>())) << line;
      EXPECT_TRUE(j.contains("data_wait_s")) << line;
    }
  }
  EXPECT_EQ(data_records, 2);
  EXPECT_GE(skipped, 6);  // every epoch reads every video once: the three broken ones at least
}

// With --zero 3 the parameters are sharded, but S3D-G's BatchNorm statistics are buffers: the
// evaluation at the end of training and `milnce eval` of the per-rank checkpoint use them (without them
// every clip embeds alike and ranks last), and agree.
TEST(RawVideoTraining, ZeroStage3KeepsTheBatchNormStatisticsInEvaluationAndCheckpoints) {
  TempDir dir;
  smallVideoData(dir.path() + "/data");
  const std::string flags = "--frames 4 --size 24 --s3d-width 0.125 --embed 16";
  auto [rc, out] = runCommand(
      fmt::format("env OMP_NUM_THREADS=1 {0}/dtrain-run --standalone --nproc-per-node 2 {0}/milnce train --raw-video "
                  "--data {1}/data --out {1}/run --epochs 2 --batch 3 --zero 3 --eval-windows 1 --no-progress {2} 2>&1",
                  DTRAIN_BIN_DIR, dir.path(), flags),
      280);
  ASSERT_EQ(rc, 0) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(after training \(2 epochs\)\s+(.*))"))) << out;
  const std::string trained = m[1].str();
  // Each rank's file holds its BatchNorm statistics, moved by training (they start at mean 0, var 1).
  std::string newest;
  for (const auto& e : fs::directory_iterator(dir.path() + "/run/checkpoints"))
    if (e.is_directory() && e.path().filename().string() > fs::path(newest).filename().string()) newest = e.path();
  const auto parts = dtrain::Checkpointer::loadRanks(newest);
  ASSERT_EQ(parts.size(), 2u);
  for (const auto& p : parts) {
    ASSERT_EQ(p.model.count("video.s3d.conv1.bn1.running_mean"), 1u) << newest;
    EXPECT_GT(p.model.at("video.s3d.conv1.bn1.running_mean").abs().sum().item<double>(), 0) << newest;
  }
  auto [erc, eout] = runCommand(fmt::format("env OMP_NUM_THREADS=1 {0}/milnce eval --data {1}/data --run {1}/run --windows 1 --progress off {2} 2>&1",
                                            DTRAIN_BIN_DIR, dir.path(), flags),
                                120);
  ASSERT_EQ(erc, 0) << eout;
  ASSERT_TRUE(std::regex_search(eout, m, std::regex(R"(epoch 2\s+(.*))"))) << eout;
  EXPECT_EQ(m[1].str(), trained) << out << eout;
}

}  // namespace
