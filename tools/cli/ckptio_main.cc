// ckptio: inspect, verify, repair and trim checkpoint stores.
//
// Exit codes: 0 all good, 1 something is bad (or an operation failed),
// 2 usage error.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckptio/ckptio.h"
#include "common/progress.h"
#include "common/seconds_option.h"
#include "common/store_args.h"
#include "text.h"

namespace ckptio {
namespace {

using json = nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitBad = 1;
constexpr int kExitUsage = 2;

// JSON output never throws: text that is not UTF-8 (a corrupt name quoted
// in an error) becomes U+FFFD.
std::string Dump(const json& j) { return j.dump(2, ' ', false, json::error_handler_t::replace); }

int Fail(const Status& s) {
  std::cerr << "ckptio: " << s << "\n";
  return s.code() == Code::kInvalidArgument ? kExitUsage : kExitBad;
}

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The writer lock for repair and gc, waiting up to --wait seconds.
Result<std::unique_ptr<StoreWriter>> OpenWriterWaiting(Store& store, double wait_s) {
  WriterOptions wo;
  wo.lock_wait = std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  auto writer = store.OpenWriter(wo);
  const Status& s = writer.status();
  if (s.message().find("already has a writer") != std::string::npos)
    return Status(s.code(), s.message() + " (here: --wait SECONDS waits for it)");
  return writer;
}

Result<uint64_t> CommittedBytes(Store& store) {
  CKPTIO_ASSIGN_OR_RETURN(auto steps, store.ListSteps());
  uint64_t total = 0;
  for (const auto& s : steps)
    if (s.state == StepState::kCommitted) total += s.bytes;
  return total;
}

struct StepVerdict {
  int64_t step = 0;
  std::vector<std::string> errors;  // empty when the step verifies
  bool corrupt = false;             // some error is DATA_LOSS: damage fsck --repair retires
  bool unreadable = false;          // some other error (access, I/O): not judged

  std::string first_damage;  // the first DATA_LOSS error

