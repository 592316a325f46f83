// Tensor dumps for offline comparison (CPU reference now, GPU path later): NumPy .npy v1.0 files
// plus a manifest.json describing each one. The names are the contract: a GPU run that dumps the
// same step under the same names can be compared file by file (tools outside this repo, or
// numpy.load + the manifest).
//
// Storage dtypes (the manifest's "dtype" is the logical one, "npy" the NumPy descr on disk):
//   kF32    float32        '<f4'
//   kBF16   bfloat16       '<u2'  raw bf16 bits (NumPy has no bfloat16): value = bits << 16 as fp32
//   kE4M3   float8_e4m3fn  '|u1'  raw codes
//   kUE8M0  ue8m0          '|u1'  raw biased exponents (value 2^(b-127))
//   kE2M1x2 e2m1x2         '|u1'  two e2m1 codes per byte, even element in the low nibble
//   kU8     uint8          '|u1'  plain bytes (masks, cache bytes)
//   kI32    int32          '<i4'
// Files are little-endian whatever the host (this code only runs on little-endian hosts and says
// so at compile time).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace v4attn::ref {

enum class DumpDtype { kF32, kBF16, kE4M3, kUE8M0, kE2M1x2, kU8, kI32 };
const char* dump_dtype_name(DumpDtype d);  // the manifest's logical dtype ("bfloat16", ...)
const char* dump_npy_descr(DumpDtype d);   // '<f4', '<u2', '|u1' or '<i4'
int64_t dump_dtype_bytes(DumpDtype d);

struct DumpEntry {
  std::string name;     // e.g. "L06.qr"; also the file stem
  std::string file;     // name + ".npy", relative to the dump directory
  DumpDtype dtype;
  std::vector<int64_t> shape;
  std::string meaning;  // one sentence: what the tensor is, in the spec's words
};

// The .npy v1.0 header (magic, version, length, dict, space padding, '\n') for a C-order array;
// its total length is a multiple of 64 bytes.
std::string npy_header(const char* descr, const std::vector<int64_t>& shape);

// An .npy file read back (v1.0 / v2.0, C order only): the header's descr and shape, raw data.
struct NpyArray {
  std::string descr;
  std::vector<int64_t> shape;
  bool fortran_order = false;
  std::vector<uint8_t> data;
};
// Throws std::runtime_error on a malformed file (bad magic, header, or data length).
NpyArray read_npy(const std::string& path);

// Writes one .npy per add() into `dir` (created if missing) and, on finish(), manifest.json:
//   {"format": "v4attn-dump-1", "meta": {...}, "entries": [{"name", "file", "dtype", "npy",
//    "shape", "meaning"}, ...]}
// Names may contain [A-Za-z0-9._-] only (they are file names); a repeated name is refused.
class Dumper {
 public:
  explicit Dumper(std::string dir);
  ~Dumper();  // writes the manifest if finish() was not called (errors then are swallowed)
  Dumper(const Dumper&) = delete;
  Dumper& operator=(const Dumper&) = delete;

  // data holds prod(shape) elements of dump_dtype_bytes(dtype) bytes each, C order.
  void add(const std::string& name, DumpDtype dtype, const std::vector<int64_t>& shape, const void* data,
           const std::string& meaning);
  bool has(const std::string& name) const;
  // Free-form step description stored under "meta" in the manifest (string or integer values).
  void set_meta(const std::string& key, const std::string& value);
  void set_meta(const std::string& key, int64_t value);

  void finish();  // writes manifest.json (again, if called twice)
  const std::string& dir() const { return dir_; }
  const std::vector<DumpEntry>& entries() const { return entries_; }

 private:
  std::string dir_;
  std::vector<DumpEntry> entries_;
  std::vector<std::pair<std::string, std::string>> meta_str_;
  std::vector<std::pair<std::string, int64_t>> meta_int_;
  bool finished_ = false;
};

}  // namespace v4attn::ref
