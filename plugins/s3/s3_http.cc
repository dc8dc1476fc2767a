// The s3:// backend's HTTP client (see s3_http.h).
#include "s3_http.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

namespace ckptio::s3 {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kTries = 3;
// An answer that is not streamed into a sink (errors, listings, upload
// ids) larger than this is refused: no S3 answer ckptio reads is near it.
constexpr size_t kMaxBodyBytes = size_t{64} << 20;
// libcurl 7.88 sends "Expect: 100-continue" with every PUT and holds the
// body back until the server's "100 Continue", one round trip more. A body
// up to this size goes at once: a record, a manifest or a small object
// costs one round trip. A larger part still waits, so that a refused
// request does not send its bytes for nothing.
constexpr size_t kSendAtOnceBytes = size_t{1} << 20;

void GlobalInit() {
  static const CURLcode init = curl_global_init(CURL_GLOBAL_DEFAULT);
  (void)init;
}

struct Transfer {
  const Request* request = nullptr;
  Response* response = nullptr;
  CURL* curl = nullptr;
  size_t sent = 0;
  bool too_long = false;  // more than the sink or kMaxBodyBytes
};

size_t OnHeader(char* data, size_t size, size_t n, void* arg) {
  auto* t = static_cast<Transfer*>(arg);
  std::string_view line(data, size * n);
  if (line.substr(0, 5) == "HTTP/") {  // a new response (after 100 Continue)
    t->response->headers.clear();
    return size * n;
  }
  size_t colon = line.find(':');
  if (colon == std::string_view::npos) return size * n;
  std::string name(line.substr(0, colon));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
    value.remove_suffix(1);
  t->response->headers[name] = std::string(value);
  return size * n;
}

size_t OnBody(char* data, size_t size, size_t n, void* arg) {
  auto* t = static_cast<Transfer*>(arg);
  const size_t len = size * n;
  long code = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &code);
  Response& r = *t->response;
  if (t->request->sink != nullptr && code >= 200 && code < 300) {
    if (r.received + len > t->request->sink_size) {
      t->too_long = true;
      return 0;  // aborts the transfer
    }
    std::memcpy(t->request->sink + r.received, data, len);
    // The bytes as they now stand in the sink, still in cache: what the
    // caller gets is what was hashed.
    if (t->request->sink_hash != nullptr)
      t->request->sink_hash->Update(t->request->sink + r.received, len);
  } else {
    if (r.body.size() + len > kMaxBodyBytes) {
      t->too_long = true;
      return 0;
    }
    r.body.append(data, len);
  }
  r.received += len;
  return len;
}

// A body is sent again from `offset` (0) when curl retries a request on a
// fresh connection after a reused one turned out dead.
int OnSeek(void* arg, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(arg);
  if (origin != SEEK_SET || offset < 0 || static_cast<size_t>(offset) > t->request->body.size())
    return CURL_SEEKFUNC_FAIL;
  t->sent = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

size_t OnRead(char* buf, size_t size, size_t n, void* arg) {
  auto* t = static_cast<Transfer*>(arg);
  const std::string_view body = t->request->body;
  size_t len = std::min(size * n, body.size() - t->sent);
  std::memcpy(buf, body.data() + t->sent, len);
  t->sent += len;
  return len;
}

bool Transient(CURLcode c) {
  switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SEND_FAIL_REWIND:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

bool TransientStatus(long status) { return status == 429 || status >= 500; }

}  // namespace

struct Client::Handle {
  CURL* curl = curl_easy_init();
  ~Handle() {
    if (curl) curl_easy_cleanup(curl);
  }
};

std::string Response::Header(const std::string& name) const {
  auto it = headers.find(name);
  return it == headers.end() ? std::string() : it->second;
}

std::string Response::ErrorCode() const {
  auto codes = XmlValues(body, "Code");
  return codes.empty() ? std::string() : codes.front();
}

std::string UriEncode(std::string_view s, bool keep_slash) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::vector<std::string> XmlValues(std::string_view xml, std::string_view tag) {
  const std::string open = "<" + std::string(tag) + ">";
  const std::string close = "</" + std::string(tag) + ">";
  std::vector<std::string> out;
  size_t at = 0;
  while ((at = xml.find(open, at)) != std::string_view::npos) {
    size_t begin = at + open.size();
    size_t end = xml.find(close, begin);
    if (end == std::string_view::npos) break;
    std::string_view raw = xml.substr(begin, end - begin);
    std::string value;
    value.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] != '&') {
        value += raw[i];
        continue;
      }
      size_t semi = raw.find(';', i);
      if (semi == std::string_view::npos) {
        value += raw.substr(i);
        break;
      }
      std::string_view ent = raw.substr(i + 1, semi - i - 1);
      if (ent == "amp") {
        value += '&';
      } else if (ent == "lt") {
        value += '<';
      } else if (ent == "gt") {
        value += '>';
      } else if (ent == "quot") {
        value += '"';
      } else if (ent == "apos") {
        value += '\'';
      } else if (ent.size() > 1 && ent[0] == '#') {
        // A numeric reference: kept as one byte when ASCII, else as a
        // character no valid key holds (so the key is skipped, not misread).
        long cp = ent[1] == 'x' ? std::strtol(std::string(ent.substr(2)).c_str(), nullptr, 16)
                                : std::strtol(std::string(ent.substr(1)).c_str(), nullptr, 10);
        value += cp > 0 && cp < 128 ? static_cast<char>(cp) : '\x7f';
      } else {
        value += raw.substr(i, semi - i + 1);
      }
      i = semi;
    }
    out.push_back(std::move(value));
    at = end + close.size();
  }
  return out;
}

