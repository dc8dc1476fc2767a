// The RPC-counting forwarder of the NFS tests (see rpc_counter.h).
#include "rpc_counter.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>

#include "common/loopback.h"

namespace ckptio::testing {
namespace {

constexpr uint32_t kNfsProgram = 100003;

std::string ProcedureName(uint32_t program, uint32_t version, uint32_t procedure) {
  static const char* const kNfs3[] = {
      "NULL",    "GETATTR",     "SETATTR", "LOOKUP", "ACCESS",   "READLINK", "READ",   "WRITE",
      "CREATE",  "MKDIR",       "SYMLINK", "MKNOD",  "REMOVE",   "RMDIR",    "RENAME", "LINK",
      "READDIR", "READDIRPLUS", "FSSTAT",  "FSINFO", "PATHCONF", "COMMIT"};
  if (program == kNfsProgram && version == 3 && procedure < std::size(kNfs3))
    return kNfs3[procedure];
  if (program == kNfsProgram && version == 4 && procedure == 1) return "COMPOUND";
  return std::to_string(program) + "/" + std::to_string(version) + "/" + std::to_string(procedure);
}

uint32_t Word(const std::string& b, size_t at) {
  uint32_t w;
  std::memcpy(&w, b.data() + at, 4);
  return ntohl(w);
}

// Finds the calls in a client's byte stream: records of fragments, each
// behind a 4-byte mark (last-fragment bit, length); a record's first 24
// bytes are xid, message type (0: call), RPC version, program, version and
// procedure.
class CallParser {
 public:
  template <typename OnCall>
  void Feed(const char* p, size_t n, OnCall on_call) {
    while (n > 0) {
      if (left_ == 0) {  // a fragment's mark
        const size_t take = std::min(n, 4 - head_.size());
        head_.append(p, take);
        p += take;
        n -= take;
        if (head_.size() < 4) return;
        const uint32_t mark = Word(head_, 0);
        head_.clear();
        left_ = mark & 0x7fffffffu;
        want_header_ = record_start_;
        record_start_ = (mark & 0x80000000u) != 0;  // the next fragment starts a record
        continue;
      }
      size_t take = std::min<size_t>(n, left_);
      if (want_header_) {
        take = std::min(take, 24 - head_.size());
        head_.append(p, take);
        if (head_.size() == 24) {
          if (Word(head_, 4) == 0) on_call(Word(head_, 12), Word(head_, 16), Word(head_, 20));
          head_.clear();
          want_header_ = false;
        }
      }
      p += take;
      n -= take;
      left_ -= take;
      if (left_ == 0 && want_header_) {  // a first fragment under 24 bytes: not a call
        head_.clear();
        want_header_ = false;
      }
    }
  }

 private:
  std::string head_;
  uint64_t left_ = 0;  // bytes of the current fragment still to come
  bool want_header_ = false, record_start_ = true;
};

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

std::string RpcCounter::Calls::ToString() const {
  std::multimap<int, std::string, std::greater<int>> ranked;
  for (const auto& [name, n] : by_name) ranked.emplace(n, name);
  std::string s = std::to_string(total()) + " calls";
  const char* sep = ": ";
  for (const auto& [n, name] : ranked) {
    s += sep + std::to_string(n) + " " + name;
    sep = ", ";
  }
  return s;
}

RpcCounter::RpcCounter(int to_port) : to_port_(to_port) {
  listen_fd_ = ListenOnLoopback(0, 16, &port_);
  if (listen_fd_ < 0) return;
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

RpcCounter::~RpcCounter() {
  if (listen_fd_ < 0) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
    for (int fd : sockets_) ::shutdown(fd, SHUT_RDWR);
  }
  ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept
  acceptor_.join();
  for (auto& t : servers_) t.join();  // (no new ones once stopping)
  ::close(listen_fd_);
  for (int fd : sockets_) ::close(fd);
}

RpcCounter::Calls RpcCounter::Take() {
  std::lock_guard<std::mutex> g(mu_);
  Calls out;
  std::swap(out, calls_);
  return out;
}

void RpcCounter::Count(const std::string& name) {
  std::lock_guard<std::mutex> g(mu_);
  ++calls_.by_name[name];
  calls_.order.push_back(name);
}

void RpcCounter::AcceptLoop() {
  while (true) {
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    std::lock_guard<std::mutex> g(mu_);
    if (client < 0) {
      if (stopping_ || (errno != EINTR && errno != ECONNABORTED)) return;
      continue;
    }
    if (stopping_) {
      ::close(client);
      return;
    }
    sockets_.push_back(client);
    servers_.emplace_back([this, client] { Serve(client); });
  }
}

void RpcCounter::Serve(int client) {
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (server < 0) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    sockets_.push_back(server);
    if (stopping_) return;
  }
  const sockaddr_in target = Loopback(to_port_);
  if (::connect(server, reinterpret_cast<const sockaddr*>(&target), sizeof target) != 0) {
    ::shutdown(client, SHUT_RDWR);
    return;
  }
  const int one = 1;
  for (int fd : {client, server}) ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // Replies flow back untouched; each call is counted before it is passed
  // on, so it is counted by the time its caller has the answer.
  std::thread down([&] {
    std::string buf(1 << 16, '\0');
    ssize_t n;
    while ((n = ::read(server, buf.data(), buf.size())) > 0 || (n < 0 && errno == EINTR))
      if (n > 0 && !WriteAll(client, buf.data(), static_cast<size_t>(n))) break;
    ::shutdown(client, SHUT_RDWR);
  });
  CallParser parser;
  std::string buf(1 << 16, '\0');
  ssize_t n;
  while ((n = ::read(client, buf.data(), buf.size())) > 0 || (n < 0 && errno == EINTR)) {
    if (n <= 0) continue;
    parser.Feed(buf.data(), static_cast<size_t>(n),
                [&](uint32_t prog, uint32_t vers, uint32_t proc) {
                  Count(ProcedureName(prog, vers, proc));
                });
    if (!WriteAll(server, buf.data(), static_cast<size_t>(n))) break;
  }
  ::shutdown(server, SHUT_RDWR);
  down.join();
}

}  // namespace ckptio::testing
