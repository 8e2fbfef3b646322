// torch::pickle_load with its tensors checked against their records (see pickle_load.h). The steps are
// libtorch's own (torch/csrc/jit/serialization/pickle.cpp: readArchiveAndTensors of "data.pkl" with the
// tensors under "data/"), with the archive read through BytesAdapter and every record's size kept.
#include "pickle_load.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/csrc/jit/serialization/unpickler.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "zip_layout.h"

namespace dtrain::detail {

namespace {

// The archive's bytes, for libtorch's zip reader: a read past the end gets what there is (libtorch's
// own adapter copied whatever was asked, past the buffer).
class BytesAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BytesAdapter(const std::vector<char>& bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<uint64_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  const std::vector<char>& bytes_;
};

// "" when every tensor in v lies inside its record (`records`: a storage's data -> its record's bytes).
std::string tensorProblem(const c10::IValue& v, const std::map<const void*, size_t>& records, int depth = 0) {
  if (depth > 32) return "values nested more than 32 deep";
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return "";
    if (!t.has_storage()) return "a tensor without storage";
    const auto it = records.find(t.storage().data());
    const size_t have = it == records.end() ? 0 : it->second;
    if (it == records.end() && t.storage().nbytes() > 0) return "a tensor whose storage is not one of its records";
    if (t.storage().nbytes() > have)
      return fmt::format("a storage of {} bytes read from a record of {}", t.storage().nbytes(), have);
    if (t.numel() == 0) return "";
    int64_t last = t.storage_offset();  // the farthest element, in elements
    if (last < 0) return "a tensor with a negative storage offset";
    for (int64_t i = 0; i < t.dim(); ++i) {
      if (t.stride(i) < 0) return "a tensor with a negative stride";
      if (t.size(i) > 1 && t.stride(i) > (std::numeric_limits<int64_t>::max() / 16 - last) / (t.size(i) - 1))
        return "a tensor whose strides overflow";
      last += (t.size(i) - 1) * t.stride(i);
    }
    const auto need = static_cast<uint64_t>(last + 1) * t.element_size();
    if (need > have)
      return fmt::format("a tensor of shape [{}] that reaches {} bytes into a record of {}", fmt::join(t.sizes(), ", "),
                         need, have);
    return "";
  }
  auto each = [&](const c10::IValue& x) { return tensorProblem(x, records, depth + 1); };
  std::string p;
  if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict())
      if (!(p = each(e.key())).empty() || !(p = each(e.value())).empty()) return p;
  } else if (v.isList()) {
    for (const auto& x : v.toListRef())
      if (!(p = each(x)).empty()) return p;
  } else if (v.isTuple()) {
    for (const auto& x : v.toTupleRef().elements())
      if (!(p = each(x)).empty()) return p;
  }
  return "";
}

struct Op {
  unsigned char op;
  uint64_t start, end;
};

// For every SETITEM (one key and value into the dict below them; Python's pickler writes it for a dict
// whose last batch holds one item), the index of the opcode that starts its key: found by following the
// stack, each value remembered by the opcode that began it. libtorch 1.13's unpickler has no SETITEM,
// so plainDicts writes MARK there and SETITEMS for it. Throws on an opcode it does not follow.
std::set<size_t> setItemKeys(const std::vector<Op>& ops) {
  struct Mark {
    size_t depth, op;  // the stack's size at the MARK, and the MARK's opcode
  };
  std::vector<size_t> stack;  // each value's first opcode
  std::vector<Mark> marks;
  std::set<size_t> keys;
  auto pop = [&](size_t n) {
    if (stack.size() < n) throw std::runtime_error("a pickle that pops more than it pushed");
    const size_t first = stack[stack.size() - n];
    stack.resize(stack.size() - n);
    return first;
  };
  auto popMark = [&] {  // pops to the last MARK; returns its opcode
    if (marks.empty() || marks.back().depth > stack.size())
      throw std::runtime_error("a pickle that pops a MARK it did not set");
    const Mark m = marks.back();
    marks.pop_back();
    stack.resize(m.depth);
    return m.op;
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const unsigned char op = ops[i].op;
    switch (op) {
      case 0x80: case 'q': case 'r': case 'p': case '.': break;  // PROTO, memo puts, STOP
      case '(': marks.push_back({stack.size(), i}); break;
      case 'c': case 'X': case 'U': case 'T': case 'B': case 'C': case 'V': case 'S': case 'K': case 'J': case 'M':
      case 'I': case 'L': case 'F': case 'G': case 'N': case 0x88: case 0x89: case ')': case ']': case '}':
      case 'h': case 'j': case 'g': case 0x8a: case 0x8b: stack.push_back(i); break;
      case 'Q': case 0x85: stack.push_back(pop(1)); break;
      case 'R': case 'b': case 0x86: case 0x81: stack.push_back(pop(2)); break;
      case 0x87: stack.push_back(pop(3)); break;
      case 't': case 'l': case 'd': stack.push_back(popMark()); break;  // the MARK begins the new value
      case 'u': case 'e': popMark(); break;  // SETITEMS, APPENDS: the container below the MARK stays
      case 'a': pop(1); break;
      case 's': {
        if (stack.size() < 3) throw std::runtime_error("a SETITEM without a dict, key and value");
        keys.insert(stack[stack.size() - 2]);
        pop(2);
        break;
      }
      default: throw std::runtime_error(fmt::format("a pickle opcode {:#04x} that dtrain does not follow", op));
    }
  }
  return keys;
}

