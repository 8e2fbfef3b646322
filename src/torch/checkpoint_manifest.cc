// The per-rank checkpoint layout (see checkpoint.h): every rank writes its own file, rank 0 writes the
// manifest last, after every rank reported success; loading takes the newest checkpoint whose manifest
// and files are all there. The commit protocol of a save:
//   1. every rank: remove a stale manifest of the same (epoch, step) (so a replaced checkpoint stops
//      existing before any of its files changes), then write its file atomically (temporary, fsync,
//      rename, fsync of the directory); an error is caught, not thrown yet;
//   2. every rank reports (epoch, step, bytes, error) to every other (allgather): if any rank failed or
//      disagrees on (epoch, step), every rank throws the same error naming them, and no manifest exists;
//   3. rank 0 writes the manifest atomically and prunes, then tells the others whether it succeeded.
// A rank that dies mid-save makes the others fail in step 2 (the group's deadline bounds the wait).
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <tuple>

#include "checkpoint_io.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "errors.h"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

constexpr const char* kManifestFormat = "dtrain-checkpoint-manifest-v1";
constexpr size_t kMaxMessage = 2000;

// What every rank says about one step of the protocol: four numbers and an error ("" when fine).
struct Report {
  std::array<int64_t, 4> nums{};
  std::string error;
};

// Every rank's report, in rank order, on every rank (collective).
std::vector<Report> gatherReports(comm::ProcessGroup& pg, const std::array<int64_t, 4>& nums, std::string error) {
  if (error.size() > kMaxMessage) error.resize(kMaxMessage);
  const size_t n = static_cast<size_t>(pg.size());
  std::array<int64_t, 5> mine{nums[0], nums[1], nums[2], nums[3], static_cast<int64_t>(error.size())};
  std::vector<int64_t> all(5 * n);
  pg.allgather(mine.data(), all.data(), 5, comm::DType::i64)->wait();
  std::vector<Report> out(n);
  std::vector<size_t> lengths(n);
  size_t total = 0;
  for (size_t r = 0; r < n; ++r) {
    out[r].nums = {all[5 * r], all[5 * r + 1], all[5 * r + 2], all[5 * r + 3]};
    lengths[r] = static_cast<size_t>(std::clamp<int64_t>(all[5 * r + 4], 0, kMaxMessage));
    total += lengths[r];
  }
  if (total > 0) {  // every rank knows the lengths, so all take this branch together
    std::string text(total, '\0');
    pg.allgatherv(error.data(), text.data(), lengths, comm::DType::u8)->wait();
    size_t at = 0;
    for (size_t r = 0; r < n; ++r) {
      out[r].error = text.substr(at, lengths[r]);
      at += lengths[r];
    }
  }
  return out;
}

// Rank 0's numbers and error text on every rank (collective).
Report broadcastReport(comm::ProcessGroup& pg, Report rep) {
  if (rep.error.size() > kMaxMessage) rep.error.resize(kMaxMessage);
  std::array<int64_t, 5> head{rep.nums[0], rep.nums[1], rep.nums[2], rep.nums[3],
                              static_cast<int64_t>(rep.error.size())};
  pg.broadcast(head.data(), 5, comm::DType::i64, 0)->wait();
  rep.nums = {head[0], head[1], head[2], head[3]};
  const auto len = static_cast<size_t>(std::clamp<int64_t>(head[4], 0, kMaxMessage));
  rep.error.resize(len);
  if (len > 0) pg.broadcast(rep.error.data(), len, comm::DType::u8, 0)->wait();
  return rep;
}

// What a checkpoint directory holds.
struct Inspection {
  enum Kind { no_manifest, incomplete, complete } kind = no_manifest;
  int64_t world_size = 0;
  bool parameter_server = false;  // rank 0's file holds the job's parameter-server state
  std::string reason;  // incomplete: which file is missing or short
};

// Error naming the manifest when it exists but is not a valid manifest (no silent fallback: it was
// renamed into place whole, so damage here is not an interrupted save).
Inspection inspect(const fs::path& cdir) {
  Inspection out;
  std::error_code ec;
  const fs::path manifest = cdir / Checkpointer::kManifestName;
  if (!fs::exists(manifest, ec)) return out;
  const std::string path = manifest.string();
  detail::DictReader r(path, detail::loadCheckpointDict(path, detail::readFile(path), kManifestFormat));
  const auto files = r.strings("files");
  const auto bytes = r.integers("bytes");
  out.world_size = r.integer("world_size");
  out.parameter_server = r.integer("parameter_server") != 0;
  if (files.size() != bytes.size() || static_cast<int64_t>(files.size()) != out.world_size)
    throw Error(fmt::format("checkpoint manifest {} is inconsistent: {} files, {} sizes, world_size {}", path,
                            files.size(), bytes.size(), out.world_size));
  for (size_t i = 0; i < files.size(); ++i) {
    const fs::path f = cdir / files[i];
    const auto size = fs::file_size(f, ec);
    if (ec) {
      out.kind = Inspection::incomplete;
      out.reason = fmt::format("{} is missing", f.string());
      return out;
    }
    if (static_cast<int64_t>(size) != bytes[i]) {
      out.kind = Inspection::incomplete;
      out.reason = fmt::format("{} has {} bytes, the manifest says {}", f.string(), size, bytes[i]);
      return out;
    }
  }
  out.kind = Inspection::complete;
  return out;
}

