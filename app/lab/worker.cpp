#include "app/lab/worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/errors.h"
#include "core/files.h"
#include "core/numbers.h"
#include "core/parallel.h"
#include "models/preprocess/clip_image.h"
#include "core/trace.h"

namespace kvlens {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<std::string> pieces_of(const Model& m, const std::vector<int>& ids) {
  std::vector<std::string> out;
  for (int id : ids) out.push_back(m.tokenizer().piece(id));
  return out;
}

const Setup::Method* find_method(const Setup& s, int id) {
  for (const Setup::Method& m : s.methods)
    if (m.id == id) return &m;
  return nullptr;
}

}  // namespace

std::string base_key(const Setup& s) {
  const ExperimentOptions& o = s.opt;
  std::string k = s.model_dir + '\n' + s.image_path + '\n' + o.prompt + '\n' + o.templ + '\n' +
                  row_storage_name(o.kv_storage) + '\n';
  for (double v : {static_cast<double>(o.max_new_tokens), static_cast<double>(o.diag_steps), o.sparsity_p, o.hit_budget,
                   static_cast<double>(o.hit_window), static_cast<double>(o.hist_bins)})
    k += format_number(v) + ',';
  return k;
}

RGBImage shown_image(const Tensor& pv, const PreprocessConfig& cfg) {
  RGBImage img;
  if (pv.shape.size() != 3 || pv.shape[0] != 3) return img;
  img.height = static_cast<int>(pv.shape[1]);
  img.width = static_cast<int>(pv.shape[2]);
  img.data.resize(static_cast<size_t>(img.width) * img.height * 3);
  const size_t plane = static_cast<size_t>(img.width) * img.height;
  for (int c = 0; c < 3; ++c)
    for (size_t i = 0; i < plane; ++i) {
      double v = pv.data[c * plane + i];
      if (cfg.do_normalize) v = v * cfg.std[c] + cfg.mean[c];
      if (cfg.do_rescale && cfg.rescale_factor != 0) v /= cfg.rescale_factor;
      img.data[i * 3 + c] = static_cast<uint8_t>(std::clamp(std::lround(v), 0L, 255L));
    }
  return img;
}

RGBImage image_for_views(const Model& model, const RGBImage& img) {
  if (!model.info().image_dependent) return shown_image(model.pixel_values(img), model.preprocess_config());
  constexpr int kMaxSide = 672;
  const int side = std::max(img.width, img.height);
  if (side <= kMaxSide) return img;
  const int w = std::max(1, static_cast<int>(std::lround(static_cast<double>(img.width) * kMaxSide / side)));
  const int h = std::max(1, static_cast<int>(std::lround(static_cast<double>(img.height) * kMaxSide / side)));
  return resize_bicubic(img, w, h);
}

