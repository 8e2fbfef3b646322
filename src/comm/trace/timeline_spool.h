// The timeline's spool: while a rank runs, its writer thread copies the recorded events into
// DIR/trace-rank<R>.spool in a compact binary form (some 40 bytes an op, against some 250 of JSON), and
// the JSON is made from the spool when the timeline is flushed (dtrain::trace::flush(), a failed op)
// and at exit. On the machine this was measured on, formatting and writing JSON while a tight loop of
// 4 KiB allreduces ran cost that loop some 12% (`dtrain-bench allreduce --timeline-blocks`); spooling
// costs a fraction of it. A rank that dies leaves its spool beside its JSON, and dtrain-trace merge
// reads both.
//
// The spool is self-contained (strings by value, never pointers): a header, then records, each a type
// byte and its fields in the machine's byte order:
//   'T' tid u64                  the events that follow are this thread's
//   'N' tid u64, str             a thread's name
//   'H' id u32, shape            an op's constant part (group, dtype, count, peers..., name, category)
//   'E' event                    kind, times, what its kind carries, then name, category, args' keys
//                                (an op: its shape's id, sequence number, queue time; its error if any)
// where str is a u32 length and the bytes. A string reference is a u32: 0 for none; kInline and a str
// for text stored once (copied names, error messages); kDefine, an id and a str for a literal's first
// use; else that id.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "comm/trace/timeline_buffer.h"

namespace dtrain::comm::trace::timeline {

constexpr char kSpoolMagic[8] = {'D', 'T', 'S', 'P', 'O', 'O', 'L', '1'};
constexpr size_t kSpoolHeader = 8 + 4 + 8;  // magic, pid i32, skew_us i64

// The writer thread's encoder. Strings in a chunk's arena are written by value; other strings (literals)
// once per spool, checked by content, so a caller's buffer reused for another name stays right.
class SpoolWriter {
 public:
  // The header of an empty spool; forgets every definition written before.
  void begin(std::string& out, int pid, int64_t skew_us);
  void threadName(std::string& out, uint64_t tid, const std::string& name);
  void event(std::string& out, const Event& e, const Chunk& c, uint64_t tid);
  // Before a drained chunk is handed back for reuse: its shapes' addresses will be reused.
  void forgetShapes() { shapes_.clear(); }

 private:
  void ref(std::string& out, const char* s, const Chunk& c);
  uint32_t shape(std::string& out, const Event& e, const Chunk& c);

  struct Literal {
    uint32_t id;
    std::string text;
  };
  std::unordered_map<const char*, Literal> strings_;
  struct Shape {  // an 'H' record written: its id, and the name and category of the ops it was for
    uint32_t id;
    const char* name;
    const char* cat;
  };
  std::unordered_map<const OpShape*, Shape> shapes_;
  uint32_t next_id_ = 1;
  uint64_t tid_ = ~uint64_t{0};
};

// Reads a spool's records back and formats their events as the writer would have (format()).
class SpoolReader {
 public:
  // Checks the header (throws naming what is wrong); returns its size.
  size_t header(const char* data, size_t n);
  // Formats the whole records at the front of [data, data + n) onto `out`; returns the bytes they took
  // (a record cut by the end of the data is left for the next call). Throws on a record that cannot be.
  size_t read(const char* data, size_t n, std::string& out);

 private:
  int pid_ = 0;
  int64_t skew_us_ = 0;
  uint64_t tid_ = 0;
  std::deque<std::string> text_;                      // every string read (stable addresses)
  std::unordered_map<uint32_t, const char*> strings_;  // kDefine ids
  struct Shape {  // an 'H' record read
    OpShape shape;
    const char* name;
    const char* cat;
  };
  std::deque<Shape> shapes_;
  std::deque<std::vector<int>> peers_;
  std::unordered_map<uint32_t, const Shape*> shape_ids_;
};

// A spool file's events as JSON lines (each "\n," and an event, as in the rank's JSON file), for
// dtrain-trace merge; a record cut by the end of the file (a rank that died) ends it. Throws naming the
// file when it is not a spool.
std::string spoolFileToJson(const std::string& path);

// The thread_name and thread_sort_index metadata events of a thread, as JSON lines.
void appendThreadName(std::string& out, int pid, uint64_t tid, const std::string& name);

}  // namespace dtrain::comm::trace::timeline
