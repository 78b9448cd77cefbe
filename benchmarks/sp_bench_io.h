// sp_bench's files, shared by --mode train and --mode decode: --inputs DIR (the full inputs, <DIR>/<name>.npy, read
// and checked on every rank) and --dump DIR (rank 0 writes the full outputs, with --dump-inputs also the inputs, and
// --json), each written atomically (bench::write_file_atomic). A mode supplies its list of names and shapes; the
// rules on the files are the same for every mode.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/comm.h"

namespace seqpar::bench {

// --json must not name a file --dump writes (<dump>/<name>.npy for each of `dumped`); Error naming both otherwise.
// Local (the same on every rank).
void check_json_not_dumped(const SpBenchOptions& o, const std::vector<std::string>& dumped);

// --inputs: each of `specs` read from <o.inputs_dir>/<name>.npy with exactly its shape, fp32 or fp64, every element
// finite and, when `value_rule` is given, allowed by it (value_rule(name, x): "" or the rule x breaks). Errors name
// the file, the element and the rule. Local (every rank reads the files itself).
NamedArrays load_inputs(const SpBenchOptions& o, const std::vector<TensorSpec>& specs,
                        const std::function<std::string(const std::string&, double)>& value_rule = {});

// The arrays as --dump-inputs writes them (and --inputs reads them back): fp64 stays fp64, every other floating dtype
// is widened to fp32 (which holds its values exactly).
NamedArrays widen_for_dump(const NamedArrays& arrays);

// Rank 0 writes the --dump files (with a packed row its cu_seqlens.npy; with --dump-inputs the arrays
// `inputs_to_dump()` returns; then `got`) and the --json file (when json is not null), after the table was printed;
// a failure stops at the first file that fails and is raised on every rank with rank 0's message. Collective over
// `world`. `inputs_to_dump` runs on rank 0 only, inside the same error handling.
void write_outputs(Communicator& world, const SpBenchOptions& o, const std::function<NamedArrays()>& inputs_to_dump,
                   const NamedArrays& got, const nlohmann::json* json);

}  // namespace seqpar::bench