Worker::Worker() {
  published_ = std::make_shared<Snapshot>();
  // The worker's OpenMP loops as its creator has them (the app and the CLI: one thread unless
  // OMP_NUM_THREADS says otherwise); a new thread would start with OpenMP's default, every core.
  const int omp_threads = omp_loop_threads();
  thread_ = std::thread([this, omp_threads] {
    const ScopedOmpThreads as_creator(omp_threads);
    loop_threads_ = omp_loop_threads();
    loop();
  });
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t Worker::submit(Setup s) {
  uint64_t v;
  {
    std::lock_guard<std::mutex> l(mu_);
    want_ = std::move(s);
    v = ++want_version_;
  }
  cv_.notify_all();
  return v;
}

std::shared_ptr<const Snapshot> Worker::latest() const {
  std::lock_guard<std::mutex> l(mu_);
  return published_;
}

Progress Worker::progress() const {
  return {tokens_done_.load(), tokens_total_.load(), busy_.load()};
}

bool Worker::base_wanted(const std::string& key) {
  std::lock_guard<std::mutex> l(mu_);
  return !stop_ && base_key(want_) == key;
}

bool Worker::run_wanted(int id, const std::string& spec, const std::string& bkey) {
  std::lock_guard<std::mutex> l(mu_);
  if (stop_ || base_key(want_) != bkey) return false;
  const Setup::Method* m = find_method(want_, id);
  return m && m->params.spec() == spec;
}

void Worker::publish(bool busy, const std::string& stage) {
  auto s = std::make_shared<Snapshot>();
  s->busy = busy;
  s->stage = stage;
  s->model = facts_;
  s->model_error = model_error_;
  s->base = base_;
  s->base_error = base_error_;
  s->runs = ordered_;
  for (const auto& [id, e] : run_errors_) s->run_errors[id] = e.second;
  s->report = report_;
  s->report_ms = report_ms_;
  s->runs_done = runs_done_;
  s->runs_cancelled = runs_cancelled_;
  busy_ = busy;
  std::function<void()> wake;
  {
    std::lock_guard<std::mutex> l(mu_);
    s->serial = ++serial_;
    s->setup_version = computing_version_;
    published_ = s;
    wake = on_publish_;
  }
  if (wake) wake();
}

void Worker::set_on_publish(std::function<void()> f) {
  std::lock_guard<std::mutex> l(mu_);
  on_publish_ = std::move(f);
}

Retired::Retired() {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [this] { return stop_ || !freeing_.empty(); });
      if (freeing_.empty()) return;  // (stopping, nothing left)
      std::vector<std::shared_ptr<const void>> batch = std::move(freeing_);
      freeing_.clear();
      busy_ = true;
      l.unlock();
      batch.clear();  // the destructors run here, outside the lock
      l.lock();
      busy_ = false;
      cv_.notify_all();
    }
  });
}

Retired::~Retired() {
  held_.clear();
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Retired::sweep() {
  std::vector<std::shared_ptr<const void>> handed;
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->first.use_count() != 1) {
      ++it;
      continue;
    }
    if (it->second) handed.push_back(std::move(it->first));
    it = held_.erase(it);  // (an object holding device memory is freed here)
  }
  if (handed.empty()) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& p : handed) freeing_.push_back(std::move(p));
  }
  cv_.notify_all();
}

void Retired::drain() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [this] { return freeing_.empty() && !busy_; });
}

void Worker::retire(const RunResult& r) {
  // A run, its patch recorder and its report hold host memory alone.
  retired_.add(r.run, true);
  retired_.add(r.patches, true);
  retired_.add(r.json, true);
}

void Worker::drop_runs() {
  for (const auto& [id, r] : runs_) retire(r);
  runs_.clear();
  ordered_.clear();
}

void Worker::build_report(const Setup& s) {
  trace::Scope span("worker.build_report");
  const auto t0 = std::chrono::steady_clock::now();
  ordered_.clear();
  // The report's parts, held while the report is (so that none is freed and its address reused),
  // and the instances' ids and labels.
  std::vector<std::shared_ptr<const void>> parts;
  std::string labels;
  if (base_ && model_) parts.push_back(base_->json);
  for (const Setup::Method& m : s.methods) {
    auto it = runs_.find(m.id);
    if (it == runs_.end() || it->second.spec != m.params.spec()) continue;
    it->second.label = m.label;
    ordered_.push_back(it->second);
    parts.push_back(it->second.json);
    labels += std::to_string(m.id) + '\t' + m.label + '\n';
  }
  if (!base_ || !model_) {
    retired_.add(report_, true);
    report_.reset();
    report_parts_.clear();
    return;
  }
  if (report_ && parts == report_parts_ && labels == report_labels_) return;  // the same parts: the same report
  // From the parts built once: the base, and each run's entry with its current label.
  auto report = std::make_shared<nlohmann::json>(*base_->json);
  for (const RunResult& r : ordered_) {
    nlohmann::json m = *r.json;
    if (!r.label.empty()) m["label"] = r.label;
    (*report)["methods"].push_back(std::move(m));
  }
  retired_.add(report_, true);
  report_ = report;
  report_parts_ = std::move(parts);
  report_labels_ = std::move(labels);
  report_ms_ = ms_since(t0);
}

