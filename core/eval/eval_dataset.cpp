#include "core/eval/eval_dataset.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "core/errors.h"
#include "core/files.h"
#include "core/numbers.h"

namespace kvlens {

namespace fs = std::filesystem;

std::string find_annotations(const std::string& dir) {
  if (file_exists(dir + "/annotations.json")) return dir + "/annotations.json";
  std::vector<std::string> found;
  for (const std::string& sub : {dir, dir + "/annotations"}) {
    std::error_code ec;
    if (!fs::is_directory(sub, ec)) continue;
    for (const auto& e : fs::directory_iterator(sub, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("captions_", 0) == 0 && name.size() > 5 && name.substr(name.size() - 5) == ".json")
        found.push_back(e.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  if (found.size() == 1) return found[0];
  if (found.empty())
    throw InputError(dir + ": no annotations.json or captions_*.json (expected a scene set or a COCO caption split; "
                           "or give --annotations FILE)");
  std::string list;
  for (const auto& f : found) list += (list.empty() ? "" : ", ") + f;
  throw InputError(dir + ": several caption files (" + list + "); choose one with --annotations FILE");
}

namespace {

// captions_val2014.json → val2014
std::string split_name(const std::string& annotations) {
  std::string name = fs::path(annotations).filename().string();
  if (name.rfind("captions_", 0) == 0) name = name.substr(9);
  if (name.size() > 5 && name.substr(name.size() - 5) == ".json") name.resize(name.size() - 5);
  return name;
}

}  // namespace

std::string EvalDataset::image_path(size_t pos) const { return image_root + "/" + ann.images.at(pos).file_name; }

EvalDataset load_eval_dataset(const std::string& dir, const std::string& annotations, const std::string& images,
                              const std::string& questions) {
  EvalDataset ds;
  ds.dir = dir;
  const std::string ann_path = annotations.empty() ? find_annotations(dir) : annotations;
  ds.ann = load_coco_annotations(ann_path);
  for (size_t i = 0; i < ds.ann.images.size(); ++i)
    if (ds.ann.captions.count(ds.ann.images[i].id)) ds.images.push_back(i);
  if (ds.images.empty()) throw InputError(ann_path + ": no image has a caption");
  for (size_t pos : ds.images)
    if (ds.ann.images[pos].file_name.empty())
      throw InputError(ann_path + ": image " + std::to_string(ds.ann.images[pos].id) + " has no \"file_name\"");
  // The image folder: the first candidate that holds the first image.
  const std::string first = ds.ann.images[ds.images[0]].file_name;
  std::vector<std::string> roots;
  if (!images.empty()) roots = {images};
  else roots = {dir, dir + "/images", dir + "/" + split_name(ann_path), fs::path(ann_path).parent_path().string()};
  for (const std::string& r : roots)
    if (!r.empty() && file_exists(r + "/" + first)) {
      ds.image_root = r;
      break;
    }
  if (ds.image_root.empty()) {
    std::string tried;
    for (const auto& r : roots) tried += (tried.empty() ? "" : ", ") + r + "/" + first;
    throw InputError(ann_path + ": image file '" + first + "' not found (tried " + tried + "; give --images DIR)");
  }
  ds.questions = questions.empty() ? ds.ann.questions : load_coco_questions(questions);
  if (!questions.empty()) {
    std::set<int64_t> ids;
    for (const auto& im : ds.ann.images) ids.insert(im.id);
    for (const CocoQuestion& q : ds.questions)
      if (!ids.count(q.image_id))
        throw InputError(questions + ": question for image_id " + std::to_string(q.image_id) + " that is not in " + ann_path);
  }
  return ds;
}

Shard parse_shard(const std::string& text) {
  const size_t slash = text.find('/');
  if (slash == std::string::npos) throw InputError("--shard must be I/N (e.g. 0/4), got '" + text + "'");
  Shard s;
  s.count = static_cast<int>(parse_integer(text.substr(slash + 1), "--shard N", 1, 100000));
  s.index = static_cast<int>(parse_integer(text.substr(0, slash), "--shard I", 0, s.count - 1));
  return s;
}

std::vector<size_t> shard_positions(size_t n_images, size_t limit, const Shard& shard) {
  const size_t n = limit > 0 ? std::min(limit, n_images) : n_images;
  std::vector<size_t> out;
  for (size_t i = static_cast<size_t>(shard.index); i < n; i += static_cast<size_t>(shard.count)) out.push_back(i);
  return out;
}

std::vector<int> parse_bits_list(const std::string& text) {
  std::vector<int> bits;
  size_t b = 0;
  while (b <= text.size()) {
    size_t e = text.find(',', b);
    if (e == std::string::npos) e = text.size();
    bits.push_back(static_cast<int>(parse_integer(text.substr(b, e - b), "--bits", 1, 16)));
    b = e + 1;
  }
  return bits;
}

std::vector<double> parse_budget_list(const std::string& text) {
  std::vector<double> out;
  size_t b = 0;
  while (b <= text.size()) {
    size_t e = text.find(',', b);
    if (e == std::string::npos) e = text.size();
    out.push_back(parse_real(text.substr(b, e - b), "--budgets", 0, 1));
    b = e + 1;
  }
  return out;
}

std::vector<EvalVariant> expand_variants(const std::vector<std::string>& specs, const std::vector<int>& bits,
                                         std::vector<std::string>* skipped, const std::vector<double>& budgets) {
  std::vector<EvalVariant> out;
  std::set<std::string> keys;
  EvalVariant full;
  full.key = full.label = full.method = "full";
  out.push_back(full);
  keys.insert("full");
  for (const std::string& spec : specs) {
    const Params p = parse_method_spec(spec);
    const MethodSpec& m = find_method(p.method());
    auto param = [&](const char* name) -> const ParamSpec* {
      for (const ParamSpec& s : m.params)
        if (s.name == name) return &s;
      return nullptr;
    };
    const ParamSpec* bits_p = param("bits");
    const ParamSpec* budget_p = param("budget");
    // Each axis: the values to set, or one "keep the spec's value" entry.
    std::vector<std::string> bit_values{""}, budget_values{""};
    if (bits_p && !bits.empty()) {
      bit_values.clear();
      for (int b : bits) bit_values.push_back(std::to_string(b));
    }
    if (budget_p && !budgets.empty()) {
      budget_values.clear();
      for (double b : budgets) budget_values.push_back(format_number(b));
    }
    for (const std::string& bv : bit_values)
      for (const std::string& gv : budget_values) {
        std::map<std::string, std::string> given = p.values();
        if (!bv.empty()) given["bits"] = bv;
        if (!gv.empty()) given["budget"] = gv;
        Params q;
        try {
          q = make_params(p.method(), "", given);
        } catch (const InputError& e) {
          if (skipped)
            skipped->push_back(p.method() + ": " + (bv.empty() ? "" : "bits=" + bv) + (!bv.empty() && !gv.empty() ? "," : "") +
                               (gv.empty() ? "" : "budget=" + gv) + " not accepted (" + e.what() + ")");
          continue;
        }
        EvalVariant v;
        v.key = q.method() == "full" ? "full" : q.spec();
        v.method = q.method();
        v.params = q;
        if (bits_p) {
          try {
            v.bits = static_cast<int>(parse_integer(q.str("bits"), "bits", 0, 64));
          } catch (const InputError&) {
            v.bits = 0;  // a pass-through value ("default")
          }
        }
        if (keys.insert(v.key).second) out.push_back(std::move(v));
      }
  }
  // Labels: the method and the parameters that differ from its defaults or between the rows of
  // the same method (so "lookm:alpha1=0.1,alpha2=0.1" beside "lookm:alpha1=0.2,alpha2=0.2");
  // the bit-width has its own column.
  std::map<std::string, std::map<std::string, std::set<std::string>>> seen;  // method → param → values
  for (const EvalVariant& v : out)
    if (v.params)
      for (const auto& [k, val] : v.params->values()) seen[v.method][k].insert(val);
  for (EvalVariant& v : out) {
    if (!v.params) continue;
    const MethodSpec& m = find_method(v.method);
    std::string items;
    for (const auto& [k, val] : v.params->values()) {
      if (k == "bits") continue;
      std::string def;
      for (const ParamSpec& ps : m.params)
        if (ps.name == k) {
          try {
            def = validate_param(v.method, ps, ps.def);
          } catch (const InputError&) {
            def = ps.def;  // pass-through defaults ("default") are not values of their own
          }
        }
      if (val != def || seen[v.method][k].size() > 1) items += (items.empty() ? "" : ",") + k + "=" + val;
    }
    v.label = items.empty() ? v.method : v.method + ":" + items;
  }
  return out;
}

nlohmann::json ImageRecord::to_json() const {
  nlohmann::json j;
  j["image_id"] = image_id;
  j["fingerprint"] = fingerprint;
  j["source"] = source;
  j["fp16_bytes"] = fp16_bytes;
  nlohmann::json vs = nlohmann::json::object();
  for (const auto& [key, v] : variants) {
    nlohmann::json o{{"caption", v.caption}, {"kv_bytes", v.kv_bytes}, {"answers", v.answers}, {"ms", v.ms}};
    if (v.softmax_mse) o["softmax_mse"] = *v.softmax_mse;
    vs[key] = o;
  }
  j["variants"] = vs;
  return j;
}

ImageRecord ImageRecord::from_json(const nlohmann::json& j, const std::string& where) {
  ImageRecord r;
  try {
    r.image_id = json_integer(j.at("image_id"), where + ": image_id", INT64_MIN, INT64_MAX);
    r.fingerprint = j.at("fingerprint").get<std::string>();
    r.source = j.at("source").get<std::string>();
    r.fp16_bytes = json_real(j.at("fp16_bytes"), where + ": fp16_bytes", 0, 1e18);
    for (const auto& [key, o] : j.at("variants").items()) {
      VariantOutput v;
      v.caption = o.at("caption").get<std::string>();
      v.kv_bytes = json_real(o.at("kv_bytes"), where + ": kv_bytes", 0, 1e18);
      v.answers = o.at("answers").get<std::vector<std::string>>();
      v.ms = json_real(o.at("ms"), where + ": ms", 0, 1e12);
      if (o.contains("softmax_mse")) v.softmax_mse = json_real(o.at("softmax_mse"), where + ": softmax_mse", 0, 1e30);
      r.variants[key] = std::move(v);
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": malformed image record (" + e.what() + ")");
  }
  return r;
}

}  // namespace kvlens