  void Add(const Status& s) {
    errors.push_back(s.ToString());
    if (s.code() == Code::kDataLoss && !corrupt) first_damage = errors.back();
    (s.code() == Code::kDataLoss ? corrupt : unreadable) = true;
  }
  std::string_view Label() const { return corrupt ? "BAD" : unreadable ? "NOT VERIFIED" : "OK"; }
};

// Verifies every object of step `step` (opened as `reader`), collecting
// every problem (not just the first) so that the report names all the
// damage.
StepVerdict VerifyStep(int64_t step, const Result<std::unique_ptr<CheckpointReader>>& reader,
                       Progress& progress) {
  StepVerdict v;
  v.step = step;
  if (!reader.ok()) {
    v.Add(reader.status());
    return v;
  }
  for (const auto& o : (*reader)->manifest().objects) {
    Status s = (*reader)->VerifyObject(o.name, progress.Fn());
    if (!s.ok()) v.Add(s);
  }
  return v;
}

// The last line of a verification that found `corrupt` or `unreadable` data.
std::string VerdictAdvice(const std::string& uri, bool corrupt, bool unreadable) {
  std::string out;
  if (corrupt)
    out += "corruption found: run `ckptio fsck --repair " + uri + "` to retire bad steps\n";
  if (unreadable)
    out += "some data could not be read (not judged corrupt): fix access to the store, or retry\n";
  return out.empty() ? "all verified steps are good\n" : out;
}

int CmdLs(const std::string& uri, bool verify, bool as_json) {
  auto store = OpenExisting(uri);
  if (!store.ok()) return Fail(store.status());
  auto steps = (*store)->ListSteps();
  if (!steps.ok()) return Fail(steps.status());
  auto latest = (*store)->ReadLatest();
  std::optional<int64_t> latest_step;
  if (latest.ok() && latest->has_value()) latest_step = (*latest)->step;
  bool all_good = true;
  if (verify) {
    uint64_t total = 0;
    for (const auto& s : *steps)
      if (s.state == StepState::kCommitted) total += s.bytes;
    Progress progress(total);
    for (auto& s : *steps) {
      if (s.state != StepState::kCommitted) continue;
      StepVerdict v = VerifyStep(s.step, (*store)->OpenStep(s.step), progress);
      if (v.corrupt) s.state = StepState::kCorrupt;
      if (!v.errors.empty()) {
        s.problem = v.corrupt ? v.first_damage : "not verified: " + v.errors.front();
        all_good = false;
      }
    }
  }
  json out = json::array();
  if (!as_json)
    std::cout << fmt::format("{:>14}  {:<10} {:>10}  {:<20}  {}\n", "STEP", "STATE", "SIZE",
                             "CREATED (UTC)", "");
  for (const auto& s : *steps) {
    if (s.state != StepState::kCommitted) all_good = false;
    bool is_latest = latest_step && *latest_step == s.step;
    if (as_json) {
      json j = {{"step", s.step},
                {"state", StepStateName(s.state)},
                {"bytes", s.bytes},
                {"created_unix_ms", s.created_unix_ms},
                {"latest", is_latest}};
      if (!s.problem.empty()) j["problem"] = s.problem;
      out.push_back(j);
    } else {
      std::cout << fmt::format("{:>14}  {:<10} {:>10}  {:<20}  {}\n", s.step,
                               StepStateName(s.state), HumanBytes(s.bytes),
                               FormatTime(s.created_unix_ms), is_latest ? "<- LATEST" : "");
      if (!s.problem.empty()) std::cout << "                " << s.problem << "\n";
    }
  }
  if (as_json) {
    std::cout << Dump(json{{"store", (*store)->uri()}, {"steps", out}}) << "\n";
  } else if (steps->empty()) {
    std::cout << "(no checkpoints in " << (*store)->uri() << ")\n";
  }
  if (!latest.ok()) {
    std::cerr << "ckptio: " << latest.status() << "\n";
    return kExitBad;
  }
  return verify && !all_good ? kExitBad : kExitOk;
}

int CmdVerify(const std::string& uri, const std::string& step_text, bool all, bool as_json) {
  auto store = OpenExisting(uri);
  if (!store.ok()) return Fail(store.status());
  // LATEST is part of what `verify` (of LATEST) and `verify --all` check: read
  // once, it must name a step that is there, by the hash of its manifest.
  const bool check_latest = all || step_text.empty() || step_text == "latest";
  Result<std::optional<Latest>> latest = std::optional<Latest>();
  if (check_latest) latest = (*store)->ReadLatest();
  // Each step's manifest is read once, for LATEST's check and the
  // verification (a step is opened when first needed and closed once
  // verified: a store's manifests are not all held at once).
  std::map<int64_t, Result<std::unique_ptr<CheckpointReader>>> readers;
  auto reader_of = [&](int64_t step) -> const Result<std::unique_ptr<CheckpointReader>>& {
    auto it = readers.find(step);
    if (it == readers.end()) it = readers.emplace(step, (*store)->OpenStep(step)).first;
    return it->second;
  };
  std::vector<int64_t> targets;
  std::vector<StepVerdict> verdicts;
  uint64_t total = 0;  // bytes to verify
  if (all) {
    auto steps = (*store)->ListSteps();
    if (!steps.ok()) return Fail(steps.status());
    for (const auto& s : *steps) {
      if (s.state == StepState::kTorn) continue;  // never committed; fsck reports it
      targets.push_back(s.step);
      total += s.bytes;
    }
    if (targets.empty()) {
      std::cerr << "ckptio: no committed steps in " << (*store)->uri() << "\n";
      return kExitBad;
    }
  } else {
    auto step = check_latest ? LatestStep(**store, latest) : ResolveStep(**store, step_text);
    if (!step.ok()) return Fail(step.status());
    const auto& exists = reader_of(*step);
    if (!exists.ok() && exists.status().code() == Code::kNotFound) return Fail(exists.status());
    if (exists.ok()) total = (*exists)->manifest().TotalBytes();
    targets.push_back(*step);
  }
  // A step whose manifest is damaged is reported as that step's problem.
  std::optional<Status> latest_error;
  if (check_latest) {
    Status s = latest.status();
    if (latest.ok() && latest->has_value()) {
      const Latest& l = **latest;
      const auto& named = reader_of(l.step);
      if (named.ok() && (*named)->manifest_hash() != l.manifest_hash)
        s = Status(Code::kDataLoss,
                   "store " + (*store)->uri() + ": LATEST names step " + std::to_string(l.step) +
                       " with manifest xxh3-128 " + l.manifest_hash.Hex() +
                       ", but its MANIFEST.json hashes to " + (*named)->manifest_hash().Hex());
      else if (!named.ok() && named.status().code() != Code::kDataLoss)
        s = named.status();
    }
    if (s.ok() && latest.ok() && !latest->has_value() && !targets.empty())
      s = Status(Code::kNotFound, "there is no LATEST, although steps are committed");
    if (!s.ok()) latest_error = s;
  }
  Progress progress(total);
  for (int64_t step : targets) {
    verdicts.push_back(VerifyStep(step, reader_of(step), progress));
    readers.erase(step);  // its views and open objects go with it
  }
  progress.Done();
  // LATEST naming a missing step, or another manifest than the step's, is
  // damage fsck --repair mends; another error (access, I/O) is not judged.
  const bool latest_bad = latest_error && (latest_error->code() == Code::kDataLoss ||
                                           latest_error->code() == Code::kNotFound);
  bool corrupt = latest_bad, unreadable = latest_error && !latest_bad;
  json out = json::array();
  for (const auto& v : verdicts) {
    corrupt |= v.corrupt;
    unreadable |= v.unreadable;
    if (as_json) {
      out.push_back({{"step", v.step},
                     {"ok", v.errors.empty()},
                     {"corrupt", v.corrupt},
                     {"errors", v.errors}});
    } else {
      std::cout << "step " << v.step << ": " << v.Label() << "\n";
      for (const auto& e : v.errors) std::cout << "  " << e << "\n";
    }
  }
  const bool ok = !corrupt && !unreadable;
  if (latest_error && !as_json)
    std::cout << "LATEST: " << (latest_bad ? "BAD" : "NOT VERIFIED") << "\n  " << *latest_error
              << "\n";
  if (as_json) {
    json j = {{"store", (*store)->uri()}, {"ok", ok}, {"steps", out}};
    if (latest_error) j["latest_error"] = latest_error->ToString();
    std::cout << Dump(j) << "\n";
  } else {
    std::cout << VerdictAdvice(uri, corrupt, unreadable);
  }
  return ok ? kExitOk : kExitBad;
}

int CmdInspect(const std::string& uri, const std::string& step_text, bool as_json) {
  auto store = OpenExisting(uri);
  if (!store.ok()) return Fail(store.status());
  auto step = ResolveStep(**store, step_text);
  if (!step.ok()) return Fail(step.status());
  auto reader = (*store)->OpenStep(*step);
  if (!reader.ok()) return Fail(reader.status());
  const Manifest& m = (*reader)->manifest();
  if (as_json) {
    json objects = json::array();
    for (const auto& o : m.objects)
      objects.push_back({{"name", o.name},
                         {"size", o.size},
                         {"chunk_size", o.chunk_size},
                         {"chunks", o.chunks.size()},
                         {"xxh3_128", o.hash.Hex()}});
    std::cout << Dump(json{{"store", (*store)->uri()},
                           {"step", m.step},
                           {"generation", m.generation},
                           {"world_size", m.world_size},
                           {"saving_rank", m.saving_rank},
                           {"created_unix_ms", m.created_unix_ms},
                           {"writer", m.writer},
                           {"manifest_xxh3_128", (*reader)->manifest_hash().Hex()},
                           {"bytes", m.TotalBytes()},
                           {"objects", objects},
                           {"metadata", m.metadata}})
              << "\n";
    return kExitOk;
  }
  std::cout << fmt::format(
      "store       {}\nstep        {}\ngeneration  {}\nranks       saved by rank {} of {}\n"
      "created     {}\nwriter      {}\nmanifest    xxh3-128 {}\nsize        {} in {} "
      "object(s)\n\n",
      (*store)->uri(), m.step, m.generation, m.saving_rank, m.world_size,
      FormatTime(m.created_unix_ms), Printable(m.writer), (*reader)->manifest_hash().Hex(),
      HumanBytes(m.TotalBytes()), m.objects.size());
  std::cout << fmt::format("{:<32} {:>12} {:>7}  {}\n", "OBJECT", "SIZE", "CHUNKS", "XXH3-128");
  for (const auto& o : m.objects)
    std::cout << fmt::format("{:<32} {:>12} {:>7}  {}\n", o.name, HumanBytes(o.size),
                             o.chunks.size(), o.hash.Hex());
  if (!m.metadata.empty()) {
    std::cout << "\nMETADATA\n";
    for (const auto& [k, v] : m.metadata)
      std::cout << "  " << Printable(k) << " = " << Printable(v) << "\n";
  }
  return kExitOk;
}

json ReportJson(const FsckReport& r) {
  json problems = json::array();
  for (const auto& p : r.problems) {
    json j = {{"kind", FsckKindName(p.kind)}, {"detail", p.detail}};
    if (p.step >= 0) j["step"] = p.step;
    problems.push_back(j);
  }
  json out = {{"clean", r.clean()},
              {"writer_active", r.writer_active},
              {"in_progress", r.in_progress ? json(*r.in_progress) : json(nullptr)},
              {"good_steps", r.good_steps},
              {"problems", problems},
              {"repairs", r.repairs}};
  out["latest"] = r.latest ? json(*r.latest) : json(nullptr);
  return out;
}

void PrintReport(const FsckReport& r) {
  for (const auto& rep : r.repairs) std::cout << "repaired: " << rep << "\n";
  for (const auto& p : r.problems) {
    std::cout << FsckKindName(p.kind);
    if (p.step >= 0) std::cout << " step " << p.step;
    std::cout << ": " << p.detail << "\n";
  }
  std::cout << r.good_steps.size() << " good step(s)";
  if (r.latest) std::cout << ", LATEST = " << *r.latest;
  if (r.writer_active) std::cout << ", a writer is active";
  if (r.in_progress) std::cout << " (step " << *r.in_progress << " is being written)";
  std::cout << "\n";
}

int CmdFsck(const std::string& uri, bool repair, const RepairOptions& options, bool as_json,
            double wait_s) {
  auto store = OpenExisting(uri);
  if (!store.ok()) return Fail(store.status());
  auto total = CommittedBytes(**store);
  if (!total.ok()) return Fail(total.status());
  Progress progress(*total);
  Result<FsckReport> report = Status(Code::kInternal, "unset");
  if (repair) {
    auto writer = OpenWriterWaiting(**store, wait_s);
    if (!writer.ok()) return Fail(writer.status());
    report = (*writer)->Repair(progress.Fn(), options);
  } else {
    report = (*store)->Check(progress.Fn());
  }
  progress.Done();
  if (!report.ok()) return Fail(report.status());
  if (as_json) {
    json j = ReportJson(*report);
    j["store"] = (*store)->uri();
    std::cout << Dump(j) << "\n";
  } else {
    PrintReport(*report);
    std::cout << (report->clean() ? "store is clean\n"
                  : repair
                      ? "problems remain after repair\n"
                      : "problems found: run `ckptio fsck --repair " + uri + "` to fix them\n");
  }
  return report->clean() ? kExitOk : kExitBad;
}

int CmdGc(const std::string& uri, int keep, double wait_s) {
  auto store = OpenExisting(uri);
  if (!store.ok()) return Fail(store.status());
  auto writer = OpenWriterWaiting(**store, wait_s);
  if (!writer.ok()) return Fail(writer.status());
  // gc verifies the newest step before deleting older ones: size the bar by it.
  auto steps = (*store)->ListSteps();
  if (!steps.ok()) return Fail(steps.status());
  uint64_t newest_bytes = 0;
  for (const auto& s : *steps)
    if (s.state == StepState::kCommitted) newest_bytes = s.bytes;
  Progress progress(newest_bytes);
  auto gc = (*writer)->CollectGarbage(keep, progress.Fn());
  progress.Done();
  if (!gc.ok()) return Fail(gc.status());
  bool corrupt_left = false;
  for (const auto& p : gc->corrupt) {
    std::cout << "corrupt step " << p.step << ": " << p.detail << "\n";
    corrupt_left |= std::find(gc->deleted.begin(), gc->deleted.end(), p.step) == gc->deleted.end();
  }
  // Damage gc does not judge (it reads committed steps only) stays too: a
  // manifest that does not parse, an unreadable LATEST.
  auto after = (*store)->ListSteps();
  if (!after.ok()) return Fail(after.status());
  for (const auto& s : *after) {
    if (s.state != StepState::kCorrupt) continue;
    std::cout << "corrupt step " << s.step << ": " << s.problem << "\n";
    corrupt_left = true;
  }
  if (auto latest = (*store)->ReadLatest(); !latest.ok()) {
    std::cout << "LATEST is unreadable: " << latest.status() << "\n";
    corrupt_left = true;
  }
  for (int64_t s : gc->deleted) std::cout << "deleted step " << s << "\n";
  for (int64_t s : gc->left)
    std::cout << "left step " << s << ": another writer committed it again meanwhile\n";
  std::cout << gc->deleted.size() << " step(s) deleted, newest " << keep << " kept";
  if (gc->newest_good && !gc->corrupt.empty())
    std::cout << ", and step " << *gc->newest_good << ", the newest that verifies";
  std::cout << "\n";
  if (!gc->newest_good && !gc->corrupt.empty()) std::cout << "no committed step verifies\n";
  if (!corrupt_left) return kExitOk;
  std::cout << "run `ckptio fsck --repair " << uri << "` to remove the damage\n";
  return kExitBad;
}

// `ckptio export ...` runs ckptio-export from the same directory, so that
// this tool does not load LibTorch for its other commands.
int RunExport(int argc, char** argv) {
  std::string self = "/proc/self/exe";
  char buf[4096];
  ssize_t n = ::readlink(self.c_str(), buf, sizeof buf - 1);
  std::string dir = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string(argv[0]);
  dir = dir.substr(0, dir.rfind('/') + 1);
  std::string exe = dir + "ckptio-export";
  std::vector<char*> args{exe.data()};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execv(exe.c_str(), args.data());
  std::cerr << "ckptio: cannot run " << exe << ": " << std::strerror(errno) << "\n";
  return kExitBad;
}

int Main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "export") return RunExport(argc, argv);
  CLI::App app{
      "ckptio: inspect, verify, repair and trim checkpoint stores.\n"
      "STORE is file:///abs/path, a plain path, nfs://server/export/path or s3://bucket/prefix."};
  app.require_subcommand(1);
  std::string uri, step;
  bool as_json = false, verify = false, all = false, repair = false;
  int keep = 0;
  double wait_s = 0;
  RepairOptions repair_options;

