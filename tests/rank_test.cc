// RankInfo: reading who this process is from torchrun, Slurm and Open MPI
// environments (through a fake environment), precedence between them, and
// the errors for incomplete or contradictory variables.
#include "ckptio/rank.h"

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "test_util.h"

namespace ckptio {
namespace {

using Env = std::map<std::string, std::string>;

// RankInfo::FromEnv over `env` only.
Result<RankInfo> FromEnv(const Env& env) {
  return RankInfo::FromEnv([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

Env Torchrun(const std::string& rank, const std::string& local_rank, const std::string& world,
             const std::string& local_world) {
  return {{"RANK", rank},
          {"LOCAL_RANK", local_rank},
          {"WORLD_SIZE", world},
          {"LOCAL_WORLD_SIZE", local_world}};
}

Env Slurm(const std::string& procid, const std::string& localid, const std::string& ntasks,
          const std::string& per_node) {
  // srun sets SLURM_NTASKS to the step's size too (unless --preserve-env).
  return {{"SLURM_PROCID", procid},
          {"SLURM_LOCALID", localid},
          {"SLURM_NTASKS", ntasks},
          {"SLURM_STEP_NUM_TASKS", ntasks},
          {"SLURM_STEP_TASKS_PER_NODE", per_node}};
}

Env OpenMpi(const std::string& rank, const std::string& local_rank, const std::string& size,
            const std::string& local_size) {
  return {{"OMPI_COMM_WORLD_RANK", rank},
          {"OMPI_COMM_WORLD_LOCAL_RANK", local_rank},
          {"OMPI_COMM_WORLD_SIZE", size},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", local_size}};
}

Env Merge(Env a, const Env& b) {
  for (const auto& kv : b) a[kv.first] = kv.second;
  return a;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Expects InvalidArgument whose message names every one of `words`.
void ExpectInvalid(const Env& env, const std::vector<std::string>& words) {
  auto r = FromEnv(env);
  ASSERT_FALSE(r.ok()) << "accepted: " << r->ToString() << " from " << r->source;
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status();
  for (const auto& w : words)
    EXPECT_TRUE(Contains(r.status().message(), w))
        << "the error should name \"" << w << "\": " << r.status();
}

// ---------------------------------------------------------------- torchrun

TEST(RankFromEnvTest, TorchrunFullSet) {
  Env env = Merge(Torchrun("5", "1", "8", "4"),
                  {{"TORCHELASTIC_RUN_ID", "abc123"}, {"TORCHELASTIC_RESTART_COUNT", "2"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(env));
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.source, "torchrun");
  EXPECT_EQ(r.job_id, "torchrun:abc123:2");
  CKPTIO_EXPECT_OK(r.Validate());
  EXPECT_EQ(r.ToString(), "rank 5/8 (local 1/4)");
}

TEST(RankFromEnvTest, TorchrunJobIdChangesWithRestartCount) {
  Env base = Merge(Torchrun("0", "0", "2", "2"), {{"TORCHELASTIC_RUN_ID", "run7"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo first,
                              FromEnv(Merge(base, {{"TORCHELASTIC_RESTART_COUNT", "0"}})));
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo second,
                              FromEnv(Merge(base, {{"TORCHELASTIC_RESTART_COUNT", "1"}})));
  EXPECT_FALSE(first.job_id.empty());
  EXPECT_NE(first.job_id, second.job_id)
      << "a torchrun restart must look like a new launch to file coordination";
  // Every rank of the same launch gets the same id.
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      RankInfo other_rank,
      FromEnv(Merge(Merge(Torchrun("1", "1", "2", "2"), {{"TORCHELASTIC_RUN_ID", "run7"}}),
                    {{"TORCHELASTIC_RESTART_COUNT", "0"}})));
  EXPECT_EQ(other_rank.job_id, first.job_id);
}

TEST(RankFromEnvTest, TorchrunMasterAddrPortFallback) {
  Env env =
      Merge(Torchrun("1", "1", "2", "2"), {{"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "29500"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(env));
  EXPECT_EQ(r.job_id, "master:10.0.0.7:29500");

  // torchrun's default run id "none" is no id: fall back to the master, and
  // the restart count, so that torchrun's restarts of a job differ.
  env["TORCHELASTIC_RUN_ID"] = "none";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r2, FromEnv(env));
  EXPECT_EQ(r2.job_id, "master:10.0.0.7:29500");
  env["TORCHELASTIC_RESTART_COUNT"] = "0";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo first, FromEnv(env));
  env["TORCHELASTIC_RESTART_COUNT"] = "1";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo restarted, FromEnv(env));
  EXPECT_EQ(first.job_id, "master:10.0.0.7:29500:0");
  EXPECT_NE(restarted.job_id, first.job_id);
  EXPECT_TRUE(first.job_id_reused) << "a relaunch on the same master gets the same id";

  // A real run id wins over the master address.
  env["TORCHELASTIC_RUN_ID"] = "xyz";
  env["TORCHELASTIC_RESTART_COUNT"] = "0";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r3, FromEnv(env));
  EXPECT_EQ(r3.job_id, "torchrun:xyz:0");
  EXPECT_FALSE(r3.job_id_reused);
}

TEST(RankFromEnvTest, TorchrunWithoutAnyJobIdHasEmptyJobId) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(Torchrun("0", "0", "2", "2")));
  EXPECT_EQ(r.job_id, "");
  EXPECT_EQ(r.source, "torchrun");
}

TEST(RankFromEnvTest, CkptioJobIdOverridesEverySource) {
  Env torch = Merge(Torchrun("1", "1", "2", "2"), {{"TORCHELASTIC_RUN_ID", "abc"},
                                                   {"TORCHELASTIC_RESTART_COUNT", "0"},
                                                   {"MASTER_ADDR", "h"},
                                                   {"MASTER_PORT", "1"},
                                                   {"CKPTIO_JOB_ID", "my-job"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(torch));
  EXPECT_EQ(r.job_id, "my-job");

  Env slurm = Merge(Slurm("0", "0", "2", "2"), {{"SLURM_JOB_ID", "77"}, {"CKPTIO_JOB_ID", "j"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo s, FromEnv(slurm));
  EXPECT_EQ(s.job_id, "j");

  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo single, FromEnv({{"CKPTIO_JOB_ID", "solo"}}));
  EXPECT_EQ(single.job_id, "solo");
  EXPECT_EQ(single.source, "single");

  // An empty override is no override.
  torch["CKPTIO_JOB_ID"] = "";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r2, FromEnv(torch));
  EXPECT_EQ(r2.job_id, "torchrun:abc:0");
}

TEST(RankFromEnvTest, TorchrunWithoutLocalWorldSizeAllowsAnyLocalRank) {
  Env env = Torchrun("3", "3", "4", "");
  env.erase("LOCAL_WORLD_SIZE");
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(env));
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.local_rank, 3);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_world_size, 4) << "unknown local world size: at most the world size";
}

// ---------------------------------------------------------------- Slurm

TEST(RankFromEnvTest, SlurmFullSet) {
  Env env = Merge(Slurm("5", "1", "8", "4"),
                  {{"SLURM_JOB_ID", "1234"}, {"SLURM_STEP_ID", "0"}, {"SLURM_RESTART_COUNT", "1"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(env));
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.source, "slurm");
  EXPECT_EQ(r.job_id, "slurm:1234.0:1");

  // A requeued job (new restart count) and a new job step are new launches.
  env["SLURM_RESTART_COUNT"] = "2";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo requeued, FromEnv(env));
  EXPECT_NE(requeued.job_id, r.job_id);
  env["SLURM_RESTART_COUNT"] = "1";
  env["SLURM_STEP_ID"] = "1";
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo next_step, FromEnv(env));
  EXPECT_NE(next_step.job_id, r.job_id);
}

TEST(RankFromEnvTest, SlurmTasksPerNodeListIsTolerated) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(Slurm("6", "2", "8", "4(x2)")));
  EXPECT_EQ(r.rank, 6);
  EXPECT_EQ(r.local_rank, 2);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_world_size, 8) << "an unparsable SLURM_STEP_TASKS_PER_NODE is unknown";
  CKPTIO_EXPECT_OK(r.Validate());

  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo het, FromEnv(Slurm("4", "0", "6", "4,2")));
  EXPECT_EQ(het.local_world_size, 6);

  // More per node than in the step is no bound: unknown.
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo step, FromEnv(Slurm("1", "1", "2", "4")));
  EXPECT_EQ(step.local_world_size, 2);

  Env no_per_node = Slurm("1", "1", "2", "");
  no_per_node.erase("SLURM_STEP_TASKS_PER_NODE");
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r2, FromEnv(no_per_node));
  EXPECT_EQ(r2.local_world_size, 2);
  EXPECT_EQ(r2.job_id, "");
}

