// Dumps (dump.h): the .npy v1.0 format checked by an independent parser written here, the
// manifest, and a dumped stack step whose files match the stack's own tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "v4attn/config.h"
#include "v4attn/plan.h"
#include "v4attn/reference/attention.h"
#include "v4attn/reference/dump.h"
#include "v4attn/reference/indexer.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/reference/stack.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using namespace v4attn::ref;
namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A fresh, empty directory under the build tree (unique per test).
fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::path(V4ATTN_BINARY_DIR) / "test_dumps" / name;
  fs::remove_all(d);
  return d;
}

// Independent .npy v1.0 parser: checks the fixed fields byte by byte, then pulls descr and shape
// out of the header dict with plain string searches.
struct Parsed {
  std::string descr;
  std::vector<int64_t> shape;
  std::string data;
  size_t header_total = 0;
};
Parsed parse_npy(const std::string& bytes) {
  Parsed p;
  EXPECT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 6), std::string("\x93NUMPY", 6));
  EXPECT_EQ(bytes[6], '\x01');
  EXPECT_EQ(bytes[7], '\x00');
  const size_t hlen = static_cast<uint8_t>(bytes[8]) + 256u * static_cast<uint8_t>(bytes[9]);
  p.header_total = 10 + hlen;
  EXPECT_EQ(p.header_total % 64, 0u) << "header not padded to 64 bytes";
  const std::string dict = bytes.substr(10, hlen);
  EXPECT_EQ(dict.back(), '\n');
  EXPECT_EQ(dict.front(), '{');
  EXPECT_NE(dict.find("'fortran_order': False"), std::string::npos) << dict;
  const size_t d = dict.find("'descr': '");
  EXPECT_NE(d, std::string::npos) << dict;
  p.descr = dict.substr(d + 10, dict.find('\'', d + 10) - (d + 10));
  const size_t s = dict.find("'shape': (");
  EXPECT_NE(s, std::string::npos) << dict;
  const std::string tuple = dict.substr(s + 10, dict.find(')', s) - (s + 10));
  std::string num;
  for (char ch : tuple + ",") {
    if (ch >= '0' && ch <= '9') num += ch;
    else if (ch == ',' && !num.empty()) { p.shape.push_back(std::stoll(num)); num.clear(); }
  }
  p.data = bytes.substr(p.header_total);
  return p;
}

TEST(Dump, NpyHeaderIsV1PaddedTo64) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{}, {5}, {2, 3}, {6, 4, 512}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}}) {
    const std::string h = npy_header("<f4", shape);
    const Parsed p = parse_npy(h);
    EXPECT_EQ(p.descr, "<f4");
    EXPECT_EQ(p.shape, shape);
    EXPECT_EQ(h.size(), p.header_total);
  }
  EXPECT_NE(npy_header("<u2", {5}).find("(5,)"), std::string::npos);  // a 1-tuple keeps its comma
}

