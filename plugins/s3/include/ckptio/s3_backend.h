// The s3:// backend: an S3-compatible object store (AWS S3, Ceph RADOS
// Gateway, MinIO...) over HTTP(S) with libcurl, which signs every request
// with AWS Signature Version 4 itself (CURLOPT_AWS_SIGV4).
//
//   s3://BUCKET/PREFIX?endpoint=URL&region=R&profile=P&timeout_ms=N
//                     &part_mib=N&parallel=N&lease_ms=N&path_style=0|1
//
// The store is the bucket's keys under "PREFIX/" (the whole bucket when
// PREFIX is empty). Settings come from the URI first, then the environment
// as the AWS tools read it: AWS_ENDPOINT_URL (default
// https://s3.REGION.amazonaws.com), AWS_REGION or AWS_DEFAULT_REGION
// (default us-east-1), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// AWS_SESSION_TOKEN, else the profile (URI `profile`, AWS_PROFILE, or
// "default") of AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials).
// Requests are path-style (URL/BUCKET/KEY), which every S3-compatible
// server accepts, except to AWS's own endpoint (the default, when no
// endpoint is given), which gets virtual-hosted ones (BUCKET.HOST/KEY) as
// AWS asks; path_style=0|1 chooses. http:// endpoints are allowed (a test
// server on loopback).
//
// What each call does (every key is "PREFIX/" + the core's key):
//   * ObjectWriter: bytes are buffered up to one part (part_mib, default
//     16 MiB). An object that fits is one PUT at Commit; a larger one is a
//     multipart upload whose parts go up while later bytes are appended, up
//     to `parallel` (default 4) at once, completed at Commit and aborted if
//     anything fails or the writer is dropped. S3 makes a PUT or a completed
//     upload visible whole, and durable, when it answers 200: that is the
//     commit. Nothing of an unfinished upload is visible or listed.
//   * kCreateExclusive is `PUT` with `If-None-Match: *` (412: AlreadyExists).
//     A reply lost after the server stored the object makes a resend (ours,
//     or libcurl's own) answer 412: so the object met by any 412 is read
//     back, and the create counts as ours only if it holds exactly our bytes
//     (Unavailable when it cannot be read back). Servers ignore If-None-Match on
//     CompleteMultipartUpload, so an exclusive object larger than a part is
//     checked with a HEAD just before completing: that is not atomic, and
//     the core writes such objects only under names no other writer uses.
//   * OpenObject: a GET of the first 4 KiB (Content-Range gives the size;
//     reads inside those bytes send nothing; an empty object is sized by
//     HEAD); ReadAt: GET with a Range, a large one in
//     part-sized ranges `parallel` at once. No Map: ConcurrentReads() is
//     `parallel`, so the core reads an object chunk by chunk on that many
//     threads, each hashing its chunk as its bytes arrive, each piece just
//     after it is copied into the chunk (ReadAndHash; a retried GET starts
//     its hash again). A short answer is
//     DataLoss (a torn object), like a short file.
//   * List: ListObjectsV2, every page; keys outside "PREFIX/" or not valid
//     ckptio keys (ValidateKey) are skipped, and a listing over 10 million
//     keys is refused (ResourceExhausted), so a hostile or foreign bucket
//     can neither make ckptio touch keys it does not own nor exhaust memory.
//   * Delete: HEAD (NotFound when absent), then DELETE.
//
// Locks: S3 has none. The writer lock (kLockKey) is a lease object created
// with If-None-Match and replaced every lease_ms/3 (default 15000) while
// held; a lease whose last renewal is older than lease_ms by the server's
// own clock (its Date against the lease's Last-Modified, so hosts' clocks do
// not matter) is stale and may be broken by another writer, which then
// checks 0.5 s later that the new lease is still its own (S3 has no
// conditional DELETE, so two writers breaking one stale lease could each
// delete the other's). Each renewal must end before the next is due; a
// lease not renewed for lease_ms, or found holding another's record, is
// lost (logged). A lease is not mutual exclusion under every failure (a
// writer paused past its lease keeps writing): LocksAreLeases() is true, so
// the core gives each writer its own objects folder, and its fence
// (.writer, checked before every manifest and LATEST) keeps a stale writer
// from committing. Other locks (the
// file-lock wait mode's .save-lock) are Unimplemented, with a message
// naming the wait modes that work over S3 (manifest, store).
//
// Errors: HTTP 404 is NotFound (a missing bucket says so and how to make
// it); 403 PermissionDenied naming the S3 error code (wrong keys, a clock
// too far off, a policy) and the settings to check; 5xx, 429, refused or
// broken connections (and AWS's 409 ConditionalRequestConflict)
// Unavailable after up to three tries with backoff. Every request ends
// within timeout_ms (default 30000) whatever the server does (Unavailable:
// "did not answer within ..."), retries included, and so does every call
// of a few requests (a listing of any number of pages, a delete, an
// exclusive create with its read-back); an object's parts and large reads
// get timeout_ms each. A server that answers for other bytes than a Range
// asked for is Unavailable, not DataLoss. A CompleteMultipartUpload is
// sent again on 5xx; one whose outcome is in doubt (no answer in time, or
// NoSuchUpload: an earlier send completed it) counts as completed if the
// object is there with our size as an upload of as many parts.
//
// Thread safety: calls from several threads share a pool of keep-alive
// connections (one libcurl handle each); one ObjectWriter or ObjectReader
// is used by one thread at a time, as the backend contract says.
#ifndef CKPTIO_S3_BACKEND_H_
#define CKPTIO_S3_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "ckptio/backend.h"
#include "ckptio/export.h"

namespace ckptio {

struct CKPTIO_EXPORT S3Options {
  std::string endpoint;  // "https://s3.us-east-1.amazonaws.com", "http://127.0.0.1:20080"
  std::string region = "us-east-1";
  std::string bucket;
  std::string prefix;  // "" or a valid key ("runs/run42"): the store's keys go below it
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // sent as x-amz-security-token when set
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  uint64_t part_bytes = uint64_t{16} << 20;  // 5 MiB .. 1 GiB
  int parallel = 4;                          // 1 .. 64 requests per object at once
  std::chrono::milliseconds lease = std::chrono::seconds(15);
  // ENDPOINT/BUCKET/KEY (true), or BUCKET.ENDPOINT-HOST/KEY (false).
  bool path_style = true;
};

// Parses an s3:// URI (see above) into options, filling what the URI leaves
// out from the environment and the credentials file. InvalidArgument naming
// the offending part; FailedPrecondition when no credentials are found (the
// message lists where they were looked for).
CKPTIO_EXPORT Result<S3Options> ParseS3Uri(const Uri& uri);

// A backend on the bucket. Nothing is sent until the first call; a missing
// bucket or wrong credentials show there.
CKPTIO_EXPORT Result<std::unique_ptr<StorageBackend>> NewS3Backend(S3Options options);

// Registers "s3" in `registry`.
CKPTIO_EXPORT Status RegisterS3Backend(BackendRegistry& registry);

}  // namespace ckptio

#endif  // CKPTIO_S3_BACKEND_H_