// A program run in an sbatch script itself (no srun) sees SLURM_PROCID=0
// and SLURM_NTASKS of the allocation, but no SLURM_STEP_NUM_TASKS, which
// only srun sets (Slurm's env_array_for_step); an salloc shell has no
// SLURM_PROCID at all. Either is one process, not rank 0 of SLURM_NTASKS
// waiting for ranks that never start.
TEST(RankFromEnvTest, SlurmBatchScriptAndAllocationShellAreOneProcess) {
  Env batch = {{"SLURM_JOB_ID", "1234"}, {"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"},
               {"SLURM_NTASKS", "4"},    {"SLURM_NPROCS", "4"}, {"SLURM_NTASKS_PER_NODE", "4"}};
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo b, FromEnv(batch));
  EXPECT_EQ(b.source, "single");
  EXPECT_EQ(b.world_size, 1);
  EXPECT_EQ(b.rank, 0);

  Env shell = {{"SLURM_JOB_ID", "1234"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "4"}};
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo s, FromEnv(shell));
  EXPECT_EQ(s.source, "single");
  EXPECT_EQ(s.world_size, 1);

  // srun --preserve-env leaves the allocation's SLURM_NTASKS: the step's
  // size is SLURM_STEP_NUM_TASKS.
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo e,
                              FromEnv(Merge(Slurm("1", "1", "2", "2"), {{"SLURM_NTASKS", "8"}})));
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.rank, 1);
}