TEST(Dump, WritesEachDtypeAndReadsItBack) {
  const fs::path dir = fresh_dir("dtypes");
  std::mt19937_64 rng(5);
  std::vector<float> f32(12);
  for (float& v : f32) v = static_cast<float>(rng() % 1000) / 7.0f;
  std::vector<uint16_t> bf(6);
  for (uint16_t& v : bf) v = static_cast<uint16_t>(rng());
  std::vector<uint8_t> u8(10);
  for (uint8_t& v : u8) v = static_cast<uint8_t>(rng());
  std::vector<int32_t> i32{-1, 0, 7, 123456, -99};
  {
    Dumper d(dir.string());
    d.add("a.f32", DumpDtype::kF32, {3, 4}, f32.data(), "floats");
    d.add("a.bf16", DumpDtype::kBF16, {2, 3}, bf.data(), "raw bf16 bits");
    d.add("a.e4m3", DumpDtype::kE4M3, {10}, u8.data(), "fp8 codes");
    d.add("a.i32", DumpDtype::kI32, {5}, i32.data(), "ints");
    d.add("a.empty", DumpDtype::kU8, {0, 4}, nullptr, "nothing");
    EXPECT_THROW(d.add("a.f32", DumpDtype::kF32, {1}, f32.data(), "again"), std::runtime_error);
    EXPECT_THROW(d.add("bad/name", DumpDtype::kF32, {1}, f32.data(), "slash"), std::runtime_error);
    d.set_meta("step", int64_t{3});
    d.finish();
  }
  const Parsed pf = parse_npy(read_file(dir / "a.f32.npy"));
  EXPECT_EQ(pf.descr, "<f4");
  EXPECT_EQ(pf.shape, (std::vector<int64_t>{3, 4}));
  ASSERT_EQ(pf.data.size(), f32.size() * 4);
  EXPECT_EQ(0, std::memcmp(pf.data.data(), f32.data(), pf.data.size()));
  const Parsed pb = parse_npy(read_file(dir / "a.bf16.npy"));
  EXPECT_EQ(pb.descr, "<u2");
  EXPECT_EQ(0, std::memcmp(pb.data.data(), bf.data(), bf.size() * 2));
  const Parsed pe = parse_npy(read_file(dir / "a.e4m3.npy"));
  EXPECT_EQ(pe.descr, "|u1");
  EXPECT_EQ(pe.data, std::string(u8.begin(), u8.end()));
  const Parsed pi = parse_npy(read_file(dir / "a.i32.npy"));
  EXPECT_EQ(pi.descr, "<i4");
  EXPECT_EQ(0, std::memcmp(pi.data.data(), i32.data(), i32.size() * 4));
  EXPECT_EQ(parse_npy(read_file(dir / "a.empty.npy")).shape, (std::vector<int64_t>{0, 4}));

  // read_npy (the library's reader) agrees.
  const NpyArray a = read_npy((dir / "a.i32.npy").string());
  EXPECT_EQ(a.descr, "<i4");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{5}));
  EXPECT_EQ(0, std::memcmp(a.data.data(), i32.data(), 20));

  const nlohmann::json m = nlohmann::json::parse(read_file(dir / "manifest.json"));
  EXPECT_EQ(m["format"], "v4attn-dump-1");
  EXPECT_EQ(m["meta"]["step"], 3);
  ASSERT_EQ(m["entries"].size(), 5u);
  EXPECT_EQ(m["entries"][1]["name"], "a.bf16");
  EXPECT_EQ(m["entries"][1]["dtype"], "bfloat16");
  EXPECT_EQ(m["entries"][1]["npy"], "<u2");
  EXPECT_EQ(m["entries"][1]["shape"], (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m["entries"][2]["dtype"], "float8_e4m3fn");

  // A truncated file is refused by read_npy.
  const std::string whole = read_file(dir / "a.f32.npy");
  { std::ofstream(dir / "trunc.npy", std::ios::binary) << whole.substr(0, whole.size() - 3); }
  EXPECT_THROW(read_npy((dir / "trunc.npy").string()), std::runtime_error);
}

