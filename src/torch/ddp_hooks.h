// The thread that runs DistributedDataParallel's comm-hook continuations (GradBucket::then) in the same
// order on every rank. Internal; not installed.
//
// Each bucket launch opens a lane; then() reserves the lane's next slot and the Work it waits for fills
// the slot when it completes (on whatever thread that is). The runner takes lanes in the order they
// were opened (bucket order) and runs a lane's slots in reservation order, each once it is filled; it
// leaves a lane once the hook's run() returned (the lane is sealed) and no slot is left. So the
// continuations, and the collectives they issue, follow bucket order and chain order, not completion
// order, which differs across ranks.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dtrain/comm/work.h"

namespace dtrain::comm {
class ProcessGroup;
}

namespace dtrain::detail {

struct HookLane;

// Shared by the runner thread, the lanes and the Works' completion callbacks.
struct HookQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<HookLane>> lanes;  // opened, not yet left by the runner
  bool stopping = false;
};

// One bucket launch's continuations.
struct HookLane {
  struct Slot {
    std::function<void()> task;
    bool filled = false;
  };
  std::shared_ptr<HookQueue> queue;
  int bucket = 0;
  int rank = 0;
  std::string hook;
  comm::ProcessGroup* chain_group = nullptr;  // null unless the hook chainsCollectives()
  // Under queue->mu:
  std::deque<std::shared_ptr<Slot>> slots;
  bool sealed = false;  // run() returned
  bool done = false;    // the runner left this lane

  // The next slot, as the Post that fills it (Work::then's `post`).
  comm::Work::Post reserve();
  void seal();
};

class HookRunner {
 public:
  HookRunner();
  ~HookRunner();
  HookRunner(const HookRunner&) = delete;
  HookRunner& operator=(const HookRunner&) = delete;
  // On autograd's thread, in bucket order, before the hook's run() for that bucket.
  std::shared_ptr<HookLane> open(int bucket, int rank, std::string hook, comm::ProcessGroup* chain_group);

 private:
  void loop();
  std::shared_ptr<HookQueue> q_;
  std::thread thread_;
};

}  // namespace dtrain::detail
