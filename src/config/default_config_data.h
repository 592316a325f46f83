// The embedded default config. The definitions are generated at configure time into the build
// directory (CMakeLists.txt reads configs/deepseek-v4.1-flash.json as hex and writes it out as a
// byte array), so the binary carries the config byte for byte and needs no file at run time.
#pragma once

#include <cstddef>

namespace v4attn::detail {
extern const unsigned char kDefaultConfigJson[];
extern const std::size_t kDefaultConfigJsonSize;
}  // namespace v4attn::detail
