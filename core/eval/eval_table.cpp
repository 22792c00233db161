#include "core/eval/eval_table.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>

#include "core/errors.h"
#include "core/files.h"
#include "core/numbers.h"

namespace kvlens {

namespace {

std::string fixed(double x, int digits) {
  if (std::isnan(x)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

std::string csv_cell(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string bits_text(const EvalRow& r, double fp16_mean) {
  if (r.variant.method == "full") return fp16_mean > 0 && std::fabs(r.kv_bytes - fp16_mean) < 0.5 ? "16" : "32";
  return r.variant.bits > 0 ? std::to_string(r.variant.bits) : "–";
}

// results/<slug>.json: the label with unsafe characters replaced, and the bit-width.
std::string slug(const EvalVariant& v) {
  std::string s;
  for (char c : v.label) s += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  if (v.bits > 0) s += "_b" + std::to_string(v.bits);
  return s;
}

}  // namespace

std::string trim_answer(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\n\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\n\r");
  return s.substr(b, e - b + 1);
}

std::optional<double> EvalRow::vqa_accuracy() const {
  if (questions == 0) return std::nullopt;
  return static_cast<double>(vqa_correct) / static_cast<double>(questions);
}

EvalTable build_eval_table(const EvalDataset& ds, const std::vector<size_t>& positions,
                           const std::vector<EvalVariant>& variants, const std::map<int64_t, ImageRecord>& records,
                           bool vqa, MeteorScorer* meteor, const std::string& meteor_status) {
  EvalTable t;
  t.dataset = ds.dir;
  t.images = positions.size();
  t.meteor_status = meteor ? "" : meteor_status;
  std::map<int64_t, std::vector<const CocoQuestion*>> questions;
  if (vqa)
    for (const CocoQuestion& q : ds.questions) questions[q.image_id].push_back(&q);
  std::vector<const ImageRecord*> recs;
  double fp16_sum = 0;
  for (size_t p : positions) {
    const int64_t id = ds.ann.images.at(ds.images.at(p)).id;
    const auto it = records.find(id);
    if (it == records.end()) throw InputError("no record for image " + std::to_string(id));
    recs.push_back(&it->second);
    fp16_sum += it->second.fp16_bytes;
    t.has_questions = t.has_questions || questions.count(id);
  }
  std::set<std::string> slugs;
  for (const EvalVariant& v : variants) {
    EvalRow row;
    row.variant = v;
    double bytes = 0, mse = 0;
    bool all_mse = true;
    for (size_t i = 0; i < recs.size(); ++i) {
      const ImageRecord& r = *recs[i];
      const auto it = r.variants.find(v.key);
      if (it == r.variants.end())
        throw InputError("record of image " + std::to_string(r.image_id) + " has no output for " + v.key);
      const VariantOutput& o = it->second;
      row.results.push_back({r.image_id, o.caption});
      bytes += o.kv_bytes;
      if (o.softmax_mse) mse += *o.softmax_mse;
      all_mse = all_mse && o.softmax_mse.has_value();
      for (const std::string& ref : ds.ann.captions.at(r.image_id))
        if (trim_answer(ref) == trim_answer(o.caption)) {
          ++row.caption_exact;
          break;
        }
      const auto qs = questions.find(r.image_id);
      if (qs == questions.end()) continue;
      if (o.answers.size() != qs->second.size())
        throw InputError("record of image " + std::to_string(r.image_id) + ": " + std::to_string(o.answers.size()) +
                         " answers for " + std::to_string(qs->second.size()) + " questions (" + v.key + ")");
      for (size_t k = 0; k < o.answers.size(); ++k) {
        const bool ok = trim_answer(o.answers[k]) == trim_answer(qs->second[k]->answer);
        ++row.questions;
        row.vqa_correct += ok;
        auto& bt = row.vqa_by_type[qs->second[k]->type];
        bt.first += ok;
        bt.second += 1;
      }
    }
    const double n = static_cast<double>(recs.size());
    row.kv_bytes = n > 0 ? bytes / n : 0;
    row.ratio = bytes > 0 ? fp16_sum / bytes : 0;
    if (all_mse && n > 0) row.softmax_mse = mse / n;
    row.scores = score_captions(ds.ann, row.results, meteor, meteor_status);
    std::string s = slug(v);
    for (int k = 2; !slugs.insert(s).second; ++k) s = slug(v) + "_" + std::to_string(k);
    row.results_file = "results/" + s + ".json";
    for (const std::string& w : row.scores.warnings)
      if (std::find(t.notes.begin(), t.notes.end(), w) == t.notes.end()) t.notes.push_back(w);
    t.rows.push_back(std::move(row));
  }
  return t;
}

nlohmann::json EvalTable::to_json() const {
  nlohmann::json j;
  j["dataset"] = dataset;
  j["images"] = images;
  j["metrics"] = "BLEU-1..4, METEOR, ROUGE-L, CIDEr-D as pycocoevalcap 1.2 computes them";
  if (!meteor_status.empty()) j["meteor_status"] = meteor_status;
  j["notes"] = notes;
  double fp16 = 0;
  for (const EvalRow& r : rows)
    if (r.variant.method == "full" && r.ratio > 0) fp16 = r.kv_bytes * r.ratio;
  j["rows"] = nlohmann::json::array();
  for (const EvalRow& r : rows) {
    nlohmann::json o = r.scores.to_json();
    o["method"] = r.variant.label;
    o["bits"] = bits_text(r, fp16);
    o["spec"] = r.variant.key;
    const auto acc = r.vqa_accuracy();
    o["VQA"] = acc ? nlohmann::json(*acc) : nlohmann::json(nullptr);
    o["questions"] = r.questions;
    for (const auto& [type, ct] : r.vqa_by_type) o["vqa_by_type"][type] = {{"correct", ct.first}, {"total", ct.second}};
    o["caption_exact"] = r.caption_exact;
    o["kv_bytes"] = r.kv_bytes;
    o["ratio"] = r.ratio;
    if (r.softmax_mse) o["softmax_mse"] = *r.softmax_mse;
    o["results_file"] = r.results_file;
    j["rows"].push_back(o);
  }
  return j;
}

std::string EvalTable::markdown() const {
  double fp16 = 0;
  for (const EvalRow& r : rows)
    if (r.variant.method == "full" && r.ratio > 0) fp16 = r.kv_bytes * r.ratio;
  bool mse = false;
  for (const EvalRow& r : rows) mse = mse || r.softmax_mse.has_value();
  std::string s = "| Method | Bits | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | METEOR | ROUGE-L | CIDEr-D |";
  std::string rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|";
  if (has_questions) s += " VQA |", rule += "---:|";
  if (mse) s += " softmax MSE |", rule += "---:|";
  s += " KV bytes | Ratio |\n" + rule + "---:|---:|\n";
  for (const EvalRow& r : rows) {
    s += "| " + r.variant.label + " | " + bits_text(r, fp16) + " |";
    for (const std::string& m : caption_metric_names()) s += " " + fixed(metric_value(r.scores, m), 3) + " |";
    if (has_questions) s += " " + fixed(r.vqa_accuracy().value_or(std::nan("")), 3) + " |";
    if (mse) s += " " + (r.softmax_mse ? format_number(*r.softmax_mse) : std::string("–")) + " |";
    s += " " + fixed(r.kv_bytes, 0) + " | " + fixed(r.ratio, 2) + " |\n";
  }
  s += "\n" + std::to_string(images) + " images; metrics as pycocoevalcap 1.2 computes them";
  if (!meteor_status.empty()) s += "; " + meteor_status;
  s += ". Ratio: fp16 full-cache bytes / KV bytes.\n";
  for (const std::string& n : notes) s += "- " + n + "\n";
  return s;
}

std::string EvalTable::csv() const {
  std::string s = "method,bits,spec,BLEU-1,BLEU-2,BLEU-3,BLEU-4,METEOR,ROUGE-L,CIDEr-D,VQA,kv_bytes,ratio,caption_exact,images,softmax_mse\n";
  double fp16 = 0;
  for (const EvalRow& r : rows)
    if (r.variant.method == "full" && r.ratio > 0) fp16 = r.kv_bytes * r.ratio;
  for (const EvalRow& r : rows) {
    const std::string bits = bits_text(r, fp16);
    s += csv_cell(r.variant.label) + "," + (bits == "–" ? "" : bits) + "," + csv_cell(r.variant.key);
    for (const std::string& m : caption_metric_names()) {
      const double v = metric_value(r.scores, m);
      s += "," + (std::isnan(v) ? std::string() : format_number(v));
    }
    const auto acc = r.vqa_accuracy();
    s += "," + (acc ? format_number(*acc) : std::string()) + "," + format_number(r.kv_bytes) + "," +
         format_number(r.ratio) + "," + std::to_string(r.caption_exact) + "," + std::to_string(images) + "," +
         (r.softmax_mse ? format_number(*r.softmax_mse) : std::string()) + "\n";
  }
  return s;
}

void write_eval_table(const EvalTable& t, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir + "/results", ec);
  if (ec) throw InputError(dir + "/results: cannot create folder (" + ec.message() + ")");
  for (const EvalRow& r : t.rows)
    write_file_atomic(dir + "/" + r.results_file, coco_results_json(r.results).dump(1) + "\n", "COCO results");
  write_file_atomic(dir + "/table.json", t.to_json().dump(1) + "\n", "results table");
  write_file_atomic(dir + "/table.csv", t.csv(), "results table");
  write_file_atomic(dir + "/table.md", t.markdown(), "results table");
}

}  // namespace kvlens
