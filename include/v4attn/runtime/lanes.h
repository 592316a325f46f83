// The lanes of the prepare: a main stream, side stream S (compressor + indexer) and side stream
// K (window-K write), with fork/join helpers that enforce the recording rule of
// prepare-schedule.md:
//   1. every fork is followed by main-stream work before the side work is issued;
//   2. each side block is issued on its stream right before its join, i.e. after the main-stream
//      Q chain has been issued (at graph replay a node joining several branches continues on the
//      lane of its first-recorded parent; recording main work first keeps the join, and so the
//      whole main chain, on one lane);
//   3. nothing a side stream reads is freed or reused before its join.
//
// How: side work is never issued at fork time. fork(lane) records a fork event on main now and
// opens (or extends) the lane's side block; defer(lane, fn) stores fn; join(lane) issues, on the
// side stream, for each fork in order: wait(fork event), the deferred callables of that fork;
// then records a join event and makes main wait on it. Rule 1 is checked at join: a fork whose
// deferred work is non-empty must have seen at least one main-stream issue (on_main or
// note_main_issue) after it, otherwise join throws std::logic_error. Rule 3 is the caller's: keep
// every buffer a deferred callable reads or writes alive and unmodified by main until join()
// returns (issue_layer joins within the layer, so per-layer scratch reused by the next layer is
// safe).
//
// Works eagerly and under stream capture (cudaStreamBeginCapture on main, any capture mode): the
// side streams join the capture through the fork-event waits and leave it through the join
// events, so every side block must be joined before cudaStreamEndCapture (require_all_joined()).
//
// Not thread-safe: one PrepareStreams per host thread that issues a cycle.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "v4attn/runtime/schedule.h"

namespace v4attn {

// Issues work on the given stream (a kernel launch, a GEMM, a memset ...).
using IssueFn = std::function<void(cudaStream_t)>;

enum class SideIssueOrder : uint8_t {
  kAtJoin,  // the rule (default): side work issued right before its join
  // Anti-pattern kept for measurement and tests only: defer() issues the side work immediately,
  // right after its fork, before the main chain. Replays on many more streams (h200-measurements
  // .md: 42 vs 3 for a 40-layer synthetic graph). Rule 1 is not checked in this mode.
  kEarlyForTestsOnly,
};

class PrepareStreams;

// Handle of one fork: work deferred through it waits on exactly that fork's event. Returned by
// PrepareStreams::fork; valid until the lane's join (defer after the join throws).
class SideBlock {
 public:
  Lane lane() const { return lane_; }
  // Same as PrepareStreams::defer, but attached to this fork even when the lane was forked again
  // since (the work is then issued before the later fork's wait).
  void defer(IssueFn fn) const;

 private:
  friend class PrepareStreams;
  SideBlock(PrepareStreams* owner, Lane lane, uint64_t block_id, int segment)
      : owner_(owner), lane_(lane), block_id_(block_id), segment_(segment) {}
  PrepareStreams* owner_;
  Lane lane_;
  uint64_t block_id_;
  int segment_;
};

class PrepareStreams {
 public:
  // Events in flight at once are bounded (one layer: 3 forks + 2 joins); the pool is created once.
  static constexpr int kEventPoolSize = 16;

  // Creates and owns a non-blocking main stream (and the side streams) on the current device.
  PrepareStreams();
  // Borrows the caller's main stream (not destroyed here). It must not be the legacy default
  // stream if the cycle is to be captured.
  explicit PrepareStreams(cudaStream_t borrowed_main);
  ~PrepareStreams();
  PrepareStreams(const PrepareStreams&) = delete;
  PrepareStreams& operator=(const PrepareStreams&) = delete;

  cudaStream_t main_stream() const { return main_; }
  cudaStream_t stream(Lane lane) const;

  // Issues fn(main_stream()) now and counts it as main-stream work (rule 1).
  void on_main(const IssueFn& fn);
  // For main-stream work the caller issued itself on main_stream().
  void note_main_issue() { ++main_issues_; }
  uint64_t main_issue_count() const { return main_issues_; }

  // Records a fork event on main now (everything issued on main so far happens before the side
  // work of this fork). `side` must be Lane::kS or Lane::kK. Forking a lane again before its join
  // adds a second fork to the same side block (S' of the three-lane schedule).
  SideBlock fork(Lane side);
  // Defers fn to the most recent fork of `side` (issued at join; see the top comment). Captured
  // references must stay valid until join.
  void defer(Lane side, IssueFn fn);
  // Issues the side block of `side` and makes main wait for it. A lane without an open block
  // throws std::logic_error. A block whose forks carry no work issues nothing.
  void join(Lane side);

  bool has_open_block(Lane side) const;
  // Throws std::logic_error naming the lane if a side block is still open (call before ending a
  // capture; an unjoined side stream makes cudaStreamEndCapture fail).
  void require_all_joined() const;
  // Cycle prologue: a tiny memset on each side lane (of `scratch`, >= 8 bytes of device memory the
  // caller owns), forked from and joined back into main around `main_work`. Captured in a graph,
  // it makes every lane exist, with a tail that is an ancestor of the first layer, before any
  // layer forks; without it the first layer's CMP replayed on a stream of its own (one extra
  // stream per cycle, measured; docs/perf.md).
  void lane_prologue(void* scratch, const IssueFn& main_work);
  // Error paths only: drops open side blocks without issuing their deferred work (their fork
  // events return to the pool). A capture in progress is broken by then anyway.
  void abandon_open_blocks();

  void set_side_issue_order(SideIssueOrder order);
  SideIssueOrder side_issue_order() const { return order_; }

