// sp_bench's --inputs and --dump files (benchmarks/sp_bench_io.h).
#include "benchmarks/sp_bench_io.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "benchmarks/bench_common.h"
#include "benchmarks/npy.h"
#include "benchmarks/sp_bench_timing.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
void check_json_not_dumped(const SpBenchOptions& o, const std::vector<std::string>& dumped) {
  if (o.json_path.empty() || o.dump_dir.empty()) return;
  auto normal = [](const std::filesystem::path& p) { return std::filesystem::absolute(p).lexically_normal(); };
  for (const std::string& name : dumped) {
    SEQPAR_CHECK(normal(o.json_path) != normal(std::filesystem::path(o.dump_dir) / (name + ".npy")), "--json ",
                 o.json_path, " is the file --dump ", o.dump_dir, " writes for ", name, "; choose another path");
  }
}

NamedArrays load_inputs(const SpBenchOptions& o, const std::vector<TensorSpec>& specs,
                        const std::function<std::string(const std::string&, double)>& value_rule) {
  NamedArrays inputs;
  for (const TensorSpec& s : specs) {
    npy::HostArray a = npy::read_expect((std::filesystem::path(o.inputs_dir) / (s.name + ".npy")).string(), s.shape);
    SEQPAR_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat64, o.inputs_dir, "/", s.name,
                 ".npy: element type ", dtype_name(a.dtype), " (inputs must be fp32 or fp64)");
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      const double x = a.dtype == DType::kFloat32 ? reinterpret_cast<const float*>(a.bytes.data())[i]
                                                  : reinterpret_cast<const double*>(a.bytes.data())[i];
      SEQPAR_CHECK(std::isfinite(x), o.inputs_dir, "/", s.name, ".npy: element ", i, " is ", x,
                   " (inputs must be finite)");
      if (!value_rule) continue;
      const std::string rule = value_rule(s.name, x);
      SEQPAR_CHECK(rule.empty(), o.inputs_dir, "/", s.name, ".npy: element ", i, " is ", x, " (", rule, ")");
    }
    inputs.emplace_back(s.name, std::move(a));
  }
  return inputs;
}

NamedArrays widen_for_dump(const NamedArrays& arrays) {
  NamedArrays out;
  for (const auto& [name, a] : arrays) {
    npy::HostArray wide(a.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, a.shape);
    copy_convert(a.view(), wide.view());
    out.emplace_back(name, std::move(wide));
  }
  return out;
}

void write_outputs(Communicator& world, const SpBenchOptions& o, const std::function<NamedArrays()>& inputs_to_dump,
                   const NamedArrays& got, const nlohmann::json* json) {
  std::string error;
  if (world.rank() == 0) {
    try {
      if (!o.dump_dir.empty()) {
        std::string names;
        const NamedArrays inputs = o.dump_inputs ? inputs_to_dump() : NamedArrays{};
        NamedArrays packing;  // a packed row's cu_seqlens (int64 [N+1]), as --inputs reads it
        if (o.packed()) {
          const std::vector<std::int64_t> cu = cu_seqlens_of(o.doc_lens);
          npy::HostArray a(DType::kInt64, {static_cast<std::int64_t>(cu.size())});
          std::copy(cu.begin(), cu.end(), a.view().data_as<std::int64_t>());
          packing.emplace_back("cu_seqlens", std::move(a));
        }
        for (const NamedArrays* arrays : {static_cast<const NamedArrays*>(&packing), &inputs, &got}) {
          for (const auto& [name, a] : *arrays) {
            const std::string path = (std::filesystem::path(o.dump_dir) / (name + ".npy")).string();
            write_file_atomic(
                path, [&](std::ostream& out) { npy::write(out, a.view(), path); }, o.test_fail_write_after);
            names += " " + name;
          }
        }
        std::printf("# dumped%s to %s\n", names.c_str(), o.dump_dir.c_str());
      }
      if (json != nullptr) {
        write_file_atomic(
            o.json_path, [&](std::ostream& out) { out << json->dump(2) << "\n"; }, o.test_fail_write_after);
      }
      std::fflush(stdout);
    } catch (const Error& e) {
      error = e.message();
    } catch (const std::exception& e) {  // whatever it is, the other ranks must hear of it
      error = e.what();
    }
  }
  // The message travels from rank 0 (length, then the bytes as int32), so every rank fails with the same line.
  std::int32_t length = static_cast<std::int32_t>(error.size());
  world.broadcast(TensorView(&length, DType::kInt32, {1}), 0)->wait(kLongWaitS);
  if (length == 0) return;
  std::vector<std::int32_t> chars(error.begin(), error.end());
  chars.resize(static_cast<std::size_t>(length));
  world.broadcast(TensorView(chars.data(), DType::kInt32, {length}), 0)->wait();
  SEQPAR_THROW("writing the output files (rank 0): ", std::string(chars.begin(), chars.end()));
}

}  // namespace seqpar::bench
