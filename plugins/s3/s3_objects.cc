// The s3:// backend's objects (see s3_objects.h and ckptio/s3_backend.h).
#include "s3_objects.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

#include "ckptio/layout.h"
#include "ckptio/log.h"

namespace ckptio::s3 {
namespace {

// An object is opened by a GET of its first kHeadBytes, which also tells
// its size: small records (LATEST, a manifest, .writer, a safetensors
// header) cost one round trip instead of a HEAD and a GET.
constexpr size_t kHeadBytes = 4096;
// S3's limit: an upload has at most 10,000 parts.
constexpr size_t kMaxParts = 10000;
// A listing longer than this is refused rather than held in memory.
constexpr size_t kMaxListedKeys = 10'000'000;
// And so are more pages than that many keys need (a server that answers
// "truncated" for ever with empty pages).
constexpr size_t kMaxListPages = kMaxListedKeys / 1000 + 1;

Status Unexpected(const Client& client, const Request& request, const Response& response) {
  return client.Failure(request, response);
}

// Runs work(i) for i in [0, n), up to `parallel` at once (this thread
// included); the first failure is returned, and the rest are not started.
// An exception from work (bad_alloc) is a failure too, not the end of the
// process.
Status ForEachParallel(size_t n, int parallel, const std::function<Status(size_t)>& work) {
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first = OkStatus();
  std::atomic<bool> failed{false};
  auto run = [&] {
    for (size_t i; !failed.load() && (i = next.fetch_add(1)) < n;) {
      Status s;
      try {
        s = work(i);
      } catch (const std::bad_alloc& e) {
        s = Status(Code::kResourceExhausted, std::string("reading in parallel: ") + e.what());
      } catch (const std::exception& e) {
        s = Status(Code::kInternal, std::string("reading in parallel: ") + e.what());
      } catch (...) {
        s = Status(Code::kInternal, "reading in parallel: an unknown exception");
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> g(mu);
        if (first.ok()) first = s;
        failed = true;
      }
    }
  };
  std::vector<std::thread> threads;
  const size_t extra = std::min<size_t>(n, static_cast<size_t>(std::max(parallel, 1))) - (n > 0);
  try {
    for (size_t t = 0; t < extra; ++t) threads.emplace_back(run);
  } catch (const std::system_error&) {
    // No more threads: the ones started (and this one) do the work.
  }
  run();
  for (auto& t : threads) t.join();
  return first;
}

// A GET of bytes [offset, offset + size) of `full_key` into buf (and
// `hash`, when given, fed them as they arrive), sent. More bytes than asked
// for (a server or proxy that ignores Range) is Unavailable, never
// DataLoss: the object may be fine, and `fsck --repair` deletes what is
// damaged. `what` names the bytes in messages.
Result<Response> SendRange(Client& client, Request& r, const std::string& full_key, uint64_t offset,
                           char* buf, size_t size, Deadline deadline, const std::string& what,
                           Hasher* hash = nullptr) {
  r.method = "GET";
  r.key = full_key;
  r.headers.push_back("Range: bytes=" + std::to_string(offset) + "-" +
                      std::to_string(offset + size - 1));
  r.sink = buf;
  r.sink_size = size;
  r.sink_hash = hash;
  auto sent = client.Send(r, deadline);
  if (!sent.ok() && sent.status().code() == Code::kDataLoss)
    return Status(Code::kUnavailable, what +
                                          ": the server sent more bytes than asked for (does "
                                          "it, or a proxy, ignore Range?)");
  return sent;
}

// Fills buf with [offset, offset + size) of `full_key` by one ranged GET
// (and `hash`, when given, with their hash as they arrive). An answer for
// other bytes than asked is Unavailable, as in SendRange.
Status GetRange(Client& client, const std::string& full_key, uint64_t offset, char* buf,
                size_t size, Deadline deadline, Hasher* hash = nullptr) {
  const std::string range = std::to_string(offset) + "-" + std::to_string(offset + size - 1);
  const std::string what = client.Where(full_key) + ": bytes [" + std::to_string(offset) + ", " +
                           std::to_string(offset + size) + ")";
  Request r;
  CKPTIO_ASSIGN_OR_RETURN(Response got,
                          SendRange(client, r, full_key, offset, buf, size, deadline, what, hash));
  if (got.status != 206 && got.status != 200) return Unexpected(client, r, got);
  const std::string content_range = got.Header("content-range");
  if (got.status == 206 ? content_range.rfind("bytes " + range + "/", 0) != 0 &&
                              content_range.rfind("bytes " + std::to_string(offset) + "-", 0) != 0
                        : offset != 0)
    return Status(Code::kUnavailable,
                  what + ": the server answered for other bytes (" +
                      (content_range.empty() ? "the whole object" : content_range) +
                      "): does it, or a proxy, ignore Range?");
  if (got.received != size)
    return Status(Code::kDataLoss, what + " came back " + std::to_string(got.received) +
                                       " bytes long: the object is shorter than when opened");
  return OkStatus();
}

// A byte count from a header: decimal digits only, no sign, no overflow.
std::optional<uint64_t> ParseSize(std::string_view text) {
  if (text.empty() || text.size() > 19) return std::nullopt;  // 19 digits fit
  uint64_t n = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + static_cast<uint64_t>(c - '0');
  }
  return n;
}

Result<uint64_t> Head(Client& client, const std::string& full_key, Deadline deadline) {
  Request r;
  r.method = "HEAD";
  r.key = full_key;
  CKPTIO_ASSIGN_OR_RETURN(Response got, client.Send(r, deadline));
  if (got.status != 200) return Unexpected(client, r, got);
  const std::string length = got.Header("content-length");
  auto n = ParseSize(length);
  if (!n)
    return Status(Code::kUnavailable, client.Where(full_key) + ": HEAD answered Content-Length \"" +
                                          length + "\", not a byte count");
  return *n;
}

// The first bytes of an object (up to `bytes`) and its size, from one
// ranged GET: a record no longer than that (LATEST, .writer) is read from
// one version of its key, where a HEAD and a later GET could see two. (For
// a larger object, later ranges may come from a newer version: the
// manifest's checksums catch that.)
struct Opened {
  uint64_t size = 0;
  std::string head;
};

Result<Opened> GetHead(Client& client, const std::string& full_key, Deadline deadline,
                       size_t bytes = kHeadBytes) {
  Opened o;
  o.head.resize(bytes);
  const std::string what = client.Where(full_key);
  Request r;
  CKPTIO_ASSIGN_OR_RETURN(Response got, SendRange(client, r, full_key, 0, o.head.data(),
                                                  o.head.size(), deadline, what));
  if (got.status == 416) {  // an empty object has no byte 0 to send
    CKPTIO_ASSIGN_OR_RETURN(o.size, Head(client, full_key, deadline));
    o.head.clear();
    return o;
  }
  if (got.status == 200) {  // the whole object: it is no longer than the range
    o.size = got.received;
  } else if (got.status == 206) {  // "bytes 0-LAST/SIZE"
    const std::string range = got.Header("content-range");
    const std::string want = "bytes 0-" + std::to_string(got.received - 1) + "/";
    const auto size = got.received > 0 && range.rfind(want, 0) == 0
                          ? ParseSize(std::string_view(range).substr(want.size()))
                          : std::nullopt;
    if (!size || *size < got.received)
      return Status(Code::kUnavailable, what + ": the server answered " +
                                            std::to_string(got.received) +
                                            " bytes with Content-Range \"" + range +
                                            "\" for the first " + std::to_string(bytes));
    o.size = *size;
  } else {
    return Unexpected(client, r, got);
  }
  o.head.resize(static_cast<size_t>(got.received));
  return o;
}

// Sends part `number` of upload `id`; its ETag goes to *etag.
Status UploadPart(Client& client, const std::string& key, const std::string& id,
                  std::string_view body, size_t number, std::string* etag) {
  Request r;
  r.method = "PUT";
  r.key = key;
  r.query = {{"partNumber", std::to_string(number)}, {"uploadId", id}};
  r.body = body;
  CKPTIO_ASSIGN_OR_RETURN(Response got, client.Send(r));
  if (got.status != 200) return client.Failure(r, got);
  *etag = got.Header("etag");
  if (etag->empty())
    return Status(Code::kUnavailable, client.Where(key) + ": part " + std::to_string(number) +
                                          " was stored without an ETag");
  return OkStatus();
}

// A part's bytes, reused for the next part once sent: fresh memory costs
// a page fault per 4 KiB the first time it fills, which for every part of a
// large object is CPU taken from hashing and sending. Past its first 2 MiB
// (where a small object ends) it is on transparent huge pages.
class PartBuffer {
 public:
  static Result<std::unique_ptr<PartBuffer>> Make(size_t capacity) {
    auto memory = AnonymousMemory::Allocate(capacity, size_t{2} << 20);
    if (!memory.ok())
      return Status(Code::kResourceExhausted, "a part of an upload: " + memory.status().message() +
                                                  " (lower part_mib or parallel in the URI)");
    return std::make_unique<PartBuffer>(std::move(*memory));
  }
  explicit PartBuffer(AnonymousMemory memory) : memory_(std::move(memory)) {}

