#include "attention/cpu/scratch.h"

#include <new>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "runtime/memory.h"

namespace seqpar::attn::cpu {

int max_workers() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int worker_id() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

void throw_out_of_memory(const std::string& what, std::int64_t bytes) {
  SEQPAR_THROW("out of memory: ", what, " asked for ", bytes, " bytes (the ledger holds ", ledger_totals(), ")");
}

Tensor zeroed_workspace(const Shape& shape, DType dtype, const std::string& what) {
  const std::int64_t bytes = shape_numel(shape) * static_cast<std::int64_t>(dtype_size(dtype));
  try {
    return Tensor::zeros(shape, dtype, MemCategory::kWorkspace);
  } catch (const std::bad_alloc&) {
    throw_out_of_memory(what, bytes);
  } catch (const Error& e) {
    if (e.message().rfind("out of memory", 0) != 0) throw;
    throw_out_of_memory(what, bytes);
  }
}

}  // namespace seqpar::attn::cpu
