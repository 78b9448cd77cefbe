// Files written atomically (benchmarks/atomic_file.h).
#include "benchmarks/atomic_file.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <streambuf>
#include <string>

#include "runtime/error.h"

namespace seqpar::bench {
namespace {

// Forwards to `sink` and counts the bytes; with limit >= 0 it refuses every byte past the limit, so that the stream
// goes bad exactly as it does on a full disk.
class CountingBuf final : public std::streambuf {
 public:
  CountingBuf(std::streambuf* sink, std::int64_t limit) : sink_(sink), limit_(limit) {}

 protected:
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    const char ch = traits_type::to_char_type(c);
    return xsputn(&ch, 1) == 1 ? c : traits_type::eof();
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    const std::streamsize allowed = limit_ < 0 ? n : std::clamp<std::streamsize>(limit_ - written_, 0, n);
    const std::streamsize put = allowed > 0 ? sink_->sputn(s, allowed) : 0;
    written_ += put;
    return put;
  }
  int sync() override { return sink_->pubsync(); }

 private:
  std::streambuf* sink_;
  std::int64_t limit_;
  std::int64_t written_ = 0;
};

}  // namespace

void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write,
                       std::int64_t fail_after_bytes) {
  const std::string tmp = str_cat(path, ".tmp.", static_cast<long>(::getpid()));
  std::string cause;
  try {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (!file.is_open()) {
      cause = str_cat("cannot create the temporary file ", tmp, " (", std::strerror(errno), ")");
    } else {
      CountingBuf buf(file.rdbuf(), fail_after_bytes);
      std::ostream out(&buf);
      write(out);
      out.flush();
      const bool written = out.good();
      errno = 0;
      file.close();  // flushes the file's own buffer: a full disk may only show here
      if (!written || file.fail()) {
        cause = str_cat("write error", errno != 0 ? str_cat(" (", std::strerror(errno), ")") : std::string(),
                        fail_after_bytes >= 0 ? str_cat(" (simulated after ", fail_after_bytes, " bytes)") : "");
      }
    }
  } catch (const Error& e) {
    cause = e.message();
  } catch (const std::exception& e) {
    cause = e.what();
  }
  std::error_code ec;
  if (cause.empty()) {
    std::filesystem::rename(tmp, path, ec);
    if (ec) cause = str_cat("cannot rename ", tmp, " to it (", ec.message(), ")");
  }
  if (!cause.empty()) {
    std::filesystem::remove(tmp, ec);
    SEQPAR_THROW(path, ": ", cause, " (the temporary file was removed; ", path, " not written)");
  }
}

}  // namespace seqpar::bench
