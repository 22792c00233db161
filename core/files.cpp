#include "core/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>
#include <fstream>

#include "core/errors.h"

namespace kvlens {

namespace fs = std::filesystem;

namespace {

std::string err() { return std::strerror(errno); }

// Folder and file name of an output path, following a symlink at the target so that the link
// keeps pointing at the new contents.
void split_target(const std::string& path, std::string& dir, std::string& name) {
  fs::path p(path);
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(p, ec))) {
    const fs::path r = fs::weakly_canonical(p, ec);
    if (!ec) p = r;
  }
  dir = p.has_parent_path() ? p.parent_path().string() : std::string(".");
  if (dir.empty()) dir = ".";
  name = p.filename().string();
}

std::atomic<unsigned> g_temp_counter{0};

std::string temp_name(const std::string& name) {
  return "." + name + ".kvlens-tmp-" + std::to_string(::getpid()) + "-" +
         std::to_string(g_temp_counter.fetch_add(1));
}

// Throws unless `path` is absent or a regular file, and its folder is a writable folder.
void check_target(const std::string& path, const std::string& dir, const std::string& what) {
  if (path.empty()) throw InputError("an empty path was given for the " + what);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw InputError(path + ": cannot write " + what + ": it exists and is not a regular file");
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0)
    throw InputError(path + ": cannot write " + what + ": folder " + dir + " " +
                     (errno == ENOENT ? std::string("does not exist") : err()));
  if (!S_ISDIR(ds.st_mode)) throw InputError(path + ": cannot write " + what + ": " + dir + " is not a folder");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw InputError(path + ": cannot write " + what + ": folder " + dir + " is not writable (" + err() + ")");
}

// Whether process `pid` runs (a zombie, killed but not yet reaped, does not).
bool process_alive(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  const size_t paren = line.rfind(')');
  return !(paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z');
}

}  // namespace

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

int open_input_file(const std::string& path, const std::string& what, uint64_t* size) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; the descriptor is checked to be a
  // regular file before a byte is read, and regular files ignore the flag.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw InputError(path + ": " + what + " not found");
    throw InputError(path + ": cannot open " + what + " (" + err() + ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string e = err();
    ::close(fd);
    throw InputError(path + ": cannot read " + what + " (" + e + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path + ": not a regular file (" +
                     std::string(S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket") +
                     "), expected " + what);
  }
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::string read_input_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  uint64_t size = 0;
  const int fd = open_input_file(path, what, &size);
  if (size > max_bytes) {
    ::close(fd);
    throw InputError(path + ": " + what + " is " + std::to_string(size) + " bytes, expected at most " +
                     std::to_string(max_bytes));
  }
  std::string out(static_cast<size_t>(size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t r = ::read(fd, out.data() + got, out.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string e = r < 0 ? err() : std::string("file shrank while reading");
      ::close(fd);
      throw InputError(path + ": cannot read " + what + " (" + e + ")");
    }
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  return out;
}

void check_writable(const std::string& path, const std::string& what) {
  std::string dir, name;
  split_target(path, dir, name);
  check_target(path, dir, what);
  if (name.empty() || name == "." || name == "..")
    throw InputError(path + ": cannot write " + what + ": the path names a folder, expected a file");
  // Permission bits do not tell everything (root, read-only mounts, /proc): create and remove
  // an empty temporary file where the real one will be written.
  const std::string probe = dir + "/" + temp_name(name);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const std::string e = err();
    throw InputError(path + ": cannot write " + what + ": cannot create a file in " + dir + " (" + e + ")");
  }
  ::close(fd);
  ::unlink(probe.c_str());
  remove_stale_temporaries(dir, name);
}

void write_file_atomic(const std::string& path, std::string_view data, const std::string& what) {
  std::string dir, name;
  split_target(path, dir, name);
  check_target(path, dir, what);
  if (name.empty() || name == "." || name == "..")
    throw InputError(path + ": cannot write " + what + ": the path names a folder, expected a file");
  const std::string target = dir + "/" + name;
  const std::string tmp = dir + "/" + temp_name(name);
  auto fail = [&](const std::string& step, int fd) {
    const std::string e = err();
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw InputError(path + ": cannot write " + what + ": " + step + " failed (" + e + ")");
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    const std::string e = err();
    throw InputError(path + ": cannot write " + what + ": cannot create a file in " + dir + " (" + e + ")");
  }
  // An existing target keeps its permission bits.
  struct stat old {};
  if (::stat(target.c_str(), &old) == 0 && ::fchmod(fd, old.st_mode & 07777) != 0) fail("chmod", fd);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = ENOSPC;
      fail("write", fd);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) fail("fsync", fd);
  if (::close(fd) != 0) fail("close", -1);
  if (::rename(tmp.c_str(), target.c_str()) != 0) fail("rename", -1);
  // The rename itself is durable once the folder is synced; a folder that cannot be opened for
  // syncing (some network file systems) still holds the complete new file.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull, kFnvPrime = 1099511628211ull;

void fnv(uint64_t& h, const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * kFnvPrime;
}

void hash_file_into(uint64_t& h, const std::string& path, const std::string& what) {
  const int fd = open_input_file(path, what);
  std::vector<char> buf(1 << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string e = std::strerror(errno);
      ::close(fd);
      throw InputError(path + ": cannot read " + what + " (" + e + ")");
    }
    if (n == 0) break;
    fnv(h, buf.data(), static_cast<size_t>(n));
  }
  ::close(fd);
}

std::string hash_text(uint64_t h) {
  char out[40];
  std::snprintf(out, sizeof out, "fnv1a64:%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace

std::string file_content_hash(const std::string& path, const std::string& what) {
  uint64_t h = kFnvOffset;
  hash_file_into(h, path, what);
  return hash_text(h);
}

std::string folder_content_hash(const std::string& dir, const std::string& what) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InputError(dir + ": not a folder, expected " + what);
  std::vector<std::string> names;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (!is_temporary_name(n) && it->is_regular_file(ec)) names.push_back(n);
  }
  if (ec) throw InputError(dir + ": cannot list " + what + " (" + ec.message() + ")");
  std::sort(names.begin(), names.end());
  uint64_t h = kFnvOffset;
  for (const std::string& n : names) {
    fnv(h, n.c_str(), n.size() + 1);
    hash_file_into(h, dir + "/" + n, what);
  }
  return hash_text(h);
}

bool is_temporary_name(const std::string& n) {
  return n.size() > 1 && n[0] == '.' && n.find(".kvlens-") != std::string::npos;
}

void remove_stale_temporaries(const std::string& dir, const std::string& target_name) {
  const std::string prefix = target_name.empty() ? std::string(".") : "." + target_name + ".kvlens-";
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (!is_temporary_name(n) || n.rfind(prefix, 0) != 0) continue;
    // ".NAME.kvlens-TAG-PID-N": the PID sits between the last two dashes.
    const size_t b = n.rfind('-');
    const size_t a = b == std::string::npos || b == 0 ? std::string::npos : n.rfind('-', b - 1);
    if (a == std::string::npos) continue;
    const std::string pid_text = n.substr(a + 1, b - a - 1);
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid()) continue;
    if (process_alive(pid)) continue;  // its writer still runs
    std::error_code rm;
    fs::remove_all(it->path(), rm);
  }
}

}  // namespace kvlens