// ---------------------------------------------------------------- Open MPI

TEST(RankFromEnvTest, OpenMpiFullSet) {
  Env env = Merge(OpenMpi("3", "1", "4", "2"), {{"OMPI_MCA_ess_base_jobid", "98765"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(env));
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_world_size, 2);
  EXPECT_EQ(r.source, "openmpi");
  EXPECT_EQ(r.job_id, "openmpi:98765");

  Env pmix = Merge(OpenMpi("0", "0", "4", "2"), {{"PMIX_NAMESPACE", "prterun-host-123@1"}});
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo p, FromEnv(pmix));
  EXPECT_EQ(p.job_id, "openmpi:prterun-host-123@1");

  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo bare, FromEnv(OpenMpi("0", "0", "1", "1")));
  EXPECT_EQ(bare.job_id, "");
}

// ---------------------------------------------------------------- none

TEST(RankFromEnvTest, NoVariablesIsSingleProcess) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(Env{}));
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.local_rank, 0);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.local_world_size, 1);
  EXPECT_EQ(r.source, "single");
  EXPECT_EQ(r.job_id, "");
  CKPTIO_EXPECT_OK(r.Validate());
  EXPECT_EQ(r.ToString(), "rank 0/1 (local 0/1)");

  // Job-id hints of a launcher without its rank variables change nothing.
  CKPTIO_ASSERT_OK_AND_ASSIGN(
      RankInfo r2, FromEnv({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}, {"SLURM_JOB_ID", "5"}}));
  EXPECT_EQ(r2.world_size, 1);
  EXPECT_EQ(r2.source, "single");
}

// ---------------------------------------------------------------- errors

