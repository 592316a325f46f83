// Step metadata (step.h, cache-layouts.md "Slots").
#include "v4attn/reference/step.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace v4attn {
namespace {

constexpr int64_t kFullPage = 256;  // engine page of the full pool; page 0 holds the dummy slot 0

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

}  // namespace

int64_t RequestPool::full_pool_slots() const {
  int32_t highest = 0;  // the dummy slot always exists
  for (int32_t s : req_to_token) highest = s > highest ? s : highest;
  return static_cast<int64_t>(highest) + 1;
}

RequestPool make_request_pool(int n_requests, int max_context, int rows_per_request, int window) {
  if (n_requests < 0) fail("make_request_pool: n_requests " + std::to_string(n_requests) + " is negative");
  if (max_context <= 0) fail("make_request_pool: max_context " + std::to_string(max_context) + " must be positive");
  if (rows_per_request <= 0) fail("make_request_pool: rows_per_request " + std::to_string(rows_per_request) + " must be positive");
  if (window <= 0) fail("make_request_pool: window " + std::to_string(window) + " must be positive");
  // Each request owns whole pages: its compressed slots (full slot / r) then never collide with
  // another request's, since every page start is a multiple of 256 (so of r).
  const int64_t pages_per_request = (max_context + kFullPage - 1) / kFullPage;
  const int64_t slots = kFullPage + static_cast<int64_t>(n_requests) * pages_per_request * kFullPage;
  if (slots > std::numeric_limits<int32_t>::max())
    fail("make_request_pool: " + std::to_string(n_requests) + " requests x " + std::to_string(max_context) +
         " positions overflow the int32 slot range");
  RequestPool pool;
  pool.n_requests = n_requests;
  pool.max_context = max_context;
  pool.req_to_token.resize(static_cast<size_t>(n_requests) * static_cast<size_t>(max_context));
  for (int r = 0; r < n_requests; ++r) {
    const int64_t base = kFullPage + r * pages_per_request * kFullPage;
    for (int p = 0; p < max_context; ++p)
      pool.req_to_token[static_cast<size_t>(r) * max_context + p] = static_cast<int32_t>(base + p);
  }
  pool.window_ring = window + rows_per_request - 1;
  pool.pair_ring = 1;
  while (pool.pair_ring <= rows_per_request) pool.pair_ring *= 2;
  return pool;
}

BatchDesc make_decode_batch(const std::vector<int32_t>& ctx, int pad_to) { return make_verify_batch(ctx, 1, pad_to); }

BatchDesc make_verify_batch(const std::vector<int32_t>& ctx, int v, int pad_to) {
  if (v <= 0) fail("make_verify_batch: rows per request " + std::to_string(v) + " must be positive");
  BatchDesc b;
  for (size_t r = 0; r < ctx.size(); ++r)
    for (int i = 0; i < v; ++i) {
      b.req.push_back(static_cast<int32_t>(r));
      b.pos.push_back(ctx[r] + i);
    }
  while (b.rows() < pad_to) {
    b.req.push_back(-1);
    b.pos.push_back(0);
  }
  return b;
}

StepMeta build_step_meta(const BatchDesc& batch, const RequestPool& pool, int max_pos) {
  const int T = batch.rows();
  if (batch.pos.size() != batch.req.size())
    fail("build_step_meta: batch has " + std::to_string(batch.req.size()) + " requests but " +
         std::to_string(batch.pos.size()) + " positions");
  if (pool.req_to_token.size() != static_cast<size_t>(pool.n_requests) * static_cast<size_t>(pool.max_context))
    fail("build_step_meta: request pool table size does not match n_requests x max_context");
  if (pool.window_ring <= 0 || pool.pair_ring <= 0) fail("build_step_meta: request pool has no window or pair ring");
  for (int t = 0; t < T; ++t) {
    const int32_t r = batch.req[t], p = batch.pos[t];
    const std::string row = "row " + std::to_string(t) + ": ";
    if (r == -1) continue;  // padded row
    if (r < 0 || r >= pool.n_requests)
      fail(row + "unknown request " + std::to_string(r) + " (pool has " + std::to_string(pool.n_requests) + " requests)");
    if (p < 0) fail(row + "position " + std::to_string(p) + " is negative");
    if (p >= max_pos)
      fail(row + "position " + std::to_string(p) + " is past the RoPE table (max_pos " + std::to_string(max_pos) + ")");
    if (p >= pool.max_context)
      fail(row + "position " + std::to_string(p) + " is past the request's context (max_context " +
           std::to_string(pool.max_context) + ")");
    if (pool.full_slot(r, p) <= 0)
      fail(row + "request " + std::to_string(r) + " position " + std::to_string(p) + " maps to the reserved slot " +
           std::to_string(pool.full_slot(r, p)));
  }

  StepMeta m;
  m.rows = T;
  auto sized = [T](int32_t fill) { return std::vector<int32_t>(static_cast<size_t>(T), fill); };
  m.req = sized(-1);
  m.pos = sized(0);
  m.out_cache_loc = sized(0);
  m.swa_loc = sized(-1);
  for (int r = 1; r <= 2; ++r) {
    m.c_out_loc[r] = sized(-1);
    m.clen[r] = sized(0);
  }
  m.pair_state_row = sized(-1);
  m.pair_prev_row = sized(-1);
  m.pair_partner_state_row = sized(-1);
  for (int t = 0; t < T; ++t) {
    const int32_t r = batch.req[t];
    if (r == -1) continue;
    const int32_t p = batch.pos[t];
    m.req[t] = r;
    m.pos[t] = p;
    m.out_cache_loc[t] = pool.full_slot(r, p);
    m.swa_loc[t] = pool.window_slot(r, p);
    for (int ratio = 1; ratio <= 2; ++ratio) {
      m.c_out_loc[ratio][t] = (p + 1) % ratio == 0 ? m.out_cache_loc[t] / ratio : -1;
      m.clen[ratio][t] = (p + 1) / ratio;
    }
    m.pair_state_row[t] = r * pool.pair_ring + p % pool.pair_ring;
    if (t > 0 && batch.req[t - 1] == r && batch.pos[t - 1] == p - 1) m.pair_prev_row[t] = t - 1;
    if (p % 2 == 1) m.pair_partner_state_row[t] = r * pool.pair_ring + (p - 1) % pool.pair_ring;
  }
  return m;
}

}  // namespace v4attn
