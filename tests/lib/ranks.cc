#include "ranks.h"

#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <thread>

namespace ckptio::testing {

using std::chrono::milliseconds;

int Fail(int rank, int code, const std::string& why) {
  std::fprintf(stderr, "[rank %d pid %d] exit %d: %s\n", rank, static_cast<int>(::getpid()), code,
               why.c_str());
  std::fflush(stderr);
  return code;
}

int SleepUntilKilled(int seconds) {
  for (int i = 0; i < seconds; ++i) std::this_thread::sleep_for(milliseconds(1000));
  return kExitNotKilled;
}

std::vector<std::string> Split(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

std::string Join(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& x : words) s += (s.empty() ? "" : " ") + x;
  return s;
}

std::string OneLine(std::string s) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

std::string FormatReport(const Status& s, int64_t t_ns) {
  return "ret " + std::to_string(static_cast<int>(s.code())) + " " + std::to_string(t_ns) + " " +
         OneLine(s.message());
}

std::optional<StatusReport> ParseReport(const std::optional<std::string>& line) {
  if (!line || line->rfind("ret ", 0) != 0) return std::nullopt;
  std::istringstream in(line->substr(4));
  int code = 0;
  StatusReport r;
  if (!(in >> code >> r.t_ns)) return std::nullopt;
  r.code = static_cast<Code>(code);
  std::getline(in, r.message);
  if (!r.message.empty() && r.message.front() == ' ') r.message.erase(0, 1);
  return r;
}

void RankLink::Say(const std::string& line) const { WriteLine(out_, line); }

std::optional<std::string> RankLink::Hear(milliseconds timeout) const {
  return ReadLine(in_, timeout);
}

RankGroup::RankGroup(int world)
    : world_(world), to_(world), from_(world), children_(world), lines_(world), next_(world, 0) {}

bool RankGroup::Start(int r, const Body& body) {
  if (r < 0 || r >= world_ || children_[r]) return false;
  to_[r] = std::make_unique<Pipe>();
  from_[r] = std::make_unique<Pipe>();
  if (!to_[r]->ok() || !from_[r]->ok()) return false;
  children_[r].emplace(Child::Start([&] {
    // Keep only this rank's ends, so that EOF on a pipe means its rank exited.
    for (int j = 0; j < world_; ++j) {
      if (j == r || !to_[j]) continue;
      to_[j]->CloseRead();
      to_[j]->CloseWrite();
      from_[j]->CloseRead();
      from_[j]->CloseWrite();
    }
    to_[r]->CloseWrite();
    from_[r]->CloseRead();
    RankLink link(r, to_[r]->read_fd(), from_[r]->write_fd());
    return body(link);
  }));
  // The parent keeps the read end of the rank's input too (and never reads
  // it): a Tell to a rank that has exited is then lost, instead of killing
  // this process with SIGPIPE.
  from_[r]->CloseWrite();
  return children_[r]->started();
}

bool RankGroup::StartAll(const Body& body) {
  for (int r = 0; r < world_; ++r)
    if (!Start(r, body)) return false;
  return true;
}

bool RankGroup::started(int r) const { return children_[r] && children_[r]->started(); }

bool RankGroup::all_started() const {
  for (int r = 0; r < world_; ++r)
    if (!started(r)) return false;
  return true;
}

std::vector<int> RankGroup::ExitCodes(milliseconds timeout) {
  std::vector<int> codes;
  for (int r = 0; r < world_; ++r) codes.push_back(children_[r] ? ExitCode(r, timeout) : -1);
  return codes;
}

void RankGroup::Tell(int r, const std::string& line) { WriteLine(to_[r]->write_fd(), line); }

bool RankGroup::ReadMore(int r, milliseconds timeout) {
  if (!from_[r]) return false;
  auto line = ReadLine(from_[r]->read_fd(), timeout);
  if (!line) return false;
  lines_[r].push_back(*line);
  return true;
}

std::optional<std::string> RankGroup::Next(int r, milliseconds timeout) {
  if (next_[r] == lines_[r].size() && !ReadMore(r, timeout)) return std::nullopt;
  return lines_[r][next_[r]++];
}

std::optional<std::vector<std::string>> RankGroup::Await(int r, const std::string& key,
                                                         milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  size_t seen = 0;
  while (true) {
    for (; seen < lines_[r].size(); ++seen) {
      auto w = Split(lines_[r][seen]);
      if (!w.empty() && w[0] == key) return std::vector<std::string>(w.begin() + 1, w.end());
    }
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0 || !ReadMore(r, left)) return std::nullopt;
  }
}

std::optional<std::string> RankGroup::AwaitLine(int r, const std::string& key,
                                                milliseconds timeout) {
  if (!Await(r, key, timeout)) return std::nullopt;
  for (const auto& l : lines_[r])
    if (l.rfind(key + " ", 0) == 0 || l == key) return l;
  return std::nullopt;
}

}  // namespace ckptio::testing
