// CPU reference of a whole attention stack for one step (stack.h): state, the per-layer chain and
// the dumps of its tensors.
#include "v4attn/reference/stack.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "v4attn/reference/attention.h"
#include "v4attn/reference/dump.h"
#include "v4attn/reference/gemm.h"
#include "v4attn/reference/indexer.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/rope_table.h"

namespace v4attn::ref {

namespace {

constexpr int kHd = 512;
constexpr int kIdxHd = 128;

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("RefStack: " + what); }

uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string lname(int layer) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "L%02d.", layer);
  return buf;
}

// Bytes of slot `loc` of a paged cache: data then scales.
void append_slot_bytes(const uint8_t* cache, const CacheLayout& l, int64_t loc, std::vector<uint8_t>& out) {
  const uint8_t* d = cache + l.data_offset(loc);
  const uint8_t* s = cache + l.scale_offset(loc);
  out.insert(out.end(), d, d + l.data_bytes);
  out.insert(out.end(), s, s + l.scale_bytes);
}

// [T, data+scale bytes]: the slot bytes at locs[t] (rows with loc outside (min_loc, n_slots) zero).
std::vector<uint8_t> gather_slots(const uint8_t* cache, const CacheLayout& l, int64_t n_slots,
                                  const std::vector<int32_t>& locs, int32_t min_loc) {
  const int64_t row = l.data_bytes + l.scale_bytes;
  std::vector<uint8_t> out;
  out.reserve(locs.size() * static_cast<size_t>(row));
  for (int32_t loc : locs) {
    if (loc >= min_loc && loc < n_slots) append_slot_bytes(cache, l, loc, out);
    else out.insert(out.end(), static_cast<size_t>(row), uint8_t{0});
  }
  return out;
}

}  // namespace

uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string checksum_hex(uint64_t h) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

RefStack::RefStack(const ModelPlan& plan, const StackOptions& options) : plan_(plan), options_(options) {
  const ModelConfig& c = plan_.config;
  if (plan_.parallel.tp != 1)
    fail("tp " + std::to_string(plan_.parallel.tp) + " is not supported (the CPU stack runs tp = 1 only)");
  if (static_cast<int>(plan_.layers.size()) != c.total_layers()) fail("plan has the wrong number of layers");
  if (options_.n_requests < 1) fail("n_requests must be >= 1");
  if (options_.max_context < 1) fail("max_context must be >= 1");
  if (options_.rows_per_request == 0) options_.rows_per_request = c.verify_rows_per_request();
  if (options_.rows_per_request < 1) fail("rows_per_request must be >= 1");

  pool_ = make_request_pool(options_.n_requests, options_.max_context, options_.rows_per_request, c.window_size);
  full_slots_ = pool_.full_pool_slots();
  rope_base_ = build_rope_table(rope_params_for(c, false), pool_.max_context);
  rope_compressed_ = build_rope_table(rope_params_for(c, true), pool_.max_context);

  int64_t weight_bytes = 0;
  for (const LayerPlan& l : plan_.layers) weight_bytes += l.weight_bytes();
  keep_weights_ = weight_bytes <= options_.keep_weights_max_bytes;

  const int n = c.total_layers();
  weights_.resize(static_cast<size_t>(n));
  window_.resize(static_cast<size_t>(n));
  sources_.resize(static_cast<size_t>(n));
  topk_.resize(static_cast<size_t>(n));
  const CacheLayout wl = window_layout();
  for (int l = 0; l < n; ++l) window_[static_cast<size_t>(l)].assign(static_cast<size_t>(wl.pool_bytes(window_slots())), 0);
  for (int s : c.kv_source_layers) {
    SourceCaches sc;
    const int64_t slots = comp_slots(s);
    sc.comp.assign(static_cast<size_t>(cache_layout(CacheKind::kCompressedFp4).pool_bytes(slots)), 0);
    sc.index_k.assign(static_cast<size_t>(cache_layout(CacheKind::kIndexK).pool_bytes(slots)), 0);
    if (plan_.layers[static_cast<size_t>(s)].ratio == 2) {
      sc.pair_state.resize(static_cast<size_t>(pair_state_rows()) * 1024);
      pair_state_init(sc.pair_state.data(), pair_state_rows());
    }
    sources_[static_cast<size_t>(s)] = std::move(sc);
  }
  topk_width_ = (c.index_topk + 63) / 64 * 64;
  for (int r = 1; r <= 2; ++r) {
    const int64_t stride = comp_slot_stride(r);
    std::vector<int32_t>& t = comp_slot_table_[r];
    t.assign(static_cast<size_t>(pool_.n_requests * stride), -1);
    for (int q = 0; q < pool_.n_requests; ++q)
      for (int64_t j = 0; j < stride; ++j)
        t[static_cast<size_t>(q * stride + j)] = pool_.full_slot(q, static_cast<int>(j * r)) / r;
  }
}

