// Config loading and validation (include/v4attn/config.h documents the rules and messages).
#include "v4attn/config.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <system_error>

#include "config/default_config_data.h"

namespace v4attn {

namespace {

using nlohmann::json;

constexpr const char* kEmbeddedSource = "<embedded default>";

// Messages must stay on one line (the CLI promises exactly one line on stderr).
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw ConfigError(one_line("config error in " + source + ": " + what));
}

std::string key_prefix(const char* key) { return std::string("key \"") + key + "\": "; }

// "string \"5120\"", "float (5120.0)", "array": what a wrongly typed value is, with the value
// itself where it is short enough to help.
std::string describe(const json& v) {
  auto with_value = [&](const char* type) {
    std::string text = v.dump();
    if (text.size() > 40) text = text.substr(0, 37) + "...";
    return std::string(type) + " " + (v.is_string() ? text : "(" + text + ")");
  };
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "object";
    case json::value_t::array: return "array";
    case json::value_t::string: return with_value("string");
    case json::value_t::boolean: return with_value("boolean");
    case json::value_t::number_float: return with_value("float");
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return with_value("integer");
    default: return "unsupported value";
  }
}

// Reads typed values out of the root object, naming the key and the source on every failure.
class Reader {
 public:
  Reader(const json& root, const std::string& source) : root_(root), source_(source) {}

  const json* find(const char* key) const {
    auto it = root_.find(key);
    return it == root_.end() ? nullptr : &*it;
  }
  const json& require(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) fail(source_, std::string("missing required key \"") + key + "\"");
    return *v;
  }

  int64_t integer_value(const char* key, const json& v, const std::string& where, int64_t lo,
                        int64_t hi) const {
    if (!v.is_number_integer())
      fail(source_, key_prefix(key) + where + "expected an integer, got " + describe(v));
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))
      fail(source_, key_prefix(key) + where + v.dump() + " is out of range");
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) fail(source_, key_prefix(key) + where + v.dump() + " is out of range");
    return x;
  }
  int get_int(const char* key) const {
    return static_cast<int>(integer_value(key, require(key), "", INT_MIN, INT_MAX));
  }
  int64_t get_int64(const char* key) const {
    return integer_value(key, require(key), "", INT64_MIN, INT64_MAX);
  }
  double get_double(const char* key) const {
    const json& v = require(key);
    if (!v.is_number()) fail(source_, key_prefix(key) + "expected a number, got " + describe(v));
    return v.get<double>();
  }
  std::vector<int> get_int_list(const char* key) const {
    const json& v = require(key);
    if (!v.is_array())
      fail(source_, key_prefix(key) + "expected an array of integers, got " + describe(v));
    std::vector<int> out;
    out.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      out.push_back(static_cast<int>(
          integer_value(key, v[i], "entry " + std::to_string(i) + ": ", INT_MIN, INT_MAX)));
    return out;
  }

 private:
  const json& root_;
  const std::string& source_;
};

// nlohmann's message is "[json.exception.parse_error.101] parse error at line 3, column 1:
// syntax error ..."; keep the part after the location (we give the byte offset ourselves).
std::string parse_error_reason(const json::parse_error& e) {
  std::string what = e.what();
  const size_t column = what.find("column ");
  if (column != std::string::npos) {
    const size_t colon = what.find(": ", column);
    if (colon != std::string::npos) return what.substr(colon + 2);
  }
  return what;
}

// ---- validation -------------------------------------------------------------------------------

class Validator {
 public:
  explicit Validator(const ModelConfig& cfg) : c_(cfg) {}

