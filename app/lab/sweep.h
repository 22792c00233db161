// Parameter grids for `kvlens sweep` and `kvlens calibrate --by cider`: an axis is
// NAME=START:STOP:STEPS (STEPS points from START to STOP, linear, or geometric with ":log"),
// or NAME=V1,V2,... (explicit values, also for choices); several axes make their product.
// Every value is validated by the method's parameter schema.
#pragma once
#include <string>
#include <vector>

#include "core/eval/eval_dataset.h"
#include "core/eval/eval_table.h"
#include "core/compress/method.h"

namespace kvlens {

struct SweepAxis {
  std::string name;
  std::vector<std::string> values;  // canonical text, as the schema validates it
  std::vector<double> numbers;      // the same as numbers (NaN for a non-numeric choice)
  bool log = false;
};

// Throws InputError naming the axis, e.g. "--param budget=0.05:0.4:0: STEPS must be ...".
SweepAxis parse_sweep_axis(const std::string& text, const Params& base);

// One spec per grid point (the first axis varies slowest), from `base` with the axes' values.
std::vector<std::string> sweep_specs(const Params& base, const std::vector<SweepAxis>& axes);

// sweep.csv: the full cache (empty parameter fields), then one line per grid point: the axes'
// values, every metric, VQA, KV bytes, ratio, softmax MSE (when computed) and the spec.
std::string sweep_csv(const std::vector<SweepAxis>& axes, const EvalTable& t);

}  // namespace kvlens