const LayerWeights& RefStack::weights(int layer) {
  if (layer < 0 || layer >= config().total_layers()) fail("no layer " + std::to_string(layer));
  auto& slot = weights_[static_cast<size_t>(layer)];
  if (!slot) {
    if (!keep_weights_)
      for (auto& w : weights_) w.reset();  // one layer at a time: the full config does not fit twice
    slot = make_synthetic_layer_weights(plan_, layer, options_.seed);
  }
  return *slot;
}

std::vector<uint8_t>& RefStack::window_cache(int layer) {
  if (layer < 0 || layer >= config().total_layers()) fail("no layer " + std::to_string(layer));
  return window_[static_cast<size_t>(layer)];
}

RefStack::SourceCaches& RefStack::source(int kv_source) {
  if (kv_source < 0 || kv_source >= config().total_layers() || !sources_[static_cast<size_t>(kv_source)])
    fail("layer " + std::to_string(kv_source) + " is not a kv source");
  return *sources_[static_cast<size_t>(kv_source)];
}
const RefStack::SourceCaches& RefStack::source(int kv_source) const {
  return const_cast<RefStack*>(this)->source(kv_source);
}

int64_t RefStack::comp_slots(int kv_source) const {
  if (kv_source < 0 || kv_source >= config().total_layers() || plan_.layers[static_cast<size_t>(kv_source)].ratio == 0)
    fail("layer " + std::to_string(kv_source) + " has no compressed pool");
  return full_slots_ / plan_.layers[static_cast<size_t>(kv_source)].ratio + 1;
}
std::vector<uint8_t>& RefStack::comp_cache(int kv_source) { return source(kv_source).comp; }
std::vector<uint8_t>& RefStack::index_k_cache(int kv_source) { return source(kv_source).index_k; }
std::vector<float>& RefStack::pair_state(int kv_source) { return source(kv_source).pair_state; }

CompressorCaches RefStack::compressor_caches(int kv_source) {
  SourceCaches& sc = source(kv_source);
  CompressorCaches cc;
  cc.comp = sc.comp.data();
  cc.comp_slots = comp_slots(kv_source);
  cc.index_k = sc.index_k.data();
  cc.index_k_slots = cc.comp_slots;
  cc.pair_state = sc.pair_state.empty() ? nullptr : sc.pair_state.data();
  cc.pair_state_rows = sc.pair_state.empty() ? 0 : pair_state_rows();
  return cc;
}

const std::vector<int32_t>& RefStack::topk(int index_source) const {
  if (index_source < 0 || index_source >= config().total_layers() ||
      !plan_.layers[static_cast<size_t>(index_source)].is_index_source)
    fail("layer " + std::to_string(index_source) + " is not an index source");
  return topk_[static_cast<size_t>(index_source)];
}

const std::vector<int32_t>& RefStack::comp_slot_table(int ratio) const {
  if (ratio != 1 && ratio != 2) fail("comp_slot_table: ratio must be 1 or 2");
  return comp_slot_table_[ratio];
}