TEST(Dump, StackStepDumpsTheChosenLayers) {
  const fs::path dir = fresh_dir("stack");
  const ModelPlan plan = build_plan(reduced_config(), 1);
  StackOptions so;
  so.max_context = 320;
  so.seed = 9;
  RefStack st(plan, so);
  synthetic_prefill(st, {301});
  Dumper d(dir.string());
  StepOptions o;
  o.dumper = &d;
  o.dump_layers = {2, 6, 8};
  const StepResult res = st.run_step(make_verify_batch({301}, 6), o);

  const nlohmann::json m = nlohmann::json::parse(read_file(dir / "manifest.json"));
  std::set<std::string> names;
  for (const auto& e : m["entries"]) {
    const std::string name = e["name"];
    names.insert(name);
    // Every listed file exists, parses, and has the manifest's shape and the right data size.
    const Parsed p = parse_npy(read_file(dir / std::string(e["file"])));
    EXPECT_EQ(p.shape, e["shape"].get<std::vector<int64_t>>()) << name;
    EXPECT_EQ(p.descr, e["npy"].get<std::string>()) << name;
    int64_t n = 1;
    for (int64_t s : p.shape) n *= s;
    const int64_t elem = p.descr == "|u1" ? 1 : p.descr == "<u2" ? 2 : 4;
    EXPECT_EQ(static_cast<int64_t>(p.data.size()), n * elem) << name;
    EXPECT_FALSE(std::string(e["meaning"]).empty()) << name;
  }
  for (const char* want :
       {"step.req", "step.pos", "step.swa_loc", "step.c_out_loc_r2", "step.clen_r1", "step.pair_prev_row",
        "step.comp_slot_table_r1", "rope.table_compressed", "L02.x", "L02.w.wqkv_a", "L02.w.wqkv_a.scale",
        "L02.w.compressor.wkv", "L02.w.indexer.wq_b", "L02.qkv_a", "L02.qr", "L02.q", "L02.q_pad", "L02.window.kv",
        "L02.window.slot_bytes", "L02.cmp.kvs", "L02.cmp.latent_pre_rope", "L02.cmp.index_k_slot_bytes",
        "L02.cmp.pair_state_before", "L02.idx.q_codes", "L02.idx.q_scales", "L02.idx.weights", "L02.idx.scores",
        "L02.topk", "L02.attn_out", "L02.lora_out", "L02.out", "L06.cmp.proj", "L06.w.compressor.wkv_c",
        "L06.idx.candidate_mask", "L08.idx.candidate_mask", "L08.idx.scores_masked", "L08.topk", "src02.comp_cache",
        "src06.index_k_cache"})
    EXPECT_TRUE(names.count(want)) << "missing " << want;
  for (const std::string& n : names) {
    EXPECT_NE(n.rfind("L03.", 0), 0u) << n << " (layer 3 was not asked for)";
    EXPECT_NE(n.rfind("L00.", 0), 0u) << n;
  }
  EXPECT_FALSE(names.count("rope.table_base"));  // no ratio-0 layer dumped
  for (const auto& e : m["entries"])
    if (e["name"] == "L02.x") {
      EXPECT_EQ(e["dtype"], "bfloat16");
    }

  // Contents: the dumped tensors are the stack's.
  const Parsed topk = parse_npy(read_file(dir / "L08.topk.npy"));
  ASSERT_EQ(topk.data.size(), st.topk(8).size() * 4);
  EXPECT_EQ(0, std::memcmp(topk.data.data(), st.topk(8).data(), topk.data.size()));
  const Parsed out = parse_npy(read_file(dir / "L06.out.npy"));
  ASSERT_EQ(out.data.size(), res.layers[6].output.size() * 2);
  EXPECT_EQ(0, std::memcmp(out.data.data(), res.layers[6].output.data(), out.data.size()));
  const std::vector<num::bf16_t> x = st.synthetic_x(2, res.meta, res.step);
  const Parsed px = parse_npy(read_file(dir / "L02.x.npy"));
  ASSERT_EQ(px.data.size(), x.size() * 2);
  EXPECT_EQ(0, std::memcmp(px.data.data(), x.data(), px.data.size()));
  const Parsed comp = parse_npy(read_file(dir / "src02.comp_cache.npy"));
  EXPECT_EQ(comp.data, std::string(st.comp_cache(2).begin(), st.comp_cache(2).end()));
  // The written window slot bytes are the cache's bytes at swa_loc.
  const Parsed ws = parse_npy(read_file(dir / "L06.window.slot_bytes.npy"));
  const CacheLayout wl = st.window_layout();
  const int64_t loc = res.meta.swa_loc[3];
  EXPECT_EQ(0, std::memcmp(ws.data.data() + 3 * 528, st.window_cache(6).data() + wl.data_offset(loc), 512));
  EXPECT_EQ(0, std::memcmp(ws.data.data() + 3 * 528 + 512, st.window_cache(6).data() + wl.scale_offset(loc), 16));
}

