#include "models/evaluate.h"

#include <chrono>
#include <fstream>

#include "core/errors.h"
#include "core/json_file.h"
#include "core/method.h"
#include "core/numbers.h"

namespace kvlens {

namespace {
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\n");
  return s.substr(b, e - b + 1);
}
}  // namespace

SceneSet load_scene_set(const std::string& dir) {
  const std::string path = dir + "/annotations.json";
  const nlohmann::json j =
      read_json_file(path, "scene annotations (expected a folder written by kvlens scenes)");
  for (const char* key : {"images", "annotations"})
    if (!j.contains(key) || !j[key].is_array()) throw InputError(path + ": missing '" + key + "' list");
  SceneSet s;
  s.dir = dir;
  std::map<int64_t, size_t> index;
  try {
    for (const auto& im : j["images"]) {
      const int64_t id = json_integer(im.at("id"), path + ": image id", 0, INT64_MAX);
      index[id] = s.images.size();
      s.images.push_back({id, im.at("file_name").get<std::string>(), {}});
    }
    for (const auto& a : j["annotations"]) {
      const auto it = index.find(json_integer(a.at("image_id"), path + ": annotation image_id", 0, INT64_MAX));
      if (it == index.end()) throw InputError(path + ": annotation for unknown image_id " + a.at("image_id").dump());
      s.images[it->second].captions.push_back(a.at("caption").get<std::string>());
    }
    if (j.contains("questions"))
      for (const auto& q : j["questions"])
        s.questions.push_back({json_integer(q.at("image_id"), path + ": question image_id", 0, INT64_MAX),
                               q.at("question").get<std::string>(),
                               q.at("answer").get<std::string>(), q.value("type", std::string("other"))});
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": malformed entry (" + e.what() + ")");
  }
  return s;
}

EvalResult evaluate_scenes(const LlavaModel& model, const SceneSet& set, const EvalOptions& opt) {
  EvalResult r;
  r.method = opt.method.empty() ? "full" : parse_method_spec(opt.method).spec();
  r.kv_storage = row_storage_name(opt.kv_storage);
  const size_t n = opt.max_images > 0 ? std::min<size_t>(opt.max_images, set.images.size()) : set.images.size();
  std::map<int64_t, const SceneSet::Image*> wanted;
  for (size_t i = 0; i < n; ++i) wanted[set.images[i].id] = &set.images[i];
  GenerateOptions g;
  g.max_new_tokens = opt.max_new_tokens;
  g.kv_storage = opt.kv_storage;
  const bool keep = !opt.method.empty() && make_policy(opt.method)->needs_prefill_attention();
  auto answer = [&](const Buffer& feats, const std::string& prompt, double* bytes) {
    // A fresh policy per sequence: policies keep per-sequence state (decode probes, counts).
    const std::unique_ptr<KVPolicy> policy = opt.method.empty() ? nullptr : make_policy(opt.method);
    const PrefillState st = model.prefill_features(feats, prompt, kDefaultTemplate, keep);
    const DecodeResult d = model.decode(st, policy.get(), g);
    if (bytes) *bytes = static_cast<double>(d.bytes_after_prefill.total());
    return trim(d.text);
  };
  std::map<int64_t, std::vector<const SceneSet::Question*>> qs;
  if (opt.vqa)
    for (const auto& q : set.questions)
      if (wanted.count(q.image_id)) qs[q.image_id].push_back(&q);
  double total_ms = 0;
  for (size_t i = 0; i < n; ++i) {
    const SceneSet::Image& im = set.images[i];
    const auto t0 = std::chrono::steady_clock::now();
    const Buffer feats = model.encode_image(model.pixel_values(load_image(set.dir + "/" + im.file)));
    double bytes = 0;
    const std::string cap = answer(feats, kDefaultPrompt, &bytes);
    total_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    r.captions.push_back(cap);
    r.kv_bytes_mean += bytes / n;
    ++r.images;
    for (const auto& ref : im.captions)
      if (trim(ref) == cap) {
        ++r.caption_exact;
        break;
      }
    for (const auto* q : qs[im.id]) {
      const bool ok = answer(feats, q->question, nullptr) == trim(q->answer);
      ++r.questions;
      r.vqa_correct += ok;
      auto& t = r.vqa_by_type[q->type];
      t.first += ok;
      t.second += 1;
    }
  }
  r.caption_ms_mean = n ? total_ms / n : 0.0;
  return r;
}

nlohmann::json EvalResult::to_json() const {
  nlohmann::json j;
  j["method"] = method;
  j["kv_storage"] = kv_storage;
  j["images"] = images;
  j["caption_exact"] = caption_exact;
  j["caption_accuracy"] = caption_accuracy();
  j["questions"] = questions;
  j["vqa_correct"] = vqa_correct;
  j["vqa_accuracy"] = vqa_accuracy();
  for (const auto& kv : vqa_by_type)
    j["vqa_by_type"][kv.first] = {{"correct", kv.second.first}, {"total", kv.second.second}};
  j["kv_bytes_mean"] = kv_bytes_mean;
  j["caption_ms_mean"] = caption_ms_mean;
  return j;
}

}  // namespace kvlens