  [[noreturn]] void bad(const char* key, const std::string& what) const {
    fail(c_.source, key_prefix(key) + what);
  }
  void positive(const char* key, int64_t v) const {
    if (v <= 0) bad(key, "must be > 0, got " + std::to_string(v));
  }
  void positive_real(const char* key, double v) const {
    if (!(v > 0.0) || !std::isfinite(v)) bad(key, "must be > 0, got " + shortest(v));
  }
  void multiple_of_32(const char* key, int v) const {
    if (v % 32 != 0)
      bad(key, "must be a multiple of 32 (FP8 GEMM K blocks are 32 wide), got " +
                   std::to_string(v));
  }
  static std::string shortest(double v) {
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, r.ptr);
  }

  // Strictly increasing backbone layers with ratio > 0.
  void source_list(const char* key, const std::vector<int>& layers) const {
    for (size_t i = 0; i < layers.size(); ++i) {
      const int L = layers[i];
      if (L < 0 || L >= c_.n_layers)
        bad(key, "layer " + std::to_string(L) + " is out of range (sources are backbone layers 0.." +
                     std::to_string(c_.n_layers - 1) + ")");
      if (c_.compress_ratios[L] == 0)
        bad(key, "layer " + std::to_string(L) +
                     " has compress ratio 0 (a source layer must compress)");
      if (i > 0 && L == layers[i - 1]) bad(key, "layer " + std::to_string(L) + " is listed twice");
      if (i > 0 && L < layers[i - 1])
        bad(key, "not sorted: " + std::to_string(L) + " after " + std::to_string(layers[i - 1]));
    }
  }

  void run() const {
    positive("dim", c_.dim);
    positive("n_layers", c_.n_layers);
    if (c_.n_mtp_layers < 0) bad("n_mtp_layers", "must be >= 0, got " + std::to_string(c_.n_mtp_layers));
    positive("n_heads", c_.n_heads);
    if (c_.rope_head_dim != 64)
      bad("rope_head_dim", "must be 64 (V4.1 rotates the last 64 dims of a head), got " +
                               std::to_string(c_.rope_head_dim));
    if (c_.head_dim != 512)
      bad("head_dim", "must be 512 (448 nope + 64 rope): this engine's kernels and cache "
                      "layouts are written for 512-dim heads, got " + std::to_string(c_.head_dim));
    positive("q_lora_rank", c_.q_lora_rank);
    positive("o_groups", c_.o_groups);
    positive("o_lora_rank", c_.o_lora_rank);
    multiple_of_32("dim", c_.dim);
    multiple_of_32("q_lora_rank", c_.q_lora_rank);
    multiple_of_32("o_lora_rank", c_.o_lora_rank);
    if (c_.n_heads % c_.o_groups != 0)
      bad("o_groups", "n_heads " + std::to_string(c_.n_heads) + " is not divisible by o_groups " +
                          std::to_string(c_.o_groups));
    positive("window_size", c_.window_size);
    if (!(c_.norm_eps > 0.0f) || !std::isfinite(c_.norm_eps))
      bad("norm_eps", "must be > 0 as an fp32 value, got " + shortest(c_.norm_eps));
    positive("index_n_heads", c_.index_n_heads);
    if (c_.index_head_dim != 128)
      bad("index_head_dim", "must be 128 (the indexer kernels and the 68-byte index-K layout are "
                            "written for it), got " + std::to_string(c_.index_head_dim));
    if (c_.index_topk <= 0 || c_.index_topk % 64 != 0)
      bad("index_topk", "must be a positive multiple of 64 (attention reads the top-k in blocks "
                        "of 64), got " + std::to_string(c_.index_topk));
    if (!(c_.rope_theta > 1.0) || !std::isfinite(c_.rope_theta))
      bad("rope_theta", "must be > 1 (a RoPE base), got " + shortest(c_.rope_theta));
    if (!(c_.compress_rope_theta > 1.0) || !std::isfinite(c_.compress_rope_theta))
      bad("compress_rope_theta", "must be > 1 (a RoPE base), got " + shortest(c_.compress_rope_theta));
    positive("original_seq_len", c_.original_seq_len);
    positive_real("rope_factor", c_.rope_factor);
    positive_real("beta_fast", c_.beta_fast);
    positive_real("beta_slow", c_.beta_slow);
    if (c_.dspark_block_size < 1)
      bad("dspark_block_size", "must be >= 1, got " + std::to_string(c_.dspark_block_size));

    // Layer roles.
    const int64_t total = int64_t{c_.n_layers} + c_.n_mtp_layers;
    if (static_cast<int64_t>(c_.compress_ratios.size()) != total)
      bad("compress_ratios", "has " + std::to_string(c_.compress_ratios.size()) +
                                 " entries, expected n_layers + n_mtp_layers = " +
                                 std::to_string(total));
    for (size_t L = 0; L < c_.compress_ratios.size(); ++L) {
      const int r = c_.compress_ratios[L];
      if (r < 0 || r > 2)
        bad("compress_ratios", "entry " + std::to_string(L) + " is " + std::to_string(r) +
                                   ", expected 0, 1 or 2");
      if (static_cast<int>(L) >= c_.n_layers && r != 0)
        bad("compress_ratios", "entry " + std::to_string(L) + " is " + std::to_string(r) +
                                   " but it is a draft stage (ids >= n_layers), which is "
                                   "window-only (ratio 0)");
    }
    source_list("kv_source_layers", c_.kv_source_layers);
    source_list("index_source_layers", c_.index_source_layers);
    for (int L = 0; L < c_.n_layers; ++L) {
      const int r = c_.compress_ratios[L];
      if (r == 0) continue;
      const int kv = max_at_or_before(c_.kv_source_layers, L);
      if (kv < 0)
        bad("kv_source_layers", "layer " + std::to_string(L) + " has compress ratio " +
                                    std::to_string(r) + " but no kv source at or before it "
                                    "(it would have no compressed cache to read)");
      if (max_at_or_before(c_.index_source_layers, L) < 0)
        bad("index_source_layers", "layer " + std::to_string(L) + " has compress ratio " +
                                       std::to_string(r) + " but no index source at or before "
                                       "it (it would have no top-k to read)");
      if (c_.compress_ratios[kv] != r)
        bad("compress_ratios", "layer " + std::to_string(L) + " has ratio " + std::to_string(r) +
                                   " but its kv source " + std::to_string(kv) + " has ratio " +
                                   std::to_string(c_.compress_ratios[kv]) +
                                   " (it would read that cache with the wrong compressed length)");
    }
    // After the coverage checks, so that a layer left without an index source is reported as
    // such rather than as its kv source missing from the index list.
    for (int s : c_.kv_source_layers)
      if (!std::binary_search(c_.index_source_layers.begin(), c_.index_source_layers.end(), s))
        bad("kv_source_layers", "layer " + std::to_string(s) +
                                    " is not in index_source_layers (every kv source is also an "
                                    "index source)");
    const int cand = c_.candidate_source_layer;
    if (cand != -1) {
      if (cand < 0 || cand >= c_.n_layers)
        bad("candidate_source_layer", std::to_string(cand) +
                                          " is out of range (-1 = none, else a backbone layer)");
      if (!std::binary_search(c_.index_source_layers.begin(), c_.index_source_layers.end(), cand))
        bad("candidate_source_layer", "layer " + std::to_string(cand) +
                                          " is not an index source (only an indexer can "
                                          "publish candidate blocks)");
      const int cand_kv = max_at_or_before(c_.kv_source_layers, cand);
      for (int s : c_.index_source_layers) {
        if (s <= cand) continue;
        const int kv = max_at_or_before(c_.kv_source_layers, s);
        if (kv != cand_kv)
          bad("candidate_source_layer",
              "index source " + std::to_string(s) + " would mask its scores with the candidate "
              "blocks of layer " + std::to_string(cand) + ", which index kv source " +
              std::to_string(cand_kv) + ", but it reads kv source " + std::to_string(kv));
      }
      positive("candidate_topk_blocks", c_.candidate_topk_blocks);
      positive("candidate_block_size", c_.candidate_block_size);
    } else {
      if (c_.candidate_topk_blocks < 0)
        bad("candidate_topk_blocks", "must be >= 0, got " + std::to_string(c_.candidate_topk_blocks));
      if (c_.candidate_block_size < 0)
        bad("candidate_block_size", "must be >= 0, got " + std::to_string(c_.candidate_block_size));
    }
  }

  static int max_at_or_before(const std::vector<int>& sorted_layers, int L) {
    int best = -1;
    for (int s : sorted_layers)
      if (s <= L) best = s;
    return best;
  }

 private:
  const ModelConfig& c_;
};

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail(path, "cannot read: it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(path, std::string("cannot read: ") + std::strerror(errno));
  return text.str();
}

}  // namespace

