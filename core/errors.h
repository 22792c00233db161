// Typed errors thrown by core/, kernels/ and models/. Only app/ decides what a failure means
// to a person (print, exit code 2, GUI message).
#pragma once
#include <stdexcept>
#include <string>

namespace kvlens {

// Bad input from the user: a file, a tensor, a parameter or a value that is not what was
// expected. The message names the thing and what was expected, in one line.
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& what) : std::runtime_error(what) {}
};

// A computation stopped because its caller asked it to (a newer request replaced it). Not a
// failure to show: the caller that cancelled expects it.
class Cancelled : public std::runtime_error {
 public:
  explicit Cancelled(const std::string& what) : std::runtime_error(what) {}
};

// A model's activations went NaN or infinite: bad weights (or an overflow) in the checkpoint.
// The message names the first tensor that did.
class NonFiniteError : public InputError {
 public:
  explicit NonFiniteError(const std::string& what) : InputError(what) {}
};

// A broken invariant inside kvlens (a bug, not bad input).
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& what) : std::logic_error(what) {}
};

}  // namespace kvlens