  // Scheduling priority of the two side lanes' streams (CUDA stream priority: lower is higher;
  // 0 = default, clamped into the device's range). launch_kernel copies a stream's priority into
  // each launch (and so into captured graph nodes), so that when CTAs of several lanes wait for
  // free SMs the side lanes' go first. Recreates the side streams: no side block may be open and
  // no capture may be in progress. Returns the priority in effect.
  int set_side_priority(int priority);

 private:
  friend class SideBlock;
  struct Fork {
    cudaEvent_t event = nullptr;
    uint64_t main_issues_at_fork = 0;
    bool side_waited = false;  // early mode: the side stream already waits on `event`
    std::vector<IssueFn> work;
  };
  struct Block {
    bool open = false;
    uint64_t id = 0;
    std::vector<Fork> forks;
  };
  void init_side_streams_and_events();
  static int side_index(Lane side, const char* what);
  void defer_to(Lane side, uint64_t block_id, int segment, IssueFn fn);
  void issue_early(Lane side, Fork& f, const IssueFn& fn);
  cudaEvent_t acquire_event();
  void release_event(cudaEvent_t e);
  void close_block(Block& b);  // releases the fork events, clears the block

  cudaStream_t main_ = nullptr;
  bool owns_main_ = false;
  std::array<cudaStream_t, 2> side_{};  // [0] = S, [1] = K
  std::array<Block, 2> blocks_{};
  std::vector<cudaEvent_t> all_events_;
  std::vector<cudaEvent_t> free_events_;
  uint64_t main_issues_ = 0;
  uint64_t next_block_id_ = 1;
  SideIssueOrder order_ = SideIssueOrder::kAtJoin;
};

// One layer's prepare, as callables per work item. The stack driver fills this from its kernels;
// issue_layer decides streams and order.
struct LayerIssue {
  uint32_t work = 0;  // WorkItem bits (LayerPlan::work); QA, QB and KV are required
  IssueFn qa;         // fused wq_a|wkv GEMM (+ q_norm when `q_norm` is empty); writes KV's input
  IssueFn q_norm;     // optional: q_norm on its own, so that fork(K) precedes it (KV needs only
                      // the GEMM's kv part); the three-lane diagram's "[q_norm]"
  IssueFn qb;         // wq_b GEMM + q_rope_store
  IssueFn kv;         // window K: kv_norm + RoPE + fp8 quant + paged store (reads QA's kv part)
  IssueFn cmp;        // compressor (+ index-K store); reads x; required iff work has kWorkCMP
  IssueFn idx;        // indexer; reads x, qr and the index-K cache; required iff kWorkIDX
  // Where the three-lane schedule forks the S block (experiment knob, measured by the CUPTI test;
  // see docs/perf.md): kAtLayerStart: CMP right after x, IDX joins it after q_norm (two parents);
  // kAfterQNorm: the whole S block (CMP then IDX) forks after q_norm (one parent);
  // kIdxOnKWithoutCmp: like kAtLayerStart, but a layer with IDX and no CMP runs IDX on lane K
  // after KV.
  // kIdxGemmsOnK: like kAtLayerStart, and `idx_pre` (the indexer's GEMMs) runs on lane K after
  // KV, forked after q_norm, beside the compressor on S; `idx` must then wait for it itself (an
  // event recorded by idx_pre: lane K is joined, so recorded, before lane S is issued).
  enum class SFork { kAtLayerStart, kAfterQNorm, kIdxOnKWithoutCmp, kIdxGemmsOnK } s_fork = SFork::kAtLayerStart;
  IssueFn idx_pre;  // optional first part of IDX (see kIdxGemmsOnK); else issued right before idx
  // Optional part of IDX that reads only x (weights_proj): on a side lane it is issued at the
  // layer's start, behind CMP on the same lane (or alone), so it does not wait for qr; on main
  // (serial) it runs right before idx_pre / idx. Its outputs must be read only by idx.
  IssueFn idx_x;
  // Three-lane, a layer with CMP and IDX on lane S: idx_x forks onto lane K at the layer's start
  // (beside CMP, ahead of KV) instead of behind CMP on S. `idx` must then wait for it itself (an
  // event recorded by idx_x: lane K is joined, so recorded, before lane S is issued). Other
  // schedules and layers ignore it.
  bool idx_x_on_k = false;
};

// Issues one layer's prepare on `lanes` in the documented order; returns with every side block
// joined (attention may be issued on lanes.main_stream() next). Callables of items not in
// `layer.work` are ignored. Order per schedule (C = CMP, I = IDX, only when in `work`):
//   serial       main: QA [q_norm] QB KV C I
//   sources-side main: fork(S){C Ix} QA [q_norm] fork(S'){I} QB KV join(S)
//   three-lane   main: fork(S){C Ix} QA fork(K){KV} [q_norm] fork(S'){I} QB join(K) join(S)
// (Ix = idx_x, when set; serial runs it right before I. With idx_x_on_k, a three-lane layer with
// C and I: fork(S){C} fork(K){Ix} QA fork(K){KV} ..., I waiting for Ix through its own event.)
// where {..} is the deferred side work, issued on its lane at the join. IDX always forks after
// q_norm (it reads qr) and shares lane S with CMP, so CMP's index-K writes precede IDX's reads.
// Throws std::invalid_argument when a required callable is missing and std::logic_error when a
// side block is already open (nothing issued then). If a callable throws, the layer's open side
// blocks are dropped (abandon_open_blocks) and the exception propagates.
void issue_layer(PrepareStreams& lanes, Schedule schedule, const LayerIssue& layer);

}  // namespace v4attn