  // Copies up to `size` bytes in; returns how many fitted.
  size_t Append(const char* p, size_t size) {
    const size_t take = std::min(size, memory_.size() - size_);
    std::memcpy(memory_.data() + size_, p, take);
    size_ += take;
    return take;
  }
  bool full() const { return size_ == memory_.size(); }
  bool empty() const { return size_ == 0; }
  std::string_view bytes() const { return {memory_.data(), size_}; }
  void clear() { size_ = 0; }

 private:
  AnonymousMemory memory_;
  size_t size_ = 0;
};

// Writes an object: buffered to one part, then one PUT or a multipart upload.
class S3Writer : public ObjectWriter {
 public:
  S3Writer(std::shared_ptr<Client> client, std::string full_key, WriteMode mode)
      : client_(std::move(client)), key_(std::move(full_key)), mode_(mode) {}

  ~S3Writer() override {
    if (done_) return;
    (void)WaitParts();  // their outcome no longer matters
    if (!upload_id_.empty()) Abort();
  }

  Status Append(const void* data, size_t size) override {
    if (!error_.ok()) return error_;
    if (done_) return Status(Code::kFailedPrecondition, Where() + ": writer already committed");
    const char* p = static_cast<const char*>(data);
    bytes_ += size;
    while (size > 0) {
      if (!buffer_) {
        auto fresh = TakeBuffer();
        if (!fresh.ok()) return Fail(fresh.status());
        buffer_ = std::move(*fresh);
      }
      const size_t took = buffer_->Append(p, size);
      p += took;
      size -= took;
      if (buffer_->full()) CKPTIO_RETURN_IF_ERROR(SendPart());
    }
    return OkStatus();
  }

