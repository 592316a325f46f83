#include "v4attn/runtime/lanes.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "runtime/cuda_utils.h"

namespace v4attn {

// --- SideBlock -------------------------------------------------------------------------------

void SideBlock::defer(IssueFn fn) const { owner_->defer_to(lane_, block_id_, segment_, std::move(fn)); }

// --- PrepareStreams --------------------------------------------------------------------------

PrepareStreams::PrepareStreams() : owns_main_(true) {
  V4_CUDA_CHECK(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking));
  try {
    init_side_streams_and_events();
  } catch (...) {
    cudaStreamDestroy(main_);
    throw;
  }
}

PrepareStreams::PrepareStreams(cudaStream_t borrowed_main) : main_(borrowed_main), owns_main_(false) {
  init_side_streams_and_events();
}

void PrepareStreams::init_side_streams_and_events() {
  // Non-blocking: the side lanes must not synchronise implicitly with the legacy default stream;
  // their only ordering is the fork/join events.
  try {
    for (auto& s : side_) V4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    all_events_.reserve(kEventPoolSize);
    for (int i = 0; i < kEventPoolSize; ++i) {
      cudaEvent_t e = nullptr;
      // Ordering only: timing would add a timestamp write per record for nothing.
      V4_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      all_events_.push_back(e);
    }
  } catch (...) {
    for (cudaEvent_t e : all_events_) cudaEventDestroy(e);
    all_events_.clear();
    for (auto& s : side_)
      if (s) cudaStreamDestroy(s);
    throw;
  }
  free_events_ = all_events_;
}

PrepareStreams::~PrepareStreams() {
  // Destroying streams or events with work pending is allowed (resources are released when the
  // work completes). Deferred work of a never-joined block is dropped.
  for (cudaEvent_t e : all_events_) cudaEventDestroy(e);
  for (auto& s : side_)
    if (s) cudaStreamDestroy(s);
  if (owns_main_ && main_) cudaStreamDestroy(main_);
}

int PrepareStreams::side_index(Lane side, const char* what) {
  if (side == Lane::kS) return 0;
  if (side == Lane::kK) return 1;
  throw std::logic_error(std::string("PrepareStreams::") + what + ": lane " + to_string(side) +
                         " is not a side lane (use S or K)");
}

cudaStream_t PrepareStreams::stream(Lane lane) const {
  if (lane == Lane::kMain) return main_;
  return side_[side_index(lane, "stream")];
}

void PrepareStreams::on_main(const IssueFn& fn) {
  if (!fn) throw std::invalid_argument("PrepareStreams::on_main: empty callable");
  fn(main_);
  ++main_issues_;
}

cudaEvent_t PrepareStreams::acquire_event() {
  if (free_events_.empty())
    throw std::logic_error("PrepareStreams: all " + std::to_string(kEventPoolSize) +
                           " fork/join events in use (forks without joins?)");
  cudaEvent_t e = free_events_.back();
  free_events_.pop_back();
  return e;
}

// Reusing an event right after the wait that consumes it is safe: cudaStreamWaitEvent waits for
// the record that was current when it was called, later records do not affect it (eagerly), and
// under capture the wait resolves to the captured nodes at call time.
void PrepareStreams::release_event(cudaEvent_t e) { free_events_.push_back(e); }

void PrepareStreams::close_block(Block& b) {
  for (Fork& f : b.forks) release_event(f.event);
  b.forks.clear();
  b.open = false;
}

SideBlock PrepareStreams::fork(Lane side) {
  const int i = side_index(side, "fork");
  Block& b = blocks_[i];
  cudaEvent_t e = acquire_event();
  const cudaError_t err = cudaEventRecord(e, main_);
  if (err != cudaSuccess) {
    release_event(e);
    throw_cuda_error(err, "cudaEventRecord(fork event, main)", __FILE__, __LINE__);
  }
  if (!b.open) {
    b.open = true;
    b.id = next_block_id_++;
  }
  Fork f;
  f.event = e;
  f.main_issues_at_fork = main_issues_;
  b.forks.push_back(std::move(f));
  return SideBlock(this, side, b.id, static_cast<int>(b.forks.size()) - 1);
}

