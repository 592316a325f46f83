// NVTX ranges (nvtx3, header-only) for Nsight Systems timelines: e.g. one range per layer.
//   for (int l = 0; l < n_layers; ++l) { NvtxRange range("layer", l); issue_layer(...); ... }
// A push / pop costs a few ns when no tool is attached. Ranges are host-side: under stream
// capture they mark the capture, not the replay.
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <cstdio>

namespace v4attn {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  // "<prefix> <index>", e.g. NvtxRange("layer", 12) -> "layer 12".
  NvtxRange(const char* prefix, int index) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s %d", prefix, index);
    nvtxRangePushA(buf);  // NVTX copies the string
  }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace v4attn
