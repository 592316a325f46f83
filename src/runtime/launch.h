// The one place that sets launch attributes (PDL, dynamic shared memory). Every kernel of v4attn
// is launched through launch_kernel(); the global switch and the debug print live here.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "runtime/cuda_utils.h"

namespace v4attn {

struct LaunchConfig {
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  size_t smem_bytes = 0;
  cudaStream_t stream = nullptr;
  // Programmatic dependent launch: the kernel may start before its stream predecessor finishes;
  // it must call pdl_wait() (griddepcontrol.wait) before reading anything the predecessor writes.
  bool pdl = false;
  // Thread-block cluster shape (sm_90); {1, 1, 1} = no cluster attribute. The grid must be a
  // multiple of it in every dimension.
  dim3 cluster{1, 1, 1};
};

// V4ATTN_LAUNCH_DEBUG=1 prints every launch (name, grid, block, smem, pdl, cluster) to stderr.
bool launch_debug_enabled();

template <class... KArgs, class... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), const LaunchConfig& cfg, Args&&... args) {
  // Any dynamic shared memory: raise the kernel's limit to it. Static shared memory counts
  // against the same 48 KB default, so "dynamic > 48 KB" is not the right test (a kernel with
  // 4 B static + exactly 48 KB dynamic failed to launch on the H200).
  if (cfg.smem_bytes > 0)
    V4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(cfg.smem_bytes)));
  cudaLaunchConfig_t lc{};
  lc.gridDim = cfg.grid;
  lc.blockDim = cfg.block;
  lc.dynamicSmemBytes = cfg.smem_bytes;
  lc.stream = cfg.stream;
  cudaLaunchAttribute attr[3];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = cfg.pdl ? 1 : 0;
  lc.attrs = attr;
  lc.numAttrs = 1;
  const bool cluster = cfg.cluster.x * cfg.cluster.y * cfg.cluster.z > 1;
  if (cluster) {
    attr[lc.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[lc.numAttrs].val.clusterDim.x = cfg.cluster.x;
    attr[lc.numAttrs].val.clusterDim.y = cfg.cluster.y;
    attr[lc.numAttrs].val.clusterDim.z = cfg.cluster.z;
    ++lc.numAttrs;
  }
  // A stream with a non-default priority (PrepareStreams::set_side_priority) passes it to the
  // launch explicitly, so that a captured graph's kernel node carries it too.
  int priority = 0;
  if (cfg.stream != nullptr) V4_CUDA_CHECK(cudaStreamGetPriority(cfg.stream, &priority));
  if (priority != 0) {
    attr[lc.numAttrs].id = cudaLaunchAttributePriority;
    attr[lc.numAttrs].val.priority = priority;
    ++lc.numAttrs;
  }
  if (launch_debug_enabled())
    std::fprintf(stderr, "[v4attn launch] %s grid(%u,%u,%u) block(%u,%u,%u) smem %zu pdl %d%s\n", name,
                 cfg.grid.x, cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.block.y, cfg.block.z,
                 cfg.smem_bytes, cfg.pdl ? 1 : 0, cluster ? " (cluster launch)" : "");
  V4_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, static_cast<KArgs>(args)...));
}

}  // namespace v4attn
