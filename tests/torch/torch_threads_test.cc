// Where the system gives no more threads (RLIMIT_NPROC, memory), saves and
// loads still work: the copies, the hashing and the write overlap run on
// the caller's thread, and SaveAsync saves synchronously, saying so
// (thread starts refused by refuse_threads.cc's pthread_create).
#include <chrono>
#include <future>
#include <string>

#include "ckptio/ckptio.h"
#include "ckptio/torch.h"
#include "refuse_threads.h"
#include "test_util.h"

namespace ckptio {
namespace {

using testing::TempDir;

TEST(NoThreadsTest, SaveSaveAsyncAndLoadWorkOnTheCallersThread) {
  torch::set_num_threads(1);  // LibTorch's own pool would abort without its threads
  // 24 MiB: copied in several 8 MiB pieces, hashed in several chunks,
  // written in pieces of 1 MiB and more (the write overlap).
  torch::Tensor saved = torch::rand({6 << 20});
  TempDir dir;
  auto ckpt = Checkpointer::Open(dir.Sub("store"), RankInfo{});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  {
    testing::RefuseThreads none;
    CKPTIO_ASSERT_OK((*ckpt)->Save(1, State{{"t", saved}}));
    ::testing::internal::CaptureStderr();
    auto async = (*ckpt)->SaveAsync(2, State{{"t", saved}});
    const std::string warning = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(async.wait_for(std::chrono::seconds(0)), std::future_status::ready)
        << "without a thread, the call saves by itself";
    CKPTIO_ASSERT_OK(async.get());
    EXPECT_NE(warning.find("could not start its thread"), std::string::npos) << warning;
    torch::Tensor into = torch::zeros({6 << 20});
    State state{{"t", into}};
    auto loaded = (*ckpt)->Load(state);
    ASSERT_TRUE(loaded.ok() && loaded->step.has_value())
        << (loaded.ok() ? "nothing to load" : loaded.status().ToString());
    EXPECT_EQ((*loaded->step), 2);
    EXPECT_TRUE(torch::equal(into, saved));
    EXPECT_GT(none.refused(), 0) << "no thread was refused: the test proves nothing";
  }
  for (int64_t step : {1, 2}) {
    CKPTIO_ASSERT_OK_AND_ASSIGN(auto reader, (*ckpt)->store().OpenStep(step));
    CKPTIO_EXPECT_OK(reader->Verify());
  }
}

}  // namespace
}  // namespace ckptio
