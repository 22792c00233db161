#include "app/lab/eval_runner.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "core/errors.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/compress/method.h"
#include "core/eval/eval_table.h"
#include "app/lab/experiment.h"
#include "app/lab/memory_plan.h"

namespace kvlens {

namespace fs = std::filesystem;

namespace {

// FNV-1a, 64 bit.
struct Hash {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  void add(const std::string& s) { add(s.data(), s.size() + 1); }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return buf;
  }
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double fp16_bytes(const KVStore& store) {
  KVBytes b;
  for (int l = 0; l < store.n_layers(); ++l)
    for (const KVSegment& seg : store.layer(l).segments) b += seg.dense_bytes(store.head_dim(), 2);
  return static_cast<double>(b.total());
}

std::string record_path(const std::string& out_dir, int64_t id) {
  return out_dir + "/images/" + std::to_string(id) + ".json";
}

}  // namespace

nlohmann::json EvalSettings::to_json() const {
  return {{"prompt", prompt}, {"template", templ}, {"max_new_tokens", max_new_tokens}, {"vqa", vqa},
          {"softmax_mse", softmax_mse}, {"kv_storage", row_storage_name(kv_storage)}};
}

std::string model_fingerprint(const std::string& model_dir) {
  Hash h;
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(model_dir, ec)) files.push_back(e.path().filename().string());
  if (ec) throw InputError(model_dir + ": cannot list the model folder (" + ec.message() + ")");
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    const std::string path = model_dir + "/" + f;
    const bool weights = f.size() > 12 && f.substr(f.size() - 12) == ".safetensors";
    const bool small = f == "config.json" || f == "tokenizer.model" || f == "tokenizer_config.json" ||
                       f == "added_tokens.json" || f == "preprocessor_config.json" ||
                       f == "model.safetensors.index.json";
    if (!weights && !small) continue;
    h.add(f);
    if (small) {
      h.add(read_input_file(path, "model file"));
      continue;
    }
    // Weight files: size, the first and the last MiB (the header names every tensor).
    uint64_t size = 0;
    const int fd = open_input_file(path, "weights", &size);
    h.add(&size, sizeof size);
    std::string buf(std::min<uint64_t>(size, 1 << 20), '\0');
    for (uint64_t off : {uint64_t{0}, size - buf.size()}) {
      const ssize_t n = pread(fd, buf.data(), buf.size(), static_cast<off_t>(off));
      if (n > 0) h.add(buf.data(), static_cast<size_t>(n));
    }
    close(fd);
  }
  return h.hex();
}

std::string record_fingerprint(const std::string& model_fp, const EvalSettings& s) {
  Hash h;
  h.add(model_fp);
  h.add(s.to_json().dump());
  return h.hex();
}

std::string image_source(const EvalDataset& ds, size_t pos) {
  const CocoAnnotations::Image& im = ds.ann.images.at(ds.images.at(pos));
  Hash h;
  h.add(read_input_file(ds.image_path(ds.images.at(pos)), "image"));
  for (const CocoQuestion& q : ds.questions)
    if (q.image_id == im.id) h.add(q.question);
  return h.hex();
}