void PrepareStreams::defer(Lane side, IssueFn fn) {
  const int i = side_index(side, "defer");
  const Block& b = blocks_[i];
  if (!b.open)
    throw std::logic_error(std::string("PrepareStreams::defer: lane ") + to_string(side) + " has no open fork");
  defer_to(side, b.id, static_cast<int>(b.forks.size()) - 1, std::move(fn));
}

void PrepareStreams::defer_to(Lane side, uint64_t block_id, int segment, IssueFn fn) {
  const int i = side_index(side, "defer");
  Block& b = blocks_[i];
  if (!fn) throw std::invalid_argument("PrepareStreams::defer: empty callable");
  if (!b.open || b.id != block_id)
    throw std::logic_error(std::string("PrepareStreams::defer: the fork of lane ") + to_string(side) +
                           " was already joined");
  Fork& f = b.forks.at(static_cast<size_t>(segment));
  if (order_ == SideIssueOrder::kEarlyForTestsOnly) {
    issue_early(side, f, fn);
    return;
  }
  f.work.push_back(std::move(fn));
}

void PrepareStreams::issue_early(Lane side, Fork& f, const IssueFn& fn) {
  cudaStream_t s = side_[side_index(side, "defer")];
  if (!f.side_waited) {
    V4_CUDA_CHECK(cudaStreamWaitEvent(s, f.event, 0));
    f.side_waited = true;
  }
  fn(s);
}

void PrepareStreams::join(Lane side) {
  const int i = side_index(side, "join");
  Block& b = blocks_[i];
  if (!b.open)
    throw std::logic_error(std::string("PrepareStreams::join: lane ") + to_string(side) + " has no open fork");
  cudaStream_t s = side_[i];

  if (order_ == SideIssueOrder::kAtJoin) {
    // Rule 1, checked before anything is issued so that a violation leaves the streams untouched.
    for (const Fork& f : b.forks) {
      if (!f.work.empty() && main_issues_ == f.main_issues_at_fork) {
        close_block(b);
        throw std::logic_error(std::string("PrepareStreams::join(") + to_string(side) +
                               "): recording rule violated: no main-stream work was issued between the fork "
                               "and the join (issue the main chain through on_main() before joining)");
      }
    }
  }

  bool any_work = false;
  try {
    for (Fork& f : b.forks) {
      if (order_ == SideIssueOrder::kEarlyForTestsOnly) {
        any_work = any_work || f.side_waited;
        continue;
      }
      if (f.work.empty()) continue;  // a fork without work adds no dependency
      V4_CUDA_CHECK(cudaStreamWaitEvent(s, f.event, 0));
      for (const IssueFn& fn : f.work) fn(s);
      any_work = true;
    }
  } catch (...) {
    close_block(b);  // keep the object usable; the cycle being issued is broken anyway
    throw;
  }
  // The fork events are consumed (waits issued); they may be recorded again from here on.
  close_block(b);
  if (!any_work) return;  // the side stream never joined main's work: nothing to join back

  cudaEvent_t j = acquire_event();
  cudaError_t err = cudaEventRecord(j, s);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(main_, j, 0);
  release_event(j);
  if (err != cudaSuccess) throw_cuda_error(err, "join: cudaEventRecord(side) / cudaStreamWaitEvent(main)", __FILE__, __LINE__);
}