  auto* ls = app.add_subcommand("ls", "List steps with their state, size and time");
  ls->add_option("STORE", uri, "store URI or path")->required();
  ls->add_flag("--verify", verify, "read and check every byte (marks bad steps corrupt)");
  ls->add_flag("--json", as_json, "machine-readable output");

  auto* ver = app.add_subcommand(
      "verify", "Check every byte of a step (default: LATEST) or of all steps; exit 1 if bad");
  ver->add_option("STORE", uri, "store URI or path")->required();
  auto* step_opt = ver->add_option("STEP", step, "step number or \"latest\"");
  ver->add_flag("--all", all, "verify every committed step")->excludes(step_opt);
  ver->add_flag("--json", as_json, "machine-readable output");

  auto* insp = app.add_subcommand("inspect", "Show a step's manifest: objects, hashes, metadata");
  insp->add_option("STORE", uri, "store URI or path")->required();
  insp->add_option("STEP", step, "step number or \"latest\"")->required();
  insp->add_flag("--json", as_json, "machine-readable output");

  auto* fsck = app.add_subcommand(
      "fsck", "Report torn steps, corrupt steps, stale temp files and a bad LATEST");
  fsck->add_option("STORE", uri, "store URI or path")->required();
  auto* repair_flag =
      fsck->add_flag("--repair", repair,
                     "fix them: repoint LATEST at the newest good step, delete corrupt and torn "
                     "steps and stale temps (never a step that verifies; when none does, one "
                     "corrupt step stays for salvage)");
  fsck->add_flag("--delete-all-corrupt", repair_options.delete_all_corrupt,
                 "with --repair: when no step verifies, delete also the corrupt step it would "
                 "keep for salvage")
      ->needs(repair_flag);
  fsck->add_flag("--json", as_json, "machine-readable output");
  fsck->add_option("--wait", wait_s, "seconds to wait for the writer lock with --repair")
      ->check(Seconds(0, 1e6));  // more overflows the deadline

