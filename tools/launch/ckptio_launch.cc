// ckptio-launch: starts N local ranks of a program with the torchrun
// environment, forwards signals to each rank's process group, ends the
// ranks when it dies itself, and reports how each rank ended.
//
//   ckptio-launch -n 4 -- ckptio-ddp-demo --store ./demo-store
//
// Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port unless --master-port) and
// CKPTIO_JOB_ID (fresh per launch). When a rank fails, the others get
// --grace seconds to finish, then SIGTERM, then SIGKILL 5 s later. A
// forwarded SIGHUP, SIGINT, SIGTERM or SIGQUIT gives them --grace seconds
// before SIGKILL, and a second one SIGKILLs them at once. A signal ignored
// when the launcher starts (nohup) stays ignored, by it and by the ranks.
// Ranks are not in the terminal's foreground: when stdin is a terminal they
// read end-of-file instead, and one stopped for using the terminal anyway
// (SIGTTIN, SIGTTOU) fails the job instead of stalling it.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/loopback.h"
#include "common/seconds_option.h"

namespace {

// Forwarded to every rank's process group; one pending flag per signal, so
// a SIGUSR1 followed at once by a SIGTERM forwards both. Signals pending
// together go in this order: USR1/USR2 ("checkpoint now") before the ones
// that end the ranks.
constexpr int kForwarded[] = {SIGUSR1, SIGUSR2, SIGHUP, SIGINT, SIGTERM, SIGQUIT};
volatile sig_atomic_t g_pending[NSIG] = {};

void OnSignal(int sig) { g_pending[sig] = 1; }

// Whether forwarding `sig` asks the ranks to end (not USR1/USR2).
bool Ends(int sig) { return sig != SIGUSR1 && sig != SIGUSR2; }

std::string Describe(int status) {
  if (WIFEXITED(status)) return "exited " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return std::string("killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           ::strsignal(WTERMSIG(status)) + ")";
  return "ended (status " + std::to_string(status) + ")";
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int Run(int argc, char** argv) {
  CLI::App app{"ckptio-launch: run N local ranks of PROGRAM with the torchrun environment"};
  int n = 1, master_port = 0;
  double grace = 30;
  std::string job_id;
  std::vector<std::string> command;
  app.add_option("-n,--nproc", n, "number of ranks")->check(CLI::Range(1, 1024));
  app.add_option("--master-port", master_port, "rendezvous port (default: a free one)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--job-id", job_id, "CKPTIO_JOB_ID for the ranks (default: fresh)");
  app.add_option("--grace", grace,
                 "seconds the ranks get after one fails (then SIGTERM, and SIGKILL 5 s later) "
                 "or after a forwarded SIGHUP/SIGINT/SIGTERM/SIGQUIT (then SIGKILL)")
      ->check(ckptio::Seconds(0, 1e6));  // more overflows the deadline
  app.add_option("command", command, "PROGRAM and its arguments (after --)")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // 2 for a usage error, as ckptio's other tools: CLI11's own codes (105...)
    // would read as a rank's exit status.
    return app.exit(e) == 0 ? 0 : 2;
  }

  if (master_port == 0) master_port = ckptio::FreePort();
  if (master_port <= 0) {
    std::cerr << "ckptio-launch: could not find a free port; pass --master-port\n";
    return 1;
  }
  if (job_id.empty()) {
    std::random_device rd;
    char buf[32];
    std::snprintf(buf, sizeof buf, "launch-%08x%08x", rd(), rd());
    job_id = buf;
  }
  // A signal ignored now (nohup's SIGHUP) stays ignored, here and in the
  // ranks, which inherit that. SIGCHLD ignored would reap the ranks unseen.
  bool ignored[NSIG] = {};
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  for (int sig : kForwarded) {
    struct sigaction old {};
    ::sigaction(sig, nullptr, &old);
    ignored[sig] = old.sa_handler == SIG_IGN;
    if (!ignored[sig]) ::sigaction(sig, &sa, nullptr);
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGCHLD, &dfl, nullptr);

  // Each rank leads a process group of its own, so that a signal reaches
  // everything it started (a shell wrapper's program too) and a terminal's
  // Ctrl-C reaches it once, through the launcher.
  std::vector<pid_t> pids(n, -1);
  auto signal_all = [&](int sig) {
    for (pid_t p : pids) {
      if (p <= 0) continue;
      ::kill(-p, sig);
      // A stopped rank acts on the signal only once continued.
      if (Ends(sig) && sig != SIGKILL) ::kill(-p, SIGCONT);
    }
  };
  // A rank reading the terminal would stop (SIGTTIN) and stall the job: as
  // a shell does for background jobs, it reads /dev/null instead.
  const bool stdin_is_terminal = ::isatty(STDIN_FILENO) == 1;
  const pid_t launcher = ::getpid();
  sigset_t forwarded, before;
  ::sigemptyset(&forwarded);
  for (int sig : kForwarded) ::sigaddset(&forwarded, sig);
  for (int rank = 0; rank < n; ++rank) {
    // Blocked across fork: a signal now is forwarded once the rank exists,
    // instead of running the handler in a child that is about to exec.
    ::sigprocmask(SIG_BLOCK, &forwarded, &before);
    pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      ::sigprocmask(SIG_SETMASK, &before, nullptr);
      std::cerr << "ckptio-launch: cannot start rank " << rank << ": fork: " << std::strerror(err)
                << "; stopping the ranks already started\n";
      // SIGTERM, then SIGKILL after 5 s for a rank that ignores it.
      signal_all(SIGTERM);
      const auto kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      for (pid_t& p : pids) {
        while (p > 0 && ::waitpid(p, nullptr, WNOHANG) == 0) {
          if (std::chrono::steady_clock::now() > kill_at) ::kill(-p, SIGKILL);
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        p = -1;
      }
      return 1;
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      // Gone with the launcher, even if it is SIGKILLed.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) ::_exit(128 + SIGTERM);
      for (int sig : kForwarded)
        if (!ignored[sig]) ::sigaction(sig, &dfl, nullptr);
      ::sigprocmask(SIG_SETMASK, &before, nullptr);
      if (stdin_is_terminal) {
        const int null = ::open("/dev/null", O_RDONLY);
        if (null < 0 || ::dup2(null, STDIN_FILENO) < 0) ::_exit(127);
        if (null != STDIN_FILENO) ::close(null);
      }
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(master_port).c_str(), 1);
      ::setenv("CKPTIO_JOB_ID", job_id.c_str(), 1);
      std::vector<char*> args;
      for (auto& a : command) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      std::cerr << "ckptio-launch: cannot run " << command[0] << ": " << std::strerror(errno)
                << "\n";
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no race with the child's own call
    pids[rank] = pid;
    ::sigprocmask(SIG_SETMASK, &before, nullptr);
  }
  std::cerr << "ckptio-launch: started " << n << " rank(s) of " << command[0] << " (MASTER_PORT "
            << master_port << ", job " << job_id << ")\n";

  int first_failure = 0;
  int remaining = n;
  using Clock = std::chrono::steady_clock;
  const auto grace_time =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace));
  auto escalate_at = Clock::time_point::max();  // when the next signal goes out
  bool termed = false;                          // the ranks were asked to end: SIGKILL comes next
  std::string stop_why;                         // why escalate_at was set, before `termed`
  while (remaining > 0) {
    for (int sig : kForwarded) {
      if (!g_pending[sig]) continue;
      g_pending[sig] = 0;  // cleared first: one arriving now is forwarded next time round
      if (Ends(sig) && termed) {
        std::cerr << "ckptio-launch: " << ::strsignal(sig) << " again: killing the ranks\n";
        signal_all(SIGKILL);
        escalate_at = Clock::time_point::max();
        continue;
      }
      signal_all(sig);
      if (Ends(sig)) {
        termed = true;
        escalate_at = std::min(escalate_at, Clock::now() + grace_time);
      }
    }
    int status = 0;
    pid_t done = ::waitpid(-1, &status, WNOHANG | WUNTRACED);
    if (done < 0 && errno == ECHILD) {
      std::cerr << "ckptio-launch: " << remaining << " rank(s) were reaped unseen; their exit "
                << "status is lost\n";
      return first_failure ? first_failure : 1;
    }
    if (done > 0 && WIFSTOPPED(status)) {
      const int sig = WSTOPSIG(status);
      const auto rank = std::find(pids.begin(), pids.end(), done) - pids.begin();
      std::cerr << "ckptio-launch: rank " << rank << " stopped by signal " << sig << " ("
                << ::strsignal(sig) << ")";
      if (sig == SIGTTIN || sig == SIGTTOU) {
        // It would wait for the terminal forever, and the others for it.
        std::cerr << (sig == SIGTTIN
                          ? ": it read from the terminal (/dev/tty), which ranks cannot; give "
                            "it input from a file instead"
                          : ": it changed the terminal's settings, or wrote to it under `stty "
                            "tostop`, which ranks cannot; run `stty -tostop` or send the "
                            "ranks' output to a file")
                  << " (each rank has a process group of its own, not the terminal's)\n";
        if (first_failure == 0) first_failure = 128 + sig;
        if (!termed && escalate_at > Clock::now()) {  // the first such stop says why
          escalate_at = Clock::now();
          stop_why = "rank " + std::to_string(rank) + " cannot go on";
        }
      } else {
        std::cerr << "; it goes on when sent SIGCONT\n";
      }
      continue;
    }
    if (done > 0) {
      for (int rank = 0; rank < n; ++rank) {
        if (pids[rank] != done) continue;
        pids[rank] = -1;
        --remaining;
        std::cerr << ("ckptio-launch: rank " + std::to_string(rank) + " " + Describe(status) +
                      "\n");
        if (ExitCode(status) != 0 && first_failure == 0) {
          first_failure = ExitCode(status);
          if (!termed) {
            escalate_at = Clock::now() + grace_time;
            std::ostringstream why;
            why << "a rank failed " << grace << " s ago";
            stop_why = why.str();
          }
        }
      }
      continue;
    }
    if (Clock::now() >= escalate_at) {
      if (!termed) {
        std::cerr << "ckptio-launch: " << stop_why << "; stopping the rest\n";
        signal_all(SIGTERM);
        termed = true;
        escalate_at = Clock::now() + std::chrono::seconds(5);
      } else {
        std::cerr << "ckptio-launch: " << remaining << " rank(s) still running; killing them\n";
        signal_all(SIGKILL);
        escalate_at = Clock::time_point::max();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return first_failure;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "ckptio-launch: " << e.what() << "\n";
    return 1;
  }
}
