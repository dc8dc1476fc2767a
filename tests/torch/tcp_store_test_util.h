// A TCPStore on 127.0.0.1 for the tests of the c10d wait mode.
#ifndef CKPTIO_TESTS_TORCH_TCP_STORE_TEST_UTIL_H_
#define CKPTIO_TESTS_TORCH_TCP_STORE_TEST_UTIL_H_

#include <chrono>
#include <cstdint>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ckptio/torch.h"

namespace ckptio::testing {

// The server (port 0: a free one, see getPort()) or a client of it; the
// classic (non-libuv) server, which every LibTorch this builds with has.
inline c10::intrusive_ptr<c10d::TCPStore> ConnectTcpStore(
    uint16_t port, bool server, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = server;
  o.waitWorkers = false;
  o.timeout = timeout;
  UseClassicTcpStore(o);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

}  // namespace ckptio::testing

#endif  // CKPTIO_TESTS_TORCH_TCP_STORE_TEST_UTIL_H_