void PrepareStreams::lane_prologue(void* scratch, const IssueFn& main_work) {
  if (scratch == nullptr) throw std::invalid_argument("PrepareStreams::lane_prologue: scratch is null");
  if (!main_work) throw std::invalid_argument("PrepareStreams::lane_prologue: empty main work");
  auto* bytes = static_cast<unsigned char*>(scratch);
  fork(Lane::kS).defer([bytes](cudaStream_t s) { V4_CUDA_CHECK(cudaMemsetAsync(bytes, 0, 4, s)); });
  fork(Lane::kK).defer([bytes](cudaStream_t s) { V4_CUDA_CHECK(cudaMemsetAsync(bytes + 4, 0, 4, s)); });
  on_main(main_work);
  join(Lane::kK);
  join(Lane::kS);
}

bool PrepareStreams::has_open_block(Lane side) const { return blocks_[side_index(side, "has_open_block")].open; }

void PrepareStreams::require_all_joined() const {
  for (Lane l : {Lane::kS, Lane::kK})
    if (has_open_block(l))
      throw std::logic_error(std::string("PrepareStreams: lane ") + to_string(l) + " has a fork without its join");
}

void PrepareStreams::abandon_open_blocks() {
  for (Block& b : blocks_)
    if (b.open) close_block(b);
}

int PrepareStreams::set_side_priority(int priority) {
  if (blocks_[0].open || blocks_[1].open)
    throw std::logic_error("PrepareStreams::set_side_priority: a side block is open");
  int least = 0, greatest = 0;
  V4_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int p = std::clamp(priority, greatest, least);  // greatest is the numerically smallest
  for (auto& s : side_) {
    V4_CUDA_CHECK(cudaStreamSynchronize(s));
    V4_CUDA_CHECK(cudaStreamDestroy(s));
    s = nullptr;
    V4_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, p));
  }
  return p;
}

void PrepareStreams::set_side_issue_order(SideIssueOrder order) {
  if (blocks_[0].open || blocks_[1].open)
    throw std::logic_error("PrepareStreams::set_side_issue_order: a side block is open");
  order_ = order;
}

// --- issue_layer -----------------------------------------------------------------------------