void evaluate_image(const Model& model, const EvalDataset& ds, size_t pos, const std::vector<EvalVariant>& variants,
                    const EvalSettings& s, ImageRecord& record) {
  const CocoAnnotations::Image& im = ds.ann.images.at(ds.images.at(pos));
  record.image_id = im.id;
  std::vector<const EvalVariant*> todo;
  for (const EvalVariant& v : variants)
    if (!record.variants.count(v.key) || (s.softmax_mse && !record.variants.at(v.key).softmax_mse)) todo.push_back(&v);
  if (todo.empty()) return;
  bool keep = s.softmax_mse;
  for (const EvalVariant* v : todo) keep = keep || (v->params && make_policy(*v->params)->needs_prefill_attention());
  const RGBImage img = load_image(ds.image_path(ds.images.at(pos)));
  const ImageFeatures feats = model.encode_image(model.pixel_values(img), model.visual_layout(img.width, img.height));
  GenerateOptions g;
  g.max_new_tokens = s.max_new_tokens;
  g.kv_storage = s.kv_storage;
  std::map<std::string, VariantOutput> out;
  // The caption prompt: one prefill, every variant.
  if (s.softmax_mse) {
    ExperimentOptions o;
    o.prompt = s.prompt;
    o.templ = s.templ;
    o.max_new_tokens = s.max_new_tokens;
    o.kv_storage = s.kv_storage;
    check_memory(model, o, feats.layout);  // refused before any work when the run cannot fit
    const Experiment ex = start_experiment(model, model.prefill_features(feats, s.prompt, s.templ, true), o);
    record.fp16_bytes = static_cast<double>(ex.full_fp16_bytes.total());
    for (const EvalVariant* v : todo) {
      const auto t0 = std::chrono::steady_clock::now();
      VariantOutput& r = out[v->key];
      if (!v->params) {
        r.caption = trim_answer(ex.full.text);
        r.kv_bytes = static_cast<double>(ex.full.bytes_after_prefill.total());
        r.softmax_mse = 0.0;
      } else {
        const MethodRun m = run_method(model, ex, *v->params, o);
        r.caption = trim_answer(m.result.text);
        r.kv_bytes = static_cast<double>(m.result.bytes_after_prefill.total());
        r.softmax_mse = m.mean_softmax_mse;
      }
      r.ms += ms_since(t0);
    }
  } else {
    const PrefillState st = model.prefill_features(feats, s.prompt, s.templ, keep);
    record.fp16_bytes = fp16_bytes(st.store);
    for (const EvalVariant* v : todo) {
      const auto t0 = std::chrono::steady_clock::now();
      // A fresh policy per sequence: policies keep per-sequence state.
      const std::unique_ptr<KVPolicy> policy = v->params ? make_policy(*v->params) : nullptr;
      const DecodeResult d = model.decode(st, policy.get(), g);
      VariantOutput& r = out[v->key];
      r.caption = trim_answer(d.text);
      r.kv_bytes = static_cast<double>(d.bytes_after_prefill.total());
      r.ms += ms_since(t0);
    }
  }
  // Each question: one prefill, every variant.
  if (s.vqa)
    for (const CocoQuestion& q : ds.questions) {
      if (q.image_id != im.id) continue;
      const PrefillState st = model.prefill_features(feats, q.question, s.templ, keep);
      for (const EvalVariant* v : todo) {
        const auto t0 = std::chrono::steady_clock::now();
        const std::unique_ptr<KVPolicy> policy = v->params ? make_policy(*v->params) : nullptr;
        VariantOutput& r = out[v->key];
        r.answers.push_back(trim_answer(model.decode(st, policy.get(), g).text));
        r.ms += ms_since(t0);
      }
    }
  for (auto& [key, v] : out) record.variants[key] = std::move(v);
}

bool read_image_record(const std::string& out_dir, int64_t id, ImageRecord& r) {
  const std::string path = record_path(out_dir, id);
  if (!file_exists(path)) return false;
  try {
    r = ImageRecord::from_json(read_json_file(path, "image record"), path);
  } catch (const InputError&) {
    return false;  // unreadable: computed again and replaced
  }
  return r.image_id == id;
}

std::map<int64_t, ImageRecord> run_eval(const Model& model, const EvalDataset& ds, const std::vector<size_t>& positions,
                                        const std::vector<EvalVariant>& variants, const EvalSettings& s,
                                        const std::string& fingerprint, const std::string& out_dir,
                                        const std::function<void(const EvalProgress&)>& progress) {
  if (!out_dir.empty()) {
    std::error_code ec;
    fs::create_directories(out_dir + "/images", ec);
    if (ec) throw InputError(out_dir + "/images: cannot create folder (" + ec.message() + ")");
  }
  std::map<int64_t, ImageRecord> records;
  EvalProgress p;
  p.total = positions.size();
  for (size_t pos : positions) {
    const int64_t id = ds.ann.images.at(ds.images.at(pos)).id;
    ImageRecord r;
    const std::string source = image_source(ds, pos);
    if (out_dir.empty() || !read_image_record(out_dir, id, r) || r.fingerprint != fingerprint || r.source != source)
      r = ImageRecord{};
    r.fingerprint = fingerprint;
    r.source = source;
    const size_t before = r.variants.size();
    bool complete = true;
    for (const EvalVariant& v : variants)
      complete = complete && r.variants.count(v.key) && (!s.softmax_mse || r.variants.at(v.key).softmax_mse);
    if (!complete) {
      const auto t0 = std::chrono::steady_clock::now();
      evaluate_image(model, ds, pos, variants, s, r);
      p.seconds += ms_since(t0) / 1000.0;
      ++p.computed;
      if (!out_dir.empty() && r.variants.size() >= before)
        write_file_atomic(record_path(out_dir, id), r.to_json().dump() + "\n", "image record");
    }
    records[id] = std::move(r);
    ++p.done;
    if (progress) progress(p);
  }
  return records;
}

}  // namespace kvlens
