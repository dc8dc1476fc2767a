#include "ckptio/rank.h"

#include <cerrno>
#include <cstdlib>
#include <string>

namespace ckptio {

namespace {

constexpr long kMaxCount = 1 << 24;  // ranks in a job, at most

// Parses a count written in decimal digits only (no sign, no spaces): -1
// for "absent", -2 for malformed, -3 for over kMaxCount.
int ParseCount(const char* text) {
  if (text == nullptr) return -1;
  if (*text < '0' || *text > '9') return -2;
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (*end != '\0') return -2;
  if (errno == ERANGE || v > kMaxCount) return -3;
  return static_cast<int>(v);
}

struct Scheme {
  const char* source;
  const char* rank;
  const char* local_rank;
  const char* world_size;
  const char* local_world_size;  // optional
};

constexpr Scheme kSchemes[] = {
    {"torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"},
    // Before Slurm: mpirun inside an allocation starts every rank with the
    // batch step's SLURM_PROCID (0), and only Open MPI's variables differ.
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    // Only srun's tasks: srun alone sets SLURM_STEP_NUM_TASKS (the step's
    // size; SLURM_NTASKS can be the allocation's). A program run in the
    // batch script itself also sees SLURM_PROCID=0 and SLURM_NTASKS, but it
    // is one process, not rank 0 of SLURM_NTASKS, and so is one in an
    // salloc shell: without SLURM_STEP_NUM_TASKS, Slurm's variables are not
    // read at all.
    {"slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE"},
};

std::string JobId(const std::function<const char*(const char*)>& get, const char* source) {
  auto val = [&](const char* name) -> std::string {
    const char* v = get(name);
    return v ? v : "";
  };
  if (!val("CKPTIO_JOB_ID").empty()) return val("CKPTIO_JOB_ID");
  std::string s = source;
  if (s == "torchrun") {
    if (!val("TORCHELASTIC_RUN_ID").empty() && val("TORCHELASTIC_RUN_ID") != "none")
      return "torchrun:" + val("TORCHELASTIC_RUN_ID") + ":" + val("TORCHELASTIC_RESTART_COUNT");
    // Static rendezvous (run id "none"): the master, and the restart count,
    // which tells torchrun's restarts of the same launch apart.
    if (!val("MASTER_PORT").empty())
      return "master:" + val("MASTER_ADDR") + ":" + val("MASTER_PORT") +
             (val("TORCHELASTIC_RESTART_COUNT").empty() ? ""
                                                        : ":" + val("TORCHELASTIC_RESTART_COUNT"));
  } else if (s == "slurm") {
    if (!val("SLURM_JOB_ID").empty())
      return "slurm:" + val("SLURM_JOB_ID") + "." + val("SLURM_STEP_ID") + ":" +
             val("SLURM_RESTART_COUNT");
  } else if (s == "openmpi") {
    for (const char* name : {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri"})
      if (!val(name).empty()) return std::string("openmpi:") + val(name);
  }
  return "";
}

}  // namespace

Result<RankInfo> RankInfo::FromEnv() {
  return FromEnv([](const char* n) { return std::getenv(n); });
}

Result<RankInfo> RankInfo::FromEnv(const std::function<const char*(const char*)>& get) {
  for (const Scheme& sc : kSchemes) {
    if (std::string(sc.source) == "slurm" && get(sc.world_size) == nullptr) continue;
    const char* names[] = {sc.rank, sc.local_rank, sc.world_size};
    int present = 0;
    for (const char* n : names) present += get(n) != nullptr;
    if (present == 0) continue;
    if (present < 3)
      return Status(Code::kInvalidArgument, std::string(sc.source) +
                                                " environment is incomplete: need " + sc.rank +
                                                ", " + sc.local_rank + " and " + sc.world_size +
                                                " (found " + std::to_string(present) +
                                                " of them); set the others, or unset these if "
                                                "another launcher's variables or an explicit "
                                                "RankInfo should decide");
    RankInfo r;
    r.source = sc.source;
    int values[4] = {ParseCount(get(sc.rank)), ParseCount(get(sc.local_rank)),
                     ParseCount(get(sc.world_size)), ParseCount(get(sc.local_world_size))};
    const char* all[] = {sc.rank, sc.local_rank, sc.world_size, sc.local_world_size};
    // Slurm's SLURM_STEP_TASKS_PER_NODE reads "4(x2)" on several nodes, and
    // "2,1" when they differ: then it is unknown, as is a count past the step.
    if (std::string(sc.source) == "slurm" && (values[3] < -1 || values[3] > values[2]))
      values[3] = -1;
    for (int i = 0; i < 4; ++i) {
      if (values[i] == -2)
        return Status(Code::kInvalidArgument, std::string(all[i]) + "=\"" + get(all[i]) +
                                                  "\" is not a non-negative integer (digits only)");
      if (values[i] == -3)
        return Status(Code::kInvalidArgument, std::string(all[i]) + "=\"" + get(all[i]) +
                                                  "\" is over ckptio's limit of " +
                                                  std::to_string(kMaxCount) + " ranks");
    }
    r.rank = values[0];
    r.local_rank = values[1];
    r.world_size = values[2];
    // Unknown: any local rank below world_size is possible.
    r.local_world_size = values[3] >= 0 ? values[3] : r.world_size;
    r.job_id = JobId(get, sc.source);
    r.job_id_reused = r.job_id.rfind("master:", 0) == 0;
    CKPTIO_RETURN_IF_ERROR(
        r.Validate().WithContext(std::string("from the ") + sc.source + " environment"));
    return r;
  }
  RankInfo single;
  single.source = "single";
  single.job_id = JobId(get, "single");
  return single;
}

Status RankInfo::Validate() const {
  auto bad = [&](const std::string& what) {
    return Status(Code::kInvalidArgument, "inconsistent rank identity " + ToString() + ": " + what);
  };
  if (world_size < 1) return bad("world size must be at least 1");
  if (rank < 0 || rank >= world_size) return bad("rank must be in [0, world_size)");
  if (local_world_size < 1 || local_world_size > world_size)
    return bad("local world size must be in [1, world_size]");
  if (local_rank < 0 || local_rank >= local_world_size)
    return bad("local rank must be in [0, local_world_size)");
  if (local_rank > rank) return bad("local rank cannot exceed the global rank");
  return OkStatus();
}

std::string RankInfo::ToString() const {
  return "rank " + std::to_string(rank) + "/" + std::to_string(world_size) + " (local " +
         std::to_string(local_rank) + "/" + std::to_string(local_world_size) + ")";
}

}  // namespace ckptio
