// Config loader: the embedded default, every class of refusal (each message must name the file
// and the key, on one line), unknown keys, the JSON round trip, the reduced config, TP splits.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "v4attn/config.h"

namespace {

using nlohmann::ordered_json;
using v4attn::ConfigError;
using v4attn::ModelConfig;

const std::string kSourceDir = V4ATTN_SOURCE_DIR;
const std::string kTestSource = "mutated-test-config.json";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

ordered_json default_json() { return ordered_json::parse(v4attn::default_config_json()); }

// The default config with one change applied, as JSON text.
std::string mutated(const std::function<void(ordered_json&)>& change) {
  ordered_json j = default_json();
  change(j);
  return j.dump(2);
}

// Parses `text` (as file kTestSource), expects a ConfigError and returns its message after
// checking the parts every message must have.
std::string error_of(const std::string& text, const std::string& source = kTestSource) {
  try {
    v4attn::parse_config(text, source);
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("config error in " + source + ": ", 0), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  }
  ADD_FAILURE() << "no ConfigError for the config";
  return "";
}

std::string error_after(const std::function<void(ordered_json&)>& change) {
  return error_of(mutated(change));
}

// The message names the key: `key "name"` or `missing required key "name"`.
::testing::AssertionResult names_key(const std::string& msg, const std::string& key) {
  if (msg.find("\"" + key + "\"") != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message does not name key \"" << key << "\": " << msg;
}

const std::vector<std::string> kIntKeys = {
    "dim", "n_layers", "n_mtp_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "window_size", "candidate_source_layer", "candidate_topk_blocks",
    "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk", "original_seq_len",
    "dspark_block_size"};
const std::vector<std::string> kFloatKeys = {"norm_eps", "rope_theta", "compress_rope_theta",
                                             "rope_factor", "beta_fast", "beta_slow"};
const std::vector<std::string> kListKeys = {"compress_ratios", "kv_source_layers",
                                            "index_source_layers"};

}  // namespace

// ---- the embedded default -------------------------------------------------------------------

TEST(ConfigLoad, EmbeddedDefaultEqualsTheFileByteForByte) {
  const std::string file = read_file(kSourceDir + "/configs/deepseek-v4.1-flash.json");
  ASSERT_FALSE(file.empty());
  EXPECT_EQ(v4attn::default_config_json().size(), file.size());
  EXPECT_TRUE(v4attn::default_config_json() == file);
}

TEST(ConfigLoad, DefaultHasTheV41FlashValues) {
  const ModelConfig c = v4attn::load_config();
  EXPECT_EQ(c.source, "<embedded default>");
  EXPECT_EQ(c.dim, 5120);
  EXPECT_EQ(c.n_layers, 40);
  EXPECT_EQ(c.n_mtp_layers, 3);
  EXPECT_EQ(c.n_heads, 64);
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.rope_head_dim, 64);
  EXPECT_EQ(c.nope_head_dim(), 448);
  EXPECT_EQ(c.q_lora_rank, 1280);
  EXPECT_EQ(c.o_groups, 8);
  EXPECT_EQ(c.o_lora_rank, 1024);
  EXPECT_EQ(c.window_size, 128);
  EXPECT_EQ(c.norm_eps, 1e-20f);
  std::vector<int> ratios = {0, 0};
  ratios.insert(ratios.end(), 18, 2);
  ratios.insert(ratios.end(), 20, 1);
  ratios.insert(ratios.end(), 3, 0);
  EXPECT_EQ(c.compress_ratios, ratios);
  EXPECT_EQ(c.kv_source_layers, (std::vector<int>{2, 8, 14, 20}));
  EXPECT_EQ(c.index_source_layers, (std::vector<int>{2, 8, 14, 20, 24, 28, 32, 36}));
  EXPECT_EQ(c.candidate_source_layer, 20);
  EXPECT_EQ(c.candidate_topk_blocks, 2048);
  EXPECT_EQ(c.candidate_block_size, 8);
  EXPECT_EQ(c.index_n_heads, 32);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 512);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.compress_rope_theta, 160000.0);
  EXPECT_EQ(c.original_seq_len, 65536);
  EXPECT_EQ(c.rope_factor, 16.0);
  EXPECT_EQ(c.beta_fast, 32.0);
  EXPECT_EQ(c.beta_slow, 1.0);
  EXPECT_EQ(c.dspark_block_size, 5);
  EXPECT_EQ(c.total_layers(), 43);
  EXPECT_EQ(c.verify_rows_per_request(), 6);
}