// The rewrite pickle_load.h describes, of the `size` pickle bytes at `data`. libtorch's unpickler has no
// POP, and it turns an OrderedDict into None. torch.save pushes the OrderedDict class once (GLOBAL, then
// memoized) and fetches it from the memo for later instances (BINGET): a tensor's backward hooks (empty)
// and the state_dict's _metadata. So every instance `<class> [memo] EMPTY_TUPLE REDUCE` becomes
// EMPTY_DICT when its items follow ([memo] MARK ... SETITEMS) and NONE otherwise (as libtorch reads it),
// and BUILD (the state_dict's attributes: {'_metadata': ...}) becomes TUPLE2, making (dict, state) of the
// instance and its state; pickleLoadChecked keeps the dict.
// A dict's single last item (SETITEM) becomes MARK key value SETITEMS (setItemKeys).
std::string plainDicts(const char* data, size_t size) {
  std::vector<Op> ops;
  const std::string problem = walkPickle(data, size, [&](unsigned char op, uint64_t start, uint64_t end) {
    ops.push_back({op, start, end});
  });
  if (!problem.empty()) throw std::runtime_error(problem);
  const std::set<size_t> keys = setItemKeys(ops);
  static const std::string kOrderedDict = "ccollections\nOrderedDict\n";
  // The memo index an opcode stores into or fetches from (BINPUT/BINGET: 1 byte, LONG_*: 4, PUT/GET: a line).
  auto memoIndex = [&](const Op& o) -> uint64_t {
    if (o.op == 'q' || o.op == 'h') return static_cast<unsigned char>(data[o.start + 1]);
    if (o.op == 'r' || o.op == 'j') {
      uint64_t v = 0;
      for (int b = 3; b >= 0; --b) v = (v << 8) | static_cast<unsigned char>(data[o.start + 1 + b]);
      return v;
    }
    return std::strtoull(std::string(data + o.start + 1, o.end - o.start - 1).c_str(), nullptr, 10);
  };
  auto isPut = [](unsigned char op) { return op == 'q' || op == 'r' || op == 'p'; };
  auto isGet = [](unsigned char op) { return op == 'h' || op == 'j' || op == 'g'; };
  auto bytesOf = [&](const Op& o) { return std::string(data + o.start, o.end - o.start); };
  std::set<uint64_t> class_memo;  // where the OrderedDict class is memoized
  std::string out;
  out.reserve(size);
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& o = ops[i];
    if (o.op == 0x95 || o.op == 0x94)
      throw std::runtime_error("a protocol 4 pickle (frames, MEMOIZE): dtrain reads torch.save's protocol 2");
    if (keys.count(i)) out += '(';  // SETITEM as MARK key value SETITEMS
    if (o.op == 'b' || o.op == 's') {
      out += o.op == 'b' ? '\x86' : 'u';
      continue;
    }
    const bool global = o.op == 'c' && bytesOf(o) == kOrderedDict;
    const bool fetched = isGet(o.op) && class_memo.count(memoIndex(o)) > 0;
    if (!global && !fetched) {
      out += bytesOf(o);
      continue;
    }
    size_t j = i + 1;
    std::string put;  // the class's memo slot: kept (holding the instance), every fetch of it is rewritten
    if (global && j < ops.size() && isPut(ops[j].op)) {
      class_memo.insert(memoIndex(ops[j]));
      put = bytesOf(ops[j++]);
    }
    if (j + 1 >= ops.size() || ops[j].op != ')' || ops[j + 1].op != 'R')
      throw std::runtime_error(fmt::format("an OrderedDict at offset {} that is not built from an empty tuple", o.start));
    size_t after = j + 2;
    if (after < ops.size() && isPut(ops[after].op)) ++after;
    out += after < ops.size() && ops[after].op == '(' ? '}' : 'N';
    out += put;
    i = j + 1;  // EMPTY_TUPLE REDUCE replaced; the memo and MARK after them follow as they are
  }
  return out;
}

}  // namespace

c10::IValue pickleLoadChecked(const std::vector<char>& bytes, bool python_dicts) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BytesAdapter>(bytes));
  auto record_of_pickle = reader.getRecord("data.pkl");
  const at::DataPtr& pickle = std::get<0>(record_of_pickle);
  size_t pickle_bytes = std::get<1>(record_of_pickle);
  const char* pickle_data = static_cast<const char*>(pickle.get());
  std::string rewritten;
  if (python_dicts) {
    rewritten = plainDicts(pickle_data, pickle_bytes);
    pickle_data = rewritten.data();
    pickle_bytes = rewritten.size();
  }
  size_t at = 0;
  auto read = [&](char* buf, size_t n) {
    n = std::min(n, pickle_bytes - at);
    std::memcpy(buf, pickle_data + at, n);
    at += n;
    return n;
  };
  std::map<const void*, size_t> records;
  auto record = [&](const std::string& name) {
    auto got = reader.getRecord("data/" + name);
    records[std::get<0>(got).get()] = std::get<1>(got);
    return std::move(std::get<0>(got));
  };
  torch::jit::Unpickler unpickler(read, nullptr, nullptr, record, {});
  unpickler.set_version(reader.version());
  c10::IValue root = unpickler.parse_ivalue();
  // A state_dict's (dict, attributes) pair (plainDicts): the dict.
  if (python_dicts && root.isTuple() && root.toTupleRef().elements().size() == 2 &&
      root.toTupleRef().elements()[0].isGenericDict())
    root = root.toTupleRef().elements()[0];
  const std::string problem = tensorProblem(root, records);
  if (!problem.empty()) throw std::runtime_error("its pickle holds " + problem);
  return root;
}

}  // namespace dtrain::detail
