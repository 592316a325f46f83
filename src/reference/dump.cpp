// NumPy .npy writer/reader and the dump manifest (dump.h).
#include "v4attn/reference/dump.h"

#include <bit>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace v4attn::ref {

static_assert(std::endian::native == std::endian::little,
              "dumps write the host's bytes as little-endian .npy data");

namespace {

constexpr char kMagic[] = "\x93NUMPY";  // 6 bytes

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

bool valid_name(const std::string& name) {
  if (name.empty() || name[0] == '.') return false;
  for (char c : name)
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
          c == '-'))
      return false;
  return true;
}

std::string shape_tuple(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
  // NumPy writes "(3,)" for one dimension and "(2, 3)" for more; the comma style is free, but a
  // one-element tuple needs its trailing comma.
  return s + ")";
}

}  // namespace

const char* dump_dtype_name(DumpDtype d) {
  switch (d) {
    case DumpDtype::kF32: return "float32";
    case DumpDtype::kBF16: return "bfloat16";
    case DumpDtype::kE4M3: return "float8_e4m3fn";
    case DumpDtype::kUE8M0: return "ue8m0";
    case DumpDtype::kE2M1x2: return "e2m1x2";
    case DumpDtype::kU8: return "uint8";
    case DumpDtype::kI32: return "int32";
  }
  return "?";
}

const char* dump_npy_descr(DumpDtype d) {
  switch (d) {
    case DumpDtype::kF32: return "<f4";
    case DumpDtype::kBF16: return "<u2";
    case DumpDtype::kI32: return "<i4";
    default: return "|u1";
  }
}

int64_t dump_dtype_bytes(DumpDtype d) {
  switch (d) {
    case DumpDtype::kF32:
    case DumpDtype::kI32: return 4;
    case DumpDtype::kBF16: return 2;
    default: return 1;
  }
}

std::string npy_header(const char* descr, const std::vector<int64_t>& shape) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape_tuple(shape) + ", }";
  // magic(6) + version(2) + header length(2) + dict + padding + '\n', total a multiple of 64.
  const size_t unpadded = 10 + dict.size() + 1;
  const size_t total = (unpadded + 63) / 64 * 64;
  dict.append(total - unpadded, ' ');
  dict.push_back('\n');
  if (dict.size() > 65535) fail("npy_header: header too long for format 1.0");
  std::string h(kMagic, 6);
  h.push_back('\x01');
  h.push_back('\x00');
  h.push_back(static_cast<char>(dict.size() & 0xff));
  h.push_back(static_cast<char>(dict.size() >> 8));
  return h + dict;
}

NpyArray read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("read_npy: cannot open " + path);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, std::string(kMagic, 6)) != 0) fail("read_npy: " + path + ": bad magic");
  const int major = static_cast<uint8_t>(bytes[6]);
  size_t hlen, start;
  if (major == 1) {
    hlen = static_cast<uint8_t>(bytes[8]) | (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail("read_npy: " + path + ": truncated header");
    hlen = 0;
    for (int i = 0; i < 4; ++i) hlen |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
    start = 12;
  } else {
    fail("read_npy: " + path + ": unsupported version " + std::to_string(major));
  }
  if (bytes.size() < start + hlen) fail("read_npy: " + path + ": truncated header");
  const std::string dict = bytes.substr(start, hlen);
  NpyArray a;
  const auto value_of = [&](const std::string& key) -> size_t {
    const size_t k = dict.find("'" + key + "'");
    if (k == std::string::npos) fail("read_npy: " + path + ": header has no '" + key + "'");
    const size_t colon = dict.find(':', k);
    if (colon == std::string::npos) fail("read_npy: " + path + ": bad header");
    size_t v = colon + 1;
    while (v < dict.size() && dict[v] == ' ') ++v;
    return v;
  };
  size_t v = value_of("descr");
  if (v >= dict.size() || dict[v] != '\'') fail("read_npy: " + path + ": bad descr");
  const size_t end = dict.find('\'', v + 1);
  if (end == std::string::npos) fail("read_npy: " + path + ": bad descr");
  a.descr = dict.substr(v + 1, end - v - 1);
  v = value_of("fortran_order");
  a.fortran_order = dict.compare(v, 4, "True") == 0;
  v = value_of("shape");
  if (v >= dict.size() || dict[v] != '(') fail("read_npy: " + path + ": bad shape");
  const size_t close = dict.find(')', v);
  if (close == std::string::npos) fail("read_npy: " + path + ": bad shape");
  std::string num;
  for (size_t i = v + 1; i <= close; ++i) {
    const char c = dict[i];
    if (c >= '0' && c <= '9') {
      num.push_back(c);
    } else if (c == ',' || c == ')') {
      if (!num.empty()) a.shape.push_back(std::stoll(num));
      num.clear();
    } else if (c != ' ') {
      fail("read_npy: " + path + ": bad shape");
    }
  }
  int64_t elem = 0;
  if (a.descr == "<f4" || a.descr == "<i4" || a.descr == "<u4") elem = 4;
  else if (a.descr == "<u2" || a.descr == "<i2" || a.descr == "<f2") elem = 2;
  else if (a.descr == "|u1" || a.descr == "|i1" || a.descr == "|b1") elem = 1;
  else if (a.descr == "<f8" || a.descr == "<i8") elem = 8;
  else fail("read_npy: " + path + ": unsupported descr " + a.descr);
  int64_t n = 1;
  for (int64_t d : a.shape) n *= d;
  const size_t data_start = start + hlen;
  if (bytes.size() - data_start != static_cast<size_t>(n * elem))
    fail("read_npy: " + path + ": data has " + std::to_string(bytes.size() - data_start) + " bytes, shape needs " +
         std::to_string(n * elem));
  a.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(data_start), bytes.end());
  return a;
}

