// --device of the benchmarks: cpu (default), cuda or cuda:N. Header-only, shared by sp_bench and kernel_bench.
#pragma once

#include <string>

#include "runtime/device.h"
#include "runtime/error.h"

namespace seqpar::bench {

// The device named by `value` (the value of the option `flag`, e.g. "--device").
// Errors: a value other than cpu, cuda, cuda:N (N >= 0); cuda in a build without CUDA ("built without CUDA"); cuda
//   when no device is usable (the driver's reason); an ordinal beyond the visible devices.
// Sync: host-only (asks the CUDA runtime for the device count in a CUDA build).
inline Device parse_bench_device(const std::string& value, const char* flag = "--device") {
  if (value == "cpu") return Device::cpu();
  int ordinal = -1;
  if (value == "cuda") {
    ordinal = 0;
  } else if (value.rfind("cuda:", 0) == 0 && value.size() > 5 &&
             value.find_first_not_of("0123456789", 5) == std::string::npos && value.size() <= 9) {
    ordinal = std::stoi(value.substr(5));
  }
  SEQPAR_CHECK(ordinal >= 0, flag, " ", value, " must be cpu, cuda or cuda:N");
#if defined(SEQPAR_WITH_CUDA)
  const std::string why = cuda_unavailable_reason();
  SEQPAR_CHECK(why.empty(), flag, " ", value, ": ", why);
  SEQPAR_CHECK(ordinal < cuda_device_count(), flag, " ", value, ": device ", ordinal, " is not one of the ",
               cuda_device_count(), " visible CUDA devices");
#else
  SEQPAR_THROW(flag, " ", value, ": this seqpar was built without CUDA (SEQPAR_WITH_CUDA=OFF); ", flag,
               " must be cpu in this build");
#endif
  return Device::cuda(ordinal);
}

}  // namespace seqpar::bench