std::vector<num::bf16_t> RefStack::synthetic_x(int layer, const StepMeta& meta, int64_t step) const {
  const int64_t dim = config().dim;
  std::vector<num::bf16_t> x(static_cast<size_t>(meta.rows * dim));
  for (int t = 0; t < meta.rows; ++t) {
    const int32_t r = meta.req[static_cast<size_t>(t)];
    uint64_t key;
    if (r >= 0)  // a live row: its token's hidden state, whatever step carries it
      key = mix64(mix64(options_.seed ^ 0x78ull) ^ mix64(static_cast<uint64_t>(layer) << 40 ^
                                                          static_cast<uint64_t>(r) << 24 ^
                                                          static_cast<uint64_t>(meta.pos[static_cast<size_t>(t)])));
    else  // a padded row: garbage that differs per step and row
      key = mix64(mix64(options_.seed ^ 0x9adull) ^ mix64(static_cast<uint64_t>(step) << 32 ^
                                                           static_cast<uint64_t>(layer) << 20 ^ static_cast<uint64_t>(t)));
    const std::vector<num::bf16_t> row = synthetic_bf16(static_cast<size_t>(dim), key, 1.0f);
    std::copy(row.begin(), row.end(), x.begin() + t * dim);
  }
  return x;
}

std::vector<int> RefStack::layers_to_run(const StepOptions& o) const {
  const ModelConfig& c = config();
  if (o.max_layers < -1) fail("max_layers must be >= 0 or -1");
  const int n = o.max_layers < 0 ? c.n_layers : std::min(o.max_layers, c.n_layers);
  std::vector<int> ids;
  for (int l = 0; l < n; ++l) ids.push_back(l);
  if (o.include_draft)
    for (int l = c.n_layers; l < c.total_layers(); ++l) ids.push_back(l);
  return ids;
}

StepResult RefStack::run_step(const BatchDesc& batch, const StepOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  StepResult res;
  res.meta = build_step_meta(batch, pool_, static_cast<int>(max_pos()));  // validates the batch
  // A request may not bring more rows than the rings were sized for (the pair ring and the
  // window ring would wrap inside the step).
  {
    std::vector<int> per_req(static_cast<size_t>(pool_.n_requests), 0);
    for (int32_t r : res.meta.req)
      if (r >= 0 && ++per_req[static_cast<size_t>(r)] > options_.rows_per_request)
        throw std::invalid_argument("RefStack::run_step: request " + std::to_string(r) + " has more than " +
                                    std::to_string(options_.rows_per_request) + " rows (rows_per_request)");
  }
  for (int l : options.dump_layers)
    if (l < 0 || l >= config().total_layers())
      throw std::invalid_argument("RefStack::run_step: dump layer " + std::to_string(l) + " does not exist");
  res.step = steps_++;
  const std::vector<int> ids = layers_to_run(options);

  Dumper* d = options.dumper;
  if (d != nullptr) {
    const StepMeta& m = res.meta;
    const std::vector<int64_t> tshape{m.rows};
    d->set_meta("config", config().source);
    d->set_meta("step", res.step);
    d->set_meta("rows", m.rows);
    d->set_meta("seed", static_cast<int64_t>(options_.seed));
    d->set_meta("n_requests", pool_.n_requests);
    d->set_meta("max_context", pool_.max_context);
    d->set_meta("window_ring", pool_.window_ring);
    d->set_meta("pair_ring", pool_.pair_ring);
    d->set_meta("topk_width", topk_width_);
    const auto i32 = [&](const char* name, const std::vector<int32_t>& v, const char* meaning) {
      d->add(name, DumpDtype::kI32, tshape, v.data(), meaning);
    };
    i32("step.req", m.req, "request of each row; -1 = padded row");
    i32("step.pos", m.pos, "position of each row (0 for padded rows)");
    i32("step.out_cache_loc", m.out_cache_loc, "full-pool slot of each row; 0 = padded row (writes nothing)");
    i32("step.swa_loc", m.swa_loc, "window ring slot (req*window_ring + pos%window_ring); -1 = no write");
    i32("step.c_out_loc_r1", m.c_out_loc[1], "ratio-1 compressed slot written by the row, <= 0 = skip");
    i32("step.c_out_loc_r2", m.c_out_loc[2], "ratio-2 compressed slot written by the row (odd pos), <= 0 = skip");
    i32("step.clen_r1", m.clen[1], "visible ratio-1 compressed positions (pos+1)/1");
    i32("step.clen_r2", m.clen[2], "visible ratio-2 compressed positions (pos+1)/2");
    i32("step.pair_state_row", m.pair_state_row, "ratio-2 pair-state row req*pair_ring + pos%pair_ring; -1 padded");
    i32("step.pair_prev_row", m.pair_prev_row, "ratio-2 partner row in this batch (pos-1 of the same request), else -1");
    i32("step.pair_partner_state_row", m.pair_partner_state_row,
        "odd pos: pair-state row of the partner pos-1, else -1");
    for (int r = 1; r <= 2; ++r)
      d->add("step.comp_slot_table_r" + std::to_string(r), DumpDtype::kI32,
             {pool_.n_requests, comp_slot_stride(r)}, comp_slot_table_[r].data(),
             "compressed position j of request q -> compressed-pool slot req_to_token[q][j*r]/r");
  }

  for (int l : ids) {
    const bool dump = d != nullptr && (options.dump_layers.empty() ||
                                       std::find(options.dump_layers.begin(), options.dump_layers.end(), l) !=
                                           options.dump_layers.end());
    res.layers.push_back(run_layer(l, res.meta, res.step, options, dump));
    if (options.on_layer) options.on_layer(res.layers.back());
  }
  if (d != nullptr) d->finish();
  res.total_ms = ms_since(t0);
  return res;
}