// The checkpoint directories of dir (complete or not), oldest first.
std::vector<CheckpointFile> checkpointDirs(const std::string& dir) {
  std::vector<CheckpointFile> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    auto parsed = detail::parseCheckpointName(it->path().filename().string(), "");
    if (!parsed || !it->is_directory(ec)) continue;
    out.push_back({it->path().string(), parsed->first, parsed->second});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointFile& a, const CheckpointFile& b) {
    return std::tie(a.epoch, a.step, a.path) < std::tie(b.epoch, b.step, b.path);
  });
  return out;
}

std::vector<char> manifestBytes(const CheckpointState& s, const std::vector<Report>& reports) {
  // s is rank 0's state.
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  c10::List<std::string> files;
  c10::List<int64_t> bytes;
  const int world = static_cast<int>(reports.size());
  for (int r = 0; r < world; ++r) {
    files.push_back(Checkpointer::rankFileName(r, world));
    bytes.push_back(reports[static_cast<size_t>(r)].nums[2]);
  }
  dict.insert("format", std::string(kManifestFormat));
  dict.insert("epoch", s.epoch);
  dict.insert("step", s.step);
  dict.insert("world_size", int64_t{world});
  dict.insert("files", files);
  dict.insert("bytes", bytes);
  dict.insert("parameter_server", int64_t{s.parameter_server.empty() ? 0 : 1});
  return detail::pickleWithDigest(dict);
}

}  // namespace

Checkpointer::Checkpointer(std::string dir, std::shared_ptr<comm::ProcessGroup> group, int keep_last)
    : Checkpointer(std::move(dir), keep_last, /*writer=*/true) {
  DTRAIN_CHECK(group != nullptr, InvalidArgument, "Checkpointer: null process group");
  group_ = std::move(group);
}

std::string Checkpointer::dirName(int64_t epoch, int64_t step) {
  return fmt::format("{}{:06}-{:09}", detail::kCheckpointPrefix, epoch, step);
}

std::string Checkpointer::rankFileName(int rank, int world_size) {
  return fmt::format("rank-{:05}-of-{:05}.pt", rank, world_size);
}

std::string Checkpointer::savePerRank(const CheckpointState& s) const {
  auto& pg = *group_;
  const int rank = pg.rank(), world = pg.size();
  const std::string name = dirName(s.epoch, s.step);
  const std::string cdir = (fs::path(dir_) / name).string();

  // 1. This rank's file.
  std::string path, error;
  int64_t written = -1;
  try {
    DTRAIN_CHECK_GE(s.epoch, 0, "Checkpointer::save: epoch");
    DTRAIN_CHECK_GE(s.step, 0, "Checkpointer::save: step");
    DTRAIN_CHECK(rank == 0 || s.parameter_server.empty(), InvalidArgument,
                 "parameter_server is the job's state: rank 0 saves it (worker 0's saveState()), the other ranks "
                 "leave it empty (loadLatest gives every rank rank 0's)");
    const auto bytes = detail::pickleState(s, rank, world);
    std::error_code ec;
    fs::create_directories(cdir, ec);
    if (ec) throw Error(fmt::format("checkpoint: cannot create directory {}: {}", cdir, ec.message()));
    detail::removeFileDurably(cdir, kManifestName);
    path = detail::writeFileAtomically(cdir, rankFileName(rank, world), bytes);
    written = static_cast<int64_t>(bytes.size());
  } catch (const std::exception& e) {
    error = detail::errorText(e);
  }

  // 2. Everyone's outcome, on every rank. A rank that died or hangs fails the collective.
  const std::string not_saved =
      fmt::format("[rank {}] checkpoint {} not saved (the previous one stays the newest): ", rank, cdir);
  std::vector<Report> reports;
  try {
    reports = gatherReports(pg, {s.epoch, s.step, written, 0}, error);
  } catch (const std::exception&) {
    detail::rethrowWithContext(not_saved);
  }
  std::vector<std::string> problems;
  for (int r = 0; r < world; ++r) {
    const Report& rep = reports[static_cast<size_t>(r)];
    if (!rep.error.empty()) problems.push_back(fmt::format("rank {} failed: {}", r, rep.error));
  }
  const auto& r0 = reports[0].nums;
  std::vector<std::string> numbers;
  bool agree = true;
  for (int r = 0; r < world; ++r) {
    const auto& n = reports[static_cast<size_t>(r)].nums;
    agree &= n[0] == r0[0] && n[1] == r0[1];
    numbers.push_back(fmt::format("rank {}: ({}, {})", r, n[0], n[1]));
  }
  if (!agree)
    problems.push_back(fmt::format("the ranks disagree on (epoch, step): {}", fmt::join(numbers, ", ")));
  if (!problems.empty())
    throw Error(not_saved + fmt::format("{}", fmt::join(problems, "; ")));

  // 3. Rank 0 commits: the manifest makes the checkpoint exist.
  Report commit;
  if (rank == 0) {
    try {
      detail::writeFileAtomically(cdir, kManifestName, manifestBytes(s, reports));
    } catch (const std::exception& e) {
      commit.error = detail::errorText(e);
    }
    if (commit.error.empty()) {
      // Pruning failures are not errors: the new checkpoint is already safe, and the next save retries.
      std::error_code ec;
      auto complete = listPerRank();
      if (keep_last_ > 0 && complete.size() > static_cast<size_t>(keep_last_))
        for (size_t i = 0; i + keep_last_ < complete.size(); ++i) fs::remove_all(complete[i].path, ec);
      // Directories without a manifest are saves that never completed; every rank is past its write here,
      // so none is in progress.
      for (const auto& d : checkpointDirs(dir_))
        if (d.path != cdir && !fs::exists(fs::path(d.path) / kManifestName, ec)) fs::remove_all(d.path, ec);
      // A rank that crashed mid-write of an earlier attempt at this (epoch, step) left a temporary file.
      for (const auto& e : fs::directory_iterator(cdir, ec))
        if (e.path().filename().string().rfind(detail::kCheckpointTmpPrefix, 0) == 0) fs::remove(e.path(), ec);
    }
  }
  try {
    commit = broadcastReport(pg, commit);
  } catch (const std::exception&) {
    detail::rethrowWithContext(not_saved);
  }
  if (!commit.error.empty()) throw Error(not_saved + "rank 0 could not write its manifest: " + commit.error);
  return path;
}