  Status Commit() override {
    if (!error_.ok()) return error_;
    if (done_) return Status(Code::kFailedPrecondition, Where() + ": writer already committed");
    if (upload_id_.empty()) {
      const std::string_view body = buffer_ ? buffer_->bytes() : std::string_view();
      Status s = mode_ == WriteMode::kCreateExclusive
                     ? PutExclusive(*client_, key_, body, client_->Deadline())
                     : Put(body);
      done_ = true;
      buffer_.reset();
      return s;
    }
    if (buffer_ && !buffer_->empty()) CKPTIO_RETURN_IF_ERROR(SendPart());
    Status s = WaitParts();
    // Servers ignore If-None-Match on CompleteMultipartUpload: an exclusive
    // object larger than a part is checked just before, which a racing
    // creator can still beat (the core writes such objects only under
    // names no other writer uses).
    if (s.ok() && mode_ == WriteMode::kCreateExclusive) {
      auto there = Head(*client_, key_, client_->Deadline());
      if (there.ok())
        s = Status(Code::kAlreadyExists, Where() + " already exists (created by another writer)");
      else if (there.status().code() != Code::kNotFound)
        s = there.status();
    }
    if (s.ok()) s = Complete();
    if (!s.ok()) return Fail(s);
    done_ = true;
    return OkStatus();
  }

