// Child processes with pipes: a line-oriented conversation (METEOR's Java scorer) and one-shot
// commands whose output is captured. Writes to a child that has exited fail with an error
// instead of killing the process with SIGPIPE.
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

namespace kvlens {

class Subprocess {
 public:
  // Starts argv[0] (searched on PATH when it has no '/') in `cwd` ("" = the current folder)
  // with stdin and stdout connected to this object and stderr sent to /dev/null. Throws
  // InputError naming the program when it cannot be started.
  Subprocess(const std::vector<std::string>& argv, const std::string& cwd = "");
  ~Subprocess();  // closes stdin, waits briefly, then kills the child
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Throws InputError "<what>: ..." when the child is gone.
  void write_line(const std::string& line, const std::string& what);
  // One line without its '\n'; throws InputError when the child closes its output or does not
  // answer within `timeout_s` seconds.
  std::string read_line(double timeout_s, const std::string& what);

 private:
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buffer_;
};

// Runs argv to completion and returns its stdout; `ok` tells whether it exited with status 0.
// A program that cannot be started gives ok = false.
std::string run_capture(const std::vector<std::string>& argv, bool& ok, double timeout_s = 20);

// The path of `name` on PATH ("" when absent or not executable).
std::string find_on_path(const std::string& name);

}  // namespace kvlens
