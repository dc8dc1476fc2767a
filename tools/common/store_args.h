// What the command-line tools share about naming a store and a step.
#ifndef CKPTIO_TOOLS_COMMON_STORE_ARGS_H_
#define CKPTIO_TOOLS_COMMON_STORE_ARGS_H_

#include <memory>
#include <string>

#include "ckptio/backends.h"
#include "ckptio/store.h"
#include "text.h"

namespace ckptio {

// Opens a store that must already exist: reading, repairing or trimming a
// mistyped path must not create a store, nor take a folder that merely
// exists (the store's parent, say) for one. A store is a folder that is
// empty (made ahead of the job) or holds something ckptio writes at its top:
// LATEST, .writer, .lock, .save-lock, .coord/ or a step-* folder.
inline Result<std::unique_ptr<Store>> OpenExisting(const std::string& uri) {
  CKPTIO_ASSIGN_OR_RETURN(auto store, OpenStore(uri));
  CKPTIO_ASSIGN_OR_RETURN(auto keys, store->backend().List(""));  // NotFound: no store
  if (keys.empty()) return store;
  for (const auto& key : keys)
    if (IsStoreKey(key)) return store;
  return Status(Code::kNotFound,
                store->uri() +
                    " is not a ckptio store: it holds no LATEST, .writer, .lock, "
                    "step-* or .coord (is it the store's parent?); check the path");
}

// The step LATEST names, from what Store::ReadLatest returned, or why none.
inline Result<int64_t> LatestStep(const Store& store, const Result<std::optional<Latest>>& latest) {
  if (!latest.ok())
    return latest.status().WithContext("reading LATEST (run `ckptio fsck --repair " + store.uri() +
                                       "`, or name a step)");
  if (!latest->has_value())
    return Status(Code::kNotFound, "store " + store.uri() + " has no LATEST: nothing committed");
  return (*latest)->step;
}

// "latest" (what LATEST names) or a step number.
inline Result<int64_t> ResolveStep(Store& store, const std::string& text) {
  if (text == "latest") return LatestStep(store, store.ReadLatest());
  try {
    size_t used = 0;
    long long v = std::stoll(text, &used);
    if (used == text.size() && v >= 0 && v <= kMaxStep) return static_cast<int64_t>(v);
  } catch (const std::exception&) {
  }
  return Status(Code::kInvalidArgument, "bad STEP \"" + Printable(text) + "\": a number in [0, " +
                                            std::to_string(kMaxStep) + "] or \"latest\"");
}

}  // namespace ckptio

#endif  // CKPTIO_TOOLS_COMMON_STORE_ARGS_H_
