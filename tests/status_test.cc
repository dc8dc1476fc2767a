// Status between ranks (EncodeStatus / DecodeStatus), Result's value
// access on an error, and the log sink.
#include "ckptio/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ckptio/log.h"

namespace ckptio {
namespace {

TEST(StatusCoding, EveryCodeTravelsWithItsMessageAndArrivesAsAPeersError) {
  for (int n = 1; n <= static_cast<int>(Code::kInternal); ++n) {
    const Status sent(static_cast<Code>(n), "step 3: it broke: here");  // ':' in the message
    auto got = DecodeStatus(EncodeStatus(sent));
    ASSERT_TRUE(got.has_value()) << EncodeStatus(sent);
    EXPECT_EQ(got->code(), sent.code());
    EXPECT_EQ(got->message(), sent.message());
    EXPECT_EQ(got->origin(), Status::Origin::kPeer);
    EXPECT_EQ(sent.origin(), Status::Origin::kThisProcess);
  }
  auto ok = DecodeStatus(EncodeStatus(OkStatus()));
  ASSERT_TRUE(ok.has_value());
  EXPECT_TRUE(ok->ok());
}

TEST(StatusCoding, DamagedOrHostileTextIsRefusedNotCast) {
  for (const char* bad :
       {"", ":", "13:out of range", "99:x", "-1:x", "1a:x", "001:x", "x:1", "7", "+7:x", " 7:x"})
    EXPECT_FALSE(DecodeStatus(bad).has_value()) << '"' << bad << '"';
  EXPECT_FALSE(CodeFromNumber(-1).has_value());
  EXPECT_FALSE(CodeFromNumber(static_cast<int>(Code::kInternal) + 1).has_value());
  EXPECT_EQ(CodeFromNumber(static_cast<int>(Code::kDataLoss)), Code::kDataLoss);
}

TEST(StatusCoding, ContextKeepsTheOrigin) {
  const Status peer = Status(Code::kUnavailable, "server gone").FromPeer();
  EXPECT_EQ(peer.WithContext("rank 2").origin(), Status::Origin::kPeer);
  EXPECT_EQ(peer.WithContext("rank 2").message(), "rank 2: server gone");
}

// A cause is typed, travels with the status through WithContext, and does
// not cross to another rank (its category means nothing there).
TEST(StatusCause, AnErrnoIsTheCauseAndContextKeepsItButAPeerGetsNone) {
  const Status s = ErrnoToStatus(ENOSPC, "write /ckpt/x");
  EXPECT_EQ(s.cause(), std::errc::no_space_on_device);
  EXPECT_EQ(s.WithContext("saving step 3").cause(), std::errc::no_space_on_device);
  EXPECT_FALSE(Status(Code::kDataLoss, "checksum").cause());
  EXPECT_FALSE(s.FromPeer().cause());
  auto got = DecodeStatus(EncodeStatus(s));
  ASSERT_TRUE(got.has_value());
  EXPECT_FALSE(got->cause());
  EXPECT_EQ(got->code(), Code::kResourceExhausted);
  const Status timed =
      Status(Code::kUnavailable, "mount").WithCause(std::make_error_code(std::errc::timed_out));
  EXPECT_EQ(timed.cause(), std::errc::timed_out);
  EXPECT_EQ(timed.message(), "mount");
}

TEST(ResultDeathTest, ReadingTheValueOfAnErrorAbortsWithItsMessage) {
  Result<int> failed = Status(Code::kDataLoss, "step 7 does not verify");
  EXPECT_DEATH((void)failed.value(),
               "value\\(\\) of a failed Result.*DATA_LOSS: step 7 does not verify");
  EXPECT_DEATH((void)*failed, "DATA_LOSS: step 7");
  Result<std::string> none = Status(Code::kNotFound, "no store");
  EXPECT_DEATH((void)none->size(), "NOT_FOUND: no store");
}

TEST(Result, AnOkStatusWithoutAValueIsAnError) {
  Result<int> r = OkStatus();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInternal);
}

TEST(Log, MessagesGoToTheSinkSetAndBackToStderrAfter) {
  std::vector<std::pair<LogLevel, std::string>> got;
  LogSink before = SetLogSink([&](LogLevel level, std::string_view message) {
    got.emplace_back(level, std::string(message));
  });
  EXPECT_FALSE(before);  // stderr by default
  Log(LogLevel::kWarning, "step 5 failed verification");
  LogSink mine = SetLogSink(nullptr);
  EXPECT_TRUE(mine);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].first, LogLevel::kWarning);
  EXPECT_EQ(got[0].second, "step 5 failed verification");
  ::testing::internal::CaptureStderr();
  Log(LogLevel::kWarning, "to stderr");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "ckptio: warning: to stderr\n");
  EXPECT_EQ(got.size(), 1u);
}

}  // namespace
}  // namespace ckptio
