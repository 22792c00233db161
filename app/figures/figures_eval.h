// Figures of dataset evaluations, built from a results table (core/eval/eval_table.h): a sweep's
// metric against each swept parameter and against KV bytes, and the τ1/τ2 calibration
// heatmaps. Plain data for the renderers of app/figures/figures.h.
#pragma once
#include <string>
#include <vector>

#include "core/eval/eval_table.h"
#include "app/figures/figures.h"
#include "app/lab/sweep.h"

namespace kvlens::fig {

// A row's value of `metric`: a caption metric name (BLEU-1 ... CIDEr-D), "VQA" or
// "softmax MSE"; NaN when the row has none. Throws InputError for an unknown name.
double row_metric(const EvalRow& r, const std::string& metric);

// For one or two numeric axes, `metric` against each axis (with two, one line per value of the
// other); for any grid, `metric` against KV bytes with each point labelled by its values. The
// full cache is a dashed horizontal line.
std::vector<Figure> sweep_figures(const std::vector<SweepAxis>& axes, const EvalTable& t, const std::string& metric);

// `metric` over τ1 (rows, downwards) × τ2 (columns) of a calibration grid, the best cell marked;
// `log_z` for error-like metrics.
Figure calibration_heatmap(const std::vector<double>& taus, const EvalTable& t, const std::string& metric, bool log_z,
                           double best_tau1, double best_tau2);

}  // namespace kvlens::fig