 private:
  std::string Where() const { return client_->Where(key_); }

  Status Fail(Status s) {
    error_ = s;
    (void)WaitParts();  // their outcome no longer matters
    if (!upload_id_.empty()) Abort();
    upload_id_.clear();
    done_ = true;
    return s;
  }

  Status Put(std::string_view body) {
    Request r;
    r.method = "PUT";
    r.key = key_;
    r.body = body;
    CKPTIO_ASSIGN_OR_RETURN(Response got, client_->Send(r));
    if (got.status != 200) return Unexpected(*client_, r, got);
    return OkStatus();
  }

  // Starts the upload if needed, then sends the buffer as the next part in
  // the background, waiting first for the oldest when `parallel` are out.
  Status SendPart() {
    if (upload_id_.empty()) {
      Status s = Initiate();
      if (!s.ok()) return Fail(s);
    }
    if (etags_.size() == kMaxParts)
      return Fail(Status(Code::kResourceExhausted,
                         Where() + ": more than 10000 parts: raise part_mib in the URI"));
    while (in_flight_.size() >= static_cast<size_t>(client_->options().parallel)) {
      Status s = WaitOldest();
      if (!s.ok()) return Fail(s);
    }
    const size_t number = etags_.size() + 1;
    etags_.emplace_back();
    // The buffer stays with its part until WaitOldest takes it back.
    const std::string_view body = buffer_->bytes();
    auto client = client_;
    auto key = key_;
    auto id = upload_id_;
    std::string* etag = &etags_[number - 1];
    try {
      in_flight_.push_back(
          {std::move(buffer_),
           std::async(std::launch::async, [client, key, id, body, number, etag]() -> Status {
             try {
               return UploadPart(*client, key, id, body, number, etag);
             } catch (const std::exception& e) {  // bad_alloc: nothing may escape to get()
               return Status(Code::kResourceExhausted,
                             std::string("uploading a part: ") + e.what());
             }
           })});
    } catch (const std::system_error& e) {
      return Fail(
          Status(Code::kResourceExhausted, Where() + ": no thread for a part: " + e.what()));
    }
    return OkStatus();
  }

  // A buffer sent before, else a new one.
  Result<std::unique_ptr<PartBuffer>> TakeBuffer() {
    if (spare_.empty()) return PartBuffer::Make(client_->options().part_bytes);
    auto b = std::move(spare_.back());
    spare_.pop_back();
    b->clear();
    return b;
  }

  Status WaitOldest() {
    Status s = in_flight_.front().sent.get();
    spare_.push_back(std::move(in_flight_.front().buffer));
    in_flight_.pop_front();
    return s;
  }

  Status WaitParts() {
    Status first = OkStatus();
    while (!in_flight_.empty()) {
      Status s = WaitOldest();
      if (first.ok() && !s.ok()) first = s;
    }
    return first;
  }

  // Sent again on failure like any request: an upload started by a try
  // whose answer was lost stays unfinished, invisible, and is aborted by the
  // next writer's takeover or `ckptio gc`.
  Status Initiate() {
    Request r;
    r.method = "POST";
    r.key = key_;
    r.query = {{"uploads", ""}};
    CKPTIO_ASSIGN_OR_RETURN(Response got, client_->Send(r));
    if (got.status != 200) return Unexpected(*client_, r, got);
    auto ids = XmlValues(got.body, "UploadId");
    if (ids.empty() || ids.front().empty())
      return Status(Code::kUnavailable, Where() + ": the server started an upload without an id");
    upload_id_ = ids.front();
    return OkStatus();
  }