namespace {

void require_callable(const IssueFn& fn, uint32_t work, WorkItem item, const char* name) {
  if ((work & item) && !fn)
    throw std::invalid_argument(std::string("issue_layer: work item ") + name + " is set but its callable is empty");
}

// Deferred callables refer to `layer`'s members, which outlive issue_layer (the joins happen in
// it), so the deferred copy is a reference, not a copy of the callable's state.
IssueFn by_ref(const IssueFn& fn) {
  return [&fn](cudaStream_t s) { fn(s); };
}

// One order for every schedule; lane_for decides which items leave main. Side items are forked
// at the earliest point their inputs are ready (CMP: x, at the start; KV: after QA; IDX: after
// q_norm) and joined after QB; main items run in the order QA [q_norm] QB KV CMP IDX.
void issue_layer_in_order(PrepareStreams& lanes, Schedule schedule, const LayerIssue& layer) {
  const bool has_cmp = (layer.work & kWorkCMP) != 0;
  const bool has_idx = (layer.work & kWorkIDX) != 0;
  const Lane kv_lane = lane_for(schedule, kWorkKV);
  const Lane cmp_lane = lane_for(schedule, kWorkCMP);
  const Lane idx_lane = lane_for(schedule, kWorkIDX);
  bool forked[kNumLanes] = {};
  const auto side = [&](Lane lane, const IssueFn& fn) {
    lanes.fork(lane).defer(by_ref(fn));
    forked[static_cast<int>(lane)] = true;
  };

  using SFork = LayerIssue::SFork;
  const bool three = schedule == Schedule::kThreeLane;
  const bool cmp_late = three && layer.s_fork == SFork::kAfterQNorm;
  const Lane idx_side =
      three && layer.s_fork == SFork::kIdxOnKWithoutCmp && !has_cmp && idx_lane != Lane::kMain ? Lane::kK : idx_lane;
  // Work that reads only x, forked at the start: CMP (unless cmp_late) and idx_x. When both go
  // to the same lane they share one fork (one event), CMP first.
  const bool cmp_early = has_cmp && cmp_lane != Lane::kMain && !cmp_late;
  const bool idx_x_early = has_idx && layer.idx_x && idx_side != Lane::kMain;
  // idx_x on lane K beside CMP on S (LayerIssue::idx_x_on_k): it does not wait behind CMP.
  const bool idx_x_on_k = three && layer.idx_x_on_k && has_cmp && idx_x_early && idx_side == Lane::kS;
  const IssueFn cmp_then_idx_x = [&layer](cudaStream_t s) {
    layer.cmp(s);
    layer.idx_x(s);
  };
  if (cmp_early && idx_x_early && cmp_lane == idx_side && !idx_x_on_k) {
    side(cmp_lane, cmp_then_idx_x);  // after x
  } else {
    if (cmp_early) side(cmp_lane, layer.cmp);                                      // after x
    if (idx_x_early) side(idx_x_on_k ? Lane::kK : idx_side, layer.idx_x);  // after x
  }
  lanes.on_main(layer.qa);
  if (kv_lane != Lane::kMain) side(kv_lane, layer.kv);  // after QA's GEMM (the kv part)
  if (layer.q_norm) lanes.on_main(layer.q_norm);
  if (has_cmp && cmp_lane != Lane::kMain && cmp_late) side(cmp_lane, layer.cmp);  // after qr
  const bool pre_on_k = three && layer.s_fork == SFork::kIdxGemmsOnK && has_idx && layer.idx_pre;
  // Without its own lane, idx_pre runs right before idx, on idx's lane.
  const IssueFn idx_all = [&layer, idx_x_early](cudaStream_t s) {
    if (layer.idx_x && !idx_x_early) layer.idx_x(s);
    if (layer.idx_pre) layer.idx_pre(s);
    layer.idx(s);
  };
  const IssueFn& idx_fn = pre_on_k ? layer.idx : idx_all;
  if (pre_on_k) side(Lane::kK, layer.idx_pre);                          // K': after qr, behind KV
  if (has_idx && idx_lane != Lane::kMain) side(idx_side, idx_fn);  // S': after qr
  lanes.on_main(layer.qb);
  if (kv_lane == Lane::kMain) lanes.on_main(layer.kv);
  if (has_cmp && cmp_lane == Lane::kMain) lanes.on_main(layer.cmp);
  if (has_idx && idx_lane == Lane::kMain) lanes.on_main(idx_fn);
  // Side blocks are issued here, after the whole main chain: rule 2.
  if (forked[static_cast<int>(Lane::kK)]) lanes.join(Lane::kK);
  if (forked[static_cast<int>(Lane::kS)]) lanes.join(Lane::kS);
}

}  // namespace

void issue_layer(PrepareStreams& lanes, Schedule schedule, const LayerIssue& layer) {
  const uint32_t w = layer.work;
  constexpr uint32_t kRequired = kWorkQA | kWorkQB | kWorkKV;
  if ((w & kRequired) != kRequired)
    throw std::invalid_argument("issue_layer: every layer has QA, QB and KV; work bits = " + std::to_string(w));
  require_callable(layer.qa, w, kWorkQA, "QA");
  require_callable(layer.qb, w, kWorkQB, "QB");
  require_callable(layer.kv, w, kWorkKV, "KV");
  require_callable(layer.cmp, w, kWorkCMP, "CMP");
  require_callable(layer.idx, w, kWorkIDX, "IDX");
  if (lanes.has_open_block(Lane::kS) || lanes.has_open_block(Lane::kK))
    throw std::logic_error("issue_layer: a side block is already open on these lanes");
  try {
    issue_layer_in_order(lanes, schedule, layer);
  } catch (...) {
    lanes.abandon_open_blocks();  // a callable threw: do not leave half a layer's forks open
    throw;
  }
}

}  // namespace v4attn
