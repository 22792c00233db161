// kvlens eval: every method (× bit-width for quantizers) on every image of a dataset with one
// shared prefill per image, scored with the COCO caption metrics and VQA accuracy, as a table in
// the layout of CalibQuant's Table 1. kvlens merge: shard outputs joined into the same table.
#include <cstdio>
#include <filesystem>
#include <set>

#include "app/cli/commands.h"
#include "app/cli/defaults.h"
#include "app/cli/eval_common.h"
#include "app/cli/mpi_world.h"
#include "app/cli/options.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/compress/method.h"

namespace kvlens::app {

namespace {

struct EvalArgs {
  DatasetArgs data;
  std::vector<std::string> methods;
  std::string bits, budgets, out, json_out;
};

void run_eval_command(const EvalArgs& a) {
  effective_settings(a.data);  // every option is checked before anything is created
  if (a.out.empty() && a.json_out.empty()) throw InputError("give --out DIR (tables, results, per-image records) or --json FILE");
  std::vector<std::string> skipped;
  const std::vector<EvalVariant> variants =
      expand_variants(a.methods, a.bits.empty() ? std::vector<int>{} : parse_bits_list(a.bits), &skipped,
                      a.budgets.empty() ? std::vector<double>{} : parse_budget_list(a.budgets));
  if (!a.out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.out, ec);
    if (ec) throw InputError(a.out + ": cannot create the output folder (" + ec.message() + ")");
    check_writable(a.out + "/table.md", "results table");
  }
  if (!a.json_out.empty()) check_writable(a.json_out, "eval JSON");
  const EvalDataset ds = load_eval_dataset(a.data.dir, a.data.annotations, a.data.images, a.data.questions);
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.data.model), a.data.backend);
  const Model& model = *model_owned;
  const EvalOutcome o = run_dataset(a.data, model, ds, variants, a.out, skipped);
  if (mpi_world().rank != 0) return;
  finish_table(o, a.data.meteor, a.out, a.json_out);
}

struct MergeArgs {
  std::vector<std::string> dirs;
  std::string out, json_out;
  MeteorOptions meteor;
};

void run_merge(const MergeArgs& a) {
  if (a.dirs.empty()) throw InputError("merge: give the shard output folders");
  std::vector<nlohmann::json> manifests;
  for (const std::string& d : a.dirs) manifests.push_back(read_json_file(d + "/manifest.json", "eval manifest"));
  const nlohmann::json& m0 = manifests[0];
  for (size_t i = 1; i < manifests.size(); ++i)
    for (const char* key : {"dataset", "limit", "fingerprint", "settings", "variants", "model"})
      if (manifests[i].value(key, nlohmann::json()) != m0.value(key, nlohmann::json()))
        throw InputError(a.dirs[i] + "/manifest.json: \"" + key + "\" differs from " + a.dirs[0] +
                         "/manifest.json; only shards of one run can be merged");
  std::error_code ec;
  std::filesystem::create_directories(a.out + "/images", ec);
  if (ec) throw InputError(a.out + ": cannot create the output folder (" + ec.message() + ")");
  check_writable(a.out + "/table.md", "results table");
  DatasetArgs d;
  try {
    d.dir = m0.at("dataset").at("dir").get<std::string>();
    d.annotations = m0.at("dataset").at("annotations").get<std::string>();
    d.images = m0.at("dataset").at("images").get<std::string>();
    d.questions = m0.at("dataset").at("questions").get<std::string>();
    d.limit = m0.at("limit").get<int>();
  } catch (const nlohmann::json::exception& e) {
    throw InputError(a.dirs[0] + "/manifest.json: malformed manifest (" + e.what() + ")");
  }
  const EvalDataset ds = load_eval_dataset(d.dir, d.annotations, d.images, d.questions);
  EvalOutcome o;
  o.ds = &ds;
  o.variants = variants_from_manifest(m0, a.dirs[0] + "/manifest.json");
  o.notes = m0.value("skipped", std::vector<std::string>{});
  o.vqa = m0.at("settings").value("vqa", true);
  o.positions = shard_positions(ds.images.size(), static_cast<size_t>(d.limit), Shard{});
  const std::string fp = m0.at("fingerprint").get<std::string>();
  for (size_t p : o.positions) {
    const int64_t id = ds.ann.images.at(ds.images.at(p)).id;
    bool found = false;
    for (const std::string& dir : a.dirs) {
      ImageRecord r;
      if (!read_image_record(dir, id, r) || r.fingerprint != fp) continue;
      bool complete = true;
      for (const EvalVariant& v : o.variants) complete = complete && r.variants.count(v.key);
      if (!complete) continue;
      if (std::filesystem::weakly_canonical(dir, ec) != std::filesystem::weakly_canonical(a.out, ec))
        write_file_atomic(a.out + "/images/" + std::to_string(id) + ".json", r.to_json().dump() + "\n", "image record");
      o.records[id] = std::move(r);
      found = true;
      break;
    }
    if (!found)
      throw InputError("merge: no complete record of image " + std::to_string(id) + " in the given folders (a shard "
                       "is missing or did not finish; run it again, it resumes)");
  }
  nlohmann::json m = m0;
  m["shard"] = "all";
  write_file_atomic(a.out + "/manifest.json", m.dump(1) + "\n", "eval manifest");
  finish_table(o, a.meteor, a.out, a.json_out);
}

}  // namespace

void add_eval_command(CLI::App& root) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* c = root.add_subcommand(
      "eval", "Methods (x bit-widths) on a dataset: BLEU, METEOR, ROUGE-L, CIDEr-D, VQA accuracy, KV bytes");
  add_dataset_options(c, a->data);
  c->add_option("--method", a->methods, "Method spec to evaluate besides the full cache (repeatable)");
  c->add_option("--bits", a->bits, "Bit-widths for methods with a bits parameter, e.g. 8,4,2,1");
  c->add_option("--budgets", a->budgets, "Budgets for methods with a budget parameter (evictors), e.g. 0.05,0.1,0.2,0.4");
  c->add_option("--out", a->out, "Output folder: table.md/.csv/.json, results/<row>.json, images/<id>.json, manifest");
  c->add_option("--json", a->json_out, "Also write the table as JSON to this file");
  c->footer(
      "Each image is encoded and prefilled once per prompt (the caption prompt and each question); every row "
      "compresses that prefill and decodes greedily. Finished images are kept in OUT/images, so an interrupted run "
      "resumes where it stopped. Under mpirun each rank takes one shard and rank 0 writes the table; --shard I/N "
      "runs one shard on its own, and kvlens merge joins the shard folders.");
  c->callback([a] { run_eval_command(*a); });

  auto m = std::make_shared<MergeArgs>();
  CLI::App* mc = root.add_subcommand("merge", "Join kvlens eval shard folders into the table of the whole dataset");
  mc->add_option("dirs", m->dirs, "Shard output folders (kvlens eval --shard I/N --out DIR)")->required();
  mc->add_option("--out", m->out, "Output folder of the merged table")->required();
  mc->add_option("--json", m->json_out, "Also write the table as JSON to this file");
  add_meteor_options(mc, m->meteor);
  mc->callback([m] { run_merge(*m); });
}

}  // namespace kvlens::app
