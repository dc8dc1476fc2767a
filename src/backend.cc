#include "ckptio/backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "text.h"

namespace ckptio {

namespace {
bool IsKeyChar(char c) {  // ASCII only, whatever the locale
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

bool IsSchemeChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '.' || c == '-';
}
}  // namespace

Result<Hash128> ObjectReader::ReadAndHash(uint64_t offset, void* buf, size_t size) {
  CKPTIO_RETURN_IF_ERROR(ReadAt(offset, buf, size));
  return HashBytes(buf, size);
}

Result<AnonymousMemory> AnonymousMemory::Allocate(size_t size, size_t huge_from) {
  const size_t mapped = std::max<size_t>(size, 1);
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return Status(Code::kResourceExhausted,
                  "no memory for " + std::to_string(size) + " bytes: " + std::strerror(errno));
  if (huge_from < size)
    (void)::madvise(static_cast<char*>(p) + huge_from, size - huge_from, MADV_HUGEPAGE);
  return AnonymousMemory(static_cast<char*>(p), size, mapped);
}

AnonymousMemory::AnonymousMemory(AnonymousMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

AnonymousMemory& AnonymousMemory::operator=(AnonymousMemory&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, mapped_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

AnonymousMemory::~AnonymousMemory() {
  if (data_) ::munmap(data_, mapped_);
}

Status ValidateKey(std::string_view key) {
  auto bad = [&](std::string_view why) {
    return Status(Code::kInvalidArgument,
                  "invalid object key \"" + Printable(key) + "\": " + std::string(why));
  };
  if (key.empty()) return bad("empty");
  if (key.size() > kMaxKeyLength) return bad("longer than 1024 bytes");
  if (key.front() == '/') return bad("absolute paths are not allowed");
  size_t start = 0;
  while (true) {
    size_t end = key.find('/', start);
    std::string_view part = key.substr(start, end == std::string_view::npos ? end : end - start);
    if (part.empty()) return bad("empty path component");
    if (part == "." || part == "..") return bad("'.' and '..' are not allowed");
    if (part.size() > kMaxKeyComponent) return bad("a component is longer than 200 bytes");
    if (part.substr(0, 4) == ".nfs")
      return bad(
          "names starting with .nfs are reserved (a kernel NFS client renames files "
          "deleted while open to .nfsXXXX; listings skip them)");
    for (char c : part) {
      if (!IsKeyChar(c)) return bad("only [A-Za-z0-9._-] and '/' between components are allowed");
    }
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return OkStatus();
}

Status ValidatePrefix(std::string_view prefix) {
  if (prefix.empty()) return OkStatus();
  if (prefix.back() == '/') prefix.remove_suffix(1);
  return ValidateKey(prefix);
}

Result<Uri> Uri::Parse(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Status(Code::kInvalidArgument,
                  "invalid store URI \"" + Printable(text) + "\": " + std::string(why));
  };
  if (text.empty()) return bad("empty");
  if (text.find('\0') != std::string_view::npos) return bad("contains NUL");
  Uri uri;
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
  };
  // What looks like a URI but lacks the "//": "<scheme>:/..." where the
  // scheme is one that could be registered ([A-Za-z0-9+.-]+, case-folded)
  // and the ':' is followed by one '/'. Taken as a plain path, "nfs:/filer/x"
  // would quietly become the local directory ./nfs:/filer/x, so it is
  // refused, except "file:/abs" (RFC 8089's short form of file:///abs),
  // which is the path /abs. A ':' not followed by '/' ("run:1/x") is part of
  // a plain path.
  size_t colon = text.find(':');
  std::string_view rest;
  if (colon != std::string_view::npos && colon > 0 && colon + 1 < text.size() &&
      text[colon + 1] == '/' && text.compare(colon + 1, 2, "//") != 0) {
    std::string scheme = lower(std::string(text.substr(0, colon)));
    if (std::all_of(scheme.begin(), scheme.end(), IsSchemeChar)) {
      std::string_view after = text.substr(colon + 1);  // "/..."
      if (scheme != "file")
        return bad("a URI needs \"//\" after the scheme: write " + scheme + ":/" +
                   Printable(after) + " (host first), or ./" + Printable(text) +
                   " for a local directory of that name");
      uri.scheme = scheme;
      rest = after;  // no authority: the rest is the path (and query)
    }
  }
  if (uri.scheme.empty()) {
    size_t sep = text.find("://");
    if (sep == std::string_view::npos) {
      // A plain path.
      uri.scheme = "file";
      uri.path = std::string(text);
      return uri;
    }
    std::string scheme = lower(std::string(text.substr(0, sep)));
    if (scheme.empty() || !std::all_of(scheme.begin(), scheme.end(), IsSchemeChar))
      return bad("the scheme must be letters, digits, '+', '.' or '-'");
    uri.scheme = scheme;
    rest = text.substr(sep + 3);
  }
  size_t q = rest.find('?');
  std::string_view query;
  if (q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  size_t slash = rest.find('/');
  uri.authority = std::string(rest.substr(0, slash));
  uri.path = slash == std::string_view::npos ? "/" : std::string(rest.substr(slash));
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (kv.empty()) continue;
    size_t eq = kv.find('=');
    std::string key(kv.substr(0, eq));
    if (key.empty()) return bad("a query parameter has no name");
    std::string value = eq == std::string_view::npos ? "" : std::string(kv.substr(eq + 1));
    if (!uri.params.emplace(key, value).second)
      return bad("query parameter '" + key + "' given twice");
  }
  return uri;
}

Status BackendRegistry::Register(std::string scheme, BackendFactory factory) {
  if (scheme.empty() || !std::all_of(scheme.begin(), scheme.end(), IsSchemeChar))
    return Status(Code::kInvalidArgument,
                  "backend scheme \"" + Printable(scheme) + "\" must be lowercase [a-z0-9+.-]");
  if (factories_.count(scheme))
    return Status(Code::kAlreadyExists,
                  "a backend is already registered for scheme \"" + scheme + "\"");
  factories_.emplace(std::move(scheme), std::move(factory));
  return OkStatus();
}

Result<std::unique_ptr<StorageBackend>> BackendRegistry::Open(std::string_view text) const {
  CKPTIO_ASSIGN_OR_RETURN(Uri uri, Uri::Parse(text));
  auto it = factories_.find(uri.scheme);
  if (it == factories_.end()) {
    std::string known;
    for (const auto& s : Schemes()) known += (known.empty() ? "" : ", ") + s + "://";
    return Status(Code::kInvalidArgument,
                  "unknown storage scheme \"" + uri.scheme + "://\" in \"" + Printable(text) +
                      "\"; known schemes: " + (known.empty() ? "none registered" : known) +
                      " (a plain path means file://)");
  }
  return it->second(uri);
}

std::vector<std::string> BackendRegistry::Schemes() const {
  std::vector<std::string> out;
  for (const auto& [scheme, factory] : factories_) out.push_back(scheme);
  return out;
}

}  // namespace ckptio
