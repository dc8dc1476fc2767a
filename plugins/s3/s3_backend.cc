// The s3:// backend: parses s3:// URIs and the AWS settings, and assembles
// the StorageBackend from the client (s3_http.h), the objects
// (s3_objects.h) and the writer lock (s3_locks.h). The model is described
// in ckptio/s3_backend.h.
#include "ckptio/s3_backend.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "s3_http.h"
#include "s3_locks.h"
#include "s3_objects.h"

namespace ckptio {
namespace {

class S3Backend : public StorageBackend {
 public:
  explicit S3Backend(const S3Options& options)
      : client_(std::make_shared<s3::Client>(options)),
        objects_(client_),
        locks_(std::make_shared<s3::LeaseTable>(client_)) {}

  std::string Uri() const override { return client_->Where(); }
  Result<std::unique_ptr<ObjectWriter>> NewObject(std::string_view key, WriteMode mode) override {
    return objects_.NewObject(key, mode);
  }
  Result<std::unique_ptr<ObjectReader>> OpenObject(std::string_view key) override {
    return objects_.OpenObject(key);
  }
  Result<ObjectInfo> Stat(std::string_view key) override { return objects_.Stat(key); }
  Result<std::vector<std::string>> List(std::string_view prefix) override {
    return objects_.List(prefix);
  }
  Status Delete(std::string_view key) override { return objects_.Delete(key); }
  Result<std::unique_ptr<BackendLock>> TryLock(std::string_view key, LockMode mode) override {
    return locks_->TryLock(key, mode);
  }
  Result<bool> IsLocked(std::string_view key) override { return locks_->IsLocked(key); }
  bool LocksAreLeases() const override { return true; }
  Result<size_t> AbortUnfinishedWrites() override { return objects_.AbortUploads(); }

 private:
  std::shared_ptr<s3::Client> client_;
  s3::Objects objects_;
  std::shared_ptr<s3::LeaseTable> locks_;
};

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string Trim(std::string s) {
  size_t b = s.find_first_not_of(" \t\r");
  size_t e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The keys of `profile` in an AWS credentials file (INI: "[name]" sections
// of "key = value" lines). Empty when the file or the profile is absent.
std::map<std::string, std::string> ReadProfile(const std::string& path,
                                               const std::string& profile) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    line = Trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      inside = Trim(line.substr(1, line.size() - 2)) == profile;
      continue;
    }
    size_t eq = line.find('=');
    if (inside && eq != std::string::npos)
      out[Trim(line.substr(0, eq))] = Trim(line.substr(eq + 1));
  }
  return out;
}

// A positive integer URI parameter within [lo, hi].
Result<int64_t> Number(const std::string& name, const std::string& value, int64_t lo, int64_t hi) {
  char* end = nullptr;
  long long n = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || n < lo || n > hi)
    return Status(Code::kInvalidArgument, "s3:// parameter " + name + "=" + value +
                                              " must be a whole number in [" + std::to_string(lo) +
                                              ", " + std::to_string(hi) + "]");
  return static_cast<int64_t>(n);
}

}  // namespace