  // Parsed by ckptio-export; listed here for --help.
  app.add_subcommand("export",
                     "Write a step's tensors as a file torch.load() reads: export STORE STEP -o "
                     "out.pt")
      ->allow_extras();

  auto* gc = app.add_subcommand(
      "gc", "Delete all but the newest N committed steps (never the newest that verifies)");
  gc->add_option("STORE", uri, "store URI or path")->required();
  gc->add_option("--keep", keep, "how many newest steps to keep (the LATEST one always stays)")
      ->required()
      ->check(CLI::Range(1, 1000000));
  gc->add_option("--wait", wait_s, "seconds to wait for the writer lock")
      ->check(Seconds(0, 1e6));  // more overflows the deadline

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    (void)app.exit(e);
    return kExitUsage;
  }
  if (*ls) return CmdLs(uri, verify, as_json);
  if (*ver) return CmdVerify(uri, step, all, as_json);
  if (*insp) return CmdInspect(uri, step, as_json);
  if (*fsck) return CmdFsck(uri, repair, repair_options, as_json, wait_s);
  if (*gc) return CmdGc(uri, keep, wait_s);
  return kExitUsage;
}

}  // namespace
}  // namespace ckptio

int main(int argc, char** argv) {
  try {
    return ckptio::Main(argc, argv);
  } catch (const std::exception& e) {  // a bug: ckptio reports errors as Status
    std::cerr << "ckptio: internal error: " << e.what() << "\n";
    return 1;
  }
}
