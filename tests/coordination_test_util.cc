#include "coordination_test_util.h"

#include <sys/stat.h>

#include <algorithm>
#include <thread>

#include "ckptio/posix_backend.h"

namespace ckptio::coordination_testing {

using ::ckptio::testing::RandomBytes;

RankInfo MakeRank(int rank, const std::string& job) {
  return ::ckptio::testing::TestRank(rank, kWorld, job);
}

std::string StepData(int64_t step) {
  return "step=" + std::to_string(step) + ";" +
         RandomBytes(4000 + static_cast<size_t>(step % 7) * 100, static_cast<uint64_t>(step));
}

Status OpenRank(const std::string& path, int rank, const std::string& job, WaitMode mode,
                RankCtx* ctx) {
  CKPTIO_ASSIGN_OR_RETURN(auto backend, NewPosixBackend(path));
  ctx->backend = std::shared_ptr<StorageBackend>(std::move(backend));
  ctx->store = std::make_unique<Store>(ctx->backend);
  CKPTIO_ASSIGN_OR_RETURN(ctx->coord, NewFileCoordinator(ctx->backend, MakeRank(rank, job), mode));
  return OkStatus();
}

Status VerifyStep(Store& store, int64_t step) {
  CKPTIO_ASSIGN_OR_RETURN(auto reader, store.OpenStep(step));
  if (reader->step() != step)
    return Status(Code::kDataLoss, "OpenStep(" + std::to_string(step) + ") gave step " +
                                       std::to_string(reader->step()));
  CKPTIO_RETURN_IF_ERROR(reader->Verify());
  CKPTIO_ASSIGN_OR_RETURN(std::string data, reader->ReadAll("data.bin"));
  if (data != StepData(step))
    return Status(Code::kDataLoss, "data.bin of step " + std::to_string(step) +
                                       " does not hold that step's bytes (starts \"" +
                                       data.substr(0, 16) + "\")");
  return OkStatus();
}

std::string AttemptOf(int64_t step) { return "test.s" + std::to_string(step); }

Status SaveStep(StoreWriter& writer, Coordinator& coord, int64_t step, int64_t* commit_start_ns) {
  CKPTIO_RETURN_IF_ERROR(coord.BeginSave(step, AttemptOf(step), milliseconds(5000)));
  Status outcome = [&]() -> Status {
    CKPTIO_ASSIGN_OR_RETURN(auto pending, writer.Begin(step));
    const std::string data = StepData(step);
    {
      CKPTIO_ASSIGN_OR_RETURN(auto stream, pending->AddObject("data.bin"));
      const size_t piece = data.size() / 4 + 1;
      for (size_t off = 0; off < data.size(); off += piece) {
        CKPTIO_RETURN_IF_ERROR(
            stream->Write(data.data() + off, std::min(piece, data.size() - off)));
        std::this_thread::sleep_for(milliseconds(1));
      }
      CKPTIO_RETURN_IF_ERROR(stream->Close());
    }
    const std::string meta = "step " + std::to_string(step);
    CKPTIO_RETURN_IF_ERROR(pending->PutObject("meta.txt", meta.data(), meta.size()));
    CKPTIO_RETURN_IF_ERROR(pending->SetMetadata(kSaveAttemptKey, AttemptOf(step)));
    if (commit_start_ns) *commit_start_ns = NowNs();
    CKPTIO_ASSIGN_OR_RETURN(auto info, pending->Commit());
    if (info.step != step) return Status(Code::kInternal, "committed the wrong step");
    return OkStatus();
  }();
  Status ended = coord.EndSave(step, AttemptOf(step), outcome);
  return outcome.ok() ? ended : outcome;
}

WriterOptions RankZeroWriterOptions(milliseconds lock_wait) {
  WriterOptions o;
  o.lock_wait = lock_wait;
  o.world_size = kWorld;
  o.saving_rank = 0;
  return o;
}

void LeaveStaleSaveRecord(const std::string& path, WaitMode mode, int64_t step) {
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto backend, NewPosixBackend(path));
  std::shared_ptr<StorageBackend> shared(std::move(backend));
  CKPTIO_ASSERT_OK_AND_ASSIGN(auto coord, NewFileCoordinator(shared, MakeRank(0, "old-job"), mode));
  CKPTIO_ASSERT_OK(coord->BeginSave(step, AttemptOf(step), milliseconds(2000)));
  coord.reset();
  struct stat st;
  ASSERT_EQ(::stat((path + "/.coord/save").c_str(), &st), 0) << "no stale record was written";
}

}  // namespace ckptio::coordination_testing