  // Sent again on 5xx and broken connections, as S3 asks. A Complete the
  // server carried out but whose answer was lost is then answered 404
  // NoSuchUpload (libcurl may resend it on its own too, when a reused
  // connection dies first); whenever the outcome is in doubt, the object
  // is looked at instead: it was completed if it is there as an upload of
  // as many parts, of our size (ETag "<md5>-<parts>"); a wrong guess is
  // caught by the checksums.
  Status Complete() {
    std::string xml = "<CompleteMultipartUpload>";
    for (size_t i = 0; i < etags_.size(); ++i)
      xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags_[i] +
             "</ETag></Part>";
    xml += "</CompleteMultipartUpload>";
    Request r;
    r.method = "POST";
    r.key = key_;
    r.query = {{"uploadId", upload_id_}};
    r.body = xml;
    auto sent = client_->Send(r);
    Status s;
    if (!sent.ok()) {
      s = sent.status();
    } else {
      Response& got = *sent;
      // S3 may answer 200 and report the failure in the body.
      if (got.status == 200 && got.body.find("<Error>") != std::string::npos) got.status = 500;
      s = got.status == 200 ? OkStatus() : Unexpected(*client_, r, got);
    }
    const bool in_doubt = s.code() == Code::kUnavailable ||
                          (sent.ok() && sent->status == 404 && sent->ErrorCode() == "NoSuchUpload");
    if (s.ok() || (in_doubt && CompletedAnyway())) {
      upload_id_.clear();
      return OkStatus();
    }
    if (sent.ok() && sent->status == 404)  // NoSuchUpload, and no object
      return Status(Code::kUnavailable,
                    Where() +
                        ": the upload was gone (aborted by another writer's takeover or "
                        "`ckptio gc`?) and the object was not written");
    return s;
  }

  bool CompletedAnyway() {
    Request r;
    r.method = "HEAD";
    r.key = key_;
    auto got = client_->Send(r);
    if (!got.ok() || got->status != 200) return false;
    const std::string etag = got->Header("etag");
    const std::string parts = "-" + std::to_string(etags_.size()) + "\"";
    return got->Header("content-length") == std::to_string(bytes_) && etag.size() > parts.size() &&
           etag.compare(etag.size() - parts.size(), parts.size(), parts) == 0;
  }

  // Best effort: an upload left behind is invisible, and `ckptio gc` aborts it.
  void Abort() {
    Request r;
    r.method = "DELETE";
    r.key = key_;
    r.query = {{"uploadId", upload_id_}};
    (void)client_->Send(r);
    upload_id_.clear();
  }

  std::shared_ptr<Client> client_;
  const std::string key_;
  const WriteMode mode_;
  std::unique_ptr<PartBuffer> buffer_;  // the part being filled
  std::vector<std::unique_ptr<PartBuffer>> spare_;
  uint64_t bytes_ = 0;  // appended in all
  std::string upload_id_;
  std::deque<std::string> etags_;  // a deque: parts write through stable pointers
  struct InFlight {
    std::unique_ptr<PartBuffer> buffer;  // its bytes, until sent
    // Destroyed first: its destructor waits for the upload that reads
    // `buffer` (a push_back that throws destroys an entry whose part runs).
    std::future<Status> sent;
  };
  std::deque<InFlight> in_flight_;
  Status error_ = OkStatus();
  bool done_ = false;
};

class S3Reader : public ObjectReader {
 public:
  S3Reader(std::shared_ptr<Client> client, std::string full_key, Opened opened)
      : client_(std::move(client)),
        key_(std::move(full_key)),
        size_(opened.size),
        head_(std::move(opened.head)) {}

  uint64_t Size() const override { return size_; }

  Status ReadAt(uint64_t offset, void* buf, size_t size) override {
    if (offset > size_ || size > size_ - offset)
      return Status(Code::kDataLoss, client_->Where(key_) + ": bytes [" + std::to_string(offset) +
                                         ", " + std::to_string(offset + size) +
                                         ") are past its end (" + std::to_string(size_) +
                                         " bytes)");
    if (size == 0) return OkStatus();
    if (offset + size <= head_.size()) {  // fetched when opened
      std::memcpy(buf, head_.data() + offset, size);
      return OkStatus();
    }
    // Large reads in part-sized ranges, `parallel` at once.
    const uint64_t piece = client_->options().part_bytes;
    const size_t pieces = static_cast<size_t>((size + piece - 1) / piece);
    char* out = static_cast<char*>(buf);
    return ForEachParallel(pieces, client_->options().parallel, [&](size_t i) {
      const uint64_t begin = i * piece;
      const size_t len = static_cast<size_t>(std::min<uint64_t>(piece, size - begin));
      return GetRange(*client_, key_, offset + begin, out + begin, len, client_->Deadline());
    });
  }

