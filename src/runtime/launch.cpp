#include "runtime/launch.h"

namespace v4attn {

bool launch_debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("V4ATTN_LAUNCH_DEBUG");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();  // initialised once, thread-safe (magic static), read-only afterwards
  return on;
}

}  // namespace v4attn
