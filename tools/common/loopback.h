// Addresses and ports on 127.0.0.1, for the tools and the tests that start
// servers, proxies and ranks on this machine.
#ifndef CKPTIO_TOOLS_COMMON_LOOPBACK_H_
#define CKPTIO_TOOLS_COMMON_LOOPBACK_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

namespace ckptio {

// 127.0.0.1:port (port 0: any free port, when bound).
inline sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

// A TCP port on 127.0.0.1 that was free a moment ago (-1 if none could be
// bound): for a server the caller starts next, which must still handle the
// port being taken by then.
inline int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a = Loopback(0);
  socklen_t len = sizeof a;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// A TCP socket listening on 127.0.0.1:port (port 0: any free port), with
// SO_REUSEADDR so that a fixed port can be taken again at once after its last
// user; the port it got goes to *bound. Returns the socket, or -1 with errno
// telling why.
inline int ListenOnLoopback(int port, int backlog, int* bound = nullptr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1;
  sockaddr_in a = Loopback(port);
  socklen_t len = sizeof a;
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, backlog) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int why = errno;
    ::close(fd);
    errno = why;
    return -1;
  }
  if (bound != nullptr) *bound = ntohs(a.sin_port);
  return fd;
}

}  // namespace ckptio

#endif  // CKPTIO_TOOLS_COMMON_LOOPBACK_H_
