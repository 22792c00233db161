// Figures of a run report (the JSON of `kvlens run --report`, app/lab/experiment.cpp
// experiment_json), built by pure functions. The CLI exports them (`kvlens run --figures`,
// `kvlens figures`) and the desktop app draws the same ones. A report that lacks a key or holds
// a wrong type is refused with an InputError naming the key ("report: methods[1].layers[0]
// lacks 'softmax_mse'").
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "core/diagnostics/diagnostics.h"
#include "app/figures/figures.h"
#include "core/compress/method.h"

namespace kvlens::fig {

// Every figure of the report, in a stable order (ids are unique file name stems). `image`: the
// image as the model sees it (after preprocessing; null: unknown), drawn under the token-fate
// figures.
std::vector<Figure> report_figures(const nlohmann::json& report, const RGBImage* image = nullptr);

// Legend names of the report's methods: "label" when present, else "short_spec"; repeated
// names get " #2", " #3".
std::vector<std::string> method_labels(const nlohmann::json& report);
size_t method_count(const nlohmann::json& report);
// A label as part of a file name: "calibquant:bits=1" → "calibquant_bits_1" (letters, digits,
// '.' and '-' kept, runs of anything else one '_', at most 60 characters).
std::string slug(const std::string& label);
int layer_count(const nlohmann::json& report);

// The comparison table of a report's methods (the app's sortable table): one row per method in
// report order, one value per column after the name (NaN where there is none: no divergence).
struct ComparisonTable {
  struct Column {
    std::string key, name, about;  // a stable name for scripts and sessions; the header; what it holds
  };
  struct Row {
    int method = 0;  // index into the report's methods
    std::string name;
    std::vector<double> values;  // [columns.size() − 1]: the columns after "method"
  };
  std::vector<Column> columns;
  std::vector<Row> rows;
};
// Columns: method, KV KiB after prefill, ratio to the fp16 full cache, mean softmax MSE, mean KL,
// mean attention-output error, first divergence (generated token), compress ms, decode ms, and
// CIDEr-D when the report has the image's references.
ComparisonTable comparison_table(const nlohmann::json& report);
// The table as CSV (RFC 4180): a header of the column keys, then one row per method in the
// table's order, numbers with 9 significant digits, an empty field where there is no value;
// what pandas.read_csv loads as is.
std::string comparison_csv(const ComparisonTable& t);
// Whether `key` names a column of comparison_table.
bool comparison_column(const std::string& key);
// Sorts the rows by the column `key` (the method column by name), ascending or descending; rows
// without a value (NaN) go last either way, ties keep report order; a column this table lacks
// (CIDEr-D without references) leaves the order. InputError for an unknown key.
void sort_comparison(ComparisonTable& t, const std::string& key, bool descending);

enum class LayerMetric { SoftmaxMse, SoftmaxKl, OutputError, SparsityDecode };
// One line per method over the layers.
Figure layer_metric_figure(const nlohmann::json& report, LayerMetric m);
// Full-cache sparsity γ(l) in prefill and decode, and each method's decode sparsity.
Figure sparsity_figure(const nlohmann::json& report);
// CacheHitRate of every scoring strategy per layer at one recorded decode step (index into
// cache_hit_rate.steps), and the mean over layers per step.
Figure hit_rate_by_layer_figure(const nlohmann::json& report, int step_index);
Figure hit_rate_by_step_figure(const nlohmann::json& report);
// KV bytes per layer after compression, one bar per method, the fp16 full cache as a line.
Figure bytes_by_layer_figure(const nlohmann::json& report);
// KV bytes against greedy caption agreement for every method, with the Pareto front.
Figure bytes_vs_agreement_figure(const nlohmann::json& report);
// Share of the full cache's greedy tokens reproduced before the first divergence (1 = same).
double greedy_agreement(const std::vector<int>& full_ids, const std::vector<int>& ids);

// CalibQuant's calibration as a method runs it: τ1, τ2, whether g(x) applies.
using kvlens::Calibration;
// The calibration of a calibquant method's parameters; nothing when it does not calibrate
// (calibrate=off, or auto above 2 bits) or is another method. (A stack's histograms still show
// its calibrated scores, without the γ/δ marks.)
std::optional<Calibration> method_calibration(const Params& p);

// Visual score histograms (exact / quantized / calibrated on shared bins). With `calib` and a
// score range [gamma, delta], marks γ and δ and shades the calibrated range [γ−τ1, δ−τ2].
Figure score_histogram_figure(const ScoreHistogram& h, const std::string& id, const std::string& title,
                              std::optional<Calibration> calib = {}, double gamma = 0, double delta = 0);
// All heads of one layer of a method in the report (no γ/δ marks: each head has its own).
Figure score_histogram_figure(const nlohmann::json& report, int method, int layer);
// g(x) = (δ−γ+τ1−τ2)/(δ−γ)·(x−γ)+γ−τ1 drawn from [γ, δ] onto [γ−τ1, δ−τ2], with the identity.
Figure transfer_curve_figure(double gamma, double delta, Calibration c, const std::string& id, const std::string& title);
// One g(x) a head, each over its own [γ_h, δ_h] (the method calibrates head by head), with the
// identity over their union; one head: transfer_curve_figure. Heads without a range (δ ≤ γ: no
// visual key, or one score) have no line.
Figure transfer_curves_figure(const std::vector<double>& gamma, const std::vector<double>& delta, Calibration c,
                              const std::string& id, const std::string& title);
// The same for a calibrating method of the report at one layer, every head.
Figure transfer_curve_figure(const nlohmann::json& report, int method, int layer);
// Query × key attention (mean over heads) at one layer, segment boundaries marked; method = -1
// is the full cache, else the method's decode rows replace the full cache's. Needs the report's
// "attention" section (kvlens run --attention-maps).
Figure attention_heatmap_figure(const nlohmann::json& report, int layer, int method);
bool has_attention(const nlohmann::json& report);
// Small multiples of one generated token's attention over the patch grid: a tile of rows × cols
// patches for every layer (tile rows, layer 0 on top) and head (tile columns; with `mean`, one
// more column of the mean over heads), on one shared log colour scale over the three decades
// below the largest value, tiles one cell apart (drawn as missing), patches square. att[layer][head] holds rows · cols values (an empty
// list: not recorded, drawn as missing). `who` names the source, `token` the generated token.
Figure patch_multiples_figure(const std::vector<std::vector<std::vector<float>>>& att, int rows, int cols, bool mean,
                              const std::string& who, int token);
// Token fate of a method over the patch grid at one layer: field "kept" (share of KV heads),
// "bits" (mean bits of kept rows) or "merged" (mean rows merged in). Patches are square; with
// `image` (as the model sees it: the patch grid covers it), the cells are drawn at 60 % opacity
// over it, downsampled to at most 12 pixels a patch.
Figure token_fate_figure(const nlohmann::json& report, int method, int layer, const std::string& field,
                         const RGBImage* image = nullptr);

}  // namespace kvlens::fig
