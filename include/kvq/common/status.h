#pragma once
#include <string>
#include <utility>

namespace kvq {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // bad option, shape or value supplied by the caller
  kUnsupported,       // valid request this backend/build cannot serve (shape, dtype, no GPU)
  kOutOfMemory,       // page pool or device memory exhausted
  kCorruptInput,      // malformed file or bytes that break a format rule
  kNotFound,
  kInternal,          // a bug or a failed self-check
  kCudaError,
};

const char* to_string(StatusCode c);

// A library never exits: it returns a Status whose message tells the user what to change.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status out_of_memory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
inline Status corrupt_input(std::string m) { return {StatusCode::kCorruptInput, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Value-or-error, for functions that produce something.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  bool is_ok() const { return status_.is_ok(); }
  const Status& status() const { return status_; }
  T& value() & { return value_; }
  const T& value() const& { return value_; }
  T&& value() && { return std::move(value_); }
  T* operator->() { return &value_; }
  const T* operator->() const { return &value_; }

 private:
  Status status_;
  T value_{};
};

#define KVQ_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kvq::Status kvq_status_ = (expr);        \
    if (!kvq_status_.is_ok()) return kvq_status_; \
  } while (0)

}  // namespace kvq