TEST(RankFromEnvTest, PartialSetsNameTheVariables) {
  ExpectInvalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {"torchrun", "LOCAL_RANK"});
  ExpectInvalid({{"RANK", "0"}}, {"torchrun", "LOCAL_RANK", "WORLD_SIZE"});
  ExpectInvalid({{"LOCAL_RANK", "0"}}, {"torchrun", "RANK", "WORLD_SIZE"});
  ExpectInvalid({{"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "4"}}, {"RANK", "LOCAL_RANK"});
  ExpectInvalid({{"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "4"}}, {"slurm", "SLURM_LOCALID"});
  ExpectInvalid({{"SLURM_STEP_NUM_TASKS", "4"}}, {"SLURM_PROCID", "SLURM_LOCALID"});
  ExpectInvalid({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
                {"openmpi", "OMPI_COMM_WORLD_LOCAL_RANK"});
}

TEST(RankFromEnvTest, NonNumbersAreRejected) {
  ExpectInvalid(Torchrun("abc", "0", "2", "2"), {"RANK", "abc"});
  ExpectInvalid(Torchrun("1x", "0", "2", "2"), {"RANK", "1x"});
  ExpectInvalid(Torchrun("", "0", "2", "2"), {"RANK"});
  ExpectInvalid(Torchrun("0", "0", "2.5", "2"), {"WORLD_SIZE", "2.5"});
  ExpectInvalid(Torchrun("0", "zero", "2", "2"), {"LOCAL_RANK", "zero"});
  ExpectInvalid(Torchrun("0", "0", "2", "two"), {"LOCAL_WORLD_SIZE", "two"});
  ExpectInvalid(Torchrun("0", "0", "99999999999999999999999", "1"), {"WORLD_SIZE", "limit"});
  ExpectInvalid(Torchrun("0", "0", "20000000", "1"), {"WORLD_SIZE", "limit of 16777216"});
  // Digits only: no sign, no spaces (strtol would take all three).
  ExpectInvalid(Torchrun(" 1", "0", "2", "2"), {"RANK", "digits only"});
  ExpectInvalid(Torchrun("+1", "0", "2", "2"), {"RANK", "digits only"});
  ExpectInvalid(Torchrun("0", "-0", "2", "2"), {"LOCAL_RANK", "digits only"});
  ExpectInvalid(Slurm("x", "0", "2", "2"), {"SLURM_PROCID", "x"});
  ExpectInvalid(Slurm("0", "0", "many", "2"), {"SLURM_STEP_NUM_TASKS", "many"});
  ExpectInvalid(OpenMpi("0", "0", "2", "?"), {"OMPI_COMM_WORLD_LOCAL_SIZE"});
}

TEST(RankFromEnvTest, NegativeNumbersAreRejected) {
  ExpectInvalid(Torchrun("-1", "0", "2", "2"), {"RANK", "-1"});
  ExpectInvalid(Torchrun("0", "-1", "2", "2"), {"LOCAL_RANK", "-1"});
  ExpectInvalid(Torchrun("0", "0", "-2", "2"), {"WORLD_SIZE", "-2"});
  ExpectInvalid(Slurm("-3", "0", "4", "4"), {"SLURM_PROCID"});
  ExpectInvalid(OpenMpi("0", "0", "-4", "1"), {"OMPI_COMM_WORLD_SIZE"});
}

TEST(RankFromEnvTest, ContradictionsAreRejected) {
  // RANK >= WORLD_SIZE.
  ExpectInvalid(Torchrun("4", "0", "4", "4"), {"torchrun", "rank 4/4"});
  ExpectInvalid(Slurm("9", "1", "8", "4"), {"slurm"});
  ExpectInvalid(OpenMpi("2", "0", "2", "1"), {"openmpi"});
  // LOCAL_RANK >= LOCAL_WORLD_SIZE.
  ExpectInvalid(Torchrun("3", "2", "4", "2"), {"torchrun", "local"});
  ExpectInvalid(OpenMpi("3", "3", "4", "2"), {"openmpi", "local"});
  // Local rank above the global rank.
  ExpectInvalid(Torchrun("0", "1", "4", "2"), {"torchrun", "local rank"});
  // Zero world size, and more ranks on the node than in the job.
  ExpectInvalid(Torchrun("0", "0", "0", "1"), {"world size"});
  ExpectInvalid(Torchrun("0", "0", "2", "4"), {"local world size"});
  ExpectInvalid(Torchrun("0", "0", "2", "0"), {"local world size"});
}

// ---------------------------------------------------------------- precedence

TEST(RankFromEnvTest, TorchrunWinsOverOpenMpiWhichWinsOverSlurm) {
  // torchrun launched inside a Slurm allocation: both sets are present.
  Env env = Merge(Merge(Torchrun("3", "1", "4", "2"),
                        {{"TORCHELASTIC_RUN_ID", "t"}, {"TORCHELASTIC_RESTART_COUNT", "0"}}),
                  Merge(Slurm("0", "0", "2", "1"), {{"SLURM_JOB_ID", "55"}}));
  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo r, FromEnv(env));
  EXPECT_EQ(r.source, "torchrun");
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_world_size, 2);
  EXPECT_EQ(r.job_id, "torchrun:t:0");

  CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo all, FromEnv(Merge(env, OpenMpi("1", "0", "2", "1"))));
  EXPECT_EQ(all.source, "torchrun");

  // mpirun inside a Slurm allocation: every rank inherits the batch step's
  // SLURM_PROCID 0; only Open MPI's variables tell the ranks apart.
  for (const char* ompi_rank : {"1", "3"}) {
    Env slurm_mpi =
        Merge(Merge(Slurm("0", "0", "1", "1"), {{"SLURM_JOB_ID", "9"}}),
              Merge(OpenMpi(ompi_rank, ompi_rank, "4", "4"), {{"OMPI_MCA_ess_base_jobid", "1"}}));
    CKPTIO_ASSERT_OK_AND_ASSIGN(RankInfo s, FromEnv(slurm_mpi));
    EXPECT_EQ(s.source, "openmpi");
    EXPECT_EQ(s.rank, std::stoi(ompi_rank));
    EXPECT_EQ(s.world_size, 4);
    EXPECT_EQ(s.job_id, "openmpi:1");
  }
}

// ---------------------------------------------------------------- Validate, ToString

TEST(RankInfoTest, ValidateAndToString) {
  RankInfo r;
  CKPTIO_EXPECT_OK(r.Validate());
  EXPECT_EQ(r.ToString(), "rank 0/1 (local 0/1)");

  r.rank = 2;
  r.local_rank = 0;
  r.world_size = 4;
  r.local_world_size = 2;
  CKPTIO_EXPECT_OK(r.Validate());
  EXPECT_EQ(r.ToString(), "rank 2/4 (local 0/2)");

  auto expect_bad = [](RankInfo bad, const std::string& what) {
    Status s = bad.Validate();
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << bad.ToString() << ": " << s;
    EXPECT_TRUE(Contains(s.message(), what)) << s;
    EXPECT_TRUE(Contains(s.message(), bad.ToString())) << "should show the identity: " << s;
  };
  RankInfo b = r;
  b.rank = 4;
  expect_bad(b, "rank must be in [0, world_size)");
  b = r;
  b.rank = -1;
  expect_bad(b, "rank must be in [0, world_size)");
  b = r;
  b.world_size = 0;
  expect_bad(b, "world size must be at least 1");
  b = r;
  b.local_world_size = 5;
  expect_bad(b, "local world size");
  b = r;
  b.local_world_size = 0;
  expect_bad(b, "local world size");
  b = r;
  b.local_rank = 2;
  expect_bad(b, "local rank must be in [0, local_world_size)");
  b = r;
  b.local_rank = -1;
  expect_bad(b, "local rank must be in [0, local_world_size)");
  b = r;
  b.rank = 0;
  b.local_rank = 1;
  expect_bad(b, "local rank cannot exceed the global rank");
}

// The real process environment (FromEnv() without a getter).
TEST(RankFromEnvTest, ReadsTheProcessEnvironment) {
  const char* names[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CKPTIO_JOB_ID"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  ::setenv("RANK", "1", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  ::setenv("CKPTIO_JOB_ID", "env-job", 1);
  auto r = RankInfo::FromEnv();
  for (const auto& kv : saved) {
    if (kv.second)
      ::setenv(kv.first.c_str(), kv.second->c_str(), 1);
    else
      ::unsetenv(kv.first.c_str());
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->source, "torchrun");
  EXPECT_EQ(r->rank, 1);
  EXPECT_EQ(r->world_size, 2);
  EXPECT_EQ(r->job_id, "env-job");
}

}  // namespace
}  // namespace ckptio
