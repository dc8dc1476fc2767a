// RankInfo: who this process is in a distributed job.
#ifndef CKPTIO_RANK_H_
#define CKPTIO_RANK_H_

#include <functional>
#include <string>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

struct CKPTIO_EXPORT RankInfo {
  int rank = 0;        // global rank, 0 .. world_size-1
  int local_rank = 0;  // rank on this node, 0 .. local_world_size-1
  int world_size = 1;
  int local_world_size = 1;
  // Shared by every rank of one launch and different for the next launch
  // (torchrun's TORCHELASTIC_RUN_ID and restart count, or with a static
  // rendezvous MASTER_ADDR:MASTER_PORT and restart count, Slurm's job,
  // step and restart count, Open MPI's job id, or CKPTIO_JOB_ID). File-based
  // coordination scopes its records with it; empty when unknown.
  std::string job_id;
  // True when job_id may repeat in a later launch (torchrun's static
  // rendezvous: its master address and port), so that records left by an
  // earlier launch could carry it: file-based coordination refuses it. Set
  // CKPTIO_JOB_ID (or a torchrun run id) to make it unique.
  bool job_id_reused = false;
  std::string source;  // "torchrun", "slurm", "openmpi", "explicit", "single"

  // Reads, in order of precedence, torchrun's RANK/LOCAL_RANK/WORLD_SIZE/
  // LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_RANK/
  // OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_SIZE/
  // OMPI_COMM_WORLD_LOCAL_SIZE (mpirun inside a Slurm allocation), or
  // Slurm's SLURM_PROCID/SLURM_LOCALID/SLURM_STEP_NUM_TASKS
  // (SLURM_STEP_TASKS_PER_NODE), which only tasks started by srun have: a
  // program run in the batch script or an salloc shell is a single process
  // whatever SLURM_PROCID and SLURM_NTASKS say. No variables at all: a
  // single process (rank 0 of 1). A partial set, anything but decimal digits (no sign or
  // spaces), a count over 2^24, or values that contradict each other:
  // InvalidArgument naming the variables.
  static Result<RankInfo> FromEnv();
  // The same, reading variables through `get` (for tests).
  static Result<RankInfo> FromEnv(const std::function<const char*(const char*)>& get);

  // OK if the numbers are consistent.
  Status Validate() const;
  // "rank 2/4 (local 0/2)".
  std::string ToString() const;
};

}  // namespace ckptio

#endif  // CKPTIO_RANK_H_
