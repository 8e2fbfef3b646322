// MIL-NCE data: a generator of HowTo100M-like video-text data with planted structure, and the loader
// that feeds training and evaluation, sampling clips and candidate captions the way the public
// MIL-NCE_HowTo100M code does (Miech et al., CVPR 2020; video_loader.py: HT100M_DataLoader, and
// youcook_loader.py for evaluation windows).
//
// \code
//   milnce::GenOptions gen;
//   gen.out = "/data/milnce";
//   milnce::generateData(gen);                                     // once, on one rank (dtrain::zeroFirst)
//   auto ds = milnce::Dataset::load("/data/milnce");               // everything in memory
//   milnce::LoaderOptions lo;                                      // K=4 candidates, 8 steps per clip
//   std::mt19937_64 rng(seed + rank);
//   auto batch = milnce::makeBatch(ds, indices, lo, rng);          // video [B,8,F], text [B,4,12]
//   auto clips = milnce::evalVideoWindows(ds, /*windows=*/4, lo);  // [N,4,8,F]; embed, then mean
//   auto texts = milnce::evalTexts(ds, lo.max_words);              // [N,12]
// \endcode
//
// On-disk layout (the directory `out` of generateData, `dir` of Dataset::load):
//   videos.csv          video_id,feature_file          training videos (feature_file relative to dir)
//   eval_videos.csv     video_id,feature_file          held-out videos, never in videos.csv
//   features/<id>.npy   float32 [T, F], .npy v1.0, '<f4', C order (numpy.load reads it); row t is time t/rate
//   captions/<id>.csv   start,end,text                 seconds with 2 decimals; lower-case words
//   eval.csv            video_id,start,end,sentence    held-out clips, like the YouCook2 validation CSV
//   vocab.txt           one word per line; word id = line number (from 1); id 0 is padding
//   word2vec.npy        float32 [V+1, E]; row 0 zeros, other rows random unit vectors (frozen word2vec stand-in)
//   prototypes.npy      float32 [C, F]; each concept's prototype feature (ground truth, for tests and analysis)
//   meta.json           the options (all but `out`, so a dataset can be moved), rate, dims, counts and
//                       each concept's words
// A raw video data set (`milnce gen-video`, GenOptions::video) differs in: videos.csv and eval_videos.csv
// list video_id,video_file (videos/<id>.mp4); meta.json has "kind": "video", "fps", "video_size" and each
// concept's colour and shape; there are no features/ and no prototypes.npy.
//
// Planted structure: concept c has a prototype (N(0,1) in F dims) and `words_per_concept` words of its
// own (pronounceable made-up words, "badoki"); `filler_words` words are shared (the first 40 are English
// function words such as "the", "let's", "don't"; more are made up). A video is a run of segments (count uniform in [min_segments,
// max_segments], durations uniform in [min_seg_sec, max_seg_sec]), each with a uniformly drawn concept;
// the feature rows of a segment are prototype[c] + noise * N(0,1). Each segment has one caption (its bounds
// +- up to 0.5 s, clipped to the video) of 2-3 of the concept's words and 2-4 filler words in random order.
// With probability `misalign` a training caption describes a neighbouring segment's concept instead (one
// with another concept when a neighbour has one): the narration misalignment MIL-NCE is built to tolerate.
// Eval captions are never misaligned. Everything follows from `seed` alone (std::mt19937_64 with this
// file's own uniform and normal sampling, not torch's RNG); video i depends only on (seed, i).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/progress.h"