std::vector<CheckpointFile> Checkpointer::listPerRank() const {
  std::vector<CheckpointFile> out;
  for (auto& d : checkpointDirs(dir_)) {
    try {
      if (inspect(d.path).kind == Inspection::complete) out.push_back(std::move(d));
    } catch (const Error&) {
      // A damaged manifest: not a usable checkpoint (loadLatest names it if it is the newest).
    }
  }
  return out;
}

std::optional<CheckpointState> Checkpointer::loadLatestPerRank() const {
  auto& pg = *group_;
  const int rank = pg.rank(), world = pg.size();
  // Rank 0 chooses for everyone: nums = {found (1; 2: with parameter-server state), epoch, step, world size}.
  Report choice;
  if (rank == 0) {
    try {
      auto dirs = checkpointDirs(dir_);
      for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
        const Inspection in = inspect(it->path);
        if (in.kind == Inspection::no_manifest) continue;  // a save that never completed
        if (in.kind == Inspection::incomplete) {
          std::fprintf(stderr, "[rank 0] checkpoint: skipping %s: %s\n", it->path.c_str(), in.reason.c_str());
          continue;
        }
        choice.nums = {in.parameter_server ? 2 : 1, it->epoch, it->step, in.world_size};
        break;
      }
    } catch (const std::exception& e) {
      choice.error = detail::errorText(e);
    }
  }
  const std::string context = fmt::format("[rank {}] checkpoint: loading from {}: ", rank, dir_);
  try {
    choice = broadcastReport(pg, choice);
  } catch (const std::exception&) {
    detail::rethrowWithContext(context);
  }
  if (!choice.error.empty())
    throw Error(fmt::format("[rank {}] checkpoint: rank 0 could not choose a checkpoint in {}: {}", rank, dir_,
                            choice.error));
  if (choice.nums[0] == 0) return std::nullopt;
  const std::string cdir = (fs::path(dir_) / dirName(choice.nums[1], choice.nums[2])).string();
  if (choice.nums[3] != world)
    throw InvalidArgument(fmt::format("[rank {}] checkpoint {} was written by {} ranks, this group has {}: loading "
                                      "at another world size is not supported yet",
                                      rank, cdir, choice.nums[3], world));

  // Every rank reads its own file; all succeed or all throw.
  std::optional<CheckpointState> state;
  std::string error;
  try {
    state = load((fs::path(cdir) / rankFileName(rank, world)).string());
    // The parameter servers' state is the job's, in rank 0's file: every worker's loadState needs it.
    if (rank != 0 && choice.nums[0] == 2)
      state->parameter_server = load((fs::path(cdir) / rankFileName(0, world)).string()).parameter_server;
  } catch (const std::exception& e) {
    error = detail::errorText(e);
  }
  std::vector<Report> reports;
  try {
    reports = gatherReports(pg, {0, 0, 0, 0}, error);
  } catch (const std::exception&) {
    detail::rethrowWithContext(context);
  }
  std::vector<std::string> problems;
  for (int r = 0; r < world; ++r)
    if (!reports[static_cast<size_t>(r)].error.empty())
      problems.push_back(fmt::format("rank {}: {}", r, reports[static_cast<size_t>(r)].error));
  if (!problems.empty())
    throw Error(fmt::format("[rank {}] checkpoint {} could not be loaded: {}", rank, cdir, fmt::join(problems, "; ")));
  return state;
}

}  // namespace dtrain
