// Every file kvlens reads as input and every file it writes goes through here.
//
// Inputs: only regular files are read. A FIFO, a device or a folder given where a file is
// expected is refused with a message naming the path, before anything could block on it.
//
// Outputs: one atomic writer. The bytes go to a temporary file in the target's folder, which is
// written, flushed, fsynced and renamed over the target (then the folder is fsynced), each step
// checked. A failed or interrupted write leaves the previous file as it was; a target that
// exists and is not a regular file (/dev/full, a folder) is refused.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace kvlens {

// Whether anything exists at `path` (following symlinks).
bool file_exists(const std::string& path);

// Opens `path` read-only and returns the descriptor; throws InputError
// "<path>: cannot open <what> (...)" or "<path>: not a regular file, expected <what>".
// `size`, when given, receives the file size.
int open_input_file(const std::string& path, const std::string& what, uint64_t* size = nullptr);

// Reads a whole input file (at most `max_bytes`, else InputError naming the limit).
std::string read_input_file(const std::string& path, const std::string& what,
                            uint64_t max_bytes = uint64_t{1} << 32);

// Content hashes, "fnv1a64:<16 hex digits>": of a file's bytes, and of a folder (every regular
// file directly in it, in name order: its name, then its bytes; temporaries skipped). Sessions
// record them to tell whether a model or image changed since. Throws InputError naming the path.
std::string file_content_hash(const std::string& path, const std::string& what);
std::string folder_content_hash(const std::string& dir, const std::string& what);

// Replaces `path` with `data` atomically; throws InputError "<path>: cannot write <what>: ..."
// and leaves the previous file untouched when any step fails.
void write_file_atomic(const std::string& path, std::string_view data, const std::string& what);

// Checks, before any work is done, that `path` could be written: its folder exists and is
// writable and the target is absent or a regular file. Throws InputError as write_file_atomic.
void check_writable(const std::string& path, const std::string& what);

// Temporary names in a folder: ".NAME.kvlens-TAG-PID-N" (TAG "tmp" for the atomic writer,
// "partial" / "old" for scene sets). Stale ones, left by a killed process that no longer
// runs, are removed by remove_stale_temporaries (those of one target when `target_name` is
// given); check_writable does it for its target.
bool is_temporary_name(const std::string& file_name);
void remove_stale_temporaries(const std::string& dir, const std::string& target_name = "");

}  // namespace kvlens