// A reduced-config stack after a prefill of 301 positions and one verify step of 6 rows whose chosen
// layers were dumped into a fresh directory `name`; load(n) reads back the data bytes of n.npy.
struct DumpedStep {
  fs::path dir;
  ModelPlan plan;
  std::unique_ptr<RefStack> st;
  StepResult res;
  DumpedStep(const std::string& name, uint64_t seed, const std::vector<int>& layers)
      : dir(fresh_dir(name)), plan(build_plan(reduced_config(), 1)) {
    StackOptions so;
    so.max_context = 320;
    so.seed = seed;
    st = std::make_unique<RefStack>(plan, so);
    synthetic_prefill(*st, {301});
    Dumper d(dir.string());
    StepOptions o;
    o.dumper = &d;
    o.dump_layers = layers;
    res = st->run_step(make_verify_batch({301}, 6), o);
  }
  std::string load(const std::string& name) const { return parse_npy(read_file(dir / (name + ".npy"))).data; }
};

// Which RoPE table each layer rotates with (spec section 2: ratio 0 layers rope_theta without YaRN,
// ratio > 0 layers compress_rope_theta with YaRN), for Q, the window K and the indexer's q: the dumped
// tensors before RoPE, rotated here with a table built from the config's keys by hand, must give the
// dumped tensors after it. (The tables' own arithmetic is tested in test_rope_table.cpp; this is the
// wiring: a layer handed the other table fails.)
TEST(Dump, EachLayerRotatesWithItsRatiosTable) {
  const DumpedStep ds("rope_tables", 11, {0, 2, 6});  // ratio 0; ratio 2 (an index source); ratio 1 (an index source)
  const ModelPlan& plan = ds.plan;
  const ModelConfig& c = plan.config;
  const StepResult& res = ds.res;
  const int64_t T = res.meta.rows;
  const int64_t max_pos = ds.st->max_pos();
  const auto table_for = [&](int ratio) {
    RopeParams p;
    p.base = ratio == 0 ? c.rope_theta : c.compress_rope_theta;
    p.yarn = ratio != 0;
    p.factor = c.rope_factor;
    p.original_seq_len = c.original_seq_len;
    p.beta_fast = c.beta_fast;
    p.beta_slow = c.beta_slow;
    return build_rope_table(p, max_pos);
  };
  const auto bf16s = [](const std::string& bytes) {
    std::vector<num::bf16_t> v(bytes.size() / 2);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  };
  const auto f32s = [](const std::string& bytes) {
    std::vector<float> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  };
  ASSERT_NE(table_for(0), table_for(1)) << "the two tables must differ for the test to mean anything";
  for (int layer : {0, 2, 6}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const int ratio = plan.layers[static_cast<size_t>(layer)].ratio;
    ASSERT_EQ(ratio, layer == 0 ? 0 : layer == 2 ? 2 : 1);
    const std::vector<float> table = table_for(ratio);
    char prefix[8];
    std::snprintf(prefix, sizeof prefix, "L%02d.", layer);
    const std::string L = prefix;
    // Q: q (before RoPE) -> q_pad.
    std::vector<num::bf16_t> q = bf16s(ds.load(L + "q"));
    ASSERT_EQ(q.size(), static_cast<size_t>(T * c.n_heads * c.head_dim));
    rope_rows(q.data(), T, c.n_heads, c.head_dim, static_cast<int64_t>(c.n_heads) * c.head_dim, res.meta.pos.data(),
              table.data(), max_pos);
    EXPECT_TRUE(q == bf16s(ds.load(L + "q_pad"))) << "Q rotated with another table";
    // Window K: RMSNorm(qkv_a's kv part, kv_norm) -> RoPE -> window.kv.
    const std::vector<num::bf16_t> qkv_a = bf16s(ds.load(L + "qkv_a"));
    const int64_t qkv_w = c.q_lora_rank + 512;
    const std::vector<float> kv_norm = f32s(ds.load(L + "w.kv_norm"));
    std::vector<num::bf16_t> kv(static_cast<size_t>(T * 512));
    rmsnorm_rows(qkv_a.data() + c.q_lora_rank, T, 512, qkv_w, kv_norm.data(), c.norm_eps, kv.data(), 512);
    rope_rows(kv.data(), T, 1, 512, 512, res.meta.pos.data(), table.data(), max_pos);
    EXPECT_TRUE(kv == bf16s(ds.load(L + "window.kv"))) << "window K rotated with another table";
    // The indexer's q (index sources): idx.qi -> RoPE + FP4 indexer quant -> idx.q_codes / q_scales.
    if (plan.layers[static_cast<size_t>(layer)].is_index_source) {
      const std::vector<num::bf16_t> qi = bf16s(ds.load(L + "idx.qi"));
      const int Hi = plan.parallel.local_index_heads;
      const IndexerQ iq = indexer_q_pack(qi.data(), T, Hi, res.meta.pos.data(), table.data(), max_pos);
      const std::string codes = ds.load(L + "idx.q_codes"), scales = ds.load(L + "idx.q_scales");
      EXPECT_EQ(std::string(iq.codes.begin(), iq.codes.end()), codes) << "indexer q rotated with another table";
      EXPECT_EQ(std::string(iq.scales.begin(), iq.scales.end()), scales);
    }
  }
}

