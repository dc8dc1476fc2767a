// s3:// URIs and the AWS settings around them (no server needed): what the
// URI says wins, then the environment, then the credentials file; defaults;
// and every malformed part refused with a message that names it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "ckptio/backends.h"
#include "ckptio/s3_backend.h"
#include "test_util.h"

namespace ckptio {
namespace {

const char* const kAwsVars[] = {"AWS_ENDPOINT_URL",
                                "AWS_ENDPOINT_URL_S3",
                                "AWS_REGION",
                                "AWS_DEFAULT_REGION",
                                "AWS_ACCESS_KEY_ID",
                                "AWS_SECRET_ACCESS_KEY",
                                "AWS_SESSION_TOKEN",
                                "AWS_PROFILE",
                                "AWS_SHARED_CREDENTIALS_FILE",
                                "HOME"};

// Each test starts from an environment without AWS settings (and a HOME
// without ~/.aws), and gets the caller's back afterwards.
class S3UriTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kAwsVars) {
      const char* was = std::getenv(v);
      saved_[v] = was ? std::optional<std::string>(was) : std::nullopt;
      ::unsetenv(v);
    }
    ::setenv("HOME", dir_.path().c_str(), 1);
  }
  void TearDown() override {
    for (const auto& [v, was] : saved_) {
      if (was)
        ::setenv(v.c_str(), was->c_str(), 1);
      else
        ::unsetenv(v.c_str());
    }
  }
  static Result<S3Options> Parse(const std::string& text) {
    CKPTIO_ASSIGN_OR_RETURN(Uri uri, Uri::Parse(text));
    return ParseS3Uri(uri);
  }
  static void Keys() {
    ::setenv("AWS_ACCESS_KEY_ID", "ENVKEY", 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", "envsecret", 1);
  }
  void CredentialsFile(const std::string& text) {
    testing::WriteFile(dir_.path() + "/credentials", text);
    ::setenv("AWS_SHARED_CREDENTIALS_FILE", (dir_.path() + "/credentials").c_str(), 1);
  }

  testing::TempDir dir_;
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST_F(S3UriTest, TheEnvironmentFillsWhatTheUriLeavesOut) {
  Keys();
  ::setenv("AWS_SESSION_TOKEN", "envtoken", 1);
  ::setenv("AWS_REGION", "eu-west-3", 1);
  auto o = Parse("s3://my-bucket/runs/run42/");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->bucket, "my-bucket");
  EXPECT_EQ(o->prefix, "runs/run42");
  EXPECT_EQ(o->region, "eu-west-3");
  EXPECT_EQ(o->endpoint, "https://s3.eu-west-3.amazonaws.com");
  EXPECT_EQ(o->access_key_id, "ENVKEY");
  EXPECT_EQ(o->secret_access_key, "envsecret");
  EXPECT_EQ(o->session_token, "envtoken");
  EXPECT_EQ(o->timeout.count(), 30000);
  EXPECT_EQ(o->part_bytes, uint64_t{16} << 20);
  EXPECT_EQ(o->parallel, 4);
  EXPECT_FALSE(o->path_style) << "AWS's own endpoint takes virtual-hosted requests";

  ::setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000", 1);
  o = Parse("s3://my-bucket");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->endpoint, "http://127.0.0.1:9000");
  EXPECT_EQ(o->prefix, "");
  EXPECT_TRUE(o->path_style) << "another server gets path-style requests";
  ::setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9001", 1);  // the S3-specific one wins
  o = Parse("s3://my-bucket");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->endpoint, "http://127.0.0.1:9001");
}

TEST_F(S3UriTest, TheUriWinsOverTheEnvironment) {
  Keys();
  ::setenv("AWS_REGION", "eu-west-3", 1);
  ::setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000", 1);
  auto o = Parse(
      "s3://b12/p?endpoint=http://rgw.local:7480&region=us-west-2&timeout_ms=2500&part_mib=8"
      "&parallel=16&lease_ms=4000&path_style=0");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->endpoint, "http://rgw.local:7480");
  for (const char* endpoint : {"http://[::1]:9000", "https://rgw.local/", "http://10.0.0.1"}) {
    auto other = Parse(std::string("s3://b12/p?endpoint=") + endpoint);
    ASSERT_TRUE(other.ok()) << endpoint << ": " << other.status();
    EXPECT_EQ(other->endpoint, endpoint);
  }
  EXPECT_EQ(o->region, "us-west-2");
  EXPECT_EQ(o->timeout.count(), 2500);
  EXPECT_EQ(o->part_bytes, uint64_t{8} << 20);
  EXPECT_EQ(o->parallel, 16);
  EXPECT_EQ(o->lease.count(), 4000);
  EXPECT_FALSE(o->path_style);
  o = Parse("s3://b12/p?path_style=1");  // AWS's endpoint, path-style asked for
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->path_style);
}