Client::Client(const S3Options& options)
    : options_(options),
      where_("s3://" + options.bucket + (options.prefix.empty() ? "" : "/" + options.prefix)),
      sigv4_("aws:amz:" + options.region + ":s3"),
      userpwd_(options.access_key_id + ":" + options.secret_access_key) {
  GlobalInit();
}

Client::~Client() = default;

std::unique_ptr<Client::Handle> Client::Take() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!idle_.empty()) {
      auto h = std::move(idle_.back());
      idle_.pop_back();
      return h;
    }
  }
  return std::make_unique<Handle>();
}

void Client::Give(std::unique_ptr<Handle> h) {
  std::lock_guard<std::mutex> g(mu_);
  if (idle_.size() < 64) idle_.push_back(std::move(h));
}

std::string EndpointProblem(const std::string& endpoint) {
  if (endpoint.rfind("http://", 0) != 0 && endpoint.rfind("https://", 0) != 0)
    return "must start with https:// or http://";
  std::unique_ptr<CURLU, void (*)(CURLU*)> url(curl_url(), curl_url_cleanup);
  if (!url) return "cannot be parsed: libcurl has no memory";
  if (CURLUcode rc = curl_url_set(url.get(), CURLUPART_URL, endpoint.c_str(), 0); rc != CURLUE_OK)
    return std::string("is not a URL: ") + curl_url_strerror(rc);
  // A part the URL has: its text; none: nullopt.
  auto part = [&](CURLUPart which) -> std::optional<std::string> {
    char* text = nullptr;
    if (curl_url_get(url.get(), which, &text, 0) != CURLUE_OK) return std::nullopt;
    std::string out = text;
    curl_free(text);
    return out;
  };
  if (part(CURLUPART_USER) || part(CURLUPART_PASSWORD))
    return "holds a user name: give credentials in AWS_ACCESS_KEY_ID / "
           "AWS_SECRET_ACCESS_KEY or a profile";
  if (part(CURLUPART_QUERY) || part(CURLUPART_FRAGMENT)) return "has a query or a fragment";
  if (auto path = part(CURLUPART_PATH); path && *path != "/" && !path->empty())
    return "has a path (\"" + *path + "\"): give scheme, host and port only";
  return "";
}

std::string Client::Url(const Request& request) const {
  std::string url = options_.endpoint;
  while (!url.empty() && url.back() == '/') url.pop_back();
  if (options_.path_style) {
    url += "/" + UriEncode(options_.bucket, false);
  } else {  // virtual-hosted: https://BUCKET.host/KEY
    const size_t host = url.find("://") + 3;
    url.insert(host, options_.bucket + ".");
  }
  url += "/";
  if (!request.key.empty()) url += UriEncode(request.key, true);
  char sep = '?';
  for (const auto& [k, v] : request.query) {  // std::map: sorted, as SigV4 wants
    url += sep + UriEncode(k, false) + "=" + UriEncode(v, false);
    sep = '&';
  }
  return url;
}

Result<Response> Client::Send(const Request& request) { return Send(request, Deadline()); }

Result<Response> Client::Send(const Request& request, Clock::time_point deadline) {
  auto h = Take();
  if (h->curl == nullptr)
    return Status(Code::kResourceExhausted, "libcurl: no memory for a handle");
  Result<Response> r = Status(Code::kInternal, "not sent");
  for (int attempt = 1; attempt <= kTries; ++attempt) {
    bool transient = false;
    r = SendOnce(*h, request, deadline, &transient);
    if (r.ok()) {
      r->attempts = attempt;
      // AWS answers two conditional writes of one key at once with 409
      // ConditionalRequestConflict: sent again, ours gets its 200 or 412.
      transient = TransientStatus(r->status) ||
                  (r->status == 409 && r->ErrorCode() == "ConditionalRequestConflict");
    }
    if (!request.idempotent || !transient || attempt == kTries) break;
    auto pause = milliseconds(50 << (2 * (attempt - 1)));  // 50 ms, 200 ms
    if (Clock::now() + pause >= deadline) break;
    std::this_thread::sleep_for(pause);
  }
  Give(std::move(h));
  return r;
}

