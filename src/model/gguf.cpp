// GGUF container: "GGUF" magic, u32 version, u64 tensor count, u64 metadata count, metadata
// (string key, u32 type, value), tensor table (name, u32 n_dims, u64 dims, u32 type, u64 offset),
// padding to general.alignment, then the tensor data section.
#include <sys/mman.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "kvq/common/checked.h"
#include "kvq/common/file_io.h"
#include "kvq/model/gguf.h"

namespace kvq::model::gguf {

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::kUint8: return "uint8";
    case ValueType::kInt8: return "int8";
    case ValueType::kUint16: return "uint16";
    case ValueType::kInt16: return "int16";
    case ValueType::kUint32: return "uint32";
    case ValueType::kInt32: return "int32";
    case ValueType::kFloat32: return "float32";
    case ValueType::kBool: return "bool";
    case ValueType::kString: return "string";
    case ValueType::kArray: return "array";
    case ValueType::kUint64: return "uint64";
    case ValueType::kInt64: return "int64";
    case ValueType::kFloat64: return "float64";
  }
  return "unknown";
}

bool Value::is_integer() const {
  switch (type) {
    case ValueType::kUint8: case ValueType::kInt8: case ValueType::kUint16: case ValueType::kInt16:
    case ValueType::kUint32: case ValueType::kInt32: case ValueType::kUint64: case ValueType::kInt64:
    case ValueType::kBool:
      return true;
    default: return false;
  }
}

bool Value::is_number() const {
  return is_integer() || type == ValueType::kFloat32 || type == ValueType::kFloat64;
}

size_t Value::array_size() const {
  if (type != ValueType::kArray) return 0;
  if (elem_type == ValueType::kString) return strings.size();
  if (elem_type == ValueType::kArray) return arrays.size();
  return numbers.size();
}

Result<int64_t> Value::as_int() const {
  switch (type) {
    case ValueType::kInt8: case ValueType::kInt16: case ValueType::kInt32: case ValueType::kInt64:
      return i;
    case ValueType::kUint8: case ValueType::kUint16: case ValueType::kUint32: case ValueType::kBool:
      return static_cast<int64_t>(u);
    case ValueType::kUint64:
      if (u > static_cast<uint64_t>(INT64_MAX)) return invalid_argument("uint64 value too large");
      return static_cast<int64_t>(u);
    default:
      return invalid_argument(std::string("expected an integer, found ") + value_type_name(type));
  }
}

Result<double> Value::as_double() const {
  if (type == ValueType::kFloat32 || type == ValueType::kFloat64) return f;
  auto v = as_int();
  if (!v.is_ok()) return invalid_argument(std::string("expected a number, found ") + value_type_name(type));
  return static_cast<double>(v.value());
}

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint64_t kMaxDims = 4;          // ggml's limit
constexpr uint32_t kMaxNesting = 4;       // arrays of arrays deeper than this are refused

// Bounds-checked little-endian reader over the file image.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }

  template <class T>
  Status read(T* v, const char* what) {
    if (left() < sizeof(T)) return truncated(what);
    std::memcpy(v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::ok();
  }
  Status read_string(std::string* s, const char* what) {
    uint64_t len = 0;
    KVQ_RETURN_IF_ERROR(read(&len, what));
    if (len > left())
      return corrupt_input(std::string(what) + ": string length " + std::to_string(len) + " at byte " +
                           std::to_string(pos_) + " runs past the end of the file");
    s->assign(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return Status::ok();
  }
  Status truncated(const char* what) const {
    return corrupt_input(std::string("file is truncated while reading ") + what + " at byte " + std::to_string(pos_));
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

size_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::kUint8: case ValueType::kInt8: case ValueType::kBool: return 1;
    case ValueType::kUint16: case ValueType::kInt16: return 2;
    case ValueType::kUint32: case ValueType::kInt32: case ValueType::kFloat32: return 4;
    case ValueType::kUint64: case ValueType::kInt64: case ValueType::kFloat64: return 8;
    default: return 0;
  }
}

bool known_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::kFloat64); }