LayerRecord RefStack::run_layer(int L, const StepMeta& meta, int64_t step, const StepOptions& options, bool dump) {
  const ModelConfig& c = config();
  const LayerPlan& lp = plan_.layers[static_cast<size_t>(L)];
  const int r = lp.ratio;
  const int64_t T = meta.rows, dim = c.dim, q_rank = c.q_lora_rank, qkv_w = q_rank + kHd;
  const int H = plan_.parallel.local_heads;
  const float eps = c.norm_eps;
  const std::vector<float>& table = rope_table(r);
  const int64_t mp = max_pos();
  Dumper* dumper = dump ? options.dumper : nullptr;
  const std::string pre = lname(L);
  const auto add = [&](const std::string& name, DumpDtype dt, const std::vector<int64_t>& shape, const void* data,
                       const std::string& meaning) {
    if (dumper != nullptr) dumper->add(pre + name, dt, shape, data, meaning);
  };
  const auto add_global = [&](const std::string& name, DumpDtype dt, const std::vector<int64_t>& shape,
                              const void* data, const std::string& meaning) {
    if (dumper != nullptr && !dumper->has(name)) dumper->add(name, dt, shape, data, meaning);
  };

  LayerRecord rec;
  rec.layer = L;
  rec.ratio = r;
  rec.mode = lp.mode;
  rec.kv_src = lp.kv_src;
  rec.idx_src = lp.idx_src;
  const auto t0 = std::chrono::steady_clock::now();

  const LayerWeights& w = weights(L);
  const std::vector<num::bf16_t> x = synthetic_x(L, meta, step);
  if (dumper != nullptr) {
    add_global(r == 0 ? "rope.table_base" : "rope.table_compressed", DumpDtype::kF32, {mp, 64}, table.data(),
               r == 0 ? "RoPE table of ratio-0 layers: rope_theta, no YaRN; [max_pos, 32 x (cos, sin)]"
                      : "RoPE table of ratio>0 layers: compress_rope_theta with YaRN; [max_pos, 32 x (cos, sin)]");
    const auto fp8 = [&](const std::string& name, const Fp8Matrix& m) {
      add(name, DumpDtype::kE4M3, {m.n, m.k}, m.w.data(), "weight codes [N, K] e4m3 (out = x @ W^T)");
      add(name + ".scale", DumpDtype::kUE8M0, {(m.n + 31) / 32, m.k / 32}, m.scale.data(),
          "ue8m0 scale per 32x32 block of " + name);
    };
    const auto bf16m = [&](const std::string& name, const Bf16Matrix& m, const std::string& meaning) {
      add(name, DumpDtype::kBF16, {m.n, m.k}, m.w.data(), meaning);
    };
    const auto f32v = [&](const std::string& name, const std::vector<float>& v, const std::string& meaning) {
      add(name, DumpDtype::kF32, {static_cast<int64_t>(v.size())}, v.data(), meaning);
    };
    add("x", DumpDtype::kBF16, {T, dim}, x.data(), "layer input x (attention-normed hidden state), synthetic");
    fp8("w.wqkv_a", w.wqkv_a);
    f32v("w.q_norm", w.q_norm, "q_norm weight [q_lora_rank]");
    fp8("w.wq_b", w.wq_b);
    f32v("w.kv_norm", w.kv_norm, "window kv_norm weight [512]");
    f32v("w.attn_sink", w.attn_sink, "attention sink logit per head");
    bf16m("w.wo_a", w.wo_a, "wo_a [groups*o_lora_rank, (heads/groups)*512] bf16");
    fp8("w.wo_b", w.wo_b);
    if (w.compressor) {
      const CompressorWeights& cw = *w.compressor;
      if (cw.ratio == 1) {
        bf16m("w.compressor.wkv_c", cw.wkv_c, "ratio-1 compressor projection [512, dim] bf16");
      } else {
        add("w.compressor.wkv", DumpDtype::kF32, {cw.wkv.n, cw.wkv.k}, cw.wkv.w.data(),
            "ratio-2 compressor kv projection [512, dim] fp32");
        add("w.compressor.wgate", DumpDtype::kF32, {cw.wgate.n, cw.wgate.k}, cw.wgate.w.data(),
            "ratio-2 compressor gate projection [512, dim] fp32");
      }
      f32v("w.compressor.c_norm", cw.c_norm, "compressor latent norm weight [512]");
      bf16m("w.compressor.wk", cw.wk, "index-key projection [128, 512] bf16");
      f32v("w.compressor.k_norm", cw.k_norm, "index-key norm weight [128]");
    }
    if (w.indexer) {
      fp8("w.indexer.wq_b", w.indexer->wq_b);
      bf16m("w.indexer.weights_proj", w.indexer->weights_proj, "indexer head weights projection [heads, dim] bf16");
    }
  }

  // --- Q chain (QA + QB) ---
  QChainOut qc = q_chain(w, x.data(), T, meta.pos.data(), table.data(), mp, H, H, eps);
  rec.work |= kWorkQA | kWorkQB;
  rec.q_checksum = fnv1a64(qc.q_pad.data(), qc.q_pad.size() * sizeof(num::bf16_t));
  add("qkv_a", DumpDtype::kBF16, {T, qkv_w}, qc.qkv_a.data(), "fused wq_a|wkv output (fp8 GEMM): [:, :q_lora_rank] q, rest window kv");
  add("qr", DumpDtype::kBF16, {T, q_rank}, qc.qr.data(), "RMSNorm(qkv_a[:, :q_lora_rank], q_norm)");
  add("q", DumpDtype::kBF16, {T, H, kHd}, qc.q.data(), "wq_b(qr), before RoPE");
  add("q_pad", DumpDtype::kBF16, {T, H, kHd}, qc.q_pad.data(), "q with RoPE at pos on dims 448..511 (H_pad = H)");

  // --- window K (KV) ---
  std::vector<uint8_t>& wc = window_cache(L);
  const CacheLayout wl = window_layout();
  std::vector<num::bf16_t> kv_out(static_cast<size_t>(T * kHd));
  rec.skipped += window_k_store(qc.qkv_a.data() + q_rank, T, qkv_w, w.kv_norm.data(), eps, meta.pos.data(), table.data(),
                                mp, meta.swa_loc.data(), CacheKind::kWindowV41, wl, wc.data(), window_slots(),
                                kv_out.data());
  rec.work |= kWorkKV;
  {
    uint64_t h = kFnvOffset;
    std::vector<uint8_t> bytes;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t loc = meta.swa_loc[static_cast<size_t>(t)];
      if (loc < 0 || loc >= window_slots()) continue;
      bytes.clear();
      append_slot_bytes(wc.data(), wl, loc, bytes);
      h = fnv1a64(bytes.data(), bytes.size(), h);
    }
    rec.window_checksum = h;
  }
  if (dumper != nullptr) {
    add("window.kv", DumpDtype::kBF16, {T, kHd}, kv_out.data(), "RMSNorm(wkv(x), kv_norm) with RoPE at pos (bf16), before fp8");
    const std::vector<uint8_t> slots = gather_slots(wc.data(), wl, window_slots(), meta.swa_loc, 0);
    add("window.slot_bytes", DumpDtype::kU8, {T, wl.data_bytes + wl.scale_bytes}, slots.data(),
        "window cache bytes at swa_loc after the store: 512 e4m3 then 16 ue8m0 (zeros: no write)");
    add("window.cache", DumpDtype::kU8, {static_cast<int64_t>(wc.size())}, wc.data(),
        "this layer's whole window pool after the store (kWindowV41 paged layout, 64-slot pages)");
  }

  // --- compressor (CMP), kv sources ---
  if (lp.is_kv_source) {
    CompressorCaches cc = compressor_caches(L);
    std::vector<float> state_before;
    if (dumper != nullptr && r == 2) state_before = source(L).pair_state;
    CompressorOut co = compressor_forward(*w.compressor, x.data(), dim, meta, rope_compressed_.data(), mp, eps, cc);
    rec.skipped += co.skipped;
    rec.work |= kWorkCMP;
    SourceCaches& sc = source(L);
    rec.comp_checksum = fnv1a64(sc.comp.data(), sc.comp.size());
    rec.index_k_checksum = fnv1a64(sc.index_k.data(), sc.index_k.size());
    if (dumper != nullptr) {
      if (r == 1)
        add("cmp.proj", DumpDtype::kBF16, {T, kHd}, co.proj.data(), "wkv_c(x) (bf16 GEMM)");
      else
        add("cmp.kvs", DumpDtype::kF32, {T, 2 * kHd}, co.kvs.data(), "[x_f32 @ wkv^T | x_f32 @ wgate^T] (fp32)");
      add("cmp.latent_pre_rope", DumpDtype::kBF16, {T, kHd}, co.latent_pre_rope.data(),
          "compressor latent RMSNorm(., c_norm) before RoPE (0 for rows completing no group)");
      add("cmp.kproj", DumpDtype::kBF16, {T, kIdxHd}, co.kproj.data(), "wk(latent_pre_rope) (0 for rows without latent)");
      add("cmp.g", DumpDtype::kI32, {T}, co.g.data(), "group position of the row's completed group, -1 none");
      const CacheLayout cl = cache_layout(CacheKind::kCompressedFp4), il = cache_layout(CacheKind::kIndexK);
      const std::vector<uint8_t> cs = gather_slots(sc.comp.data(), cl, comp_slots(L), meta.c_out_loc[r], 1);
      add("cmp.comp_slot_bytes", DumpDtype::kU8, {T, cl.data_bytes + cl.scale_bytes}, cs.data(),
          "compressed-KV bytes at c_out_loc: 256 B e2m1 pairs then 32 e4m3 scales (zeros: no write)");
      const std::vector<uint8_t> is = gather_slots(sc.index_k.data(), il, comp_slots(L), meta.c_out_loc[r], 1);
      add("cmp.index_k_slot_bytes", DumpDtype::kU8, {T, il.data_bytes + il.scale_bytes}, is.data(),
          "index-K bytes at c_out_loc: 64 B e2m1 pairs then 4 ue8m0 scales (zeros: no write)");
      if (r == 2) {
        add("cmp.pair_state_before", DumpDtype::kF32, {pair_state_rows(), 2 * kHd}, state_before.data(),
            "ratio-2 pair state [kv | score] per ring row before the step");
        add("cmp.pair_state_after", DumpDtype::kF32, {pair_state_rows(), 2 * kHd}, sc.pair_state.data(),
            "ratio-2 pair state after the step");
      }
    }
  }
  if (dumper != nullptr && r > 0) {
    const SourceCaches& sc = source(lp.kv_src);
    const std::string src = "src" + lname(lp.kv_src).substr(1);  // "srcNN."
    add_global(src + "comp_cache", DumpDtype::kU8, {static_cast<int64_t>(sc.comp.size())}, sc.comp.data(),
               "compressed-KV pool of kv source " + std::to_string(lp.kv_src) +
                   " after its compressor ran this step (kCompressedFp4 paged layout)");
    add_global(src + "index_k_cache", DumpDtype::kU8, {static_cast<int64_t>(sc.index_k.size())}, sc.index_k.data(),
               "index-K pool of kv source " + std::to_string(lp.kv_src) + " after its compressor ran this step");
  }

  // --- indexer (IDX), index sources ---
  if (lp.is_index_source) {
    const IndexerWeights& iw = *w.indexer;
    const int Hi = plan_.parallel.local_index_heads;
    std::vector<num::bf16_t> qi(static_cast<size_t>(T * Hi * kIdxHd));
    gemm_fp8(qc.qr.data(), T, q_rank, iw.wq_b, qi.data(), static_cast<int64_t>(Hi) * kIdxHd);
    const IndexerQ iq = indexer_q_pack(qi.data(), T, Hi, meta.pos.data(), table.data(), mp);
    std::vector<num::bf16_t> wproj(static_cast<size_t>(T * Hi));
    gemm_bf16(x.data(), T, dim, iw.weights_proj, wproj.data(), Hi);
    const std::vector<float> hw = indexer_weights(wproj.data(), T, Hi, c.index_n_heads);

    const std::vector<int32_t>& clen = meta.clen[r];
    int64_t S = 1;
    for (int32_t v : clen) S = std::max<int64_t>(S, v);
    std::vector<float> scores(static_cast<size_t>(T * S));
    const SourceCaches& sc = source(lp.kv_src);
    indexer_scores(iq, hw.data(), sc.index_k.data(), cache_layout(CacheKind::kIndexK), comp_slots(lp.kv_src),
                   meta.req.data(), clen.data(), comp_slot_table_[r].data(), comp_slot_stride(r), scores.data(), S);
    add("idx.qi", DumpDtype::kBF16, {T, Hi, kIdxHd}, qi.data(), "indexer wq_b(qr) (fp8 GEMM), before RoPE");
    add("idx.q_codes", DumpDtype::kE2M1x2, {T, Hi, kIdxHd / 2}, iq.codes.data(),
        "indexer q after RoPE at pos, FP4 indexer quant codes (block 32)");
    add("idx.q_scales", DumpDtype::kUE8M0, {T, Hi, kIdxHd / 32}, iq.scales.data(), "indexer q ue8m0 scales");
    add("idx.weights_proj_out", DumpDtype::kBF16, {T, Hi}, wproj.data(), "weights_proj(x) (bf16 GEMM)");
    add("idx.weights", DumpDtype::kF32, {T, Hi}, hw.data(), "weights_proj(x) * 128^-0.5 * index_n_heads^-0.5 (fp32)");
    add("idx.scores", DumpDtype::kF32, {T, S}, scores.data(),
        "indexer scores over compressed positions j < clen (before any candidate mask); -inf past clen");

    const int block = c.candidate_block_size;
    if (lp.is_candidate_source) {
      cand_mask_stride_ = std::max<int64_t>(1, (S + block - 1) / block);
      cand_mask_.assign(static_cast<size_t>(T * cand_mask_stride_), 0);
      ref::candidate_mask(scores.data(), T, S, clen.data(), block, c.candidate_topk_blocks, cand_mask_.data(),
                     cand_mask_stride_);
      add("idx.candidate_mask", DumpDtype::kU8, {T, cand_mask_stride_}, cand_mask_.data(),
          "published candidate block mask (blocks of candidate_block_size positions; 1 = kept)");
    } else if (lp.uses_candidates) {
      if (static_cast<int64_t>(cand_mask_.size()) != T * cand_mask_stride_ || cand_mask_stride_ * block < S)
        fail("layer " + std::to_string(L) + " needs the candidate mask of this step (did the candidate source run?)");
      apply_candidate_mask(scores.data(), T, S, clen.data(), block, cand_mask_.data(), cand_mask_stride_);
      add("idx.candidate_mask", DumpDtype::kU8, {T, cand_mask_stride_}, cand_mask_.data(),
          "candidate block mask applied (from the candidate source of this step)");
      add("idx.scores_masked", DumpDtype::kF32, {T, S}, scores.data(), "scores with positions outside the mask at -inf");
    }
    std::vector<int32_t>& own_topk = topk_[static_cast<size_t>(L)];
    own_topk.assign(static_cast<size_t>(T * topk_width_), -1);
    topk_to_slots(scores.data(), T, S, clen.data(), c.index_topk, meta.req.data(), comp_slot_table_[r].data(),
                  comp_slot_stride(r), own_topk.data(), topk_width_);
    rec.work |= kWorkIDX;
  }
  const std::vector<int32_t>* tk = nullptr;
  if (r > 0) {
    tk = &topk_[static_cast<size_t>(lp.idx_src)];
    if (static_cast<int64_t>(tk->size()) != T * topk_width_)
      fail("layer " + std::to_string(L) + " needs the top-k of index source " + std::to_string(lp.idx_src) +
           " from this step");
    rec.topk_checksum = fnv1a64(tk->data(), tk->size() * sizeof(int32_t));
    rec.topk_count = std::count_if(tk->begin(), tk->end(), [](int32_t s) { return s >= 0; });
    add("topk", DumpDtype::kI32, {T, topk_width_}, tk->data(),
        "compressed-pool slots this layer attends (top-k of index source " + std::to_string(lp.idx_src) +
            "), ascending by position, -1 padding");
  }
  rec.prepare_ms = ms_since(t0);
  if (options.prepare_only) return rec;

  // --- attention + output projection ---
  const auto t1 = std::chrono::steady_clock::now();
  AttentionInputs ai;
  ai.T = T;
  ai.heads = H;
  ai.q = qc.q_pad.data();
  ai.h_pad = H;
  ai.pos = meta.pos.data();
  ai.req = meta.req.data();
  ai.window = c.window_size;
  ai.window_ring = pool_.window_ring;
  ai.window_cache = wc.data();
  ai.window_layout = wl;
  ai.window_kind = CacheKind::kWindowV41;
  ai.window_slots = window_slots();
  if (tk != nullptr) {
    ai.topk = tk->data();
    ai.topk_stride = topk_width_;
    ai.comp_cache = source(lp.kv_src).comp.data();
    ai.comp_layout = cache_layout(CacheKind::kCompressedFp4);
    ai.comp_slots = comp_slots(lp.kv_src);
  }
  ai.attn_sink = w.attn_sink.data();
  std::vector<num::bf16_t> attn(static_cast<size_t>(T * H * kHd));
  sparse_attention(ai, attn.data());
  // output_projection in its two halves (inverse RoPE + wo_a, then wo_b), to dump the middle.
  const int groups = plan_.parallel.local_groups;
  std::vector<num::bf16_t> lora(static_cast<size_t>(T * w.wo_a.n));
  output_lora_a(attn.data(), T, H, groups, meta.pos.data(), table.data(), mp, w.wo_a, lora.data());
  rec.output.assign(static_cast<size_t>(T * dim), 0);
  gemm_fp8(lora.data(), T, w.wo_a.n, w.wo_b, rec.output.data(), dim);
  rec.attention = true;
  rec.out_checksum = fnv1a64(rec.output.data(), rec.output.size() * sizeof(num::bf16_t));
  add("attn_out", DumpDtype::kBF16, {T, H, kHd}, attn.data(), "sparse attention output with sink, before inverse RoPE");
  add("lora_out", DumpDtype::kBF16, {T, w.wo_a.n}, lora.data(), "inverse RoPE then per-group wo_a (bf16 GEMM)");
  add("out", DumpDtype::kBF16, {T, dim}, rec.output.data(), "layer attention output wo_b(lora_out) (fp8 GEMM)");
  rec.attention_ms = ms_since(t1);
  return rec;
}

}  // namespace v4attn::ref