// The stack's attention is the spec's over what the layer's prepare left (section 4: the window of
// window_size positions max(0, pos - 127)..pos of the layer's window cache, the top-k entries of the
// kv source's compressed cache -- the top-k of the layer's index source, its own or borrowed -- and
// the sink): attn_out recomputed here from the dumped inputs, with the inputs set from the spec and
// the pool rather than from the stack's own wiring, must match bytes. Layers 3 and 7 reuse the top-k
// of 2 and 6, read here from those layers' dumps.
TEST(Dump, AttentionReadsTheSpecsKeys) {
  const DumpedStep ds("attention_keys", 13, {0, 2, 3, 6, 7, 8});
  const ModelPlan& plan = ds.plan;
  const ModelConfig& c = plan.config;
  ASSERT_EQ(c.window_size, 128);
  const RefStack& st = *ds.st;
  const StepResult& res = ds.res;
  for (int layer : {0, 2, 3, 6, 7, 8}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const LayerPlan& lp = plan.layers[static_cast<size_t>(layer)];
    if (layer == 3 || layer == 7) {
      ASSERT_EQ(lp.mode, LayerMode::kReuse);
    }
    char prefix[8];
    std::snprintf(prefix, sizeof prefix, "L%02d.", layer);
    const std::string L = prefix;
    const std::string q = ds.load(L + "q_pad"), wc = ds.load(L + "window.cache"), sink = ds.load(L + "w.attn_sink");
    AttentionInputs ai;
    ai.T = res.meta.rows;
    ai.heads = c.n_heads;
    ai.q = reinterpret_cast<const num::bf16_t*>(q.data());
    ai.h_pad = c.n_heads;
    ai.pos = res.meta.pos.data();
    ai.req = res.meta.req.data();
    ai.window = 128;  // spec section 1: window_size
    ai.window_ring = st.pool().window_ring;
    ai.window_cache = reinterpret_cast<const uint8_t*>(wc.data());
    ai.window_layout = cache_layout(CacheKind::kWindowV41);
    ai.window_kind = CacheKind::kWindowV41;
    ai.attn_sink = reinterpret_cast<const float*>(sink.data());
    std::string topk, comp;
    if (lp.ratio > 0) {
      char src[8], idx[8];
      std::snprintf(src, sizeof src, "src%02d.", lp.kv_src);
      std::snprintf(idx, sizeof idx, "L%02d.", lp.idx_src);
      topk = ds.load(std::string(idx) + "topk");  // the index source's own top-k
      comp = ds.load(std::string(src) + "comp_cache");
      ai.topk = reinterpret_cast<const int32_t*>(topk.data());
      ai.topk_stride = st.topk_width();
      ai.comp_cache = reinterpret_cast<const uint8_t*>(comp.data());
      ai.comp_layout = cache_layout(CacheKind::kCompressedFp4);
    }
    std::vector<num::bf16_t> attn(static_cast<size_t>(ai.T * ai.heads * 512));
    sparse_attention(ai, attn.data());
    const std::string want = ds.load(L + "attn_out");
    ASSERT_EQ(want.size(), attn.size() * 2);
    EXPECT_EQ(0, std::memcmp(want.data(), attn.data(), want.size())) << "the stack's attention read other keys";
  }
}