Status read_scalar(Reader& r, ValueType t, Value* v) {
  v->type = t;
  switch (t) {
    case ValueType::kUint8: { uint8_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "uint8")); v->u = x; break; }
    case ValueType::kInt8: { int8_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "int8")); v->i = x; break; }
    case ValueType::kUint16: { uint16_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "uint16")); v->u = x; break; }
    case ValueType::kInt16: { int16_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "int16")); v->i = x; break; }
    case ValueType::kUint32: { uint32_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "uint32")); v->u = x; break; }
    case ValueType::kInt32: { int32_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "int32")); v->i = x; break; }
    case ValueType::kUint64: { uint64_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "uint64")); v->u = x; break; }
    case ValueType::kInt64: { int64_t x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "int64")); v->i = x; break; }
    case ValueType::kFloat32: { float x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "float32")); v->f = x; break; }
    case ValueType::kFloat64: { double x = 0; KVQ_RETURN_IF_ERROR(r.read(&x, "float64")); v->f = x; break; }
    case ValueType::kBool: {
      uint8_t x = 0;
      KVQ_RETURN_IF_ERROR(r.read(&x, "bool"));
      if (x > 1) return corrupt_input("bool value " + std::to_string(x) + " is neither 0 nor 1");
      v->u = x;
      break;
    }
    default: return internal_error("read_scalar on a non-scalar type");
  }
  return Status::ok();
}

double scalar_as_double(const Value& v) {
  if (v.type == ValueType::kFloat32 || v.type == ValueType::kFloat64) return v.f;
  switch (v.type) {
    case ValueType::kInt8: case ValueType::kInt16: case ValueType::kInt32: case ValueType::kInt64:
      return static_cast<double>(v.i);
    default: return static_cast<double>(v.u);
  }
}

Status read_value(Reader& r, uint32_t raw_type, Value* v, uint32_t depth) {
  if (!known_type(raw_type)) return corrupt_input("unknown metadata value type " + std::to_string(raw_type));
  auto t = static_cast<ValueType>(raw_type);
  if (t == ValueType::kString) {
    v->type = t;
    return r.read_string(&v->str, "metadata string");
  }
  if (t != ValueType::kArray) return read_scalar(r, t, v);
  if (depth >= kMaxNesting) return corrupt_input("metadata arrays nested deeper than " + std::to_string(kMaxNesting));
  uint32_t et = 0;
  uint64_t count = 0;
  KVQ_RETURN_IF_ERROR(r.read(&et, "array element type"));
  KVQ_RETURN_IF_ERROR(r.read(&count, "array length"));
  if (!known_type(et)) return corrupt_input("unknown metadata array element type " + std::to_string(et));
  v->type = t;
  v->elem_type = static_cast<ValueType>(et);
  // Smallest encoding of one element: a string is at least its 8-byte length, a nested array its
  // 12-byte header. Bounding `count` by the bytes left keeps a forged length from allocating.
  size_t min_elem = v->elem_type == ValueType::kString ? 8 : v->elem_type == ValueType::kArray ? 12
                                                                                             : scalar_size(v->elem_type);
  if (count > r.left() / min_elem)
    return corrupt_input("metadata array of " + std::to_string(count) + " " + value_type_name(v->elem_type) +
                         " elements does not fit in the " + std::to_string(r.left()) + " bytes left in the file");
  // Elements are appended as they are read (not allocated up front from `count`), so memory
  // follows the bytes actually present.
  if (v->elem_type == ValueType::kString) {
    for (uint64_t k = 0; k < count; ++k) KVQ_RETURN_IF_ERROR(r.read_string(&v->strings.emplace_back(), "metadata array string"));
  } else if (v->elem_type == ValueType::kArray) {
    for (uint64_t k = 0; k < count; ++k) KVQ_RETURN_IF_ERROR(read_value(r, et, &v->arrays.emplace_back(), depth + 1));
  } else {
    v->numbers.resize(count);
    Value s;
    for (auto& x : v->numbers) {
      KVQ_RETURN_IF_ERROR(read_scalar(r, v->elem_type, &s));
      x = scalar_as_double(s);
    }
  }
  return Status::ok();
}

}  // namespace

File::~File() {
  if (map_ != nullptr) munmap(map_, size_);
}

Result<std::unique_ptr<File>> File::open(const std::string& path) {
  // Refuses directories, FIFOs and devices by name (and never waits on a FIFO) before mapping.
  auto in = InputFile::open(path, "GGUF file");
  if (!in.is_ok()) return in.status();
  uint64_t size = in.value().size();
  if (size > static_cast<uint64_t>(SIZE_MAX)) return invalid_argument("GGUF file '" + path + "' is too large to map");
  std::unique_ptr<File> f(new File());
  f->name_ = path;
  f->size_ = static_cast<size_t>(size);
  if (f->size_ > 0) {
    void* m = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, in.value().fd(), 0);
    if (m == MAP_FAILED) return invalid_argument("cannot map GGUF file '" + path + "': " + std::strerror(errno));
    f->map_ = m;
    f->data_ = static_cast<const uint8_t*>(m);
  }
  KVQ_RETURN_IF_ERROR(f->parse_all());
  return f;
}

