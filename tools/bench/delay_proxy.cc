// ckptio-delay-proxy: a TCP proxy on 127.0.0.1 that holds every byte for a
// fixed delay in each direction, so an NFS server on loopback answers as
// one across a network would (each round trip costs 2 x the delay). It is
// a delay line, not a bandwidth cap: bytes keep flowing while earlier ones
// wait. For measuring how the nfs:// backend behaves with latency
// (docs/PERFORMANCE.md); not a test fixture.
//
//   ckptio-delay-proxy --listen PORT --to PORT [--delay-us N]
//
// Point an nfs:// URI's nfsport at --listen (v3: mountport stays direct).
// Runs until killed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/loopback.h"

namespace {

using Clock = std::chrono::steady_clock;

// Bytes read from one socket, each chunk written to the other `delay`
// after it arrived. The reader stops reading while kMaxQueued bytes wait.
class DelayLine {
 public:
  DelayLine(int from, int to, std::chrono::microseconds delay)
      : from_(from), to_(to), delay_(delay) {}

  // Forwards until `from` ends or either socket fails, then half-closes `to`.
  void Run() {
    std::thread writer([this] { WriteLoop(); });
    std::string buf(1 << 20, '\0');
    while (true) {
      const ssize_t n = ::read(from_, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      std::unique_lock<std::mutex> g(mu_);
      if (n <= 0 || failed_) break;
      room_.wait(g, [&] { return queued_ < kMaxQueued || failed_; });
      queued_ += static_cast<size_t>(n);
      chunks_.emplace_back(Clock::now() + delay_, buf.substr(0, static_cast<size_t>(n)));
      ready_.notify_one();
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      ended_ = true;
    }
    ready_.notify_one();
    writer.join();
  }

 private:
  static constexpr size_t kMaxQueued = 64 << 20;

  void WriteLoop() {
    while (true) {
      std::unique_lock<std::mutex> g(mu_);
      ready_.wait(g, [&] { return ended_ || !chunks_.empty(); });
      if (chunks_.empty()) break;
      auto [due, bytes] = std::move(chunks_.front());
      chunks_.pop_front();
      g.unlock();
      std::this_thread::sleep_until(due);
      if (!WriteAll(bytes)) {
        std::lock_guard<std::mutex> f(mu_);
        failed_ = true;
        room_.notify_all();
        ::shutdown(from_, SHUT_RD);  // wakes the reader
        return;
      }
      g.lock();
      queued_ -= bytes.size();
      room_.notify_all();
    }
    ::shutdown(to_, SHUT_WR);
  }
  bool WriteAll(const std::string& bytes) const {
    for (size_t off = 0; off < bytes.size();) {
      const ssize_t n = ::write(to_, bytes.data() + off, bytes.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  const int from_, to_;
  const std::chrono::microseconds delay_;
  std::mutex mu_;
  std::condition_variable ready_, room_;
  std::deque<std::pair<Clock::time_point, std::string>> chunks_;
  size_t queued_ = 0;
  bool ended_ = false, failed_ = false;
};

// Both directions of one client connection, then closes both sockets.
void Serve(int client, int to_port, std::chrono::microseconds delay) {
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_in target = ckptio::Loopback(to_port);
  if (server < 0 ||
      ::connect(server, reinterpret_cast<const sockaddr*>(&target), sizeof target) != 0) {
    std::fprintf(stderr, "ckptio-delay-proxy: cannot connect to 127.0.0.1:%d: %s\n", to_port,
                 std::strerror(errno));
    if (server >= 0) ::close(server);
    ::close(client);
    return;
  }
  const int one = 1;
  for (int fd : {client, server}) ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  DelayLine up(client, server, delay), down(server, client, delay);
  std::thread t([&] { down.Run(); });
  up.Run();
  t.join();
  ::close(server);
  ::close(client);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A TCP proxy on 127.0.0.1 that delays every byte in each direction."};
  int listen_port = 0, to_port = 0;
  int64_t delay_us = 250;
  app.add_option("--listen", listen_port, "port to accept connections on")
      ->required()
      ->check(CLI::Range(1, 65535));
  app.add_option("--to", to_port, "port on 127.0.0.1 to forward them to")
      ->required()
      ->check(CLI::Range(1, 65535));
  app.add_option("--delay-us", delay_us, "delay each way, in microseconds (round trip: 2 x)")
      ->check(CLI::Range(int64_t{0}, int64_t{10'000'000}));
  CLI11_PARSE(app, argc, argv);
  ::signal(SIGPIPE, SIG_IGN);

  const int ls = ckptio::ListenOnLoopback(listen_port, 64);
  if (ls < 0) {
    std::fprintf(stderr, "ckptio-delay-proxy: cannot listen on 127.0.0.1:%d: %s\n", listen_port,
                 std::strerror(errno));
    return 1;
  }
  std::printf("ckptio-delay-proxy: 127.0.0.1:%d -> 127.0.0.1:%d, %lld us each way\n", listen_port,
              to_port, static_cast<long long>(delay_us));
  std::fflush(stdout);
  while (true) {
    const int client = ::accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // until connections end
      else if (errno != EINTR && errno != ECONNABORTED) {
        std::fprintf(stderr, "ckptio-delay-proxy: accept: %s\n", std::strerror(errno));
        return 1;
      }
      continue;
    }
    std::thread(Serve, client, to_port, std::chrono::microseconds(delay_us)).detach();
  }
}
