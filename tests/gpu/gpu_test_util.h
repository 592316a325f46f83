// Shared by GPU tests: skip with a reason when no sm_90+ GPU is present (CI has none).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "runtime/cuda_utils.h"

#define V4_REQUIRE_GPU()                                          \
  do {                                                            \
    std::string v4_reason_;                                       \
    if (!::v4attn::gpu_available(&v4_reason_)) GTEST_SKIP() << "needs an sm_90 GPU: " << v4_reason_; \
  } while (0)
