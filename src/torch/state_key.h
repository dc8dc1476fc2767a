// The key LibTorch files a parameter's optimizer state under.
#pragma once

#include <c10/core/TensorImpl.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace ckptio::internal {

// The address of the parameter's TensorImpl: as text before LibTorch 2
// (c10::guts::to_string), the pointer itself since. `Key` is the key type of
// the optimizer's state(): std::decay_t<decltype(opt.state())>::key_type.
template <typename Key>
Key StateKey(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << impl;
    return text.str();
  } else {
    return impl;
  }
}

}  // namespace ckptio::internal
