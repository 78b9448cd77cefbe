// sp_bench --mode decode's arrays (benchmarks/sp_bench_decode.h): what each kind reads with --inputs and writes with
// --dump, and the inputs of a run, made from the seed or read from the files. A kind with a decode adds its names to
// decode_arrays().
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"

namespace seqpar::bench {

// One input of a decode run. A token input (per_token) holds `row` [...] per token: files <name> [B, T, row...] and
// <name>_dec [B, N n, row...]; a whole input (per_token false) is one file of shape `row`. Without --inputs, element e
// of token t (of the whole sequence of S = T + chunk + N n tokens, batch row b) is uniform in [lo, hi) from
// (--seed, salt, (b S + t) numel(row) + e); of a whole input from (--seed, salt, e). dtype: --dtype, or its
// accumulator dtype when state_dtype (GDN's initial_state).
struct DecodeInput {
  std::string name;
  Shape row;
  bool per_token = true;
  int salt = 0;
  double lo = -1, hi = 1;
  bool state_dtype = false;
};

// What a kind reads and writes: its inputs in file order and its outputs (full shapes), for the options.
struct DecodeArrays {
  std::vector<DecodeInput> inputs;
  std::vector<TensorSpec> outputs;
};
// The arrays of --attn o.attn (mha, gdn, dsa; Error for a kind without decode). Local arithmetic.
DecodeArrays decode_arrays(const SpBenchOptions& o);
// The files of `inputs`: every token input as <name> [B, T, ...] and <name>_dec [B, N n, ...], whole ones as they are.
std::vector<TensorSpec> decode_input_specs(const SpBenchOptions& o, const std::vector<DecodeInput>& inputs);

// The inputs of a run: from the --inputs files (`loaded`, in decode_input_specs order, checked) or the seed.
// Local (no communication); every rank makes the rows it needs.
class DecodeInputs {
 public:
  DecodeInputs(const SpBenchOptions& o, std::vector<DecodeInput> inputs, const NamedArrays* loaded);
  // Rows `tokens` (positions in the whole sequence; -1: a padding row, zeros) of token input `name`:
  // [B, tokens.size(), row...]. From files only the prompt's [0, T) and the steps' [T + chunk, S) exist.
  Tensor rows(const std::string& name, std::span<const std::int64_t> tokens) const;
  // A whole input; empty when `name` is not an input of this run (GDN's conv_weight without --conv-width).
  Tensor whole(const std::string& name) const;
  // The full inputs in decode_input_specs order, the files --dump-inputs writes.
  NamedArrays full() const;

 private:
  const DecodeInput* lookup(const std::string& name) const;  // nullptr when not an input of this run
  const DecodeInput& find(const std::string& name) const;    // Error when not

  const SpBenchOptions& o_;
  std::vector<DecodeInput> inputs_;
  const NamedArrays* loaded_;
  std::int64_t prompt_, first_step_, total_;  // T, T + chunk, S
};

// Tokens [begin, end), increasing.
std::vector<std::int64_t> token_range(std::int64_t begin, std::int64_t end);

}  // namespace seqpar::bench