Result<std::unique_ptr<File>> File::parse(const uint8_t* data, size_t size, std::string name) {
  std::unique_ptr<File> f(new File());
  f->name_ = std::move(name);
  f->owned_.assign(data, data + size);
  f->data_ = f->owned_.data();
  f->size_ = size;
  KVQ_RETURN_IF_ERROR(f->parse_all());
  return f;
}

Status File::parse_all() {
  auto wrap = [this](const Status& s) {
    return s.is_ok() ? s : Status(s.code(), "GGUF '" + name_ + "': " + s.message());
  };
  Reader r(data_, size_);
  uint32_t magic = 0;
  if (!r.read(&magic, "magic").is_ok() || magic != kMagic)
    return wrap(corrupt_input("not a GGUF file (the first 4 bytes are not \"GGUF\")"));
  KVQ_RETURN_IF_ERROR(wrap(r.read(&version_, "version")));
  if (version_ != 2 && version_ != 3) {
    // A big-endian file shows its version byte-swapped.
    bool swapped = version_ == 0x02000000u || version_ == 0x03000000u;
    return wrap(unsupported("GGUF version " + std::to_string(version_) +
                            (swapped ? " (a big-endian file)" : "") + " is not supported (kvq reads versions 2 and 3)"));
  }
  uint64_t n_tensors = 0, n_kv = 0;
  KVQ_RETURN_IF_ERROR(wrap(r.read(&n_tensors, "tensor count")));
  KVQ_RETURN_IF_ERROR(wrap(r.read(&n_kv, "metadata count")));
  // A metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor entry
  // 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
  if (n_kv > r.left() / 13)
    return wrap(corrupt_input("metadata count " + std::to_string(n_kv) + " is impossible for a file of " +
                              std::to_string(size_) + " bytes"));
  if (n_tensors > r.left() / 24)
    return wrap(corrupt_input("tensor count " + std::to_string(n_tensors) + " is impossible for a file of " +
                              std::to_string(size_) + " bytes"));

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    uint32_t type = 0;
    KVQ_RETURN_IF_ERROR(wrap(r.read_string(&key, "metadata key")));
    KVQ_RETURN_IF_ERROR(wrap(r.read(&type, "metadata value type")));
    Value v;
    Status s = read_value(r, type, &v, 0);
    if (!s.is_ok()) return wrap(Status(s.code(), "metadata '" + key + "': " + s.message()));
    if (metadata_.count(key)) return wrap(corrupt_input("metadata key '" + key + "' appears twice"));
    metadata_.emplace(std::move(key), std::move(v));
  }

  if (const Value* a = find("general.alignment")) {
    auto av = a->as_int();
    if (!av.is_ok() || av.value() <= 0 || (av.value() & (av.value() - 1)) != 0 || av.value() > (1 << 20))
      return wrap(corrupt_input("general.alignment must be a power of two integer (at most 1 MiB)"));
    alignment_ = static_cast<uint64_t>(av.value());
  }

  tensors_.clear();
  for (uint64_t k = 0; k < n_tensors; ++k) {
    TensorInfo& t = tensors_.emplace_back();
    KVQ_RETURN_IF_ERROR(wrap(r.read_string(&t.name, "tensor name")));
    uint32_t nd = 0;
    KVQ_RETURN_IF_ERROR(wrap(r.read(&nd, "tensor dimension count")));
    if (nd == 0 || nd > kMaxDims)
      return wrap(corrupt_input("tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions (1 to 4 allowed)"));
    t.dims.resize(nd);
    t.n_elems = 1;
    for (auto& d : t.dims) {
      KVQ_RETURN_IF_ERROR(wrap(r.read(&d, "tensor dimension")));
      // Any tensor must fit in the file, so no dimension (and no product) may exceed its size
      // in elements of even the densest type (q4_k: 256 values in 144 bytes < 2 per byte).
      if (d == 0 || d > 2 * static_cast<uint64_t>(size_) || t.n_elems > 2 * static_cast<uint64_t>(size_) / d)
        return wrap(corrupt_input("tensor '" + t.name + "' has an impossible shape for a file of " +
                                  std::to_string(size_) + " bytes"));
      t.n_elems *= d;
    }
    KVQ_RETURN_IF_ERROR(wrap(r.read(&t.type, "tensor type")));
    KVQ_RETURN_IF_ERROR(wrap(r.read(&t.offset, "tensor offset")));
  }
  // r.pos() <= size_ and alignment_ <= 1 MiB: no overflow.
  data_start_ = (static_cast<uint64_t>(r.pos()) + alignment_ - 1) / alignment_ * alignment_;

  // Names are indexed once (a hash map, O(n)); find_tensor uses the index.
  tensor_index_.clear();
  tensor_index_.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensor_index_.emplace(std::string_view(tensors_[i].name), i).second)
      return wrap(corrupt_input("tensor name '" + tensors_[i].name + "' appears twice"));
  }
  // Sizes are checked for every tensor, also of unsupported types, so the table is trustworthy;
  // types kvq cannot decode are only refused when a tensor is read.
  for (auto& t : tensors_) {
    if (t.offset % alignment_ != 0)
      return wrap(corrupt_input("tensor '" + t.name + "' offset " + std::to_string(t.offset) +
                                " is not a multiple of the alignment " + std::to_string(alignment_)));
    auto layout = block_layout(t.type);
    if (!layout.is_ok()) continue;
    if (t.dims[0] % static_cast<uint64_t>(layout->elems) != 0)
      return wrap(corrupt_input("tensor '" + t.name + "' row of " + std::to_string(t.dims[0]) +
                                " values is not a whole number of " + tensor_type_name(t.type) + " blocks"));
    auto n_bytes = checked_product({t.n_elems / static_cast<uint64_t>(layout->elems), static_cast<uint64_t>(layout->bytes)},
                                   "byte count of tensor '" + t.name + "'");
    if (!n_bytes.is_ok()) return wrap(n_bytes.status());
    t.n_bytes = n_bytes.value();
    if (data_start_ > size_ || t.offset > size_ - data_start_ || t.n_bytes > size_ - data_start_ - t.offset)
      return wrap(corrupt_input("tensor '" + t.name + "' (" + std::to_string(t.n_bytes) + " bytes at offset " +
                                std::to_string(t.offset) + ") runs past the end of the file; is it truncated?"));
  }
  return Status::ok();
}

