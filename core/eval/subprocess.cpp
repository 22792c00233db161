#include "core/eval/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/errors.h"

namespace kvlens {

namespace {

bool executable(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0;
}

// fork + exec with the child's stdin/stdout on pipes; stderr to /dev/null.
pid_t spawn(const std::vector<std::string>& argv, const std::string& cwd, int& to_child, int& from_child) {
  const std::string prog = argv.at(0).find('/') == std::string::npos ? find_on_path(argv[0]) : argv[0];
  if (prog.empty() || !executable(prog)) return -1;
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return -1;
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]), close(in[1]);
    return -1;
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    const int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) dup2(devnull, 2);
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(126);
    execv(prog.c_str(), args.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  if (pid < 0) {
    close(in[1]), close(out[0]);
    return -1;
  }
  to_child = in[1];
  from_child = out[0];
  return pid;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void reap(pid_t pid, double grace_s) {
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (seconds_since(t0) > grace_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t b = 0;
  while (b <= p.size()) {
    size_t e = p.find(':', b);
    if (e == std::string::npos) e = p.size();
    const std::string dir = p.substr(b, e - b);
    const std::string cand = (dir.empty() ? "." : dir) + "/" + name;
    if (executable(cand)) return cand;
    b = e + 1;
  }
  return "";
}

Subprocess::Subprocess(const std::vector<std::string>& argv, const std::string& cwd) {
  pid_ = spawn(argv, cwd, in_, out_);
  if (pid_ < 0) throw InputError(argv.at(0) + ": cannot be started");
}

Subprocess::~Subprocess() {
  if (in_ >= 0) close(in_);
  if (out_ >= 0) close(out_);
  if (pid_ > 0) reap(pid_, 5.0);
}

void Subprocess::write_line(const std::string& line, const std::string& what) {
  // Block SIGPIPE in this thread so that a dead child gives EPIPE; a pending SIGPIPE raised by
  // our write is consumed before the mask is restored.
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  const std::string data = line + "\n";
  size_t done = 0;
  int err = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(in_, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == EPIPE) {
    const timespec zero{0, 0};
    sigtimedwait(&pipe_set, nullptr, &zero);
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (err) throw InputError(what + ": the process stopped reading (" + std::strerror(err) + ")");
}

std::string Subprocess::read_line(double timeout_s, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      return line;
    }
    const double left = timeout_s - seconds_since(t0);
    if (left <= 0) throw InputError(what + ": no answer within " + std::to_string(static_cast<int>(timeout_s)) + " s");
    pollfd p{out_, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left * 1000) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(out_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw InputError(what + ": the process exited without answering");
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

std::string run_capture(const std::vector<std::string>& argv, bool& ok, double timeout_s) {
  ok = false;
  int in = -1, out = -1;
  const pid_t pid = spawn(argv, "", in, out);
  if (pid < 0) return "";
  close(in);
  std::string text;
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const double left = timeout_s - seconds_since(t0);
    if (left <= 0) break;
    pollfd p{out, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left * 1000) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    char buf[4096];
    const ssize_t n = ::read(out, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(out);
  int status = 0;
  const auto t1 = std::chrono::steady_clock::now();
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (seconds_since(t1) > 2.0) {  // output closed but still running: give up on it
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return text;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return text;
}

}  // namespace kvlens
