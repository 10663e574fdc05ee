#pragma once
// Oracle vectors from numpy + ml_dtypes (scripts/gen_fp8_vectors.py), generated at test time into
// the build tree (never committed). ctest runs every test in its own process, so the folder is
// reused while its stamp (written last by the script) is newer than the script; files are renamed
// into place, so parallel processes that both regenerate never see a half-written file.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace kvq::test {

struct Oracle {
  std::string error;  // non-empty: why the vectors are unavailable (shown by the failing test)
  std::vector<float> fp8_e4m3_decode, fp8_e4m3_fnuz_decode, int8_decode, int4_decode;
  std::vector<float> fp16_decode, bf16_decode;
  std::vector<float> sweep_inputs;
  std::vector<uint8_t> sweep_fp8_e4m3, sweep_fp8_e4m3_fnuz;
  std::vector<float> half_inputs;
  std::vector<uint16_t> half_fp16, half_bf16;
  bool ok() const { return error.empty(); }
};

template <class T>
bool read_raw(const std::string& path, std::vector<T>& out, std::string& error) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes;
  if (in) bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (!in || bytes.empty() || bytes.size() % sizeof(T) != 0) {
    error = "oracle file " + path + " is missing or malformed";
    return false;
  }
  out.resize(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), bytes.size());  // files are little-endian, as is the host
  return true;
}

inline Oracle load_oracle() {
  Oracle o;
  const std::string dir = std::string(KVQ_TEST_BINARY_DIR) + "/format_oracle";
  const std::string cmd = std::string("\"") + KVQ_PYTHON + "\" \"" + KVQ_SOURCE_DIR +
                          "/scripts/gen_fp8_vectors.py\" \"" + dir + "\"";
  namespace fs = std::filesystem;
  std::error_code ec1, ec2;
  const auto stamp = fs::last_write_time(dir + "/stamp", ec1);
  const auto script = fs::last_write_time(std::string(KVQ_SOURCE_DIR) + "/scripts/gen_fp8_vectors.py", ec2);
  const bool fresh = !ec1 && !ec2 && stamp >= script;
  const int rc = fresh ? 0 : std::system(cmd.c_str());
  if (rc != 0) {
    o.error = "could not generate the ml_dtypes oracle vectors (`" + cmd + "` exited with status " +
              std::to_string(rc) + "); the codec tests need numpy and ml_dtypes: pip install ml_dtypes numpy";
    return o;
  }
  const bool all = read_raw(dir + "/fp8_e4m3_decode.f32", o.fp8_e4m3_decode, o.error) &&
                   read_raw(dir + "/fp8_e4m3_fnuz_decode.f32", o.fp8_e4m3_fnuz_decode, o.error) &&
                   read_raw(dir + "/int8_decode.f32", o.int8_decode, o.error) &&
                   read_raw(dir + "/int4_decode.f32", o.int4_decode, o.error) &&
                   read_raw(dir + "/fp16_decode.f32", o.fp16_decode, o.error) &&
                   read_raw(dir + "/bf16_decode.f32", o.bf16_decode, o.error) &&
                   read_raw(dir + "/sweep_inputs.f32", o.sweep_inputs, o.error) &&
                   read_raw(dir + "/sweep_fp8_e4m3.u8", o.sweep_fp8_e4m3, o.error) &&
                   read_raw(dir + "/sweep_fp8_e4m3_fnuz.u8", o.sweep_fp8_e4m3_fnuz, o.error) &&
                   read_raw(dir + "/half_inputs.f32", o.half_inputs, o.error) &&
                   read_raw(dir + "/half_fp16.u16", o.half_fp16, o.error) &&
                   read_raw(dir + "/half_bf16.u16", o.half_bf16, o.error);
  if (!all) return o;
  if (o.fp8_e4m3_decode.size() != 256 || o.fp8_e4m3_fnuz_decode.size() != 256 || o.int8_decode.size() != 256 ||
      o.int4_decode.size() != 16 || o.fp16_decode.size() != 65536 || o.bf16_decode.size() != 65536 ||
      o.sweep_fp8_e4m3.size() != o.sweep_inputs.size() || o.sweep_fp8_e4m3_fnuz.size() != o.sweep_inputs.size() ||
      o.half_fp16.size() != o.half_inputs.size() || o.half_bf16.size() != o.half_inputs.size())
    o.error = "oracle vectors in " + dir + " have unexpected sizes; delete the folder and rerun";
  return o;
}

// Loaded once per process.
inline const Oracle& oracle() {
  static const Oracle o = load_oracle();
  return o;
}

}  // namespace kvq::test