// The index sources' scores are the spec's over what the prepare left (section 3.4): the head weights
// are weights_proj(x) times 128^-0.5 * index_n_heads^-0.5 (index_n_heads of the config, whatever the
// local heads), and the scores over the kv source's index-K cache at the step's clen and slot table,
// recomputed here from the dumped tensors (a rescaled weight leaves the top-k as it is: only the
// scores show it).
TEST(Dump, IndexerScoresAreTheSpecsOverTheDumpedInputs) {
  const DumpedStep ds("indexer_scores", 17, {2, 6, 8});
  const ModelPlan& plan = ds.plan;
  const ModelConfig& c = plan.config;
  const RefStack& st = *ds.st;
  const StepResult& res = ds.res;
  const int64_t T = res.meta.rows;
  const int Hi = plan.parallel.local_index_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(128.0 * c.index_n_heads));
  for (int layer : {2, 6, 8}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const LayerPlan& lp = plan.layers[static_cast<size_t>(layer)];
    ASSERT_TRUE(lp.is_index_source);
    char prefix[8], src[8];
    std::snprintf(prefix, sizeof prefix, "L%02d.", layer);
    std::snprintf(src, sizeof src, "src%02d.", lp.kv_src);
    const std::string L = prefix;
    const std::string wproj = ds.load(L + "idx.weights_proj_out"), wdump = ds.load(L + "idx.weights");
    ASSERT_EQ(wproj.size(), static_cast<size_t>(T * Hi * 2));
    ASSERT_EQ(wdump.size(), static_cast<size_t>(T * Hi * 4));
    std::vector<float> w(static_cast<size_t>(T * Hi));
    for (size_t i = 0; i < w.size(); ++i) {
      num::bf16_t b;
      std::memcpy(&b, wproj.data() + 2 * i, 2);
      w[i] = num::mul_rn(num::f32_from_bf16(b), scale);
    }
    EXPECT_EQ(0, std::memcmp(w.data(), wdump.data(), wdump.size())) << "head weights with another scale";
    IndexerQ iq;
    iq.T = T;
    iq.heads = Hi;
    const std::string codes = ds.load(L + "idx.q_codes"), scales = ds.load(L + "idx.q_scales");
    iq.codes.assign(codes.begin(), codes.end());
    iq.scales.assign(scales.begin(), scales.end());
    const std::string ik = ds.load(std::string(src) + "index_k_cache");
    const std::string clen_b = ds.load("step.clen_r" + std::to_string(lp.ratio));
    const std::string table_b = ds.load("step.comp_slot_table_r" + std::to_string(lp.ratio));
    std::vector<int32_t> clen(static_cast<size_t>(T));
    std::memcpy(clen.data(), clen_b.data(), clen_b.size());
    const std::string want = ds.load(L + "idx.scores");
    const int64_t S = static_cast<int64_t>(want.size() / 4) / T;
    ASSERT_EQ(S, *std::max_element(clen.begin(), clen.end()));
    std::vector<float> scores(static_cast<size_t>(T * S));
    const CacheLayout il = cache_layout(CacheKind::kIndexK);
    indexer_scores(iq, w.data(), reinterpret_cast<const uint8_t*>(ik.data()), il,
                   static_cast<int64_t>(ik.size()) / il.page_bytes() * il.page_size, res.meta.req.data(), clen.data(),
                   reinterpret_cast<const int32_t*>(table_b.data()), st.comp_slot_stride(lp.ratio), scores.data(), S);
    EXPECT_EQ(0, std::memcmp(scores.data(), want.data(), want.size())) << "scores over other inputs";
  }
}

}  // namespace
