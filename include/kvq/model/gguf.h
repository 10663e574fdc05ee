#pragma once
// GGUF reader (versions 2 and 3, little endian) and the ggml block decoders kvq needs to
// dequantize weights at load. Every size and count read from the file is bounded by the file size
// before anything is allocated, so a malformed file yields kCorruptInput, never a crash.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::model::gguf {

enum class ValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6,
  kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};
const char* value_type_name(ValueType t);

// ggml tensor type ids as stored in the file (only the ones kvq decodes are named).
enum class TensorType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kBf16 = 30,
};
// Name of any ggml type id ("q5_k", ...), "type<N>" for ids ggml does not define.
std::string tensor_type_name(uint32_t type);

struct BlockLayout {
  int elems = 0;  // values per block (1 for plain float types)
  int bytes = 0;  // bytes per block
};
// kUnsupported (naming the type) for ggml types kvq cannot decode.
Result<BlockLayout> block_layout(uint32_t type);
// Decodes n values (a multiple of the block size) of `type` from `data` into fp32.
Status dequantize(uint32_t type, const uint8_t* data, size_t n, float* out);

// One metadata value. Scalars live in the member matching their kind; arrays keep their element
// type and hold strings, numbers (any integer, float or bool type) or nested arrays.
struct Value {
  ValueType type = ValueType::kUint8;
  ValueType elem_type = ValueType::kUint8;  // arrays only
  uint64_t u = 0;    // unsigned integers and bool
  int64_t i = 0;     // signed integers
  double f = 0;      // floats
  std::string str;
  std::vector<std::string> strings;  // array of strings
  std::vector<double> numbers;       // array of scalars (exact for |x| <= 2^53)
  std::vector<Value> arrays;         // array of arrays

  bool is_integer() const;
  bool is_number() const;  // integer, float or bool
  size_t array_size() const;
  // Any integer type (or bool) as int64; kInvalidArgument for other kinds / out of range.
  Result<int64_t> as_int() const;
  Result<double> as_double() const;
};

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // dims[0] varies fastest (ggml "ne"): a matrix is [in, out]
  uint32_t type = 0;
  uint64_t offset = 0;  // relative to the data section
  uint64_t n_elems = 0;
  uint64_t n_bytes = 0;
};

class File {
 public:
  // Maps the file read-only and parses header, metadata and tensor table.
  static Result<std::unique_ptr<File>> open(const std::string& path);
  // Parses an in-memory image (tests, and files read by other means). The bytes are copied.
  static Result<std::unique_ptr<File>> parse(const uint8_t* data, size_t size, std::string name = "<memory>");
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::string& path() const { return name_; }
  const std::map<std::string, Value, std::less<>>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  const Value* find(std::string_view key) const;
  const TensorInfo* find_tensor(std::string_view name) const;
  // Typed getters: kNotFound when absent, kInvalidArgument when present with another kind.
  Result<int64_t> get_int(std::string_view key) const;
  Result<double> get_float(std::string_view key) const;  // any number
  Result<bool> get_bool(std::string_view key) const;
  Result<std::string> get_string(std::string_view key) const;

  // Raw bytes of a tensor (inside the mapping) and its fp32 dequantization.
  const uint8_t* tensor_data(const TensorInfo& t) const;
  Status read_f32(const TensorInfo& t, float* out) const;
  Result<std::vector<float>> read_f32(const TensorInfo& t) const;

 private:
  File() = default;
  Status parse_all();

  std::string name_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  void* map_ = nullptr;           // mmap'ed region, or null
  std::vector<uint8_t> owned_;    // in-memory copy, for parse()
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_start_ = 0;
  std::map<std::string, Value, std::less<>> metadata_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, size_t> tensor_index_;  // name (viewing tensors_) -> index
};

}  // namespace kvq::model::gguf