Result<Response> Client::SendOnce(Handle& h, const Request& request, Clock::time_point deadline,
                                  bool* transient) {
  const std::string url = Url(request);
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  auto late = [&] {
    return Status(Code::kUnavailable, where_ + ": " + request.method + " " + url +
                                          ": the server did not answer within " +
                                          std::to_string(options_.timeout.count()) +
                                          " ms (timeout_ms)");
  };
  if (left <= 0) return late();

  CURL* c = h.curl;
  curl_easy_reset(c);  // keeps the handle's live connections
  Response response;
  if (request.sink_hash != nullptr) request.sink_hash->Reset();
  Transfer t;
  t.request = &request;
  t.response = &response;
  t.curl = c;

  struct curl_slist* headers = nullptr;
  auto add = [&](const std::string& line) { headers = curl_slist_append(headers, line.c_str()); };
  // The payload is not hashed for the signature: ckptio's own checksums,
  // not SigV4, protect the bytes. RGW requires the header to be present.
  add("x-amz-content-sha256: UNSIGNED-PAYLOAD");
  if (!options_.session_token.empty()) add("x-amz-security-token: " + options_.session_token);
  // (No "Expect:" to skip 100-continue: curl 7.88 would sign the empty
  // header it then does not send, and the server refuses the signature.
  // kSendAtOnceBytes says when the body does not wait for it.)
  for (const auto& line : request.headers) add(line);

  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_AWS_SIGV4, sigv4_.c_str());
  curl_easy_setopt(c, CURLOPT_USERPWD, userpwd_.c_str());
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(left));
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(left));
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, OnHeader);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, OnBody);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  if (request.method == "HEAD") {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT") {
    curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, OnRead);
    curl_easy_setopt(c, CURLOPT_READDATA, &t);
    curl_easy_setopt(c, CURLOPT_SEEKFUNCTION, OnSeek);
    curl_easy_setopt(c, CURLOPT_SEEKDATA, &t);
    curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
    if (request.body.size() <= kSendAtOnceBytes)
      curl_easy_setopt(c, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
  } else if (request.method == "POST") {
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, request.body.data());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method != "GET") {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }

  CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(headers);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &response.status);
  if (t.too_long)
    return Status(Code::kDataLoss, where_ + ": " + request.method + " " + url +
                                       ": the server sent more bytes than asked for");
  if (rc == CURLE_OPERATION_TIMEDOUT) return late();
  if (rc != CURLE_OK) {
    *transient = Transient(rc);
    return Status(Code::kUnavailable, where_ + ": " + request.method + " " + url + ": " +
                                          curl_easy_strerror(rc) + " (is the endpoint " +
                                          options_.endpoint + " right and the server up?)");
  }
  return response;
}

Status Client::Failure(const Request& request, const Response& response) const {
  const std::string code = response.ErrorCode();
  auto messages = XmlValues(response.body, "Message");
  std::string detail = "HTTP " + std::to_string(response.status);
  if (!code.empty()) detail += " " + code;
  if (!messages.empty() && !messages.front().empty()) detail += ": " + messages.front();
  const std::string what =
      "s3://" + options_.bucket + (request.key.empty() ? "" : "/" + request.key);
  const std::string call = request.method + " " + what + " (" + detail + ")";
  switch (response.status) {
    case 404:
      if (code == "NoSuchBucket")
        return Status(Code::kNotFound, "bucket \"" + options_.bucket + "\" does not exist at " +
                                           options_.endpoint + " (" + detail +
                                           "): create it first (e.g. `aws s3 mb s3://" +
                                           options_.bucket + "`), or fix the URI");
      return Status(Code::kNotFound, call + ": no such object");
    case 403:
    case 401:
      return Status(Code::kPermissionDenied,
                    call +
                        ": the server refused the request. Check the credentials "
                        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or the "
                        "profile in ~/.aws/credentials), the region (" +
                        options_.region + "), the bucket's policy and this host's clock");
    case 416:
      return Status(Code::kDataLoss, call + ": the object is shorter than the range asked for");
    default:
      if (TransientStatus(response.status))
        return Status(Code::kUnavailable, call + ": the server failed (tried " +
                                              std::to_string(response.attempts) + " times)");
      return Status(Code::kFailedPrecondition, call + ": unexpected answer");
  }
}

}  // namespace ckptio::s3
