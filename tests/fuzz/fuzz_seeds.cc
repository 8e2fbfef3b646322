// Writes the seed corpora of the fuzzing harnesses (tests/fuzz/corpus/<harness>/), made with dtrain's
// own encoders so that each seed is a well-formed input the harness's decoder accepts or meets in a
// normal run:  fuzz_seeds tests/fuzz/corpus
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/net/auth.h"
#include "comm/store/tcp_store_codec.h"
#include "comm/trace/timeline_buffer.h"
#include "comm/trace/timeline_spool.h"
#include "comm/transport/transport.h"

using namespace dtrain::comm;  // NOLINT(google-build-using-namespace)
namespace comm = dtrain::comm;
namespace wire = comm::tcp_store_wire;

namespace {
std::string root;

void write(const std::string& harness, const std::string& name, const std::string& bytes) {
  const std::string dir = root + "/" + harness;
  ::mkdir(root.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}
std::string str(const Bytes& b) { return std::string(b.begin(), b.end()); }
template <class T>
std::string raw(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

void storeServer() {
  const Bytes value{1, 2, 3, 4};
  std::vector<std::pair<std::string, Bytes>> frames = {
      {"set", wire::Writer().str("k").str(value).finish(uint16_t(wire::Cmd::kSet))},
      {"get", wire::Writer().str("k").finish(uint16_t(wire::Cmd::kGet))},
      {"add", wire::Writer().str("n").i64(3).finish(uint16_t(wire::Cmd::kAdd))},
      {"compare_set", wire::Writer().str("k").str(value).str(Bytes{9}).finish(uint16_t(wire::Cmd::kCompareSet))},
      {"delete", wire::Writer().str("k").finish(uint16_t(wire::Cmd::kDelete))},
      {"check", wire::Writer().keys({"a", "k"}).finish(uint16_t(wire::Cmd::kCheck))},
      {"wait", wire::Writer().keys({"k"}).finish(uint16_t(wire::Cmd::kWait))},
      {"num_keys", wire::Writer().finish(uint16_t(wire::Cmd::kNumKeys))}};
  std::string all = std::string(1, '\0');
  for (auto& [name, f] : frames) {
    write("store_server_fuzz", name, std::string(1, '\0') + str(f));
    all += str(f);
  }
  write("store_server_fuzz", "all", all);
  write("store_server_fuzz", "secret_set", std::string(1, '\1') + std::string(32, 'm') + str(frames[0].second));
}

void storeClient() {
  comm::net::Challenge c{};
  const auto g = comm::net::greeting(false, c);
  const std::string greet(g.begin(), g.end());
  const Bytes value{1, 2, 3};
  const std::vector<std::string> answers = {
      str(wire::Writer().finish(wire::kOk)),                         // set
      str(wire::Writer().str(value).finish(wire::kOk)),              // get
      str(wire::Writer().i64(8).finish(wire::kOk)),                  // add
      str(wire::Writer().str(value).finish(wire::kOk)),              // compare_set
      str(wire::Writer().u8(1).finish(wire::kOk)),                   // delete
      str(wire::Writer().u8(1).u8(0).u8(1).finish(wire::kOk)),       // check
      str(wire::Writer().finish(wire::kOk)),                         // wait
      str(wire::Writer().i64(5).finish(wire::kOk))};                 // num_keys
  for (size_t i = 0; i < answers.size(); ++i)
    write("store_client_fuzz", "op" + std::to_string(i), std::string(1, char(i)) + greet + answers[i]);
  write("store_client_fuzz", "add_refused",
        std::string(1, '\2') + greet + str(wire::Writer().str("not an integer").finish(wire::kInvalidArgument)));
  const auto gs = comm::net::greeting(true, c);
  write("store_client_fuzz", "secret_get", std::string(1, char(8 + 1)) + std::string(gs.begin(), gs.end()) + "A" +
                                                   answers[1]);
}

void tcpTransport() {
  comm::transport::Label l;
  l.op = comm::transport::OpCode::allreduce;
  l.fp.op = static_cast<uint16_t>(comm::transport::OpCode::allreduce);
  l.fp.dtype = static_cast<uint8_t>(DType::f32);
  l.fp.count = 64;
  const std::string payload(256, '\x3f');
  const std::string frame = raw(comm::transport::frameHeader(l, 0, 256)) + payload;
  write("tcp_transport_fuzz", "frame", std::string(1, '\0') + frame);
  write("tcp_transport_fuzz", "frame_reduce", std::string(1, '\2') + frame);
  write("tcp_transport_fuzz", "stranger", std::string(1, '\1') + frame);
  std::string msg;
  const auto h = comm::transport::abortHeader(dtrain::ProtocolError("[rank 1] allreduce: fuzz"), msg);
  write("tcp_transport_fuzz", "abort", std::string(1, '\0') + raw(h) + msg);
}

void timelineSpool() {
  using namespace comm::trace::timeline;  // NOLINT(google-build-using-namespace)
  auto chunk = std::make_unique<Chunk>();
  SpoolWriter w;
  std::string out;
  w.begin(out, 1234, 56);
  w.threadName(out, 7, "dtrain group 0");
  Event span;
  span.kind = Event::kSpan;
  span.ts = 1000;
  span.dur = 50;
  span.name = "forward";
  span.cat = "step";
  span.s.index = 3;
  span.s.id = 0;
  span.s.args[0] = {"bytes", 4096};
  span.s.args[1] = span.s.args[2] = span.s.args[3] = {nullptr, 0};
  w.event(out, span, *chunk, 7);
  static const int peers[] = {0, 1};
  OpShape shape;
  shape.group = "world";
  shape.op = "allreduce";
  shape.dtype = "f32";
  shape.count = 1024;
  shape.bytes = 4096;
  shape.npeers = 2;
  shape.peers = peers;
  Event op;
  op.kind = Event::kOp;
  op.ts = 1100;
  op.dur = 20;
  op.name = "allreduce";
  op.cat = "comm";
  op.o.shape = &shape;
  op.o.text = nullptr;
  op.o.seq = 4;
  op.o.queued_us = 3;
  w.event(out, op, *chunk, 7);
  op.failed = true;
  op.o.text = "[rank 0] allreduce: peer rank 1 failed";
  w.event(out, op, *chunk, 8);
  write("timeline_spool_fuzz", "spool", out);
}

void etcdAnswers() {
  // byte 0: the operation (etcd_answer_fuzz.cc's request()), then the gateway's JSON.
  const std::string hdr = R"("header":{"cluster_id":"1","member_id":"2","revision":"7","raft_term":"3"})";
  write("etcd_answer_fuzz", "put", std::string(1, '\0') + "{" + hdr + "}");
  write("etcd_answer_fuzz", "range",
        std::string(1, '\1') + "{" + hdr +
            R"(,"kvs":[{"key":"L2Z1enovaw==","create_revision":"5","mod_revision":"7","version":"2","value":"AQID"}],"count":"1"})");
  write("etcd_answer_fuzz", "txn",
        std::string(1, '\3') + "{" + hdr +
            R"(,"succeeded":true,"responses":[{"response_range":{"header":{"revision":"7"},"kvs":[{"key":"L2Z1enovaw==","value":"Ag=="}]}}]})");
  write("etcd_answer_fuzz", "delete", std::string(1, '\4') + "{" + hdr + R"(,"deleted":"1"})");
  write("etcd_answer_fuzz", "count", std::string(1, '\6') + "{" + hdr + R"(,"count":"4"})");
  write("etcd_answer_fuzz", "error",
        std::string(1, char(0x81)) + R"({"error":"etcdserver: requested lease not found","code":5,"message":"x"})");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  root = argv[1];
  storeServer();
  storeClient();
  tcpTransport();
  timelineSpool();
  etcdAnswers();
  return 0;
}
