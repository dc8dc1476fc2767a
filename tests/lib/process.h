// Real processes for multi-process tests: forked children that are always
// reaped, pipes for handshakes, a clock shared across processes.
#ifndef CKPTIO_TESTS_LIB_PROCESS_H_
#define CKPTIO_TESTS_LIB_PROCESS_H_

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>

namespace ckptio::testing {

// The exit code of a child whose body threw.
inline constexpr int kChildException = 5;

// CLOCK_MONOTONIC in nanoseconds: comparable between processes of one machine.
inline int64_t NowNs() {
  struct timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

class Pipe {
 public:
  Pipe() {
    int fds[2];
    if (::pipe(fds) == 0) {
      read_ = fds[0];
      write_ = fds[1];
    }
  }
  ~Pipe() {
    CloseRead();
    CloseWrite();
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  bool ok() const { return read_ >= 0 && write_ >= 0; }
  int read_fd() const { return read_; }
  int write_fd() const { return write_; }
  void CloseRead() {
    if (read_ >= 0) ::close(read_);
    read_ = -1;
  }
  void CloseWrite() {
    if (write_ >= 0) ::close(write_);
    write_ = -1;
  }

 private:
  int read_ = -1;
  int write_ = -1;
};

// Writes `line` and a newline (best effort: the reader may be gone).
inline void WriteLine(int fd, const std::string& line) {
  std::string s = line + "\n";
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// One line from fd (without '\n'); nullopt on EOF or timeout.
inline std::optional<std::string> ReadLine(int fd, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  std::string line;
  while (true) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    struct pollfd p = {fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char c;
    ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    if (c == '\n') return line;
    line.push_back(c);
  }
}

// Blocks until the write end of the pipe is closed everywhere (EOF), or
// `timeout`. True on EOF.
inline bool WaitForEof(int fd, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  char buf[64];
  while (true) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    struct pollfd p = {fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// A forked child running `body` (its return value is the exit code); killed
// and reaped if still there when the handle is destroyed, so a failed
// assertion never leaves one behind.
class Child {
 public:
  template <typename Body>
  static Child Start(Body body) {
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = kChildException;
      try {
        code = body();
      } catch (...) {
        std::fprintf(stderr, "child %d: exception\n", static_cast<int>(::getpid()));
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    return Child(pid);
  }
  Child(Child&& o) noexcept : pid_(o.pid_), reaped_(o.reaped_), status_(o.status_) { o.pid_ = -1; }
  Child& operator=(Child&&) = delete;
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // The raw wait status, or nullopt if it is still running after `timeout`.
  std::optional<int> Wait(std::chrono::milliseconds timeout) {
    if (reaped_) return status_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        status_ = status;
        return status;
      }
      if (r < 0 && errno != EINTR) return std::nullopt;
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  // Exit code, 128+signal, or -1 on timeout.
  int ExitCode(std::chrono::milliseconds timeout) {
    auto s = Wait(timeout);
    if (!s) return -1;
    if (WIFEXITED(*s)) return WEXITSTATUS(*s);
    if (WIFSIGNALED(*s)) return 128 + WTERMSIG(*s);
    return -1;
  }

 private:
  explicit Child(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

}  // namespace ckptio::testing

#endif  // CKPTIO_TESTS_LIB_PROCESS_H_
