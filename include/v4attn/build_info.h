// What build this is: the project version, the git commit it was built from, and the build options
// that change what the kernels do or how they are timed. `v4attn --version` prints it and
// `v4attn bench --json` records it, so that a measurement names the binary that produced it.
#pragma once

#include <string>

namespace v4attn {

struct BuildInfo {
  const char* version;       // the CMake project version
  const char* commit;        // `git rev-parse --short=12 HEAD` at build time, or "unknown"
  bool dirty;                // tracked files differed from that commit at build time
  bool phase_stamps;         // a measurement build (-DV4ATTN_PHASE_STAMPS=ON): kernels record stamps
  bool pdl_trigger_at_wait;  // the PDL trigger policy (-DV4ATTN_PDL_TRIGGER_AT_WAIT)
  const char* gencode;       // the nvcc -gencode flags of the kernels
};

// Defined in the generated build/generated/build_info.cpp (cmake/build_info.cmake).
const BuildInfo& build_info();

// One line: "0.1.0 (commit 4ab5d17a1b2c, modified; phase stamps)"; the parenthesis names the commit,
// ", modified" when tracked files differed, and the non-default build options.
inline std::string build_string() {
  const BuildInfo& b = build_info();
  std::string s = std::string(b.version) + " (commit " + b.commit;
  if (b.dirty) s += ", modified";
  if (b.phase_stamps) s += "; phase stamps";
  if (!b.pdl_trigger_at_wait) s += "; PDL trigger after the last store";
  return s + ")";
}

}  // namespace v4attn