namespace milnce {

// ---- generation ----

struct GenOptions {
  std::string out;             // output directory (created; existing files are overwritten)
  int videos = 2000;           // training videos
  int eval_videos = 60;        // held-out videos; every caption of theirs is an eval clip
  int concepts = 24;
  double noise = 1.0;          // std of the per-row feature noise around the concept prototype
  double misalign = 0.3;       // probability that a training caption describes a neighbouring segment
  // Probability that a segment is the next step of the procedure (concept of the previous segment + 1,
  // mod concepts) rather than a random concept. Instructional videos follow a procedure, so a narration
  // that is off by one segment systematically names the previous or next step: the misalignment that a
  // single caption cannot undo and a bag of nearby candidates (MIL-NCE) can.
  double procedure = 0.8;
  // Of the misaligned captions, the fraction that describes the NEXT segment (narrators announce the
  // step they are about to do); the rest describe the previous one.
  double lead = 0.8;
  uint64_t seed = 1;
  int feature_dim = 64;        // F
  int word_dim = 48;           // E
  double rate = 2.0;           // feature rows (time steps) per second
  int words_per_concept = 4;
  int filler_words = 40;
  int min_segments = 6, max_segments = 12;
  double min_seg_sec = 3, max_seg_sec = 8;
  // Progress on stderr, one unit per video (dtrain/progress.h); off unless asked (the CLI asks).
  dtrain::ProgressOptions::Mode progress = dtrain::ProgressOptions::Mode::off;
  // Raw video (`milnce gen-video`): each video an mp4 (videos/<id>.mp4, listed under video_file) of
  // video_size x video_size at fps, segment s showing concept c's shape in its colour moving over a dark
  // background (render.cc); concept c's words are its colour and shape ("red", "circle"; at most 32
  // concepts). The segments and captions are drawn as above; no features or prototypes are written.
  bool video = false;
  int video_size = 72;
  int fps = 10;
};

// Writes the dataset described above into opts.out. InvalidArgument on bad options, IoError when a
// file cannot be written.
void generateData(const GenOptions& opts);

// ---- the dataset in memory ----

struct Caption {
  double start = 0, end = 0;  // seconds
  std::string text;
};

struct Video {
  std::string id;
  at::Tensor features;  // [T, F] float32, contiguous (feature data sets)
  std::string file;     // the video file (raw video data sets; opened only when a clip is read)
  std::vector<Caption> captions;
};

struct EvalClip {
  std::string video_id;
  double start = 0, end = 0;
  std::string sentence;
  int video_index = -1;  // into Dataset::eval_videos
};

// Plain data, filled by load(); fields are public so training code reads them directly.
class Dataset {
 public:
  // Reads everything under `dir` (layout above). Missing files, malformed CSV, a bad .npy header or
  // inconsistent shapes -> dtrain::InvalidArgument naming the file (and the line, for text files).
  static Dataset load(const std::string& dir);

