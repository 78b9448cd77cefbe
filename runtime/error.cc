#include "runtime/error.h"

#if SEQPAR_WITH_MPI
#include <mpi.h>
#endif

#include <atomic>

namespace seqpar {
namespace {
std::atomic<int> g_process_rank{-1};

std::string with_rank(const std::string& message) {
  const int rank = process_rank();
  return rank >= 0 ? str_cat("rank ", rank, ": ", message) : message;
}
}  // namespace

int process_rank() { return g_process_rank.load(std::memory_order_relaxed); }
void set_process_rank(int rank) { g_process_rank.store(rank, std::memory_order_relaxed); }

Error::Error(const std::string& message) : std::runtime_error(with_rank(message)), message_(message) {}

void throw_error(const char* file, int line, const std::string& message) {
  throw Error(str_cat(message, " (", file, ":", line, ")"));
}

namespace detail {
#if SEQPAR_WITH_MPI
void throw_mpi_error(const char* call, int code, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) {
    snprintf(text, sizeof(text), "MPI error code %d", code);
  }
  throw_error(file, line, str_cat("MPI call ", call, " failed: ", text));
}
#endif
}  // namespace detail
}  // namespace seqpar
