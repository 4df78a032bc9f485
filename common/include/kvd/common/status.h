// kvd's one error vocabulary: Status and StatusOr<T>.
//
// Every fallible function across a module boundary returns Status or StatusOr<T>; no exception
// crosses a module boundary. Codes are few and named for what the caller can do about them; the
// message says what exactly went wrong (which field, which value, which limit).
#pragma once

#include <cassert>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

namespace kvd {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something malformed (bad shape, NaN, bad frame)
  kNotFound = 2,            // the thing asked for does not exist (or was evicted)
  kAlreadyExists = 3,       // creating something that is already there
  kOutOfRange = 4,          // a size, index or count beyond a limit (oversized frame, budget)
  kFailedPrecondition = 5,  // the system is not in a state to do this (mismatched layout, seed)
  kResourceExhausted = 6,   // out of capacity (tier full, no free slot)
  kDeadlineExceeded = 7,    // a wait timed out (peer did not answer)
  kUnavailable = 8,         // a peer is gone or not reachable; retrying later may work
  kDataLoss = 9,            // bytes are corrupt (checksum mismatch, truncated data)
  kUnimplemented = 10,      // not supported by this build or backend
  kInternal = 11,           // an invariant broke: a bug in kvd
  kCancelled = 12,          // the operation was cancelled (shutdown)
  kAborted = 13,            // a concurrent change made the operation fail (expired lease)
  kPermissionDenied = 14,   // the caller may not do this (missing / wrong token, role, peer)
};

// Name of a code, e.g. "INVALID_ARGUMENT".
std::string_view StatusCodeName(StatusCode code);

// What a caller may branch on beyond the code, where one code covers outcomes a caller treats
// differently. A caller never reads meaning from a message: messages are for people. Carried on
// the wire (proto Error.reason); a reason a peer does not know arrives as kNone.
enum class Reason : int {
  kNone = 0,
  kDedup = 1,          // ALREADY_EXISTS: the chunk is already stored (as durably); nothing changed
  kZeroNormKey = 2,    // INVALID_ARGUMENT: KeyDiff cannot score a key whose norm is zero
  kQuotaExceeded = 3,  // RESOURCE_EXHAUSTED: the caller's namespace is at one of its quotas
};

// Name of a reason, e.g. "DEDUP"; "NONE" for kNone.
std::string_view ReasonName(Reason reason);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, Reason reason = Reason::kNone)
      : code_(code), reason_(code == StatusCode::kOk ? Reason::kNone : reason),
        message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
  static Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status ResourceExhausted(std::string m) {
    return {StatusCode::kResourceExhausted, std::move(m)};
  }
  static Status DeadlineExceeded(std::string m) {
    return {StatusCode::kDeadlineExceeded, std::move(m)};
  }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status PermissionDenied(std::string m) {
    return {StatusCode::kPermissionDenied, std::move(m)};
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  Reason reason() const { return reason_; }
  // A copy with this reason (OK stays OK, without a reason).
  Status WithReason(Reason reason) const { return Status(code_, message_, reason); }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message", "ALREADY_EXISTS (DEDUP): message" with a reason, or "OK".
  std::string ToString() const;
  // Returns a copy with "context: " prepended to the message (the reason kept); OK stays OK.
  Status WithContext(std::string_view context) const;
  // Explicitly ignore a status (documents the decision at the call site).
  void IgnoreError() const {}

  bool operator==(const Status& o) const {
    return code_ == o.code_ && reason_ == o.reason_ && message_ == o.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  Reason reason_ = Reason::kNone;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

// A value or an error. REQUIRES: constructed from a non-OK Status or from a value.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!status_.ok() && "StatusOr constructed from an OK Status without a value");
    if (status_.ok()) status_ = Status::Internal("StatusOr constructed from OK status");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // REQUIRES: ok().
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace kvd

#define KVD_CONCAT_INNER_(a, b) a##b
#define KVD_CONCAT_(a, b) KVD_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if it is not OK.
#define KVD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kvd::Status kvd_status_ = (expr);        \
    if (!kvd_status_.ok()) return kvd_status_; \
  } while (0)

// `KVD_ASSIGN_OR_RETURN(auto x, F());` declares x from a StatusOr or returns its error.
#define KVD_ASSIGN_OR_RETURN(lhs, expr) \
  KVD_ASSIGN_OR_RETURN_IMPL_(KVD_CONCAT_(kvd_statusor_, __LINE__), lhs, expr)
#define KVD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