  // A read of at most one part is one GET whose bytes are hashed as they
  // arrive, each piece as it is copied out of curl's buffer.
  Result<Hash128> ReadAndHash(uint64_t offset, void* buf, size_t size) override {
    if (size == 0 || offset + size <= head_.size() || size > client_->options().part_bytes ||
        offset > size_ || size > size_ - offset)
      return ObjectReader::ReadAndHash(offset, buf, size);
    Hasher hash;
    CKPTIO_RETURN_IF_ERROR(GetRange(*client_, key_, offset, static_cast<char*>(buf), size,
                                    client_->Deadline(), &hash));
    return hash.Digest();
  }

  // No Map: readers take the object chunk by chunk on `parallel` threads,
  // hashing each chunk as it arrives (CheckpointReader::View).
  unsigned ConcurrentReads() const override {
    return static_cast<unsigned>(client_->options().parallel);
  }

 private:
  std::shared_ptr<Client> client_;
  const std::string key_;
  const uint64_t size_;
  const std::string head_;  // its first bytes
};

}  // namespace

std::string FullKey(const S3Options& options, std::string_view key) {
  return options.prefix.empty() ? std::string(key) : options.prefix + "/" + std::string(key);
}

Result<std::string> BucketKey(const S3Options& options, std::string_view key) {
  CKPTIO_RETURN_IF_ERROR(ValidateKey(key));
  std::string full = FullKey(options, key);
  if (full.size() > kMaxKeyLength)
    return Status(Code::kInvalidArgument, "s3://" + options.bucket + "/" + full.substr(0, 64) +
                                              "...: with the prefix \"" + options.prefix +
                                              "\" the key is " + std::to_string(full.size()) +
                                              " bytes, over S3's 1024: use a shorter prefix");
  return full;
}

Result<std::string> GetSmall(Client& client, const std::string& full_key, Response* response,
                             Deadline deadline) {
  Request r;
  r.method = "GET";
  r.key = full_key;
  CKPTIO_ASSIGN_OR_RETURN(Response got, client.Send(r, deadline));
  if (got.status != 200) return Unexpected(client, r, got);
  std::string body = std::move(got.body);
  if (response) *response = std::move(got);
  return body;
}

Status PutExclusive(Client& client, const std::string& full_key, std::string_view bytes,
                    Deadline deadline) {
  Request r;
  r.method = "PUT";
  r.key = full_key;
  r.body = bytes;
  r.headers.push_back("If-None-Match: *");
  CKPTIO_ASSIGN_OR_RETURN(Response got, client.Send(r, deadline));
  if (got.status == 200) return OkStatus();
  if (got.status != 412) return Unexpected(client, r, got);
  // The key exists. It may be our own create, stored by an earlier send
  // whose answer was lost: one of ours (got.attempts > 1), or libcurl's,
  // which resends a request on its own when a reused connection dies before
  // the answer (7.88 cannot be told not to; attempts does not count those).
  // Whatever we create exclusively is unique to its writer, so the stored
  // bytes tell: asked for one byte more than ours, a ranged GET brings
  // them and the stored size at once.
  auto taken = [&] {
    return Status(Code::kAlreadyExists,
                  client.Where(full_key) + " already exists (created by another writer)");
  };
  auto unknown = [&](const Status& why) {
    return Status(Code::kUnavailable, client.Where(full_key) +
                                          " exists, and whether this writer created it is "
                                          "unknown: reading it back failed: " +
                                          why.message());
  };
  auto stored = GetHead(client, full_key, deadline, bytes.size() + 1);
  if (!stored.ok())  // (not found: deleted since)
    return stored.status().code() == Code::kNotFound ? taken() : unknown(stored.status());
  return stored->size == bytes.size() && stored->head == bytes ? OkStatus() : taken();
}