TEST(ConfigLoad, FileLoadsLikeTheEmbeddedCopyAndIsNamedAsSource) {
  const std::string path = kSourceDir + "/configs/deepseek-v4.1-flash.json";
  const ModelConfig from_file = v4attn::load_config(path);
  EXPECT_EQ(from_file.source, path);
  EXPECT_EQ(v4attn::config_to_json(from_file), v4attn::config_to_json(v4attn::load_config("")));
}

TEST(ConfigLoad, UnreadableFileIsNamed) {
  const std::string missing = kSourceDir + "/tests/configs/does_not_exist.json";
  try {
    v4attn::load_config(missing);
    FAIL() << "no error for a missing file";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("config error in " + missing + ": cannot open", 0), 0u)
        << e.what();
  }
  const std::string dir = kSourceDir + "/tests/configs";
  try {
    v4attn::load_config(dir);
    FAIL() << "no error for a directory";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("config error in " + dir + ": "), std::string::npos)
        << e.what();
  }
}

// The malformed files the CLI tests use, through load_config.
TEST(ConfigLoad, MalformedTestConfigsNameFileAndKey) {
  const struct {
    const char* file;
    const char* expected;  // part of the message after "config error in <path>: "
  } cases[] = {
      {"truncated.json", "invalid JSON at byte 539: "},
      {"missing_key.json", "missing required key \"dim\""},
      {"string_for_number.json", "key \"n_heads\": expected an integer, got string \"64\""},
      {"float_for_int.json", "key \"dim\": expected an integer, got float (5120.0)"},
      {"ratios_too_short.json",
       "key \"compress_ratios\": has 42 entries, expected n_layers + n_mtp_layers = 43"},
      {"source_ratio_zero.json", "key \"kv_source_layers\": layer 1 has compress ratio 0"},
      {"unsorted_sources.json", "key \"index_source_layers\": not sorted: 14 after 20"},
  };
  for (const auto& c : cases) {
    const std::string path = kSourceDir + "/tests/configs/" + c.file;
    try {
      v4attn::load_config(path);
      ADD_FAILURE() << "no error for " << c.file;
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("config error in " + path + ": " + c.expected, 0), 0u) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

// ---- syntax ---------------------------------------------------------------------------------

TEST(ConfigParse, TruncatedJsonGivesTheByteOffset) {
  // Cut just before a key: the parser runs out of input where the text ends.
  const size_t cut = v4attn::default_config_json().find("\"n_heads\"");
  ASSERT_NE(cut, std::string::npos);
  const std::string msg = error_of(v4attn::default_config_json().substr(0, cut));
  EXPECT_NE(msg.find("invalid JSON at byte " + std::to_string(cut) + ": "), std::string::npos) << msg;
  EXPECT_NE(msg.find("end of input"), std::string::npos) << msg;
  EXPECT_NE(error_of("").find("invalid JSON at byte 0"), std::string::npos);
  // The offending byte of a bad literal: 'x' is byte 8.
  const std::string literal = error_of("{\"dim\": x}");
  EXPECT_NE(literal.find("invalid JSON at byte 8: "), std::string::npos) << literal;
  // Cut inside a string.
  const std::string in_string = error_of("{\"dim\": 5120, \"n_he");
  EXPECT_NE(in_string.find("invalid JSON at byte 19: "), std::string::npos) << in_string;
}

TEST(ConfigParse, TopLevelMustBeAnObject) {
  const std::string msg = error_of("[1, 2, 3]");
  EXPECT_NE(msg.find("expected a JSON object at the top level, got array"), std::string::npos) << msg;
}

TEST(ConfigParse, UnknownKeysAreIgnored) {
  const std::string text = mutated([](ordered_json& j) {
    j["some_future_key"] = {{"nested", {1, 2.5, "x"}}};
    j["another"] = nullptr;
  });
  const ModelConfig c = v4attn::parse_config(text, kTestSource);
  EXPECT_EQ(c.source, kTestSource);
  EXPECT_EQ(v4attn::config_to_json(c), v4attn::config_to_json(v4attn::load_config()));
}

// ---- missing keys and types -------------------------------------------------------------------

TEST(ConfigParse, EveryRequiredKeyMissingIsNamed) {
  std::vector<std::string> required = kIntKeys;
  required.insert(required.end(), kFloatKeys.begin(), kFloatKeys.end());
  required.insert(required.end(), kListKeys.begin(), kListKeys.end());
  for (const std::string& key : required) {
    if (key == "candidate_source_layer") continue;  // optional: absent means none
    const std::string msg = error_after([&](ordered_json& j) { j.erase(key); });
    EXPECT_NE(msg.find("missing required key \"" + key + "\""), std::string::npos) << msg;
  }
}

TEST(ConfigParse, WrongTypesAreNamed) {
  for (const std::string& key : kIntKeys) {
    const std::string msg = error_after([&](ordered_json& j) { j[key] = "12"; });
    EXPECT_NE(msg.find("key \"" + key + "\": expected an integer, got string \"12\""),
              std::string::npos) << msg;
  }
  for (const std::string& key : kFloatKeys) {
    const std::string msg = error_after([&](ordered_json& j) { j[key] = true; });
    EXPECT_NE(msg.find("key \"" + key + "\": expected a number, got boolean"), std::string::npos)
        << msg;
  }
  for (const std::string& key : kListKeys) {
    const std::string msg = error_after([&](ordered_json& j) { j[key] = 5; });
    EXPECT_NE(msg.find("key \"" + key + "\": expected an array of integers, got integer"),
              std::string::npos) << msg;
  }
  const std::string msg = error_after([](ordered_json& j) { j["dim"] = nullptr; });
  EXPECT_NE(msg.find("key \"dim\": expected an integer, got null"), std::string::npos) << msg;
}

TEST(ConfigParse, FloatsWhereIntegersBelongAreRefused) {
  std::string msg = error_after([](ordered_json& j) { j["dim"] = 5120.0; });
  EXPECT_NE(msg.find("key \"dim\": expected an integer, got float (5120.0)"), std::string::npos)
      << msg;
  // An exponent makes a float in JSON too.
  msg = error_of(mutated([](ordered_json& j) { j.erase("n_heads"); }) .insert(1, "\"n_heads\": 6.4e1,"));
  EXPECT_TRUE(names_key(msg, "n_heads"));
  EXPECT_NE(msg.find("got float"), std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["compress_ratios"][3] = 2.0; });
  EXPECT_NE(msg.find("key \"compress_ratios\": entry 3: expected an integer, got float"),
            std::string::npos) << msg;
}

TEST(ConfigParse, IntegersWhereFloatsBelongAreFine) {
  const ModelConfig c = v4attn::parse_config(mutated([](ordered_json& j) {
    j["rope_factor"] = 16;  // already an integer in the real config; keep it explicit
    j["norm_eps"] = 1;
    j["beta_slow"] = 2;
  }), kTestSource);
  EXPECT_EQ(c.rope_factor, 16.0);
  EXPECT_EQ(c.norm_eps, 1.0f);
  EXPECT_EQ(c.beta_slow, 2.0);
}

TEST(ConfigParse, IntegersOutOfRangeAreNamed) {
  std::string msg = error_after([](ordered_json& j) { j["dim"] = int64_t{1} << 40; });
  EXPECT_NE(msg.find("key \"dim\": 1099511627776 is out of range"), std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["n_heads"] = uint64_t{18446744073709551615u}; });
  EXPECT_NE(msg.find("key \"n_heads\": 18446744073709551615 is out of range"), std::string::npos)
      << msg;
  msg = error_after([](ordered_json& j) { j["kv_source_layers"][1] = int64_t{-3} << 35; });
  EXPECT_NE(msg.find("key \"kv_source_layers\": entry 1: "), std::string::npos) << msg;
}

