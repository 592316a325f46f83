// Step metadata (cache-layouts.md "Slots"): from a batch description (requests, positions, rows
// per request, padded rows) to the per-row slot arrays every prepare op and kernel consumes.
// Shared by the CPU reference and the GPU path (the GPU copies these arrays to the device).
#pragma once

#include <cstdint>
#include <vector>

#include "v4attn/config.h"

namespace v4attn {

// The engine's view of its requests: req_to_token[req][pos] = full-pool slot (pages of 256
// slots per request; slot 0 is the reserved dummy, never handed to a request).
struct RequestPool {
  int n_requests = 0;
  int max_context = 0;                 // positions per request the tables cover
  std::vector<int32_t> req_to_token;   // [n_requests, max_context]
  int window_ring = 0;                 // window + max_rows_per_request - 1 (128 + 5 for DSpark)
  int pair_ring = 0;                   // ratio-2 pair-state ring per request (power of two > rows)

  int32_t full_slot(int req, int pos) const { return req_to_token[static_cast<size_t>(req) * max_context + pos]; }
  int32_t window_slot(int req, int pos) const { return req * window_ring + pos % window_ring; }
  int64_t full_pool_slots() const;     // 1 + highest slot in req_to_token
  int64_t window_pool_slots() const { return static_cast<int64_t>(n_requests) * window_ring; }
};

// Contiguous page allocation: request r owns pages of 256 slots starting after the dummy page.
RequestPool make_request_pool(int n_requests, int max_context, int rows_per_request, int window);

// One step: T rows, request-major; each row is a request's position, or a padded row.
struct BatchDesc {
  std::vector<int32_t> req;  // [T] request of each row; -1 = padded row (CUDA-graph bucket fill)
  std::vector<int32_t> pos;  // [T] position of each row (ignored for padded rows)
  int rows() const { return static_cast<int>(req.size()); }
};

// Decode: one row per request at positions ctx[r]; verify: v consecutive rows per request
// starting at ctx[r]; `pad_to` > rows appends padded rows.
BatchDesc make_decode_batch(const std::vector<int32_t>& ctx, int pad_to = 0);
BatchDesc make_verify_batch(const std::vector<int32_t>& ctx, int v, int pad_to = 0);

// Per-row slot arrays of one step ([T] each).
struct StepMeta {
  int rows = 0;
  std::vector<int32_t> req;            // -1 for padded rows
  std::vector<int32_t> pos;            // 0 for padded rows
  std::vector<int32_t> out_cache_loc;  // full-pool slot; 0 = padded row (writes nothing)
  std::vector<int32_t> swa_loc;        // window ring slot; -1 = no write
  std::vector<int32_t> c_out_loc[3];   // index by ratio 1, 2: compressed slot or <= 0 (skip);
                                       // [0] is left empty (ratio 0 has no compressed pool)
  std::vector<int32_t> clen[3];        // index by ratio 1, 2: (pos + 1) / r; 0 for padded rows
                                       // ([0] left empty)
  std::vector<int32_t> pair_state_row; // req * pair_ring + pos % pair_ring; -1 for padded rows
  std::vector<int32_t> pair_prev_row;  // ratio-2 partner in this batch (row t-1 of the same
                                       // request at pos-1), else -1 (read the pair state)
  std::vector<int32_t> pair_partner_state_row;  // req * pair_ring + (pos-1) % pair_ring for odd
                                                // pos, else -1
};

// Validates (unknown request, position past max_context or the RoPE table size `max_pos`) and
// throws std::invalid_argument with a clear message; changes nothing on error.
StepMeta build_step_meta(const BatchDesc& batch, const RequestPool& pool, int max_pos);

}  // namespace v4attn