const Value* File::find(std::string_view key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
Status missing(std::string_view key) { return {StatusCode::kNotFound, "metadata key '" + std::string(key) + "' is missing"}; }
Status wrong_kind(std::string_view key, const char* want, const Value& v) {
  return invalid_argument("metadata key '" + std::string(key) + "' should be " + want + " but is " +
                          value_type_name(v.type));
}
}  // namespace

Result<int64_t> File::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return missing(key);
  if (!v->is_integer() || v->type == ValueType::kBool) return wrong_kind(key, "an integer", *v);
  auto r = v->as_int();
  if (!r.is_ok()) return invalid_argument("metadata key '" + std::string(key) + "': " + r.status().message());
  return r;
}

Result<double> File::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return missing(key);
  if (!v->is_number() || v->type == ValueType::kBool) return wrong_kind(key, "a number", *v);
  return v->as_double();
}

Result<bool> File::get_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return missing(key);
  if (v->type != ValueType::kBool) return wrong_kind(key, "a bool", *v);
  return v->u != 0;
}

Result<std::string> File::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return missing(key);
  if (v->type != ValueType::kString) return wrong_kind(key, "a string", *v);
  return v->str;
}

const uint8_t* File::tensor_data(const TensorInfo& t) const { return data_ + data_start_ + t.offset; }

Status File::read_f32(const TensorInfo& t, float* out) const {
  auto layout = block_layout(t.type);
  if (!layout.is_ok()) return Status(layout.status().code(), "tensor '" + t.name + "': " + layout.status().message());
  return dequantize(t.type, tensor_data(t), t.n_elems, out);
}

Result<std::vector<float>> File::read_f32(const TensorInfo& t) const {
  auto layout = block_layout(t.type);
  if (!layout.is_ok()) return Status(layout.status().code(), "tensor '" + t.name + "': " + layout.status().message());
  std::vector<float> v(t.n_elems);
  KVQ_RETURN_IF_ERROR(read_f32(t, v.data()));
  return v;
}

}  // namespace kvq::model::gguf
