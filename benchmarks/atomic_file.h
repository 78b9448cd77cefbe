// Files written atomically, for every program that writes a result file (the benchmarks, device_probe): a small
// library of its own, so that a program needs neither MPI nor the benchmarks' other helpers to use it.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>

namespace seqpar::bench {

// Writes `path` atomically: `write` fills a temporary file in the same directory (`path` + ".tmp.<pid>"), which is
// flushed, closed and then renamed over `path`. Whatever fails (the callback throws, the stream goes bad, a full
// disk, the rename), the temporary file is removed and Error names `path` and the cause; `path` is then either
// absent or its previous content, never a partial file. `fail_after_bytes` >= 0 is a test hook: the stream fails
// once that many bytes have been written, as on a full disk.
void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write,
                       std::int64_t fail_after_bytes = -1);

}  // namespace seqpar::bench
