// The s3:// backend's HTTP client (internal): one S3 request at a time per
// libcurl handle, handles pooled (each keeps its connections alive), SigV4
// signing by libcurl, deadlines, retries, and S3 errors turned into Status.
#ifndef CKPTIO_PLUGINS_S3_S3_HTTP_H_
#define CKPTIO_PLUGINS_S3_S3_HTTP_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/hash.h"
#include "ckptio/s3_backend.h"
#include "ckptio/status.h"

namespace ckptio::s3 {

struct Request {
  std::string method;  // GET HEAD PUT POST DELETE
  std::string key;     // full object key in the bucket ("" for the bucket)
  // Query parameters, unencoded; sent sorted and percent-encoded (SigV4's
  // canonical query string must match what is sent).
  std::map<std::string, std::string> query;
  std::vector<std::string> headers;  // "Name: value"
  std::string_view body;             // PUT/POST
  // GET: fill `sink` (exactly sink_size bytes expected) instead of
  // Response::body. Used by ranged reads straight into the caller's buffer.
  char* sink = nullptr;
  size_t sink_size = 0;
  // With a sink: fed each piece from the sink as it is written there
  // (reset at each try); its digest is then the hash of the sink.
  Hasher* sink_hash = nullptr;
  // Whether sending it again is harmless (GET, HEAD, DELETE, a PUT of a
  // whole body). A conditional PUT is retried too: its caller resolves a
  // 412 that a retry may cause.
  bool idempotent = true;
};

struct Response {
  long status = 0;
  std::string body;  // the error document, or the body when no sink
  uint64_t received = 0;
  std::map<std::string, std::string> headers;  // lowercase names
  int attempts = 0;                            // 1 + retries
  std::string Header(const std::string& name) const;
  // <Code> of an S3 error document ("" when none).
  std::string ErrorCode() const;
};

class Client {
 public:
  explicit Client(const S3Options& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends `request`, retrying transient failures (refused or broken
  // connections, 5xx, 429) up to three tries while the deadline
  // (options.timeout from now) allows. OK with the final response whatever
  // its HTTP status (callers map 4xx with Failure); Unavailable when no
  // response came.
  Result<Response> Send(const Request& request);
  // The same, within `deadline` (a call of several requests, e.g. a
  // listing of many pages, ends by its own deadline as a whole).
  Result<Response> Send(const Request& request, std::chrono::steady_clock::time_point deadline);
  std::chrono::steady_clock::time_point Deadline() const {
    return std::chrono::steady_clock::now() + options_.timeout;
  }

  // The Status for an unexpected HTTP status: NotFound (a missing bucket
  // named), PermissionDenied, Unavailable (5xx), FailedPrecondition.
  Status Failure(const Request& request, const Response& response) const;

  // "s3://bucket/prefix" for messages.
  const std::string& Where() const { return where_; }
  // "s3://bucket/KEY" for messages about one object (KEY: a full key).
  std::string Where(std::string_view full_key) const {
    return "s3://" + options_.bucket + "/" + std::string(full_key);
  }
  const S3Options& options() const { return options_; }

 private:
  struct Handle;
  std::unique_ptr<Handle> Take();
  void Give(std::unique_ptr<Handle> h);
  // One try; *transient says whether a failure to get an answer may pass.
  Result<Response> SendOnce(Handle& h, const Request& request,
                            std::chrono::steady_clock::time_point deadline, bool* transient);
  std::string Url(const Request& request) const;

  const S3Options options_;
  const std::string where_;
  const std::string sigv4_;  // "aws:amz:REGION:s3"
  const std::string userpwd_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Handle>> idle_;
};

// Why `endpoint` cannot be an S3 endpoint, "" when it can: it must be an
// http:// or https:// URL of a host and an optional port, nothing else (a
// path, a query, a user name or a bad port would break each request's URL
// or signature), as libcurl's URL parser reads it.
std::string EndpointProblem(const std::string& endpoint);

// Percent-encodes for a URL path ('/' kept) or a query value ('/' encoded),
// as SigV4 requires (unreserved: A-Z a-z 0-9 - _ . ~).
std::string UriEncode(std::string_view s, bool keep_slash);

// The text of every <tag>...</tag> in an XML document, in order, with the
// five predefined entities and numeric references decoded. Enough for S3's
// flat answers (ListObjectsV2, InitiateMultipartUpload, errors); a
// malformed document yields what was found before the damage.
std::vector<std::string> XmlValues(std::string_view xml, std::string_view tag);

}  // namespace ckptio::s3

#endif  // CKPTIO_PLUGINS_S3_S3_HTTP_H_
