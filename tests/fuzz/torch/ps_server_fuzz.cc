// libFuzzer harness: the parameter server's request decoding and handlers (src/torch/ps/server*.cc) as a
// real ps::Server (one server, one worker; BSP, SSP or ASP by byte 0) sees them, with the harness as the
// worker: rank 0 of the pair's 2-rank group (tcp over loopback), sending what the input says. Input after
// byte 0: records of a 40-byte request header (magic, op, flags, key, clock, count, row_dim, aux: the
// bytes as they are), then payload chunks, each a control byte (bit 7: no chunk, and none after; bits
// 0-1: the dtype, u8, f32 or i64; bit 6: another chunk follows), a 16-bit element count and the elements
// (zero-padded where the input ends): a push of rows is ids (i64) then values (f32). The harness sends
// every record (each send waits at most 200 ms), then closes its group; the server must end with a
// dtrain::Error or cleanly (a goodbye), within its deadlines, never crash or throw anything else.
#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/ps.h"
#include "torch/ps/protocol.h"
#include "../fuzz_util.h"

namespace fuzz = dtrain::fuzz;
using dtrain::comm::DType;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static dtrain::comm::TcpStoreServer store_server("127.0.0.1", 0);
  static auto client = std::make_shared<dtrain::comm::TcpStore>("127.0.0.1", store_server.port(), std::chrono::seconds(5));
  static int run = 0;
  auto store = std::make_shared<dtrain::comm::PrefixStore>(fmt::format("run{}", run++), client);

  dtrain::ps::PSOptions o;
  o.consistency = data[0] % 3 == 0   ? dtrain::ps::Consistency::bsp
                  : data[0] % 3 == 1 ? dtrain::ps::Consistency::ssp
                                     : dtrain::ps::Consistency::asp;
  o.timeout = std::chrono::milliseconds(1000);
  o.partition_bytes = 1 << 16;  // small partitions: a claim of many elements meets the limit quickly
  std::string server_error;
  std::atomic<bool> foreign{false};
  dtrain::ps::Server server(store, 0, 1, 1, o);
  std::thread serving([&] {
    try {
      server.run();
    } catch (const dtrain::Error& e) {
      server_error = e.what();
    } catch (const std::exception& e) {
      server_error = e.what();
      foreign = true;
    }
  });

  // As a worker makes it: the environment's options (the transport), its own deadline.
  dtrain::comm::GroupOptions g = dtrain::comm::GroupOptions::fromEnv();
  g.timeout = std::chrono::seconds(2);
  {
    std::shared_ptr<dtrain::comm::ProcessGroup> pg;
    std::vector<uint8_t> payload;
    size_t at = 1;
    try {
      pg = dtrain::comm::ProcessGroup::create(dtrain::ps::pairStore(store, 0, 0), 0, 2, g);
      while (at + dtrain::ps::kHeaderBytes <= size) {
        dtrain::ps::Header h;
        std::memcpy(&h, data + at, sizeof h);
        at += sizeof h;
        pg->send(&h, sizeof h, DType::u8, 1)->wait(std::chrono::milliseconds(200));
        for (bool more = true; more && at + 3 <= size;) {
          const uint8_t ctl = data[at];
          const size_t count = data[at + 1] | static_cast<size_t>(data[at + 2]) << 8;
          at += 3;
          if (ctl & 0x80) break;
          more = ctl & 0x40;
          static const DType kTypes[] = {DType::u8, DType::f32, DType::i64, DType::f32};
          static const size_t kSizes[] = {1, 4, 8, 4};
          const size_t bytes = count * kSizes[ctl & 3];
          payload.assign(bytes, 0);
          const size_t have = std::min(bytes, size - at);
          if (have) std::memcpy(payload.data(), data + at, have);
          at += have;
          if (count) pg->send(payload.data(), count, kTypes[ctl & 3], 1)->wait(std::chrono::milliseconds(200));
        }
      }
    } catch (const dtrain::Error&) {
      // the server failed (it says why to this worker) or a send waited past 200 ms: stop sending
    }
    if (!pg) server.abort("fuzz harness: the worker's group did not form");
    // Destroying the group tells the server (a closed connection, or the shm group's closed flag).
  }
  serving.join();
  if (foreign) fuzz::die("the server threw something else than a dtrain::Error: " + server_error);
  return 0;
}