Dumper::Dumper(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec || !std::filesystem::is_directory(dir_)) fail("dump: cannot create directory " + dir_ + (ec ? ": " + ec.message() : ""));
}

Dumper::~Dumper() {
  if (finished_) return;
  try {
    finish();
  } catch (...) {  // a destructor must not throw; an explicit finish() reports the error
  }
}

bool Dumper::has(const std::string& name) const {
  for (const DumpEntry& e : entries_)
    if (e.name == name) return true;
  return false;
}

void Dumper::add(const std::string& name, DumpDtype dtype, const std::vector<int64_t>& shape, const void* data,
                 const std::string& meaning) {
  if (!valid_name(name)) fail("dump: invalid tensor name \"" + name + "\" (allowed: A-Z a-z 0-9 . _ -)");
  if (has(name)) fail("dump: tensor \"" + name + "\" added twice");
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) fail("dump: tensor \"" + name + "\" has a negative dimension");
    n *= d;
  }
  if (n > 0 && data == nullptr) fail("dump: tensor \"" + name + "\" has no data");
  DumpEntry e{name, name + ".npy", dtype, shape, meaning};
  const std::string path = dir_ + "/" + e.file;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fail("dump: cannot write " + path);
  const std::string header = npy_header(dump_npy_descr(dtype), shape);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  if (n > 0) f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n * dump_dtype_bytes(dtype)));
  f.close();
  if (!f) fail("dump: error writing " + path);
  entries_.push_back(std::move(e));
  finished_ = false;
}

void Dumper::set_meta(const std::string& key, const std::string& value) {
  meta_str_.emplace_back(key, value);
  finished_ = false;
}
void Dumper::set_meta(const std::string& key, int64_t value) {
  meta_int_.emplace_back(key, value);
  finished_ = false;
}

void Dumper::finish() {
  nlohmann::ordered_json j;
  j["format"] = "v4attn-dump-1";
  j["notes"] = "bfloat16 tensors are stored as raw bits ('<u2'): value = float32 from (bits << 16); "
               "float8_e4m3fn, ue8m0 and e2m1x2 are raw codes ('|u1'); e2m1x2 packs two codes per "
               "byte, even element in the low nibble, sign in bit 3 of each nibble";
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [k, v] : meta_str_) meta[k] = v;
  for (const auto& [k, v] : meta_int_) meta[k] = v;
  j["meta"] = meta;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const DumpEntry& e : entries_) {
    nlohmann::ordered_json je;
    je["name"] = e.name;
    je["file"] = e.file;
    je["dtype"] = dump_dtype_name(e.dtype);
    je["npy"] = dump_npy_descr(e.dtype);
    je["shape"] = e.shape;
    je["meaning"] = e.meaning;
    list.push_back(je);
  }
  j["entries"] = list;
  const std::string path = dir_ + "/manifest.json";
  std::ofstream f(path, std::ios::trunc);
  if (!f) fail("dump: cannot write " + path);
  f << j.dump(1) << "\n";
  f.close();
  if (!f) fail("dump: error writing " + path);
  finished_ = true;
}

}  // namespace v4attn::ref
