#pragma once
// A minimal GGUF writer for tests: builds files byte by byte from the format description, so the
// reader is checked against an independent producer (and can be fed deliberately broken files).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvq::model::testing {

class GgufWriter {
 public:
  explicit GgufWriter(uint32_t version = 3, uint64_t alignment = 32) : version_(version), alignment_(alignment) {}

  // Metadata values, already encoded (type id + payload).
  void kv_u32(const std::string& k, uint32_t v) { key(k, 4); pod(meta_, v); ++n_kv_; }
  void kv_i32(const std::string& k, int32_t v) { key(k, 5); pod(meta_, v); ++n_kv_; }
  void kv_f32(const std::string& k, float v) { key(k, 6); pod(meta_, v); ++n_kv_; }
  void kv_bool(const std::string& k, bool v) { key(k, 7); pod(meta_, static_cast<uint8_t>(v)); ++n_kv_; }
  void kv_str(const std::string& k, const std::string& v) { key(k, 8); str(meta_, v); ++n_kv_; }
  void kv_u64(const std::string& k, uint64_t v) { key(k, 10); pod(meta_, v); ++n_kv_; }
  void kv_i64(const std::string& k, int64_t v) { key(k, 11); pod(meta_, v); ++n_kv_; }
  void kv_f64(const std::string& k, double v) { key(k, 12); pod(meta_, v); ++n_kv_; }
  void kv_u8(const std::string& k, uint8_t v) { key(k, 0); pod(meta_, v); ++n_kv_; }
  void kv_i8(const std::string& k, int8_t v) { key(k, 1); pod(meta_, v); ++n_kv_; }
  void kv_u16(const std::string& k, uint16_t v) { key(k, 2); pod(meta_, v); ++n_kv_; }
  void kv_i16(const std::string& k, int16_t v) { key(k, 3); pod(meta_, v); ++n_kv_; }
  void kv_str_array(const std::string& k, const std::vector<std::string>& v) {
    key(k, 9);
    pod(meta_, uint32_t{8});
    pod(meta_, static_cast<uint64_t>(v.size()));
    for (const auto& s : v) str(meta_, s);
    ++n_kv_;
  }
  void kv_i32_array(const std::string& k, const std::vector<int32_t>& v) {
    key(k, 9);
    pod(meta_, uint32_t{5});
    pod(meta_, static_cast<uint64_t>(v.size()));
    for (int32_t x : v) pod(meta_, x);
    ++n_kv_;
  }
  // Raw escape hatch: key, type id and payload bytes as given.
  void kv_raw(const std::string& k, uint32_t type, const std::vector<uint8_t>& payload) {
    key(k, type);
    meta_.insert(meta_.end(), payload.begin(), payload.end());
    ++n_kv_;
  }

  // Adds a tensor whose data are `bytes` (already encoded in `type`); dims fastest first.
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, const std::vector<uint8_t>& bytes) {
    // Padding goes before each tensor, so the file ends right after the last tensor's bytes.
    while (data_.size() % alignment_ != 0) data_.push_back(0);
    Tensor t{name, std::move(dims), type, data_.size()};
    data_.insert(data_.end(), bytes.begin(), bytes.end());
    tensors_.push_back(std::move(t));
  }
  void tensor_f32(const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    tensor(name, std::move(dims), 0, b);
  }

  // Overrides for malformed files.
  uint64_t forced_tensor_count = UINT64_MAX;
  uint64_t forced_kv_count = UINT64_MAX;
  uint32_t magic = 0x46554747;

  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out;
    pod(out, magic);
    pod(out, version_);
    pod(out, forced_tensor_count != UINT64_MAX ? forced_tensor_count : static_cast<uint64_t>(tensors_.size()));
    pod(out, forced_kv_count != UINT64_MAX ? forced_kv_count : n_kv_);
    out.insert(out.end(), meta_.begin(), meta_.end());
    for (const auto& t : tensors_) {
      str(out, t.name);
      pod(out, static_cast<uint32_t>(t.dims.size()));
      for (uint64_t d : t.dims) pod(out, d);
      pod(out, t.type);
      pod(out, static_cast<uint64_t>(t.offset));
    }
    while (out.size() % alignment_ != 0) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

  template <class T>
  static void pod(std::vector<uint8_t>& out, T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
  }
  static void str(std::vector<uint8_t>& out, const std::string& s) {
    pod(out, static_cast<uint64_t>(s.size()));
    out.insert(out.end(), s.begin(), s.end());
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    size_t offset;
  };
  void key(const std::string& k, uint32_t type) {
    str(meta_, k);
    pod(meta_, type);
  }
  uint32_t version_;
  uint64_t alignment_;
  uint64_t n_kv_ = 0;
  std::vector<uint8_t> meta_;
  std::vector<uint8_t> data_;
  std::vector<Tensor> tensors_;
};

}  // namespace kvq::model::testing