ModelConfig parse_config(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    // nlohmann counts bytes read (1-based); report the 0-based offset of the offending byte,
    // which for a truncated file is its size.
    const size_t offset = e.byte > 0 ? e.byte - 1 : 0;
    fail(source, "invalid JSON at byte " + std::to_string(offset) + ": " + parse_error_reason(e));
  }
  if (!root.is_object()) fail(source, "expected a JSON object at the top level, got " + describe(root));

  const Reader r(root, source);
  ModelConfig c;
  c.source = source;
  c.dim = r.get_int("dim");
  c.n_layers = r.get_int("n_layers");
  c.n_mtp_layers = r.get_int("n_mtp_layers");
  c.n_heads = r.get_int("n_heads");
  c.head_dim = r.get_int("head_dim");
  c.rope_head_dim = r.get_int("rope_head_dim");
  c.q_lora_rank = r.get_int("q_lora_rank");
  c.o_groups = r.get_int("o_groups");
  c.o_lora_rank = r.get_int("o_lora_rank");
  c.window_size = r.get_int("window_size");
  c.norm_eps = static_cast<float>(r.get_double("norm_eps"));
  c.compress_ratios = r.get_int_list("compress_ratios");
  c.kv_source_layers = r.get_int_list("kv_source_layers");
  c.index_source_layers = r.get_int_list("index_source_layers");
  // Optional: absent, null or -1 all mean "no candidate source".
  const json* cand = r.find("candidate_source_layer");
  c.candidate_source_layer = (cand == nullptr || cand->is_null())
                                 ? -1
                                 : static_cast<int>(r.integer_value("candidate_source_layer",
                                                                    *cand, "", INT_MIN, INT_MAX));
  if (c.candidate_source_layer != -1) {
    c.candidate_topk_blocks = r.get_int("candidate_topk_blocks");
    c.candidate_block_size = r.get_int("candidate_block_size");
  } else {
    if (r.find("candidate_topk_blocks")) c.candidate_topk_blocks = r.get_int("candidate_topk_blocks");
    if (r.find("candidate_block_size")) c.candidate_block_size = r.get_int("candidate_block_size");
  }
  c.index_n_heads = r.get_int("index_n_heads");
  c.index_head_dim = r.get_int("index_head_dim");
  c.index_topk = r.get_int("index_topk");
  c.rope_theta = r.get_double("rope_theta");
  c.compress_rope_theta = r.get_double("compress_rope_theta");
  c.original_seq_len = r.get_int64("original_seq_len");
  c.rope_factor = r.get_double("rope_factor");
  c.beta_fast = r.get_double("beta_fast");
  c.beta_slow = r.get_double("beta_slow");
  c.dspark_block_size = r.get_int("dspark_block_size");
  validate_config(c);
  return c;
}