TEST_F(S3UriTest, CredentialsComeFromTheProfileWhenTheEnvironmentHasNone) {
  CredentialsFile(
      "# a comment\n[default]\naws_access_key_id = DEFKEY\naws_secret_access_key=defsecret\n\n"
      "[ci]\n  aws_access_key_id = CIKEY  \naws_secret_access_key = cisecret\n"
      "aws_session_token = citoken\n");
  auto o = Parse("s3://bucket/x");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->access_key_id, "DEFKEY");
  EXPECT_EQ(o->secret_access_key, "defsecret");
  EXPECT_EQ(o->session_token, "");

  ::setenv("AWS_PROFILE", "ci", 1);
  o = Parse("s3://bucket/x");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->access_key_id, "CIKEY");
  EXPECT_EQ(o->session_token, "citoken");

  // Keys in the environment win over AWS_PROFILE, as the AWS tools have it;
  // a profile named in the URI wins over both.
  Keys();
  o = Parse("s3://bucket/x");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->access_key_id, "ENVKEY");
  o = Parse("s3://bucket/x?profile=default");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->access_key_id, "DEFKEY");
}

TEST_F(S3UriTest, NoCredentialsIsFailedPreconditionSayingWhereTheyWereLookedFor) {
  auto o = Parse("s3://bucket/x");
  ASSERT_EQ(o.status().code(), Code::kFailedPrecondition) << o.status();
  EXPECT_NE(o.status().message().find("AWS_ACCESS_KEY_ID"), std::string::npos) << o.status();
  EXPECT_NE(o.status().message().find("/.aws/credentials"), std::string::npos) << o.status();
  CredentialsFile("[other]\naws_access_key_id = K\naws_secret_access_key = S\n");
  o = Parse("s3://bucket/x?profile=missing");
  ASSERT_EQ(o.status().code(), Code::kFailedPrecondition) << o.status();
  EXPECT_NE(o.status().message().find("\"missing\""), std::string::npos) << o.status();
}

TEST_F(S3UriTest, MalformedPartsAreRefusedByName) {
  Keys();
  struct Case {
    const char* uri;
    const char* names;
  };
  for (const Case& c : {
           Case{"s3://ab/x", "bucket"},
           Case{"s3://bad!bucket/x", "bucket"},
           Case{"s3://bucket/a/../b", "prefix"},
           Case{"s3://bucket/a//b", "prefix"},
           Case{"s3://bucket/x?colour=blue", "colour"},
           Case{"s3://bucket/x?timeout_ms=soon", "timeout_ms"},
           Case{"s3://bucket/x?part_mib=4", "part_mib"},
           Case{"s3://bucket/x?parallel=0", "parallel"},
           Case{"s3://bucket/x?lease_ms=10", "lease_ms"},
           Case{"s3://bucket/x?endpoint=ftp://host", "endpoint"},
           Case{"s3://bucket/x?endpoint=http://127.0.0.1:9000-b", "endpoint"},
           Case{"s3://bucket/x?endpoint=http://host:99999", "endpoint"},
           Case{"s3://bucket/x?endpoint=http://host:9000/bucket", "endpoint"},
           Case{"s3://bucket/x?endpoint=http://user@host:9000", "endpoint"},
           Case{"s3://bucket/x?endpoint=https://", "endpoint"},
           Case{"s3://bucket/x?region=us%20east", "region"},
           Case{"s3://bucket/x?path_style=yes", "path_style"},
       }) {
    auto o = Parse(c.uri);
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument) << c.uri << ": " << o.status();
    EXPECT_NE(o.status().message().find(c.names), std::string::npos) << c.uri << ": " << o.status();
  }
  ::setenv("AWS_SECRET_ACCESS_KEY", "has a space", 1);
  EXPECT_EQ(Parse("s3://bucket/x").status().code(), Code::kInvalidArgument);
}

// "s3" is a built-in scheme; opening a store sends nothing (a server that
// is not there shows at the first call, not at the open).
TEST_F(S3UriTest, TheBuiltInRegistryOpensS3Stores) {
  Keys();
  auto store = OpenStore("s3://bucket/run?endpoint=http://127.0.0.1:1&timeout_ms=500");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->uri(), "s3://bucket/run");  // no credentials in messages
  EXPECT_EQ((*store)->ListSteps().status().code(), Code::kUnavailable);
}

// Where each addressing style sends a request (the URL of a failed one).
TEST_F(S3UriTest, PathStyleAndVirtualHostedRequestsGoWhereS3ExpectsThem) {
  Keys();
  for (const auto& [style, url] :
       {std::pair<std::string, std::string>{"1", "http://127.0.0.1:1/bucket/run/LATEST"},
        {"0", "http://bucket.127.0.0.1:1/run/LATEST"}}) {
    auto store =
        OpenStore("s3://bucket/run?endpoint=http://127.0.0.1:1&timeout_ms=300&path_style=" + style);
    ASSERT_TRUE(store.ok()) << store.status();
    auto latest = (*store)->ReadLatest();
    EXPECT_EQ(latest.status().code(), Code::kUnavailable) << latest.status();
    EXPECT_NE(latest.status().message().find(url), std::string::npos)
        << "path_style=" << style << ": " << latest.status();
  }
}

}  // namespace
}  // namespace ckptio