// ---- values and consistency -------------------------------------------------------------------

TEST(ConfigParse, HeadDimensionsAreThoseOfTheKernels) {
  std::string msg = error_after([](ordered_json& j) { j["rope_head_dim"] = 32; });
  EXPECT_TRUE(names_key(msg, "rope_head_dim"));
  EXPECT_NE(msg.find("must be 64"), std::string::npos) << msg;
  for (int hd : {448, 576, 256}) {
    msg = error_after([&](ordered_json& j) { j["head_dim"] = hd; });
    EXPECT_TRUE(names_key(msg, "head_dim"));
    EXPECT_NE(msg.find("must be 512"), std::string::npos) << msg;
    EXPECT_NE(msg.find("kernels"), std::string::npos) << msg;
  }
  msg = error_after([](ordered_json& j) { j["index_head_dim"] = 64; });
  EXPECT_TRUE(names_key(msg, "index_head_dim"));
  EXPECT_NE(msg.find("must be 128"), std::string::npos) << msg;
  for (int k : {0, 500, -64}) {
    msg = error_after([&](ordered_json& j) { j["index_topk"] = k; });
    EXPECT_TRUE(names_key(msg, "index_topk"));
    EXPECT_NE(msg.find("multiple of 64"), std::string::npos) << msg;
  }
  // 64 is fine (the reduced config uses it).
  EXPECT_EQ(v4attn::parse_config(mutated([](ordered_json& j) { j["index_topk"] = 64; }), "x").index_topk, 64);
}