Result<std::unique_ptr<ObjectWriter>> Objects::NewObject(std::string_view key, WriteMode mode) {
  CKPTIO_ASSIGN_OR_RETURN(std::string full, BucketKey(client_->options(), key));
  return std::unique_ptr<ObjectWriter>(new S3Writer(client_, std::move(full), mode));
}

Result<std::unique_ptr<ObjectReader>> Objects::OpenObject(std::string_view key) {
  CKPTIO_ASSIGN_OR_RETURN(std::string full, BucketKey(client_->options(), key));
  CKPTIO_ASSIGN_OR_RETURN(Opened opened, GetHead(*client_, full, client_->Deadline()));
  return std::unique_ptr<ObjectReader>(new S3Reader(client_, std::move(full), std::move(opened)));
}

Result<ObjectInfo> Objects::Stat(std::string_view key) {
  CKPTIO_ASSIGN_OR_RETURN(std::string full, BucketKey(client_->options(), key));
  CKPTIO_ASSIGN_OR_RETURN(uint64_t size, Head(*client_, full, client_->Deadline()));
  ObjectInfo info;
  info.size = size;
  return info;
}

namespace {
// The value of a query parameter of `r`, "" when it has none.
std::string QueryValue(const Request& r, const std::string& name) {
  auto it = r.query.find(name);
  return it == r.query.end() ? "" : it->second;
}

// Sends `request`, then the request for each next page while the answer
// says IsTruncated, all by `deadline` and at most kMaxListPages of them.
// `page` handles each answer (false: stop there); `advance` sets the next
// page's markers from an answer, false when it names none new (a server
// that would page in a circle).
Status ForEachPage(Client& client, Request request, Deadline deadline, const std::string& what,
                   const std::function<Result<bool>(const Response&)>& page,
                   const std::function<bool(const std::string& body, Request& next)>& advance) {
  for (size_t n = 0;; ++n) {
    if (n == kMaxListPages)
      return Status(Code::kResourceExhausted, client.Where() + ": the server's " + what +
                                                  " went on for more than " +
                                                  std::to_string(kMaxListPages) + " pages");
    CKPTIO_ASSIGN_OR_RETURN(Response got, client.Send(request, deadline));
    CKPTIO_ASSIGN_OR_RETURN(bool more, page(got));
    if (!more) return OkStatus();
    auto truncated = XmlValues(got.body, "IsTruncated");
    if (truncated.empty() || truncated.front() != "true") return OkStatus();
    if (!advance(got.body, request))
      return Status(Code::kUnavailable, client.Where() + ": a truncated " + what +
                                            " came without a new continuation marker");
  }
}
}  // namespace

