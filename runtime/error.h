// seqpar's one exception type and the check macros used at every library boundary.
//
// Every message carries the rank of the process that raised it ("rank 3: ..."), so that a failure in a
// multi-rank job can be attributed. Library macros (MPI here; CUDA and NCCL in runtime/cuda_check.h) also name the
// call, the file and line, and the library's own error string. Habits from NCCL checks.h and TransformerEngine
// NVTE_CHECK.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace seqpar {

// Rank used to prefix error and log messages; -1 until a communicator sets it.
int process_rank();
void set_process_rank(int rank);

// Concatenates any streamable values into one string.
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// The project's exception. `what()` is "rank R: <message>" (or just the message before a rank is known).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message);
  // The message without the rank prefix; identical on every rank for a configuration error.
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace seqpar

// Throws seqpar::Error with the streamed arguments when `cond` is false.
#define SEQPAR_CHECK(cond, ...)                              \
  do {                                                       \
    if (!(cond)) [[unlikely]] {                              \
      throw ::seqpar::Error(::seqpar::str_cat(__VA_ARGS__)); \
    }                                                        \
  } while (0)

// Throws unconditionally; for unsupported cases ("backend X does not support Y").
#define SEQPAR_THROW(...) throw ::seqpar::Error(::seqpar::str_cat(__VA_ARGS__))

// Internal invariants: names file and line, since they point at a seqpar bug rather than bad input.
#define SEQPAR_ASSERT(cond, ...)                                                                    \
  do {                                                                                              \
    if (!(cond)) [[unlikely]] {                                                                     \
      ::seqpar::throw_error(__FILE__, __LINE__,                                                     \
                            ::seqpar::str_cat("internal check failed: " #cond " ", ##__VA_ARGS__)); \
    }                                                                                               \
  } while (0)

namespace seqpar::detail {
[[noreturn]] void throw_mpi_error(const char* call, int code, const char* file, int line);
}  // namespace seqpar::detail

// Wraps an MPI call: on a non-success return, throws naming the call, file:line and MPI's error string.
#define SEQPAR_CHECK_MPI(call)                                                      \
  do {                                                                              \
    int seqpar_mpi_rc_ = (call);                                                    \
    if (seqpar_mpi_rc_ != 0) [[unlikely]] {                                         \
      ::seqpar::detail::throw_mpi_error(#call, seqpar_mpi_rc_, __FILE__, __LINE__); \
    }                                                                               \
  } while (0)

// The CUDA and NCCL check macros (SEQPAR_CHECK_CUDA, SEQPAR_CHECK_NCCL) live in the internal runtime/cuda_check.h, so
// that public headers never pull in CUDA or NCCL.
