// The three prepare schedules of prepare-schedule.md and the lane each work item runs on.
// Header-only and CUDA-free, so host tools (trace report, CLI option parsing) and CPU tests can
// use it without the GPU library.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "v4attn/plan.h"  // WorkItem bits

namespace v4attn {

enum class Schedule : uint8_t {
  kSerial,       // everything on the current (main) stream: QA, QB, KV, CMP, IDX
  kSourcesSide,  // the old one: CMP and IDX on side stream S; QA, QB, KV on main
  kThreeLane,    // the new one: CMP, IDX on S; KV on K (after QA); QA, QB on main
};
inline constexpr std::array<Schedule, 3> kAllSchedules = {Schedule::kSerial, Schedule::kSourcesSide,
                                                          Schedule::kThreeLane};

// The lanes of one layer's prepare. kMain is the stream the caller issues the cycle on (the
// q_rope_store lane); kS carries the compressor and the indexer; kK the window-K write.
enum class Lane : uint8_t { kMain = 0, kS = 1, kK = 2 };
inline constexpr int kNumLanes = 3;

inline const char* to_string(Schedule s) {
  switch (s) {
    case Schedule::kSerial: return "serial";
    case Schedule::kSourcesSide: return "sources-side";
    case Schedule::kThreeLane: return "three-lane";
  }
  return "?";
}

inline const char* to_string(Lane l) {
  switch (l) {
    case Lane::kMain: return "main";
    case Lane::kS: return "S";
    case Lane::kK: return "K";
  }
  return "?";
}

// Accepts the names to_string prints and their underscore spellings (sources_side, three_lane).
inline Schedule parse_schedule(std::string_view name) {
  if (name == "serial") return Schedule::kSerial;
  if (name == "sources-side" || name == "sources_side") return Schedule::kSourcesSide;
  if (name == "three-lane" || name == "three_lane") return Schedule::kThreeLane;
  throw std::invalid_argument("unknown prepare schedule \"" + std::string(name) +
                              "\" (expected serial, sources-side or three-lane)");
}

// The lane a work item runs on under a schedule (prepare-schedule.md, "Three schedules").
// `item` must be exactly one WorkItem bit.
inline Lane lane_for(Schedule s, WorkItem item) {
  switch (item) {
    case kWorkQA:
    case kWorkQB: return Lane::kMain;
    case kWorkKV: return s == Schedule::kThreeLane ? Lane::kK : Lane::kMain;
    case kWorkCMP:
    case kWorkIDX: return s == Schedule::kSerial ? Lane::kMain : Lane::kS;
  }
  throw std::invalid_argument("lane_for: not a single work item bit: " + std::to_string(static_cast<uint32_t>(item)));
}

}  // namespace v4attn