Result<S3Options> ParseS3Uri(const Uri& uri) {
  auto bad = [&](const std::string& why) {
    return Status(Code::kInvalidArgument,
                  "invalid s3:// URI (s3://BUCKET/PREFIX?endpoint=URL"
                  "&region=R&profile=P&timeout_ms=N&part_mib=N&parallel=N"
                  "&lease_ms=N&path_style=0|1): " +
                      why);
  };
  S3Options o;
  o.bucket = uri.authority;
  // S3's bucket names: 3-63 of [a-z0-9.-]; older ones may have capitals and '_'.
  if (o.bucket.size() < 3 || o.bucket.size() > 63)
    return bad("the bucket name \"" + o.bucket + "\" must be 3 to 63 characters");
  for (unsigned char c : o.bucket)
    if (!std::isalnum(c) && c != '.' && c != '-' && c != '_')
      return bad("the bucket name \"" + o.bucket +
                 "\" may hold only letters, digits, '.', '-', '_'");
  std::string prefix = uri.path;
  while (!prefix.empty() && prefix.front() == '/') prefix.erase(0, 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (!prefix.empty()) {
    Status s = ValidateKey(prefix);
    if (!s.ok()) return bad("the prefix \"" + prefix + "\": " + s.message());
  }
  o.prefix = prefix;

  std::string profile = Env("AWS_PROFILE");
  std::optional<bool> path_style;
  bool explicit_profile = false;
  for (const auto& [key, value] : uri.params) {
    if (key == "endpoint") {
      o.endpoint = value;
    } else if (key == "region") {
      o.region = value;
    } else if (key == "profile") {
      profile = value;
      explicit_profile = true;
    } else if (key == "timeout_ms") {
      CKPTIO_ASSIGN_OR_RETURN(int64_t n, Number(key, value, 100, 3600000));
      o.timeout = std::chrono::milliseconds(n);
    } else if (key == "part_mib") {
      CKPTIO_ASSIGN_OR_RETURN(int64_t n, Number(key, value, 5, 1024));
      o.part_bytes = static_cast<uint64_t>(n) << 20;
    } else if (key == "parallel") {
      CKPTIO_ASSIGN_OR_RETURN(int64_t n, Number(key, value, 1, 64));
      o.parallel = static_cast<int>(n);
    } else if (key == "lease_ms") {
      CKPTIO_ASSIGN_OR_RETURN(int64_t n, Number(key, value, 1000, 3600000));
      o.lease = std::chrono::milliseconds(n);
    } else if (key == "path_style") {
      CKPTIO_ASSIGN_OR_RETURN(int64_t n, Number(key, value, 0, 1));
      path_style = n == 1;
    } else {
      return bad("unknown parameter \"" + key + "\"");
    }
  }
  if (!uri.params.count("region")) {
    o.region = Env("AWS_REGION");
    if (o.region.empty()) o.region = Env("AWS_DEFAULT_REGION");
    if (o.region.empty()) o.region = "us-east-1";
  }
  if (o.endpoint.empty()) o.endpoint = Env("AWS_ENDPOINT_URL_S3");
  if (o.endpoint.empty()) o.endpoint = Env("AWS_ENDPOINT_URL");
  // AWS's own endpoint wants virtual-hosted requests; other servers take
  // path-style ones, and may not resolve BUCKET.HOST at all.
  // (A bucket name with '.', '_' or capitals cannot be a host name under
  // AWS's certificate: path-style for those.)
  const bool dns_safe = o.bucket.find_first_of("._ABCDEFGHIJKLMNOPQRSTUVWXYZ") == std::string::npos;
  o.path_style = path_style.value_or(!o.endpoint.empty() || !dns_safe);
  if (o.endpoint.empty()) o.endpoint = "https://s3." + o.region + ".amazonaws.com";
  if (const std::string why = s3::EndpointProblem(o.endpoint); !why.empty())
    return bad("the endpoint \"" + o.endpoint + "\" " + why);
  for (unsigned char c : o.region)
    if (!std::isalnum(c) && c != '-') return bad("the region \"" + o.region + "\" is not one");

  // Credentials: the environment, unless a profile was named in the URI;
  // then the profile of the credentials file.
  if (!explicit_profile) {
    o.access_key_id = Env("AWS_ACCESS_KEY_ID");
    o.secret_access_key = Env("AWS_SECRET_ACCESS_KEY");
    o.session_token = Env("AWS_SESSION_TOKEN");
  }
  std::string file = Env("AWS_SHARED_CREDENTIALS_FILE");
  if (file.empty() && !Env("HOME").empty()) file = Env("HOME") + "/.aws/credentials";
  if (profile.empty()) profile = "default";
  if (o.access_key_id.empty() || o.secret_access_key.empty()) {
    auto keys = ReadProfile(file, profile);
    o.access_key_id = keys["aws_access_key_id"];
    o.secret_access_key = keys["aws_secret_access_key"];
    o.session_token = keys["aws_session_token"];
  }
  if (o.access_key_id.empty() || o.secret_access_key.empty())
    return Status(
        Code::kFailedPrecondition,
        "s3://" + o.bucket +
            ": no credentials found: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones), or put them "
            "in profile \"" +
            profile + "\" of " + (file.empty() ? std::string("~/.aws/credentials") : file) +
            " (AWS_PROFILE or the URI's profile= picks another)");
  for (const std::string* s : {&o.access_key_id, &o.secret_access_key, &o.session_token})
    for (unsigned char c : *s)
      if (c < 0x21 || c > 0x7e)
        return Status(Code::kInvalidArgument,
                      "s3://" + o.bucket + ": the credentials hold a space or control character");
  return o;
}

Result<std::unique_ptr<StorageBackend>> NewS3Backend(S3Options options) {
  if (options.bucket.empty()) return Status(Code::kInvalidArgument, "S3Options: no bucket");
  if (!options.prefix.empty()) CKPTIO_RETURN_IF_ERROR(ValidateKey(options.prefix));
  if (options.part_bytes < (uint64_t{5} << 20) || options.part_bytes > (uint64_t{1} << 30))
    return Status(Code::kInvalidArgument, "S3Options: part_bytes must be within [5 MiB, 1 GiB]");
  if (options.parallel < 1 || options.parallel > 64)
    return Status(Code::kInvalidArgument, "S3Options: parallel must be within [1, 64]");
  if (const std::string why = s3::EndpointProblem(options.endpoint); !why.empty())
    return Status(Code::kInvalidArgument,
                  "S3Options: the endpoint \"" + options.endpoint + "\" " + why);
  if (options.timeout.count() <= 0 || options.lease.count() < 1000)
    return Status(Code::kInvalidArgument,
                  "S3Options: timeout must be positive and lease at least 1000 ms");
  return std::unique_ptr<StorageBackend>(new S3Backend(options));
}

Status RegisterS3Backend(BackendRegistry& registry) {
  return registry.Register("s3", [](const Uri& uri) -> Result<std::unique_ptr<StorageBackend>> {
    CKPTIO_ASSIGN_OR_RETURN(S3Options options, ParseS3Uri(uri));
    return NewS3Backend(std::move(options));
  });
}

}  // namespace ckptio