  std::string dir;
  std::vector<Video> videos;       // training
  std::vector<Video> eval_videos;  // held out
  std::vector<EvalClip> eval_clips;
  std::unordered_map<std::string, int64_t> vocab;  // word -> id (>= 1); 0 is padding
  std::vector<std::string> words;                  // id - 1 -> word (vocab.txt in order)
  at::Tensor word_vectors;                         // [V+1, E] float32, row 0 zeros
  double rate = 0;                                 // feature rows per second
  int64_t feature_dim = 0;                         // F
  // A raw video data set (meta.json "kind": "video"; videos.csv lists video_file): clips are decoded from
  // the files (LoaderOptions' frames, fps, size) rather than cut from features.
  bool raw_video = false;
  int64_t wordDim() const { return word_vectors.defined() ? word_vectors.size(1) : 0; }
};

// ---- text ----

// The reference's _split_text on lower-cased text: re.findall(r"[\w']+", text.lower()). ASCII follows
// Python exactly (\w = letters, digits, underscore); bytes >= 0x80 count as word characters, which keeps
// UTF-8 letters inside their words (Python's Unicode \w) but also glues non-ASCII punctuation to words.
std::vector<std::string> splitWords(const std::string& text);

// Word ids of the words of `text` that are in the vocabulary (unknown words dropped, as the reference's
// _words_to_token), then zero-padded or cut to exactly max_words.
std::vector<int64_t> tokenize(const std::string& text, const std::unordered_map<std::string, int64_t>& vocab,
                              int max_words);
std::vector<int64_t> tokenize(const std::string& text, const Dataset& ds, int max_words);

// ---- training samples (HT100M_DataLoader) ----

struct LoaderOptions {
  int num_candidates = 4;  // K: captions per sample, the MIL bag of positives
  int max_words = 12;
  int clip_steps = 8;      // feature rows per clip (the reference's num_frames at fps = rate)
  double min_time = 4.0;   // captions shorter than this are widened to it (seconds)
  // true: the reference's integer seconds (int(start), int(end), randint seek); false: a continuous seek.
  bool whole_seconds = true;
  // Raw video (Dataset::raw_video; video.h's ClipSpec): `frames` frames at `fps` from the seek, size x size.
  // Training: the reference's crop_only window at a random place (or, crop_only false, the largest square
  // at a random place scaled to size) and a horizontal flip with probability 1/2 when flip; evaluation:
  // centred, unflipped. clip_steps is the features' and is not used.
  int frames = 16;
  double fps = 10;
  int size = 64;
  bool crop_only = true;
  bool flip = true;
};

struct Sample {
  at::Tensor video;  // [clip_steps, F] float32; raw video: [3, frames, size, size] uint8
  at::Tensor text;   // [K, max_words] int64 (K = 1 too: always 2-D)
};

// What sample() chose, for tests and debugging.
struct SampleTrace {
  int64_t caption_index = -1;    // ind
  int64_t candidate_start = 0;   // findNearestCandidates(captions, ind, K) (may be < 0 when fewer than K)
  double start = 0, end = 0;     // the clip span after widening (and truncation with whole_seconds)
  double seek = 0;               // seconds
  int64_t first_row = 0;         // the first feature row taken, after clamping to the video
};

// The reference's _find_nearest_candidates: the first caption of a window of K captions grown around
// `ind`, each step adding the neighbour that keeps the span (end of last - start of first) shortest:
//   start = end = ind; n = 1
//   while n < K:
//     if start == 0: return 0
//     elif end == len-1: return start - (K - n)          # may be negative when len < K
//     elif cap.end[end] - cap.start[start-1] < cap.end[end+1] - cap.start[start]: start -= 1
//     else: end += 1
//     n += 1
//   return start
// Kept as the reference has them: at the last caption the window is shifted left without comparing
// spans (and starts below 0 when the video has fewer than K captions; callers clamp), reaching caption 0
// ends the search (the window is captions 0..K-1), and ties grow to the right.
int64_t findNearestCandidates(const std::vector<Caption>& captions, int64_t ind, int num_candidates);

// One training sample from video `video_index`, as HT100M_DataLoader.__getitem__ (with _get_text and
// _get_video) does:
//  1. ind = uniform caption index; with K > 1, candidate i = caption[clamp(findNearestCandidates + i,
//     0, len-1)] (a video with fewer than K captions repeats its last); K = 1 -> caption ind alone.
//  2. span = caption[ind]'s [start, end]; if end - start < min_time: diff = min_time - (end - start),
//     start = max(0, start - diff/2), end = start + min_time. With whole_seconds, start and end are then
//     truncated to integers (the reference returns int(start), int(end)).
//  3. seek uniform in [start, max(start, end - clip_steps/rate)] seconds: an integer (randint) with
//     whole_seconds, else continuous.
//  4. rows round(seek*rate) .. +clip_steps-1, the first row clamped to [0, max(0, T - clip_steps)] so the
//     clip lies in the video (the reference's ffmpeg read past the end returns fewer frames and pads with
//     zeros; rows are cheaper to shift than to invent); a video shorter than clip_steps repeats its last row.
// All randomness comes from `rng`. InvalidArgument on a bad index or options.
Sample sample(const Dataset& ds, size_t video_index, const LoaderOptions& opts, std::mt19937_64& rng,
              SampleTrace* trace = nullptr);

struct Batch {
  at::Tensor video;  // [B, clip_steps, F] float32; raw video: [B, 3, frames, size, size] uint8
  at::Tensor text;   // [B, K, max_words] int64
};

// Raw video: steps 1-3 as above with clip_steps / rate replaced by frames / fps, then the clip decoded
// from the seek (VideoReader::readClip) with the crop place and flip drawn from `rng` after the seek.
// milnce::VideoError (video.h) naming the file when it cannot be decoded.
//
// sample() for each index in order, stacked.
Batch makeBatch(const Dataset& ds, const std::vector<int64_t>& video_indices, const LoaderOptions& opts,
                std::mt19937_64& rng);

// The random numbers of one training clip: a stream of its own for (epoch_seed, video_index), so the clip
// a sample draws in an epoch depends on neither the rank that reads it, nor its batch, nor where a resumed
// run started (a run resumed mid-epoch continues as the uninterrupted run would have).
std::mt19937_64 clipRng(uint64_t epoch_seed, int64_t video_index);

// makeBatch() with each index's sample drawn from clipRng(epoch_seed, index).
Batch makeBatch(const Dataset& ds, const std::vector<int64_t>& video_indices, const LoaderOptions& opts,
                uint64_t epoch_seed);

// ---- evaluation (Youcook_DataLoader) ----

// [windows, clip_steps, F]: `windows` clips of clip_steps rows whose starts are evenly spaced over the clip
// (np.linspace(start, max(start, end - clip_steps/rate), windows), the reference without its ffmpeg
// -0.4 s margin), the span first widened to min_time as in training (no integer truncation); rows as in
// sample() step 4. The model's embedding of a clip is the mean over its windows.
// Raw video: [windows, 3, frames, size, size] uint8, centre crops; a window that cannot be decoded is
// zeros and counted in *failures when given (VideoError is not raised: a clip is still ranked).
at::Tensor evalClipWindows(const Dataset& ds, const EvalClip& clip, int windows, const LoaderOptions& opts,
                           int64_t* failures = nullptr);
// Every eval clip: [N, windows, clip_steps, F].
at::Tensor evalVideoWindows(const Dataset& ds, int windows, const LoaderOptions& opts);
// [max_words] int64: the clip's sentence tokenized.
at::Tensor evalText(const Dataset& ds, const EvalClip& clip, int max_words);
// Every eval clip: [N, max_words] int64.
at::Tensor evalTexts(const Dataset& ds, int max_words);

// ---- file formats (used by the above; public for tools and tests) ----

// A CSV file: the header's column names and the rows, each with the line it starts on (1-based).
// RFC 4180 as Python's csv module writes it: comma separator, fields quoted with '"' when they hold a
// comma, quote or line break, '""' for a quote inside a quoted field; CRLF or LF; blank lines skipped.
struct CsvTable {
  std::string path;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::vector<int64_t> lines;
  // The index of a column; InvalidArgument naming the file when the header lacks it.
  size_t column(const std::string& name) const;
};
// InvalidArgument naming the file and line on an unterminated quote, text after a closing quote, a row
// whose field count differs from the header's, or an empty file; also when the file cannot be opened.
CsvTable readCsv(const std::string& path);
// Quotes only the fields that need it (like Python's csv.QUOTE_MINIMAL); lines end with "\n".
void writeCsv(const std::string& path, const std::vector<std::string>& header,
              const std::vector<std::vector<std::string>>& rows);

// .npy files (format versions 1.0, 2.0 and 3.0 read; 1.0 written, its header padded to 64 bytes as numpy
// does). dtypes '<f4' '<f8' '<i4' '<i8' '|u1'; C or Fortran order read (returned C-contiguous); big-endian
// data rejected.
// InvalidArgument naming the file on a bad magic, header, dtype or size.
at::Tensor readNpy(const std::string& path);
// A 1-d .npy array of numpy's fixed-width strings ('<U': UTF-32, written back as UTF-8; '|S': bytes), as
// np.save(path, np.array(words)) writes it: the HowTo100M reference's word dictionary (s3d_dict.npy).
// InvalidArgument naming the file for anything else (an object array, another shape, a bad size).
std::vector<std::string> readNpyStrings(const std::string& path);
void writeNpy(const std::string& path, const at::Tensor& tensor);

}  // namespace milnce