void Worker::loop() {
  for (;;) {
    Setup s;
    {
      std::unique_lock<std::mutex> l(mu_);
      // Idle: what was retired is swept here once the snapshots that held it are gone (Retired:
      // freed here, or handed to its own thread).
      for (;;) {
        if (stop_) return;
        if (want_version_ != idle_version_) break;
        if (retired_.empty()) {
          cv_.wait(l);
          continue;
        }
        cv_.wait_for(l, std::chrono::milliseconds(50));
        l.unlock();
        retired_.sweep();
        l.lock();
      }
      s = want_;
      computing_version_ = want_version_;
    }
    retired_.sweep();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      // 1. The model.
      const std::string model_key = s.model_dir + '\n' + s.backend.kind;
      if (model_key_ != model_key) {
        publish(true, "loading model");
        model_.reset();
        facts_.reset();
        retired_.add(base_);
        base_.reset();
        base_key_.clear();
        drop_runs();
        run_errors_.clear();
        model_key_ = model_key;
        model_error_.clear();
        try {
          std::shared_ptr<const Model> m = load_model(s.model_dir, s.backend);
          auto f = std::make_shared<ModelFacts>();
          const ModelInfo& c = m->info();
          f->dir = s.model_dir;
          f->backend = m->backend().name();
          f->layers = c.n_layers;
          f->heads = c.n_heads;
          f->kv_heads = c.n_kv_heads;
          f->head_dim = c.head_dim;
          f->visual_tokens = c.n_visual;
          f->family = c.family;
          f->tiling = c.tiling;
          f->image_dependent = c.image_dependent;
          f->patch_rows = c.patch_rows;
          f->patch_first = c.patch_first;
          f->load_ms = ms_since(t0);
          f->hash = folder_content_hash(s.model_dir, "model folder");
          model_ = m;
          facts_ = f;
        } catch (const InputError& e) {
          model_error_ = e.what();
        } catch (const DeviceError& e) {
          model_error_ = std::string("device error: ") + e.what();
        }
        build_report(s);
        publish(true, "model loaded");
        continue;
      }
      if (!model_) {  // the model failed to load: nothing to do until the setup changes
        {
          std::lock_guard<std::mutex> l(mu_);
          idle_version_ = computing_version_;
        }
        publish(false, "");
        continue;
      }
      // 2. The prefill (vision + prompt) and the full-cache reference.
      const std::string bkey = base_key(s);
      if (base_key_ != bkey) {
        publish(true, "prefill");
        retired_.add(base_);
        base_.reset();
        drop_runs();
        run_errors_.clear();
        base_key_ = bkey;
        base_error_.clear();
        try {
          // (a text-only model takes no image: the prompt alone, and no image to show)
          const bool takes_image = model_->info().takes_image();
          const RGBImage img = takes_image ? load_image(s.image_path) : RGBImage{};
          auto b = std::make_shared<BaseResult>();
          b->key = bkey;
          if (takes_image) {
            b->image_hash = file_content_hash(s.image_path, "image");
            b->shown = image_for_views(*model_, img);
          }
          ExperimentOptions opt = s.opt;
          opt.templ = model_template(*model_, opt.templ);
          opt.attention_maps = true;
          opt.keep_going = [&](int done) {
            tokens_done_ = done;
            return base_wanted(bkey);
          };
          tokens_total_ = opt.max_new_tokens;
          // The first visual position, from the tokenized prompt, so the patch recorder can
          // watch the reference decode itself.
          const Tokenizer& tok = model_->tokenizer();
          const VisualLayout layout = model_->visual_layout(img.width, img.height);
          const std::vector<int> ids = model_->prompt_ids(opt.prompt, opt.templ, layout);
          const auto at = takes_image ? std::find(ids.begin(), ids.end(), tok.image_token_id()) : ids.end();
          b->first_visual = at == ids.end() ? 0 : static_cast<int>(at - ids.begin());
          auto rec = std::make_shared<VisualAttentionRecorder>(b->first_visual, layout.n_tokens);
          auto ex = std::make_shared<Experiment>(start_experiment(*model_, img, opt, {rec.get()}));
          if (takes_image) ex->references = find_image_references(s.image_path);  // (CIDEr-D where the image has them)
          b->patches = rec;
          b->pieces = pieces_of(*model_, ex->full.generated_ids);
          b->json = std::make_shared<const nlohmann::json>(experiment_base_json(*model_, *ex, opt));
          b->ex = ex;
          b->ms = ms_since(t0);
          base_ = b;
          auto f = std::make_shared<ModelFacts>(*facts_);
          f->full_fp16_bytes = ex->full_fp16_bytes.total();
          facts_ = f;
        } catch (const InputError& e) {
          base_error_ = e.what();
        }
        build_report(s);
        publish(true, "prefill done");
        continue;
      }
      if (!base_) {
        {
          std::lock_guard<std::mutex> l(mu_);
          idle_version_ = computing_version_;
        }
        publish(false, "");
        continue;
      }
      // 3. Compression + decode for the instances whose parameters changed.
      for (auto it = runs_.begin(); it != runs_.end();) {
        if (find_method(s, it->first)) {
          ++it;
          continue;
        }
        retire(it->second);
        it = runs_.erase(it);
      }
      const Setup::Method* next = nullptr;
      std::vector<int> order = s.priority;
      for (const Setup::Method& m : s.methods)
        if (std::find(order.begin(), order.end(), m.id) == order.end()) order.push_back(m.id);
      for (int id : order) {
        const Setup::Method* m = find_method(s, id);
        if (!m) continue;
        const std::string spec = m->params.spec();
        auto r = runs_.find(id);
        auto e = run_errors_.find(id);
        if ((r == runs_.end() || r->second.spec != spec) && (e == run_errors_.end() || e->second.first != spec)) {
          next = m;
          break;
        }
      }
      if (next) {
        const std::string spec = next->params.spec();
        const int id = next->id;
        publish(true, next->label.empty() ? next->params.short_spec() : next->label);
        ExperimentOptions opt = s.opt;
        opt.attention_maps = true;
        opt.keep_going = [&](int done) {
          tokens_done_ = done;
          return run_wanted(id, spec, bkey);
        };
        tokens_total_ = opt.max_new_tokens;
        auto rec = std::make_shared<VisualAttentionRecorder>(base_->first_visual, base_->ex->prefill.n_visual);
        try {
          RunResult rr;
          rr.id = id;
          rr.spec = spec;
          const auto t_run = std::chrono::steady_clock::now();
          trace::Scope span("worker.run", id);
          auto run = std::make_shared<MethodRun>(run_method(*model_, *base_->ex, next->params, opt, {rec.get()}));
          rr.run_ms = ms_since(t_run);
          rr.pieces = pieces_of(*model_, run->result.generated_ids);
          const auto t_json = std::chrono::steady_clock::now();
          {
            trace::Scope json_span("worker.method_json", id);
            rr.json = std::make_shared<const nlohmann::json>(method_run_json(*model_, *base_->ex, *run));
          }
          rr.json_ms = ms_since(t_json);
          rr.run = run;
          rr.patches = rec;
          rr.ms = ms_since(t0);
          if (auto old = runs_.find(id); old != runs_.end()) retire(old->second);
          runs_[id] = rr;
          run_errors_.erase(id);
          ++runs_done_;
        } catch (const InputError& e) {
          run_errors_[id] = {spec, e.what()};
        }
        build_report(s);
        publish(true, "done");
        continue;
      }
      // Nothing left for this setup.
      build_report(s);
      {
        std::lock_guard<std::mutex> l(mu_);
        idle_version_ = computing_version_;
      }
      tokens_done_ = 0;
      publish(false, "");
    } catch (const Cancelled&) {
      // A newer setup replaced this work; the loop picks it up.
      ++runs_cancelled_;
    } catch (const std::exception& e) {
      run_errors_[-1] = {"", std::string("internal error: ") + e.what()};
      {
        std::lock_guard<std::mutex> l(mu_);
        idle_version_ = computing_version_;
      }
      publish(false, "");
    }
  }
}

}  // namespace kvlens