TEST(ConfigParse, NonPositiveAndMisalignedValuesAreNamed) {
  const struct {
    const char* key;
    double value;
    const char* expected;
  } cases[] = {
      {"dim", 0, "must be > 0"},
      {"dim", -5120, "must be > 0"},
      {"dim", 5000, "multiple of 32"},
      {"n_layers", 0, "must be > 0"},
      {"n_mtp_layers", -1, "must be >= 0"},
      {"n_heads", 0, "must be > 0"},
      {"q_lora_rank", 0, "must be > 0"},
      {"q_lora_rank", 1000, "multiple of 32"},
      {"o_groups", 0, "must be > 0"},
      {"o_groups", 6, "not divisible by o_groups 6"},
      {"o_lora_rank", -1, "must be > 0"},
      {"o_lora_rank", 1000, "multiple of 32"},
      {"window_size", 0, "must be > 0"},
      {"window_size", -128, "must be > 0"},
      {"index_n_heads", 0, "must be > 0"},
      {"original_seq_len", 0, "must be > 0"},
      {"dspark_block_size", 0, "must be >= 1"},
      {"candidate_topk_blocks", 0, "must be > 0"},
      {"candidate_block_size", -8, "must be > 0"},
  };
  for (const auto& c : cases) {
    const std::string msg =
        error_after([&](ordered_json& j) { j[c.key] = static_cast<int64_t>(c.value); });
    EXPECT_TRUE(names_key(msg, c.key));
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.key << " = " << c.value << ": " << msg;
  }
  const struct {
    const char* key;
    double value;
  } real_cases[] = {{"norm_eps", 0.0},      {"norm_eps", -1e-6},  {"norm_eps", 1e-50},
                    {"rope_theta", 1.0},    {"rope_theta", 0.5},  {"compress_rope_theta", 0.0},
                    {"rope_factor", 0.0},   {"beta_fast", -32.0}, {"beta_slow", 0.0}};
  for (const auto& c : real_cases) {
    const std::string msg = error_after([&](ordered_json& j) { j[c.key] = c.value; });
    EXPECT_TRUE(names_key(msg, c.key)) << c.key << " = " << c.value;
    EXPECT_NE(msg.find("must be > "), std::string::npos) << c.key << " = " << c.value << ": " << msg;
  }
}

TEST(ConfigParse, CompressRatiosMustCoverEveryLayer) {
  std::string msg = error_after([](ordered_json& j) { j["compress_ratios"].erase(0); });
  EXPECT_NE(msg.find("key \"compress_ratios\": has 42 entries, expected n_layers + n_mtp_layers = 43"),
            std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["compress_ratios"].push_back(0); });
  EXPECT_NE(msg.find("key \"compress_ratios\": has 44 entries"), std::string::npos) << msg;
  // n_mtp_layers counts: one draft stage fewer makes the list one too long.
  msg = error_after([](ordered_json& j) { j["n_mtp_layers"] = 2; });
  EXPECT_NE(msg.find("expected n_layers + n_mtp_layers = 42"), std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["compress_ratios"][30] = 4; });
  EXPECT_NE(msg.find("key \"compress_ratios\": entry 30 is 4, expected 0, 1 or 2"), std::string::npos)
      << msg;
  msg = error_after([](ordered_json& j) { j["compress_ratios"][0] = -1; });
  EXPECT_NE(msg.find("key \"compress_ratios\": entry 0 is -1"), std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["compress_ratios"][41] = 1; });
  EXPECT_NE(msg.find("key \"compress_ratios\": entry 41 is 1 but it is a draft stage"),
            std::string::npos) << msg;
}

