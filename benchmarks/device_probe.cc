// device_probe: the properties of one device as JSON, for scripts/gpu_check.sh's probe phase (saved as test data:
// the deviceless cuDNN support check reads a device's properties from such a file).
//   --device cuda[:N]: the CUDA runtime's properties under the key names of cuDNN's serialized device properties
//     (maxGridSize, multiProcessorCount, deviceVer = 100 major + 10 minor, ...), the runtime and driver versions,
//     and, in a build with the cuDNN frontend, cuDNN's own serialization of the device (cudnn_device_properties)
//     with the cuDNN version.
//   --device cpu: the host (hardware threads), so that a dry run of the check exercises the same command.
// Usage: device_probe [--device cpu|cuda|cuda:N] [--out FILE]   (stdout without --out). Exit 1 with the reason when
// the device is not usable. --out is written atomically (FILE.tmp.<pid>, then renamed: write_file_atomic);
// --test-fail-write-after N (a test hook) fails that write after N bytes, as a full disk would.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "benchmarks/atomic_file.h"
#include "benchmarks/bench_device.h"
#include "runtime/error.h"

#if defined(SEQPAR_WITH_CUDA)
#include "runtime/cuda_check.h"
#endif
#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
#include "attention/cuda/cudnn_sdpa_graphs.h"
#endif

namespace {

nlohmann::json cpu_properties() {
  nlohmann::json j;
  j["device"] = "cpu";
  j["hardware_threads"] = std::thread::hardware_concurrency();
  j["cuda_built"] = false;
#if defined(SEQPAR_WITH_CUDA)
  j["cuda_built"] = true;
#endif
  return j;
}

#if defined(SEQPAR_WITH_CUDA)
nlohmann::json cuda_properties(int ordinal) {
  cudaDeviceProp p{};
  SEQPAR_CHECK_CUDA(cudaGetDeviceProperties(&p, ordinal));
  auto attr = [&](cudaDeviceAttr a) {
    int v = 0;
    SEQPAR_CHECK_CUDA(cudaDeviceGetAttribute(&v, a, ordinal));
    return v;
  };
  int runtime = 0, driver = 0;
  SEQPAR_CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  SEQPAR_CHECK_CUDA(cudaDriverGetVersion(&driver));
  nlohmann::json j;
  j["device"] = seqpar::str_cat("cuda:", ordinal);
  j["deviceName"] = p.name;
  j["deviceVer"] = p.major * 100 + p.minor * 10;
  j["multiProcessorCount"] = p.multiProcessorCount;
  j["maxGridSize"] = {p.maxGridSize[0], p.maxGridSize[1], p.maxGridSize[2]};
  j["maxBlockSize"] = {p.maxThreadsDim[0], p.maxThreadsDim[1], p.maxThreadsDim[2]};
  j["maxThreadsPerBlock"] = p.maxThreadsPerBlock;
  j["maxThreadsPerSM"] = p.maxThreadsPerMultiProcessor;
  j["maxCtasPerSM"] = p.maxBlocksPerMultiProcessor;
  j["regsPerBlock"] = p.regsPerBlock;
  j["maxRegistersPerSM"] = p.regsPerMultiprocessor;
  j["warpSize"] = p.warpSize;
  j["maxSharedMemoryPerBlock"] = p.sharedMemPerBlock;
  j["maxSharedMemoryPerBlockOptin"] = p.sharedMemPerBlockOptin;
  j["reservedSharedMemoryPerBlock"] = p.reservedSharedMemPerBlock;
  j["totalGlobalMem"] = p.totalGlobalMem;
  j["l2CacheSize"] = p.l2CacheSize;
  j["smClockRateKHz"] = attr(cudaDevAttrClockRate);
  j["memClockRateKHz"] = attr(cudaDevAttrMemoryClockRate);
  j["pciDeviceId"] = p.pciDeviceID;
  j["isTccDriver"] = p.tccDriver;
  j["supportCoopLaunch"] = p.cooperativeLaunch;
  j["cudaDeviceId"] = ordinal;
  j["driverVer"] = driver;
  j["runtimeVer"] = runtime;
#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
  j["cudnn_version"] = seqpar::attn::cudnn::cudnn_version();
  j["cudnn_device_properties"] = seqpar::attn::cudnn::serialized_device_properties(ordinal);  // cuDNN's text
#endif
  return j;
}
#endif

int run(int argc, char** argv) {
  std::string device = "cpu", out, fail_after = "-1";
  const char* usage = "usage: device_probe [--device cpu|cuda|cuda:N] [--out FILE] [--test-fail-write-after N]";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage << "\n";
      return 0;
    }
    SEQPAR_CHECK((a == "--device" || a == "--out" || a == "--test-fail-write-after") && i + 1 < argc,
                 "unknown argument ", a, " (", usage, ")");
    (a == "--device" ? device : a == "--out" ? out : fail_after) = argv[++i];
  }
  std::int64_t fail_after_bytes = -1;
  std::size_t used = 0;
  try {
    fail_after_bytes = std::stoll(fail_after, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  SEQPAR_CHECK(used > 0 && used == fail_after.size() && fail_after_bytes >= -1, "--test-fail-write-after ", fail_after,
               " must be an integer >= 0");
  SEQPAR_CHECK(fail_after_bytes < 0 || !out.empty(), "--test-fail-write-after needs --out FILE (the write it fails)");
  [[maybe_unused]] const seqpar::Device d = seqpar::bench::parse_bench_device(device);
  nlohmann::json j = cpu_properties();
#if defined(SEQPAR_WITH_CUDA)
  if (d.is_cuda()) j = cuda_properties(d.index);
#endif
  const std::string text = j.dump(2) + "\n";
  if (out.empty()) {
    std::cout << text;
  } else {
    seqpar::bench::write_file_atomic(
        out, [&](std::ostream& os) { os << text; }, fail_after_bytes);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "device_probe: %s\n", e.what());
    return 1;
  }
}
