// The bytes floor of one prepare cycle (issue 6's yardstick): what the cycle must move at least,
// at the device-to-device copy rate measured on the H200 (../shared/spec/h200-measurements.md).
// Host only; `v4attn bench` reports each schedule's cycle against it, and against the plain-PyTorch
// figures the issue measured for four cycles.
#pragma once

#include <cstdint>
#include <optional>

#include "v4attn/plan.h"
#include "v4attn/reference/step.h"

namespace v4attn {

// 4.27 TB/s, in bytes per microsecond.
constexpr double kFloorBytesPerUs = 4.27e6;

struct CycleFloor {
  // Every prepare weight of the backbone layers (WeightUse::kPrepare), each read once per cycle.
  int64_t weight_bytes = 0;
  // The index-K reads of the index sources' scores: per index-source layer and request, the
  // positions the request's rows score -- the largest clen among its rows (of the kv source's
  // ratio); in the layers that mask with the candidate source the positions of the kept blocks,
  // candidate_topk_blocks - 1 full ones and the newest (pinned, maybe partial) -- times the index-K
  // bytes per token. A lower bound: a request's rows read one cache, and rows may keep different
  // blocks.
  int64_t index_k_bytes = 0;
  // Not counted (small beside the weights, or not reads of the cycle's inputs): activations, the
  // scores and the selections' traffic, the cache and pair-state writes.
  int64_t bytes() const { return weight_bytes + index_k_bytes; }
  double us() const { return static_cast<double>(bytes()) / kFloorBytesPerUs; }
};

// The floor of a cycle of the plan's backbone layers over the step `meta` (its rows, requests and
// clen; padded rows, req < 0, read nothing).
CycleFloor prepare_cycle_floor(const ModelPlan& plan, const StepMeta& meta);
// The same for a step shape without building its slot tables: bs requests at `context` prefilled
// positions, one row each (decode) or dspark_block_size + 1 consecutive rows (verify), clen =
// (pos + 1) / ratio. Cheap at any size (`v4attn plan --floor`).
CycleFloor prepare_cycle_floor(const ModelPlan& plan, bool verify, int bs, int64_t context);

// Issue 6's plain-PyTorch figures of the same 40-layer prepare on an H200 at 64K context, in
// microseconds per cycle: verify bs 1 5480, decode bs 1 4880, decode bs 32 7440, verify bs 4 6570;
// none for other cycles, another context, another config than the released V4.1-Flash one (the
// embedded default, compared key by key) or tp > 1.
std::optional<double> pytorch_reference_us(const ModelPlan& plan, bool verify, int bs, int64_t context);

}  // namespace v4attn