TEST(ConfigParse, SourceListsAreCheckedAndNamed) {
  const struct {
    const char* key;
    std::vector<int> layers;
    const char* expected;
  } cases[] = {
      {"kv_source_layers", {2, 8, 14, 40}, "layer 40 is out of range"},
      {"kv_source_layers", {-1, 2, 8, 14, 20}, "layer -1 is out of range"},
      {"kv_source_layers", {0, 2, 8, 14, 20}, "layer 0 has compress ratio 0"},
      {"kv_source_layers", {2, 14, 8, 20}, "not sorted: 8 after 14"},
      {"kv_source_layers", {2, 8, 8, 14, 20}, "layer 8 is listed twice"},
      {"index_source_layers", {2, 8, 14, 20, 24, 28, 32, 36, 42}, "layer 42 is out of range"},
      {"index_source_layers", {1, 2, 8, 14, 20, 24, 28, 32, 36}, "layer 1 has compress ratio 0"},
      {"index_source_layers", {2, 8, 14, 20, 28, 24, 32, 36}, "not sorted: 24 after 28"},
      {"index_source_layers", {2, 8, 14, 20, 24, 24, 28, 32, 36}, "layer 24 is listed twice"},
      // 8 dropped from the index sources: layer 8 is still covered by index source 2, but a kv
      // source owns index keys that only its own indexer would produce.
      {"kv_source_layers", {2, 8, 14, 20}, "layer 8 is not in index_source_layers"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_after([&](ordered_json& j) {
      j[c.key] = c.layers;
      if (std::string(c.expected).find("not in index_source_layers") != std::string::npos)
        j["index_source_layers"] = std::vector<int>{2, 14, 20, 24, 28, 32, 36};
    });
    EXPECT_NE(msg.find(std::string("key \"") + c.key + "\": " + c.expected), std::string::npos)
        << msg;
  }
}

TEST(ConfigParse, EveryCompressedLayerNeedsSourcesAtOrBeforeIt) {
  // No kv source at or before layer 2 (ratio 2).
  std::string msg = error_after([](ordered_json& j) {
    j["kv_source_layers"] = {8, 14, 20};
  });
  EXPECT_NE(msg.find("key \"kv_source_layers\": layer 2 has compress ratio 2 but no kv source at or before it"),
            std::string::npos) << msg;
  // No index source at or before layer 2.
  msg = error_after([](ordered_json& j) {
    j["index_source_layers"] = {8, 14, 20, 24, 28, 32, 36};
  });
  EXPECT_NE(msg.find("key \"index_source_layers\": layer 2 has compress ratio 2 but no index source"),
            std::string::npos) << msg;
  // Layer 21 with ratio 2 would read kv source 20's ratio-1 cache.
  msg = error_after([](ordered_json& j) { j["compress_ratios"][21] = 2; });
  EXPECT_NE(msg.find("key \"compress_ratios\": layer 21 has ratio 2 but its kv source 20 has ratio 1"),
            std::string::npos) << msg;
}

TEST(ConfigParse, CandidateSourceRules) {
  // Absent, null and -1 all mean none; then the candidate sizes are optional.
  for (int variant = 0; variant < 3; ++variant) {
    const ModelConfig c = v4attn::parse_config(mutated([&](ordered_json& j) {
      if (variant == 0) j.erase("candidate_source_layer");
      if (variant == 1) j["candidate_source_layer"] = nullptr;
      if (variant == 2) j["candidate_source_layer"] = -1;
      j.erase("candidate_topk_blocks");
      j.erase("candidate_block_size");
    }), kTestSource);
    EXPECT_EQ(c.candidate_source_layer, -1) << variant;
    EXPECT_EQ(c.candidate_topk_blocks, 0) << variant;
  }
  std::string msg = error_after([](ordered_json& j) { j["candidate_source_layer"] = 21; });
  EXPECT_NE(msg.find("key \"candidate_source_layer\": layer 21 is not an index source"),
            std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["candidate_source_layer"] = 40; });
  EXPECT_NE(msg.find("key \"candidate_source_layer\": 40 is out of range"), std::string::npos) << msg;
  msg = error_after([](ordered_json& j) { j["candidate_source_layer"] = -2; });
  EXPECT_NE(msg.find("key \"candidate_source_layer\": -2 is out of range"), std::string::npos) << msg;
  // Candidate source 8: index source 14 reads kv source 14, not the cache the mask indexes.
  msg = error_after([](ordered_json& j) { j["candidate_source_layer"] = 8; });
  EXPECT_NE(msg.find("key \"candidate_source_layer\": index source 14 would mask"), std::string::npos)
      << msg;
  // With a candidate source, its sizes are required.
  msg = error_after([](ordered_json& j) { j.erase("candidate_block_size"); });
  EXPECT_NE(msg.find("missing required key \"candidate_block_size\""), std::string::npos) << msg;
}

