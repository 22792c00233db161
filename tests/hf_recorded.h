// HF transformers' recorded greedy generations of an embedded model (train_embedded.py
// --hf-outputs): loading a recording, the held-out scenes it was made on, and checking a model's
// greedy decode against it. Any embedded model folder + recording, on any backend.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/scenes.h"
#include "models/model.h"
#include "models/tokenizer.h"

namespace kvlens::testing {

// The held-out seed of recordings that name none (the classic 6m model's): never used in training.
inline constexpr uint64_t kDefaultHeldoutSeed = 1000001;

// A recording file, parsed. Throws std::runtime_error naming `path` when it is missing or not JSON.
inline nlohmann::json load_recording(const std::string& path) {
  std::ifstream f(path);
  if (!f.good()) throw std::runtime_error("HF recording missing: " + path + " (not found or unreadable)");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("HF recording " + path + " is not valid JSON: " + e.what());
  }
}

// An embedded model folder, loaded. Throws std::runtime_error naming `dir` when it has no config.json.
inline std::unique_ptr<Model> load_embedded_model(const std::string& dir, const BackendOptions& backend = {}) {
  if (!std::ifstream(dir + "/config.json").good())
    throw std::runtime_error("embedded model missing: " + dir + " (no config.json)");
  return load_model(dir, backend);
}

// The model in `dir` and the recording at `path`, each loaded once per test program (what its
// tests share); the loaders' errors as above.
inline const Model& shared_embedded_model(const std::string& dir) {
  static std::map<std::string, std::unique_ptr<Model>> loaded;
  std::unique_ptr<Model>& m = loaded[dir];
  if (!m) m = load_embedded_model(dir);
  return *m;
}
inline const nlohmann::json& shared_recording(const std::string& path) {
  static std::map<std::string, nlohmann::json> loaded;
  const auto it = loaded.find(path);
  return it != loaded.end() ? it->second : loaded.emplace(path, load_recording(path)).first->second;
}

// The scenes a recording was made on: the seed and options of generate_scene.
struct RecordedScenes {
  uint64_t seed = kDefaultHeldoutSeed;
  SceneOptions opts;
};

// From "heldout_info" (the set's info block of `kvlens scenes`: seed, size, version; a classic set
// names no version) when present, else classic scenes of "heldout_seed", else of 1000001.
inline RecordedScenes recorded_scenes(const nlohmann::json& rec) {
  RecordedScenes r;
  if (rec.contains("heldout_info") && rec["heldout_info"].is_object()) {
    const auto& info = rec["heldout_info"];
    r.seed = info.value("seed", kDefaultHeldoutSeed);
    r.opts.version = info.value("version", kClassicScenes);
    r.opts.size = info.value("size", 0);
  } else if (rec.contains("heldout_seed") && rec["heldout_seed"].is_number_integer()) {
    r.seed = rec["heldout_seed"].get<uint64_t>();
  }
  return r;
}

// How many recordings of each kind a parity test checks: `dflt`, or KVLENS_HF_SPOTCHECK.
inline int hf_spotcheck_count(int dflt = 16) {
  const char* e = std::getenv("KVLENS_HF_SPOTCHECK");
  return e ? std::atoi(e) : dflt;
}

// Checks the first `n` recorded generations of `kind` ("captions" or "questions") of `rec`: each
// recorded scene regenerated, prefilled with kDefaultTemplate to the recorded prompt ids, decoded
// greedily for the recording's max_new_tokens to the recorded ids. HF recorded them with an fp32
// cache; the model decodes with its default fp16 cache (the full-cache output a researcher sees).
inline void check_recorded_generations(const Model& m, const nlohmann::json& rec, const char* kind, int n) {
  ASSERT_TRUE(rec.contains(kind) && rec[kind].is_array()) << "the recording has no \"" << kind << "\" list";
  ASSERT_TRUE(rec.contains("max_new_tokens")) << "the recording has no \"max_new_tokens\"";
  const auto& list = rec[kind];
  ASSERT_GE(static_cast<int>(list.size()), n) << kind << ": fewer recordings than asked";
  const RecordedScenes scenes = recorded_scenes(rec);
  GenerateOptions g;
  g.max_new_tokens = rec["max_new_tokens"].get<int>();
  int same = 0;
  for (int i = 0; i < n; ++i) {
    const auto& e = list[i];
    const int64_t image_id = e["image_id"].get<int64_t>();
    const Scene sc = generate_scene(scenes.seed, image_id, scenes.opts);
    const PrefillState st = m.prefill(sc.image, e["prompt"].get<std::string>(), kDefaultTemplate, false);
    ASSERT_EQ(st.ids, e["input_ids"].get<std::vector<int>>()) << kind << " " << i << " (image " << image_id
                                                              << "): prompt ids differ from HF's";
    const DecodeResult r = m.decode(st, nullptr, g);
    const auto want = e["generated_ids"].get<std::vector<int>>();
    EXPECT_EQ(r.generated_ids, want) << kind << " " << i << " (image " << image_id << "): ours '" << r.text
                                     << "', HF '" << e["text"].get<std::string>() << "'"
                                     << (e.contains("min_top2_logit_gap")
                                             ? ", HF's smallest top-2 logit gap " + e["min_top2_logit_gap"].dump()
                                             : std::string());
    same += r.generated_ids == want;
  }
  EXPECT_EQ(same, n) << kind << ": generations equal to HF's";
}

// The embedded model in `dir` on `backend` (which must be the one that runs it) against every
// kind of the recording at `recording`, hf_spotcheck_count() of each.
inline void check_model_against_recording(const std::string& dir, const std::string& recording,
                                          const BackendOptions& backend) {
  const nlohmann::json rec = load_recording(recording);
  const std::unique_ptr<Model> m = load_embedded_model(dir, backend);
  ASSERT_EQ(m->backend().name(), backend.kind);
  for (const char* kind : {"captions", "questions"}) check_recorded_generations(*m, rec, kind, hf_spotcheck_count());
}

}  // namespace kvlens::testing
