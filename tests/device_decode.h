// Helpers of the GPU model tests: the embedded model prefilled on the device, and checks that
// two decode paths of one method agree (tokens, logits within one fp16 rounding, layouts).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/compress/method.h"
#include "core/data/image.h"
#include "core/diagnostics/diagnostics.h"
#include "kernels/backends.h"
#include "models/model.h"
#include "models/tokenizer.h"
#include "tests/policy_probe.h"
#include "tests/test_util.h"

// Skips the test, visibly, where no CUDA device is usable (tests/gpu_check.sh runs it on one).
#define NEED_GPU()                                                                    \
  do {                                                                                \
    const std::string why = ::kvlens::cuda_unavailable_reason();                      \
    if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;                      \
  } while (0)

namespace kvlens::testing {

// The largest |a − ref| over the largest |ref| (the absolute difference when ref is all zero).
inline double max_rel(const std::vector<float>& a, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, std::abs(static_cast<double>(a[i]) - ref[i]));
    m = std::max(m, std::abs(static_cast<double>(ref[i])));
  }
  return m > 0 ? d / m : d;
}

// The embedded model on the GPU with its sample image prefilled (the attention kept, as
// eviction methods need it), and greedy options that run `new_tokens` tokens past any EOS and
// keep every step's logits.
struct SampleRun {
  std::unique_ptr<Model> owned;
  const Model& gpu;
  PrefillState st;
  GenerateOptions g;
  int layers = 0;
};
inline SampleRun sample_run(int new_tokens) {
  std::unique_ptr<Model> m = load_model(source_dir() + "/assets/models/kvlens-scenes-6m", {"cuda"});
  const Model& gpu = *m;
  SampleRun r{std::move(m), gpu, {}, {}, 0};
  r.st = r.gpu.prefill(load_image(source_dir() + "/assets/images/scene_000.png"), kDefaultPrompt,
                       kDefaultTemplate, true);
  r.g.max_new_tokens = new_tokens;
  r.g.stop_at_eos = false;
  r.g.keep_step_logits = true;
  r.layers = r.gpu.info().n_layers;
  return r;
}

// The embedded model on the CPU with sample_run's image prefilled (the attention kept): what the
// GPU tests compare bytes and tokens with.
struct CpuRun {
  std::unique_ptr<Model> model;
  PrefillState st;
};
inline CpuRun cpu_sample_run() {
  CpuRun c;
  c.model = load_model(source_dir() + "/assets/models/kvlens-scenes-6m", {"cpu"});
  c.st = c.model->prefill(load_image(source_dir() + "/assets/images/scene_000.png"), kDefaultPrompt, kDefaultTemplate, true);
  return c;
}

// `b` against `a`, decoded by two paths of the same method: the same tokens and cache bytes,
// and every step's logits within one fp16 rounding (2^-11 of their largest magnitude).
inline void expect_same_decode(const DecodeResult& b, const DecodeResult& a) {
  EXPECT_EQ(b.generated_ids, a.generated_ids);
  ASSERT_EQ(b.step_logits.size(), a.step_logits.size());
  for (size_t i = 0; i < a.step_logits.size(); ++i)
    EXPECT_LE(max_rel(b.step_logits[i], a.step_logits[i]), std::ldexp(1.0, -11)) << "step " << i;
  EXPECT_EQ(b.bytes_after_prefill.total(), a.bytes_after_prefill.total());
  EXPECT_EQ(b.bytes_final.total(), a.bytes_final.total());
}

// Two layouts (segments' kinds, bytes unless `bytes` is off, each head's positions and merge
// counts) are equal.
inline void expect_same_layout(const KVStore& a, const KVStore& b, bool bytes = true) {
  ASSERT_EQ(a.n_layers(), b.n_layers());
  for (int l = 0; l < a.n_layers(); ++l) {
    const auto &x = a.layer(l).segments, &y = b.layer(l).segments;
    ASSERT_EQ(x.size(), y.size()) << "layer " << l;
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(x[i].kind, y[i].kind) << "layer " << l << " segment " << i;
      if (bytes) {
        EXPECT_EQ(x[i].bytes.total(), y[i].bytes.total()) << "layer " << l << " segment " << i;
      }
      ASSERT_EQ(x[i].heads.size(), y[i].heads.size());
      for (size_t h = 0; h < x[i].heads.size(); ++h) {
        EXPECT_EQ(x[i].heads[h].pos, y[i].heads[h].pos) << "layer " << l << " segment " << i << " head " << h;
        EXPECT_EQ(x[i].heads[h].merged, y[i].heads[h].merged) << "layer " << l << " segment " << i << " head " << h;
      }
    }
  }
}

// `spec`'s policy decoded from r's prefill three ways: `host` with its hook made to act at every
// step (the loop keeps the host rows and calls it each layer and forward), `device` as the method
// is (chained), `unchained` the same with unchained steps. Checks what holds for a method that
// needs no host work while decoding: only the host path calls the hook (every layer and
// forward), only the device path chains, and unchained steps give exactly the chained ones.
struct ThreeDecodes {
  DecodeResult host, device, unchained;
};
inline ThreeDecodes decode_three_ways(const SampleRun& r, const char* spec) {
  PolicyProbe host(make_policy(spec), true), device(make_policy(spec), false), unchained(make_policy(spec), false);
  ThreeDecodes t;
  t.host = r.gpu.decode(r.st, &host, r.g);
  t.device = r.gpu.decode(r.st, &device, r.g);
  GenerateOptions u = r.g;
  u.chain_steps = false;
  t.unchained = r.gpu.decode(r.st, &unchained, u);
  EXPECT_EQ(host.decode_calls, r.layers * (r.g.max_new_tokens - 1));
  EXPECT_EQ(device.decode_calls + unchained.decode_calls, 0);
  EXPECT_TRUE(t.device.chained);
  EXPECT_FALSE(t.host.chained || t.unchained.chained);
  EXPECT_EQ(t.unchained.generated_ids, t.device.generated_ids);
  EXPECT_EQ(t.unchained.step_logits, t.device.step_logits);
  EXPECT_EQ(t.unchained.bytes_final.total(), t.device.bytes_final.total());
  return t;
}

// `spec`'s policy decoded twice from r's prefill, unchained: x on the layout alone (its policy
// reads no rows), y with an observer that reads keys and values, so that the prompt's rows come
// to the host first; a and b are their compressed stores.
struct TwoDecodes {
  DecodeResult x, y;
  KVStore a, b;
};
inline TwoDecodes decode_on_layout_and_on_rows(const SampleRun& r, const char* spec) {
  GenerateOptions u = r.g;
  u.chain_steps = false;
  const auto p0 = make_policy(spec), p1 = make_policy(spec);
  EXPECT_FALSE(p0->reads_rows());
  TwoDecodes t;
  DecodeRecorder rows(2, true);
  t.x = r.gpu.decode(r.st, p0.get(), u, {}, &t.a);
  t.y = r.gpu.decode(r.st, p1.get(), u, {&rows}, &t.b);
  EXPECT_TRUE(!rows.entries().empty() && !rows.entries().front().k.empty()) << "the observed decode read the rows";
  return t;
}

}  // namespace kvlens::testing
