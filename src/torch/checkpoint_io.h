// What both checkpoint layouts share (internal): durable atomic writes, reading a file, the names,
// the pickled dict of a CheckpointState and reading it back with errors that name the file and say
// what was found when it is not a dtrain checkpoint.
#pragma once
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint.h"

namespace dtrain::detail {

inline constexpr const char* kCheckpointFormat = "dtrain-checkpoint-v1";
inline constexpr const char* kCheckpointPrefix = "ckpt-";
inline constexpr const char* kCheckpointTmpPrefix = ".tmp-";

// Writes bytes to dir/.tmp-<name>, fsyncs it, renames it to dir/<name> and fsyncs dir: a crash leaves
// either the old dir/<name> (or none) or the new one, never a partial file. Returns dir/<name>.
// dtrain::Error naming the file on failure (the temporary file is removed).
std::string writeFileAtomically(const std::string& dir, const std::string& name, const std::vector<char>& bytes);
// Durably removes dir/<name> if it exists (unlink, then fsync dir).
void removeFileDurably(const std::string& dir, const std::string& name);
std::vector<char> readFile(const std::string& path);

// "ckpt-<epoch>-<step><suffix>" -> (epoch, step); nullopt for anything else (.tmp- files included).
std::optional<std::pair<int64_t, int64_t>> parseCheckpointName(const std::string& name, const std::string& suffix);

// The creating dir (or its nearest existing ancestor) must be a directory, and writable for a writer:
// InvalidArgument naming the path otherwise, at construction rather than at the first save.
void checkCheckpointDir(const std::string& dir, bool writer);

// torch::pickle_save of the state's dict; rank >= 0 adds the keys "rank" and "world_size" (per-rank files).
std::vector<char> pickleState(const CheckpointState& state, int rank = -1, int world_size = 0);

// torch::pickle_save of `dict` with its content digest added under "checksum" (comm/util/digest.h), which
// loadCheckpointDict checks: checkpoints, manifests and peer snapshots are written so.
std::vector<char> pickleWithDigest(c10::impl::GenericDict dict);

// The dict a checkpoint file (or manifest) holds. Error naming path: "is not a dtrain checkpoint: ..."
// with what was found (not a zip archive, a zip without a torch pickle, not a dict, no 'format' key,
// another format) or "is corrupt or truncated" for a torch archive that does not load.
// What loadTorchArchive calls the file in errors ("checkpoint", "a dtrain checkpoint"), and whether its
// pickle may hold Python's OrderedDicts (a state_dict: pickle_load.h).
struct TorchFileKind {
  const char* noun;
  const char* kind;
  bool python_dicts;
};
// The dict a torch.save / torch::pickle_save file holds, after checking its zip layout, records and pickle.
// Error naming path ("... is not <kind>: ...", "<noun> <path> is corrupt or truncated: ...").
c10::IValue loadTorchArchive(const std::string& path, const std::vector<char>& bytes, const TorchFileKind& kind);

c10::impl::GenericDict loadCheckpointDict(const std::string& path, const std::vector<char>& bytes,
                                          const std::string& format);
CheckpointState unpickleState(const std::string& path, const c10::impl::GenericDict& dict);

// Typed access to a checkpoint dict; errors name the file and the key.
class DictReader {
 public:
  DictReader(std::string path, c10::impl::GenericDict dict) : path_(std::move(path)), dict_(std::move(dict)) {}
  bool has(const std::string& key) const { return dict_.find(key) != dict_.end(); }
  const c10::IValue& get(const std::string& key) const;
  std::string str(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  at::Tensor tensor(const std::string& key) const;
  std::string bytes(const std::string& key) const;  // a 1-D uint8 tensor
  c10::impl::GenericDict dict(const std::string& key) const;
  std::map<std::string, at::Tensor> tensors(const std::string& key) const;
  std::map<std::string, double> numbers(const std::string& key) const;
  std::vector<std::string> strings(const std::string& key) const;
  std::vector<int64_t> integers(const std::string& key) const;

 private:
  [[noreturn]] void fail(const std::string& key, const std::string& what) const;
  std::string path_;
  c10::impl::GenericDict dict_;
};

}  // namespace dtrain::detail
