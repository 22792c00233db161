// --backend / --device / --fp16 on every command that runs a model.
#pragma once
#include <CLI/CLI.hpp>

#include "app/cli/options.h"
#include "core/backend.h"

namespace kvlens::app {

inline void add_backend_options(CLI::App* c, BackendOptions& o) {
  o.kind = "auto";
  c->add_option("--backend", o.kind, "Where the model runs: cpu, cuda, or auto (CUDA when a device is usable)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  add_int(c, "--device", o.device, 0, 1024, "CUDA device ordinal");
  c->add_flag("--fp16", o.fp32_as_fp16, "CUDA: keep an fp32 checkpoint's matrices as fp16 on the device");
}

}  // namespace kvlens::app