void validate_config(const ModelConfig& cfg) { Validator(cfg).run(); }

const std::string& default_config_json() {
  static const std::string text(reinterpret_cast<const char*>(detail::kDefaultConfigJson),
                                detail::kDefaultConfigJsonSize);
  return text;
}

ModelConfig load_config(const std::string& path) {
  if (path.empty()) return parse_config(default_config_json(), kEmbeddedSource);
  return parse_config(read_file(path), path);
}

std::string config_to_json(const ModelConfig& c) {
  // Floats go out as their shortest decimal form ("1e-20", not the double widening of it), so
  // that the text reads like the original and parses back to the same fp32 value.
  auto float_value = [](float f) {
    char buf[32];
    auto res = std::to_chars(buf, buf + sizeof buf, f);
    return std::stod(std::string(buf, res.ptr));
  };
  nlohmann::ordered_json j;
  j["dim"] = c.dim;
  j["n_layers"] = c.n_layers;
  j["n_mtp_layers"] = c.n_mtp_layers;
  j["n_heads"] = c.n_heads;
  j["head_dim"] = c.head_dim;
  j["rope_head_dim"] = c.rope_head_dim;
  j["q_lora_rank"] = c.q_lora_rank;
  j["o_groups"] = c.o_groups;
  j["o_lora_rank"] = c.o_lora_rank;
  j["window_size"] = c.window_size;
  j["norm_eps"] = float_value(c.norm_eps);
  j["compress_ratios"] = c.compress_ratios;
  j["kv_source_layers"] = c.kv_source_layers;
  j["index_source_layers"] = c.index_source_layers;
  j["candidate_source_layer"] = c.candidate_source_layer;
  j["candidate_topk_blocks"] = c.candidate_topk_blocks;
  j["candidate_block_size"] = c.candidate_block_size;
  j["index_n_heads"] = c.index_n_heads;
  j["index_head_dim"] = c.index_head_dim;
  j["index_topk"] = c.index_topk;
  j["rope_theta"] = c.rope_theta;
  j["compress_rope_theta"] = c.compress_rope_theta;
  j["original_seq_len"] = c.original_seq_len;
  j["rope_factor"] = c.rope_factor;
  j["beta_fast"] = c.beta_fast;
  j["beta_slow"] = c.beta_slow;
  j["dspark_block_size"] = c.dspark_block_size;
  return j.dump(2) + "\n";
}

ParallelConfig make_parallel(const ModelConfig& cfg, int tp) {
  if (tp < 1) fail(cfg.source, "tp " + std::to_string(tp) + ": must be >= 1");
  auto split = [&](const char* key, int count) {
    if (count % tp != 0)
      fail(cfg.source, key_prefix(key) + std::to_string(count) + " is not divisible by tp " +
                           std::to_string(tp));
    return count / tp;
  };
  ParallelConfig p;
  p.tp = tp;
  p.local_heads = split("n_heads", cfg.n_heads);
  p.local_index_heads = split("index_n_heads", cfg.index_n_heads);
  p.local_groups = split("o_groups", cfg.o_groups);
  return p;
}

}  // namespace v4attn