TEST(ConfigParse, MessagesStayOnOneLine) {
  const std::string msg = error_after([](ordered_json& j) { j["n_heads"] = "six\nty\r\nfour"; });
  EXPECT_TRUE(names_key(msg, "n_heads"));  // error_of checked that there is no newline
}

// ---- round trip, reduced config, TP -------------------------------------------------------------

TEST(ConfigJson, RoundTripsThroughParse) {
  for (const ModelConfig& c : {v4attn::load_config(), v4attn::reduced_config()}) {
    const std::string text = v4attn::config_to_json(c);
    const ModelConfig back = v4attn::parse_config(text, "roundtrip.json");
    EXPECT_EQ(v4attn::config_to_json(back), text);
    EXPECT_EQ(back.norm_eps, c.norm_eps);
    EXPECT_EQ(back.compress_ratios, c.compress_ratios);
    EXPECT_EQ(back.original_seq_len, c.original_seq_len);
  }
  // Floats are written in their shortest form.
  EXPECT_NE(v4attn::config_to_json(v4attn::load_config()).find("\"norm_eps\": 1e-20"),
            std::string::npos);
}

TEST(ReducedConfig, IsValidAndSmall) {
  const ModelConfig c = v4attn::reduced_config();
  EXPECT_NO_THROW(v4attn::validate_config(c));
  EXPECT_EQ(c.source, "<reduced>");
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.rope_head_dim, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.window_size, 128);
  EXPECT_EQ(c.index_topk % 64, 0);
  EXPECT_EQ(c.total_layers(), 13);
  EXPECT_LE(c.dim, 1024);
  EXPECT_LE(c.n_heads, 8);
  // The same RoPE/YaRN parameters as V4.1-Flash.
  const ModelConfig real = v4attn::load_config();
  EXPECT_EQ(c.rope_theta, real.rope_theta);
  EXPECT_EQ(c.compress_rope_theta, real.compress_rope_theta);
  EXPECT_EQ(c.original_seq_len, real.original_seq_len);
  EXPECT_EQ(c.rope_factor, real.rope_factor);
  EXPECT_EQ(c.beta_fast, real.beta_fast);
  EXPECT_EQ(c.beta_slow, real.beta_slow);
  EXPECT_EQ(c.norm_eps, real.norm_eps);
}

TEST(ReducedConfig, ValidateCatchesHandEditedMistakes) {
  ModelConfig c = v4attn::reduced_config();
  c.kv_source_layers = {2, 6, 7};  // 7 is not an index source
  try {
    v4attn::validate_config(c);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("config error in <reduced>: key \"kv_source_layers\"", 0), 0u)
        << e.what();
  }
}

TEST(ParallelConfig, SplitsHeadsAndGroups) {
  const ModelConfig c = v4attn::load_config();
  for (int tp : {1, 2, 4, 8}) {
    const v4attn::ParallelConfig p = v4attn::make_parallel(c, tp);
    EXPECT_EQ(p.tp, tp);
    EXPECT_EQ(p.local_heads, 64 / tp);
    EXPECT_EQ(p.local_index_heads, 32 / tp);
    EXPECT_EQ(p.local_groups, 8 / tp);
  }
  const v4attn::ParallelConfig r = v4attn::make_parallel(v4attn::reduced_config(), 2);
  EXPECT_EQ(r.local_heads, 2);
  EXPECT_EQ(r.local_index_heads, 2);
  EXPECT_EQ(r.local_groups, 1);
}

TEST(ParallelConfig, RefusesTpThatDoesNotSplit) {
  const ModelConfig c = v4attn::load_config();
  auto message = [&](const ModelConfig& cfg, int tp) {
    try {
      v4attn::make_parallel(cfg, tp);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "no error for tp " << tp;
    return std::string();
  };
  EXPECT_EQ(message(c, 3),
            "config error in <embedded default>: key \"n_heads\": 64 is not divisible by tp 3");
  EXPECT_EQ(message(c, 16),
            "config error in <embedded default>: key \"o_groups\": 8 is not divisible by tp 16");
  EXPECT_NE(message(c, 0).find("tp 0: must be >= 1"), std::string::npos);
  EXPECT_NE(message(c, -2).find("tp -2: must be >= 1"), std::string::npos);
  ModelConfig odd_index = c;
  odd_index.index_n_heads = 36;
  EXPECT_EQ(message(odd_index, 8),
            "config error in <embedded default>: key \"index_n_heads\": 36 is not divisible by tp 8");
}
