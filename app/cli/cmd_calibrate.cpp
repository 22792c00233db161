// kvlens calibrate --dataset: CalibQuant's τ1/τ2 grid evaluated on a dataset, as a table and
// heatmaps of CIDEr-D and softmax MSE, with the best pair by each.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "app/cli/defaults.h"
#include "app/cli/eval_common.h"
#include "app/lab/experiment.h"
#include "app/cli/mpi_world.h"
#include "core/errors.h"
#include "app/figures/figures_eval.h"
#include "core/files.h"
#include "core/numbers.h"
#include "app/lab/sweep.h"

namespace kvlens::app {

namespace {

struct GridPoint {
  double tau1 = 0, tau2 = 0, cider = 0, mse = 0;
  const EvalRow* row = nullptr;
};

nlohmann::json point_json(const GridPoint& p) {
  nlohmann::json j = p.row->scores.to_json();
  j["tau1"] = p.tau1;
  j["tau2"] = p.tau2;
  j["softmax_mse"] = p.mse;
  j["kv_bytes"] = p.row->kv_bytes;
  j["spec"] = p.row->variant.key;
  const auto acc = p.row->vqa_accuracy();
  if (acc) j["VQA"] = *acc;
  return j;
}

// tau1 down the rows, tau2 across the columns.
std::string heatmap_csv(const std::vector<double>& taus, const std::vector<GridPoint>& pts, bool cider) {
  std::map<std::pair<double, double>, double> v;
  for (const GridPoint& p : pts) v[{p.tau1, p.tau2}] = cider ? p.cider : p.mse;
  std::string s = "tau1\\tau2";
  for (double t2 : taus) s += "," + format_number(t2);
  s += "\n";
  for (double t1 : taus) {
    s += format_number(t1);
    for (double t2 : taus) s += "," + format_number(v.at({t1, t2}));
    s += "\n";
  }
  return s;
}

}  // namespace

void run_calibrate_dataset(const DatasetArgs& a0, const std::string& base_spec, const std::vector<double>& taus0,
                           const std::string& by, const std::string& out, const std::string& report) {
  if (out.empty()) throw InputError("calibrate --dataset needs --out DIR");
  if (taus0.empty()) throw InputError("--taus needs at least one value");
  const Params base = calibrating_base(base_spec);
  std::string list;
  for (double t : taus0) list += (list.empty() ? "" : ",") + format_number(t);
  const std::vector<SweepAxis> axes{parse_sweep_axis("tau1=" + list, base), parse_sweep_axis("tau2=" + list, base)};
  const std::vector<double> taus = axes[0].numbers;
  const std::vector<EvalVariant> variants = expand_variants(sweep_specs(base, axes), {}, nullptr);
  DatasetArgs a = a0;
  a.settings.softmax_mse = true;
  effective_settings(a);  // every option is checked before anything is created
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  if (ec) throw InputError(out + ": cannot create the output folder (" + ec.message() + ")");
  check_writable(out + "/calibration.json", "calibration grid");
  if (!report.empty()) check_writable(report, "report");
  const EvalDataset ds = load_eval_dataset(a.dir, a.annotations, a.images, a.questions);
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.model), a.backend);
  const Model& model = *model_owned;
  const EvalOutcome o = run_dataset(a, model, ds, variants, out, {});
  if (mpi_world().rank != 0) return;
  const EvalTable t = finish_table(o, a.meteor, out, "");
  std::vector<GridPoint> pts;
  for (const EvalRow& r : t.rows) {
    if (!r.variant.params) continue;
    GridPoint p;
    p.tau1 = r.variant.params->num("tau1");
    p.tau2 = r.variant.params->num("tau2");
    p.cider = r.scores.cider_d;
    p.mse = r.softmax_mse.value_or(std::nan(""));
    p.row = &r;
    pts.push_back(p);
  }
  const GridPoint* best_cider = nullptr;
  const GridPoint* best_mse = nullptr;
  for (const GridPoint& p : pts) {
    if (!best_cider || p.cider > best_cider->cider || (p.cider == best_cider->cider && p.mse < best_cider->mse))
      best_cider = &p;
    if (!best_mse || p.mse < best_mse->mse || (p.mse == best_mse->mse && p.cider > best_mse->cider)) best_mse = &p;
  }
  nlohmann::json grid = nlohmann::json::array();
  for (const GridPoint& p : pts) grid.push_back(point_json(p));
  const nlohmann::json j{{"base", base.spec()},
                         {"dataset", a.dir},
                         {"images", t.images},
                         {"by", by},
                         {"grid", grid},
                         {"best", point_json(by == "cider" ? *best_cider : *best_mse)},
                         {"best_by_cider", point_json(*best_cider)},
                         {"best_by_mse", point_json(*best_mse)}};
  write_file_atomic(out + "/calibration.json", j.dump(1) + "\n", "calibration grid");
  write_file_atomic(out + "/calibration.csv", sweep_csv(axes, t), "calibration grid");
  write_file_atomic(out + "/cider_heatmap.csv", heatmap_csv(taus, pts, true), "heatmap");
  write_file_atomic(out + "/mse_heatmap.csv", heatmap_csv(taus, pts, false), "heatmap");
  if (!report.empty()) write_file_atomic(report, j.dump(1) + "\n", "report");
  write_eval_figures({fig::calibration_heatmap(taus, t, "CIDEr-D", false, best_cider->tau1, best_cider->tau2),
                      fig::calibration_heatmap(taus, t, "softmax MSE", true, best_mse->tau1, best_mse->tau2)},
                     out + "/figures", a.figure_formats);
  std::printf("\nCIDEr-D (tau1 down, tau2 across)\n%s", heatmap_csv(taus, pts, true).c_str());
  std::printf("best by CIDEr-D: tau1=%g tau2=%g (CIDEr-D %.4f, softmax MSE %.4g)\n", best_cider->tau1, best_cider->tau2,
              best_cider->cider, best_cider->mse);
  std::printf("best by softmax MSE: tau1=%g tau2=%g (CIDEr-D %.4f, softmax MSE %.4g)\n", best_mse->tau1, best_mse->tau2,
              best_mse->cider, best_mse->mse);
}

}  // namespace kvlens::app