Result<std::vector<std::string>> Objects::List(std::string_view prefix) {
  CKPTIO_RETURN_IF_ERROR(ValidatePrefix(prefix));
  const S3Options& o = client_->options();
  const std::string root = o.prefix.empty() ? "" : o.prefix + "/";
  const std::string wanted = root + std::string(prefix);
  std::vector<std::string> out;
  Request r;
  r.method = "GET";
  r.query = {{"list-type", "2"}, {"prefix", wanted}};
  auto page = [&](const Response& got) -> Result<bool> {
    if (got.status != 200) return Unexpected(*client_, r, got);
    for (auto& key : XmlValues(got.body, "Key")) {
      // Only keys of this store that ckptio could have written.
      if (key.compare(0, wanted.size(), wanted) != 0) continue;
      std::string rel = key.substr(root.size());
      if (!ValidateKey(rel).ok()) continue;
      if (out.size() == kMaxListedKeys)
        return Status(Code::kResourceExhausted, client_->Where() +
                                                    ": more than 10 million keys under \"" +
                                                    wanted + "\": is this prefix a ckptio store?");
      out.push_back(std::move(rel));
    }
    return true;
  };
  auto advance = [](const std::string& body, Request& next) {
    auto token = XmlValues(body, "NextContinuationToken");
    if (token.empty() || token.front().empty() ||
        token.front() == QueryValue(next, "continuation-token"))
      return false;
    next.query["continuation-token"] = token.front();
    return true;
  };
  CKPTIO_RETURN_IF_ERROR(ForEachPage(*client_, r, client_->Deadline(),
                                     "listing of \"" + wanted + "\"", page, advance));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Status Objects::Delete(std::string_view key) {
  CKPTIO_ASSIGN_OR_RETURN(std::string full, BucketKey(client_->options(), key));
  const Deadline deadline = client_->Deadline();  // both requests within timeout_ms
  CKPTIO_RETURN_IF_ERROR(Head(*client_, full, deadline).status());  // NotFound when absent
  Request r;
  r.method = "DELETE";
  r.key = full;
  CKPTIO_ASSIGN_OR_RETURN(Response got, client_->Send(r, deadline));
  if (got.status != 204 && got.status != 200) return Unexpected(*client_, r, got);
  return OkStatus();
}

Result<size_t> Objects::AbortUploads() {
  const S3Options& o = client_->options();
  const std::string root = o.prefix.empty() ? "" : o.prefix + "/";
  std::vector<std::pair<std::string, std::string>> found;  // key, upload id
  Request r;
  r.method = "GET";
  r.query = {{"uploads", ""}, {"prefix", root}};
  auto page = [&](const Response& got) -> Result<bool> {
    if (got.status == 403) {
      // Credentials that may write but not list uploads: nothing to abort
      // that we can see; an upload left behind costs space, not safety.
      Log(LogLevel::kWarning, client_->Failure(r, got).message() +
                                  " (listing unfinished uploads to abort them; skipped)");
      return false;
    }
    if (got.status != 200) return Unexpected(*client_, r, got);
    // Each <Upload> holds one <Key> and one <UploadId>, in that order.
    for (const auto& upload : XmlValues(got.body, "Upload")) {
      auto keys = XmlValues(upload, "Key");
      auto ids = XmlValues(upload, "UploadId");
      // Only what this store writes: a store nested below the prefix
      // (PREFIX/exp1/...) or another program's uploads are not ours.
      if (keys.size() != 1 || ids.size() != 1 || keys[0].compare(0, root.size(), root) != 0)
        continue;
      const std::string rel = keys[0].substr(root.size());
      if (!ValidateKey(rel).ok() || !IsStoreKey(rel)) continue;
      found.emplace_back(keys[0], ids[0]);
    }
    return true;
  };
  auto advance = [](const std::string& body, Request& next) {
    auto key = XmlValues(body, "NextKeyMarker");
    auto id = XmlValues(body, "NextUploadIdMarker");
    const std::string next_id = id.empty() ? "" : id.front();
    if (key.empty() || key.front().empty() ||
        (key.front() == QueryValue(next, "key-marker") &&
         next_id == QueryValue(next, "upload-id-marker")))
      return false;
    next.query["key-marker"] = key.front();
    if (next_id.empty())
      next.query.erase("upload-id-marker");
    else
      next.query["upload-id-marker"] = next_id;
    return true;
  };
  CKPTIO_RETURN_IF_ERROR(ForEachPage(*client_, r, client_->Deadline(),
                                     "listing of unfinished uploads", page, advance));
  // Each abort within timeout_ms of its own (however many there are); the
  // first that fails is the answer, after trying the rest.
  size_t aborted = 0;
  Status first_error;
  for (const auto& [key, id] : found) {
    Request abort;
    abort.method = "DELETE";
    abort.key = key;
    abort.query = {{"uploadId", id}};
    auto done = client_->Send(abort, client_->Deadline());
    Status s = !done.ok() ? done.status()
               : done->status == 204 || done->status == 200 || done->status == 404
                   ? OkStatus()
                   : Unexpected(*client_, abort, *done);
    if (s.ok())
      ++aborted;
    else if (first_error.ok())
      first_error = s;
  }
  if (!first_error.ok())
    return first_error.WithContext(std::to_string(found.size() - aborted) + " of " +
                                   std::to_string(found.size()) +
                                   " unfinished uploads could not be aborted");
  return aborted;
}

}  // namespace ckptio::s3
