// Ranks as real processes, for the multi-process suites: one forked child
// per rank, a pipe each way between the parent and every rank (one line per
// message), the lines a rank sent kept for the parent to read in order or
// look through by their first word, exit codes collected, and every child
// still running killed and reaped when the group goes (a failed assertion
// never leaves one behind). Timestamps in the lines are NowNs() (process.h),
// which every process of the machine shares.
//
// Fork only while the process has no other thread (LibTorch's pools, a
// gtest death test's helpers): a child of a threaded parent can deadlock.
#ifndef CKPTIO_TESTS_LIB_RANKS_H_
#define CKPTIO_TESTS_LIB_RANKS_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckptio/status.h"
#include "process.h"

namespace ckptio::testing {

// Child exit codes every multi-process suite shares; a suite adds its own
// (from 12 up) for the ways its ranks can fail.
inline constexpr int kExitOk = 0;
inline constexpr int kExitSetup =
    10;                               // what the rank needed (store, coordinator, ...) did not open
inline constexpr int kExitPipe = 11;  // the parent's message did not come or was wrong
inline constexpr int kExitException = kChildException;
inline constexpr int kExitNotKilled = 99;  // a rank that should have been killed ran out of sleep

// In a rank: prints "[rank R pid P] exit CODE: WHY" to stderr and returns
// `code`, for `return Fail(...)` from a rank's body.
int Fail(int rank, int code, const std::string& why);

// In a rank that the parent will kill: sleeps `seconds` (one at a time),
// then returns kExitNotKilled.
int SleepUntilKilled(int seconds);

// The words of a line; the words joined by single spaces.
std::vector<std::string> Split(const std::string& line);
std::string Join(const std::vector<std::string>& words);
// `s` with every newline made a space, to travel as one line.
std::string OneLine(std::string s);

// "ret <code> <t_ns> <message...>": the outcome of a rank's call (a wait, a
// save) and when it returned, as the rank reports it to the parent.
struct StatusReport {
  Code code = Code::kInternal;
  int64_t t_ns = 0;
  std::string message;
};
std::string FormatReport(const Status& s, int64_t t_ns);
// nullopt for no line or one that is not a report.
std::optional<StatusReport> ParseReport(const std::optional<std::string>& line);

// A rank's end of its two pipes, given to its body.
class RankLink {
 public:
  RankLink(int rank, int in, int out) : rank_(rank), in_(in), out_(out) {}
  int rank() const { return rank_; }
  // One line to the parent (best effort).
  void Say(const std::string& line) const;
  // The parent's next line; nullopt on timeout or when the parent is gone.
  std::optional<std::string> Hear(std::chrono::milliseconds timeout) const;

 private:
  int rank_;
  int in_;
  int out_;
};

// Up to `world` ranks, started one at a time or all at once, and the
// parent's end of their pipes. A rank's pipes are made as it starts; each
// child keeps only its own ends, so a rank that exits closes its pipe and
// the parent's read of it ends at once.
class RankGroup {
 public:
  // Runs in the child; its return value is the exit code (an exception:
  // kExitException).
  using Body = std::function<int(RankLink&)>;

  explicit RankGroup(int world);
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  int world() const { return world_; }
  // Forks rank `r` (not yet started) running `body`; false if its pipes or
  // the fork failed.
  bool Start(int r, const Body& body);
  // Starts ranks 0 .. world-1, in order; false at the first that failed.
  bool StartAll(const Body& body);
  bool started(int r) const;
  bool all_started() const;

  Child& child(int r) { return *children_[r]; }
  // Exit code of rank `r` (Child::ExitCode), waiting up to `timeout`.
  int ExitCode(int r, std::chrono::milliseconds timeout) { return child(r).ExitCode(timeout); }
  // Exit codes of every rank, in rank order, waiting up to `timeout` for each.
  std::vector<int> ExitCodes(std::chrono::milliseconds timeout);

  // One line to rank `r` (lost if the rank has exited).
  void Tell(int r, const std::string& line);
  // Rank r's lines in the order it sent them: the next one not yet taken by
  // Next; nullopt on timeout or EOF.
  std::optional<std::string> Next(int r, std::chrono::milliseconds timeout);
  // The words after `key` of rank r's first line whose first word is
  // `key`, of all it sent (Next or not), reading more lines as needed;
  // nullopt when none came by the timeout (or EOF).
  std::optional<std::vector<std::string>> Await(int r, const std::string& key,
                                                std::chrono::milliseconds timeout);
  // The whole of that line (for "ret" reports).
  std::optional<std::string> AwaitLine(int r, const std::string& key,
                                       std::chrono::milliseconds timeout);

 private:
  // One more line of rank r into lines_[r]; false on timeout or EOF.
  bool ReadMore(int r, std::chrono::milliseconds timeout);

  int world_;
  std::vector<std::unique_ptr<Pipe>> to_, from_;
  std::vector<std::optional<Child>> children_;
  std::vector<std::vector<std::string>> lines_;
  std::vector<size_t> next_;
};

}  // namespace ckptio::testing

#endif  // CKPTIO_TESTS_LIB_RANKS_H_
