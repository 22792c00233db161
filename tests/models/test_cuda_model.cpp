// The model end to end on the CUDA backend against the CPU backend (the reference): the HF
// parity fixtures and the embedded model give the same greedy ids and first-step logits within
// 2e-2 relative; a run report's diagnostics agree within the tolerances stated below; the GPU
// KV cache holds exactly the bytes it reports; the CLI runs with --backend cuda and refuses it
// with a clear message where no device is usable.
#include <gtest/gtest.h>


#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/data/scenes.h"
#include "core/kv_format.h"
#include "kernels/backends.h"
#include "app/lab/experiment.h"
#include "app/lab/memory_plan.h"
#include "models/llama.h"
#include "models/model.h"
#include "tests/hf_recorded.h"
#include "tests/policy_probe.h"
#include "tests/recorder_check.h"
#include "tests/test_util.h"
#include "tests/captured_attention_check.h"
#include "tests/device_decode.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::max_rel;
using kt::sample_run;
using kt::SampleRun;
using kt::expect_same_decode;
using kt::CountingRecorder;

namespace {

const std::string kEmbedded = kt::source_dir() + "/assets/models/kvlens-scenes-6m";
const std::string kDeepEmbedded = kt::source_dir() + "/assets/models/kvlens-scenes-14m";  // rich scenes


TEST(CudaModel, FixturesMatchCpuAndTransformers) {
  NEED_GPU();
  const auto dirs = kt::hf_fixture_dirs();
  ASSERT_GE(dirs.size(), 3u);
  for (const std::string& dir : dirs) {
    std::ifstream f(dir + "/expected.json");
    const auto exp = nlohmann::json::parse(f);
    const RGBImage img = kt::hf_fixture_image(dir);
    const std::string templ = kt::hf_fixture_template(dir);
    const std::string prompt = exp["prompt"].get<std::string>();
    const std::unique_ptr<Model> cpu_owned = load_model(dir, {"cpu"});
    const Model& cpu = *cpu_owned;
    const std::unique_ptr<Model> gpu_owned = load_model(dir, {"cuda"});
    const Model& gpu = *gpu_owned;
    ASSERT_EQ(gpu.backend().name(), "cuda");
    const PrefillState a = cpu.prefill(img, prompt, templ, false);
    const PrefillState b = gpu.prefill(img, prompt, templ, false);
    ASSERT_EQ(a.ids, b.ids) << dir;
    EXPECT_LE(max_rel(b.logits, a.logits), 2e-2) << dir << ": first-step logits vs the CPU backend";
    const auto hf = kt::read_f32(dir + "/" + exp["logits_file"].get<std::string>());
    EXPECT_LE(max_rel(b.logits, hf), 2e-2) << dir << ": first-step logits vs HF transformers";
    GenerateOptions g;
    const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
    g.max_new_tokens = static_cast<int>(greedy.size());
    g.stop_at_eos = false;
    const DecodeResult ra = cpu.decode(a, nullptr, g), rb = gpu.decode(b, nullptr, g);
    EXPECT_EQ(rb.generated_ids, ra.generated_ids) << dir;
    EXPECT_EQ(rb.generated_ids, greedy) << dir << ": greedy ids vs HF transformers";
    // Every step's chosen-token probability (the decode steps replayed from a CUDA graph).
    ASSERT_EQ(ra.chosen_probs.size(), rb.chosen_probs.size());
    for (size_t i = 0; i < ra.chosen_probs.size(); ++i)
      EXPECT_NEAR(rb.chosen_probs[i], ra.chosen_probs[i], 2e-2) << dir << " step " << i;
  }
}

// The capture on the device: each layer's attention recomputed by the device's attention op
// equals what the prefill handed its observers, bit for bit.
TEST(CudaModel, CapturedAttentionIsThePrefillsAttention) {
  NEED_GPU();
  const std::unique_ptr<Model> gpu = load_model(kEmbedded, {"cuda"});
  kt::check_captured_attention(*gpu, load_image(kt::source_dir() + "/assets/images/scene_000.png"), "cuda");
}

// On the device the plan is checked against its free memory (the pool's unused memory counted):
// the embedded model fits; a limit one byte under the plan refuses the run, naming the device
// memory and what would fit.
TEST(CudaModel, MemoryPlanIsCheckedAgainstTheDevicesFreeMemory) {
  NEED_GPU();
  const std::unique_ptr<Model> gpu = load_model(kEmbedded, {"cuda"});
  ExperimentOptions opt;
  const VisualLayout image = gpu->visual_layout(336, 336);
  const MemoryPlan p = plan_experiment(*gpu, opt, image);
  EXPECT_EQ(p.backend, "cuda");
  EXPECT_GT(available_memory(*gpu, opt), p.total());
  EXPECT_NO_THROW(check_memory(*gpu, opt, image));
  opt.memory_limit = p.total() - 1;
  try {
    check_memory(*gpu, opt, image);
    ADD_FAILURE() << "a run over its limit was not refused";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cuda device memory"), std::string::npos) << m;
    EXPECT_NE(m.find("--backend cpu"), std::string::npos) << m;
  }
}

// The embedded models on the device against HF transformers' recorded greedy generations (16
// captions + 16 questions each; KVLENS_HF_SPOTCHECK=64 checks all).
TEST(CudaModel, EmbeddedModelMatchesTransformersOnHeldOutScenes) {
  NEED_GPU();
  kt::check_model_against_recording(kEmbedded, kt::source_dir() + "/tests/fixtures/embedded/hf_greedy.json", {"cuda"});
}

TEST(CudaModel, DeepEmbeddedModelMatchesTransformersOnHeldOutScenes) {
  NEED_GPU();
  kt::check_model_against_recording(kDeepEmbedded, kt::source_dir() + "/tests/fixtures/embedded_deep/hf_greedy.json",
                                    {"cuda"});
}

TEST(CudaModel, KvCacheBytesAreDeviceBytes) {
  NEED_GPU();
  const std::unique_ptr<Model> gpu_owned = load_model(kEmbedded, {"cuda"});
  const Model& gpu = *gpu_owned;
  const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
  const PrefillState st = gpu.prefill(img, kDefaultPrompt, kDefaultTemplate, false);
  ASSERT_TRUE(st.device);
  const ModelInfo& c = gpu.info();
  const int64_t T = static_cast<int64_t>(st.ids.size());
  // fp16 K and V plus int32 positions, per layer and KV head: exactly what was allocated.
  const int64_t want = static_cast<int64_t>(c.n_layers) * c.n_kv_heads * T * (2 * c.head_dim * 2 + 4);
  EXPECT_EQ(st.device->bytes().total(), want);
  EXPECT_EQ(st.device->allocated(), want);
  // After a 1-bit CalibQuant compression the packed visual rows are on the device as reported.
  auto policy = make_policy("calibquant:bits=1");
  KVStore compressed;
  GenerateOptions g;
  g.max_new_tokens = 4;
  const DecodeResult r = gpu.decode(st, policy.get(), g, {}, &compressed);
  EXPECT_EQ(r.bytes_after_prefill.total(), compressed.bytes().total());
  EXPECT_LT(r.bytes_after_prefill.total(), want / 4);
  // ZipCache's default groups (a layer's prompt, V token ranges shared by the KV heads) are
  // packed on the device too: 4 bits for 40 % of the rows, 2 for the rest, under a third of fp16
  // with their ranges (held as fp16 values they would take `want`).
  auto zip = make_policy("zipcache");
  KVStore zc;
  const PrefillState kept = gpu.prefill(img, kDefaultPrompt, kDefaultTemplate, true);  // its saliency needs the attention
  const DecodeResult z = gpu.decode(kept, zip.get(), g, {}, &zc);
  EXPECT_EQ(z.bytes_after_prefill.total(), zc.bytes().total());
  EXPECT_LT(z.bytes_after_prefill.total(), want / 3);
  for (const KVSegment& s : zc.layer(0).segments) EXPECT_EQ(s.storage.rfind("zipcache", 0), 0u) << s.storage;
}

// Diagnostics of `kvlens run` on both backends: captions (same greedy ids for the methods the
// issue names), softmax MSE and KL within 25% (or 1e-6 absolute), the output error within 25%
// (or 1e-4: fp16 rows on the device), score histograms within an L1
// distance of 0.05 of the counts for exact scores and 0.08 for quantized ones (or 6 counts:
// three scores crossing a bin edge), cache hit rates and sparsities within 0.05.
TEST(CudaModel, RunReportDiagnosticsAgreeWithCpu) {
  NEED_GPU();
  const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
  ExperimentOptions opt;
  opt.max_new_tokens = 16;
  const std::unique_ptr<Model> cpu_owned = load_model(kEmbedded, {"cpu"});
  const Model& cpu = *cpu_owned;
  const std::unique_ptr<Model> gpu_owned = load_model(kEmbedded, {"cuda"});
  const Model& gpu = *gpu_owned;
  Experiment a = start_experiment(cpu, img, opt), b = start_experiment(gpu, img, opt);
  EXPECT_EQ(a.full.generated_ids, b.full.generated_ids);
  for (size_t l = 0; l < a.sparsity_prefill.size(); ++l) {
    EXPECT_NEAR(a.sparsity_prefill[l], b.sparsity_prefill[l], 0.05) << "layer " << l;
    EXPECT_NEAR(a.sparsity_decode_full[l], b.sparsity_decode_full[l], 0.05) << "layer " << l;
  }
  ASSERT_EQ(a.hit_rates.rates.size(), b.hit_rates.rates.size());
  for (size_t s = 0; s < a.hit_rates.rates.size(); ++s)
    for (size_t t = 0; t < a.hit_rates.rates[s].size(); ++t)
      for (size_t l = 0; l < a.hit_rates.rates[s][t].size(); ++l)
        EXPECT_NEAR(a.hit_rates.rates[s][t][l], b.hit_rates.rates[s][t][l], 0.05)
            << a.hit_rates.strategies[s] << " step " << t << " layer " << l;
  for (const char* m : {"calibquant:bits=1", "calibquant:bits=2", "kivi:bits=2", "zipcache", "snapkv:budget=0.3",
                        "lookm", "uniform:bits=4", "turboquant"}) {
    const Params p = parse_method_spec(m);
    const MethodRun ra = run_method(cpu, a, p, opt), rb = run_method(gpu, b, p, opt);
    const bool must_match = std::string(m).rfind("calibquant", 0) == 0 || std::string(m) == "kivi:bits=2" ||
                            std::string(m) == "zipcache";
    if (must_match) {
      EXPECT_EQ(ra.result.generated_ids, rb.result.generated_ids) << m;
    }
    EXPECT_LE(std::abs(ra.mean_softmax_mse - rb.mean_softmax_mse), 0.25 * ra.mean_softmax_mse + 1e-6) << m;
    // The device compares each query with the exact attention from the prefill's capture (no
    // rows cross); the CPU from its rows. KL and the output error as the MSE.
    EXPECT_LE(std::abs(ra.mean_kl - rb.mean_kl), 0.25 * ra.mean_kl + 1e-6) << m;
    EXPECT_LE(std::abs(ra.mean_output_error - rb.mean_output_error), 0.25 * ra.mean_output_error + 1e-4) << m;
    ASSERT_EQ(ra.layers.size(), rb.layers.size());
    for (size_t l = 0; l < ra.layers.size(); ++l) {
      const auto &ha = ra.layers[l].visual_scores, &hb = rb.layers[l].visual_scores;
      for (const auto* pair : {&ha.exact, &ha.quantized, &ha.calibrated}) {
        const auto& x = *pair;
        const auto& y = pair == &ha.exact ? hb.exact : pair == &ha.quantized ? hb.quantized : hb.calibrated;
        ASSERT_EQ(x.size(), y.size()) << m;
        double tot = 0, d = 0;
        for (size_t i = 0; i < x.size(); ++i) tot += x[i], d += std::abs(double(x[i]) - y[i]);
        // A score that crosses a bin edge moves two counts; at small totals three such
        // crossings (6 counts) are allowed beyond the fraction. Quantized (and calibrated)
        // scores may move further than exact ones: a last-bit difference in a key between the
        // backends can flip one of its codes, which moves the score by a whole quantization step.
        const double frac = pair == &ha.exact ? 0.05 : 0.08;
        if (tot > 0) {
          EXPECT_LE(d, std::max(frac * tot, 6.0)) << m << " layer " << l << " histogram (" << tot << " counts)";
        }
      }
      EXPECT_NEAR(ra.layers[l].sparsity_decode, rb.layers[l].sparsity_decode, 0.05) << m << " layer " << l;
    }
  }
}

// More diagnostic steps than a device decode puts off at once (LlamaWorkspace::kStashSlots): the
// steps are handed over in two batches, each step compared with its own exact attention (its
// query, and the generated rows as that step saw them). The mean diagnostics and each layer's
// decode sparsity agree with the CPU's, which compares every step as it runs, within
// RunReportDiagnosticsAgreeWithCpu's bounds; a step compared with another step's query or rows
// would move them by far more.
TEST(CudaModel, DiagnosticsOfMoreStepsThanADecodePutsOffAgreeWithCpu) {
  NEED_GPU();
  const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
  ExperimentOptions opt;
  opt.max_new_tokens = 16;
  opt.diag_steps = LlamaWorkspace::kStashSlots + 3;
  const std::unique_ptr<Model> cpu = load_model(kEmbedded, {"cpu"}), gpu = load_model(kEmbedded, {"cuda"});
  Experiment a = start_experiment(*cpu, img, opt), b = start_experiment(*gpu, img, opt);
  ASSERT_EQ(a.full.generated_ids, b.full.generated_ids);
  for (const char* m : {"snapkv:budget=0.3", "calibquant:bits=2", "turboquant"}) {
    const Params p = parse_method_spec(m);
    const MethodRun ra = run_method(*cpu, a, p, opt), rb = run_method(*gpu, b, p, opt);
    EXPECT_EQ(ra.result.generated_ids, rb.result.generated_ids) << m;
    EXPECT_LE(std::abs(ra.mean_softmax_mse - rb.mean_softmax_mse), 0.25 * ra.mean_softmax_mse + 1e-6) << m;
    EXPECT_LE(std::abs(ra.mean_kl - rb.mean_kl), 0.25 * ra.mean_kl + 1e-6) << m;
    EXPECT_LE(std::abs(ra.mean_output_error - rb.mean_output_error), 0.25 * ra.mean_output_error + 1e-4) << m;
    ASSERT_EQ(ra.layers.size(), rb.layers.size());
    for (size_t l = 0; l < ra.layers.size(); ++l)
      EXPECT_NEAR(ra.layers[l].sparsity_decode, rb.layers[l].sparsity_decode, 0.05) << m << " layer " << l;
  }
}

TEST(CudaModel, CliCaptionOnCudaEqualsCpu) {
  NEED_GPU();
  const auto c = kt::run(kt::cli() + " caption --backend cpu --max-new-tokens 12");
  const auto g = kt::run(kt::cli() + " caption --backend cuda --max-new-tokens 12");
  ASSERT_EQ(c.code, 0) << c.output;
  ASSERT_EQ(g.code, 0) << g.output;
  EXPECT_EQ(c.output, g.output);
}

// The device KV cache holds fp16 rows: asking for exact fp32 rows on it is refused with a message
// naming the setting and the backend that has them, never silently stored as fp16.
TEST(CudaModel, Fp32RowsAreRefusedOnTheDevice) {
  NEED_GPU();
  const auto r = kt::run(kt::cli() + " caption --backend cuda --kv-storage fp32 --max-new-tokens 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--kv-storage fp32"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--backend cpu"), std::string::npos) << r.output;
  const auto m = kt::run(kt::cli() + " run --backend cuda --method full:storage=fp32 --max-new-tokens 2");
  EXPECT_EQ(m.code, 2) << m.output;
  EXPECT_NE(m.output.find("full:storage=fp32"), std::string::npos) << m.output;
  const auto c = kt::run(kt::cli() + " caption --backend cpu --kv-storage fp32 --max-new-tokens 2");
  EXPECT_EQ(c.code, 0) << c.output;
}

TEST(CudaModel, CliRefusesCudaWithoutADevice) {
  if (cuda_unavailable_reason().empty()) GTEST_SKIP() << "a CUDA device is usable here; the refusal is for machines without one";
  const auto r = kt::run(kt::cli() + " caption --backend cuda --max-new-tokens 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--backend cuda"), std::string::npos) << r.output;
  // auto falls back to the CPU.
  const auto a = kt::run(kt::cli() + " caption --backend auto --max-new-tokens 2");
  EXPECT_EQ(a.code, 0) << a.output;
}

// Greedy decode with steps chained (each launched before the previous one's logits are back)
// gives what the unchained loop gives: the same ids, the same bits of every step's logits and
// chosen-token probability, and the same final cache bytes — also when the caption ends at an
// EOS and the step launched past it is dropped.
TEST(CudaModel, ChainedStepsEqualUnchainedSteps) {
  NEED_GPU();
  struct Case {
    std::string dir;
    int max_new;
    bool stop_at_eos;
  };
  std::vector<Case> cases = {{kEmbedded, 64, true}, {kEmbedded, 9, false}, {kEmbedded, 1, false}, {kEmbedded, 0, false}};
  for (const std::string& d : kt::hf_fixture_dirs()) cases.push_back({d, 6, false});
  int ended_at_eos = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir + " max_new_tokens " + std::to_string(c.max_new));
    const std::unique_ptr<Model> gpu_owned = load_model(c.dir, {"cuda"});
    const Model& gpu = *gpu_owned;
    ASSERT_TRUE(gpu.backend().chains_steps());
    const RGBImage img = c.dir == kEmbedded ? load_image(kt::source_dir() + "/assets/images/scene_000.png")
                                            : kt::hf_fixture_image(c.dir);
    const PrefillState st =
        gpu.prefill(img, kDefaultPrompt, c.dir == kEmbedded ? std::string(kDefaultTemplate) : kt::hf_fixture_template(c.dir), false);
    GenerateOptions g;
    g.max_new_tokens = c.max_new;
    g.stop_at_eos = c.stop_at_eos;
    g.keep_step_logits = true;
    g.chain_steps = false;
    const DecodeResult a = gpu.decode(st, nullptr, g);
    g.chain_steps = true;
    const DecodeResult b = gpu.decode(st, nullptr, g);
    const DecodeResult b2 = gpu.decode(st, nullptr, g);  // chained again, from the same prefill state
    if (!c.stop_at_eos) {
      EXPECT_EQ(static_cast<int>(a.generated_ids.size()), c.max_new);
    }
    EXPECT_FALSE(a.chained);
    for (const DecodeResult* r : {&b, &b2}) {
      EXPECT_EQ(r->chained, c.max_new > 0);
      EXPECT_EQ(r->generated_ids, a.generated_ids);
      EXPECT_EQ(r->text, a.text);
      EXPECT_EQ(r->chosen_probs, a.chosen_probs);
      ASSERT_EQ(r->step_logits.size(), a.step_logits.size());
      for (size_t i = 0; i < a.step_logits.size(); ++i) EXPECT_EQ(r->step_logits[i], a.step_logits[i]) << "step " << i;
      EXPECT_EQ(r->bytes_final.total(), a.bytes_final.total());
    }
    if (c.stop_at_eos) {
      ended_at_eos += static_cast<int>(a.generated_ids.size()) < c.max_new;
      // The cache grew by one row per forward, the dropped step's excluded.
      const ModelInfo& t = gpu.info();
      const int64_t row = static_cast<int64_t>(t.n_layers) * t.n_kv_heads * (2 * t.head_dim * 2 + 4);
      EXPECT_EQ(b.bytes_final.total() - b.bytes_after_prefill.total(),
                row * (static_cast<int64_t>(b.generated_ids.size()) - 1));
    }
  }
  EXPECT_EQ(ended_at_eos, 1) << "the EOS case must end before max_new_tokens, so a step launched ahead is dropped";
}

// A prefill-only method decodes on the device alone — no host rows, no hook, steps replayed and
// chained — to the same tokens and cache bytes as when the loop keeps the host rows and calls the
// hook once a layer and forward, and to logits within 2^-11 of their largest magnitude: the
// paths' kernels differ (the fp16 eviction methods' plain steps fuse RoPE, the append and
// attention into one; with host rows the append takes its own kernel), so their fp32 sums differ
// in order, which can move the fp16 rounding of an attention output by one step (2^-11
// relative). Chained and unchained device-only steps agree exactly.
TEST(CudaModel, PrefillOnlyMethodsDecodeOnTheDeviceAlone) {
  NEED_GPU();
  SampleRun r = sample_run(12);
  ASSERT_TRUE(r.gpu.backend().chains_steps());
  for (const char* spec : {"calibquant:bits=1", "calibquant:bits=2", "calibquant:bits=4", "snapkv", "stack"}) {
    SCOPED_TRACE(spec);
    const kt::ThreeDecodes t = kt::decode_three_ways(r, spec);
    expect_same_decode(t.device, t.host);
  }
}

// A method that acts at some steps only (KIVI quantizing its oldest dense group, here with no
// residual rows, which the device's steps do not take) runs the other steps' layers on the
// device alone, fetching the new rows' host copies after the step: the same tokens, bytes and
// logits (as above) as the loop that keeps the host rows in step at every layer, and its hook
// called at the acting steps only.
TEST(CudaModel, MethodsThatActAtSomeStepsSkipTheOthersHostWork) {
  NEED_GPU();
  SampleRun r = sample_run(14);
  for (const char* spec : {"kivi:bits=4,group=3,residual=0", "stack:evict=snapkv,quant=kivi,group=4,residual=0"}) {
    SCOPED_TRACE(spec);
    kt::PolicyProbe host(make_policy(spec), true), some(make_policy(spec), false);
    const DecodeResult a = r.gpu.decode(r.st, &host, r.g);
    const DecodeResult b = r.gpu.decode(r.st, &some, r.g);
    EXPECT_EQ(host.decode_calls, r.layers * (r.g.max_new_tokens - 1));
    EXPECT_GT(some.decode_calls, 0);
    EXPECT_LT(some.decode_calls, host.decode_calls);
    expect_same_decode(b, a);
  }
}

// A decode observed for its first steps only (the run's recorders) hands those steps over and runs
// the rest on the device alone: the same tokens and bytes as an unobserved decode and logits
// within one fp16 rounding (as above: observed steps append and attend in two kernels), and the
// observed steps' events equal those of an observer of every step while an observer with rows
// reads them; a step read only by a recorder without rows hands its events over at its end,
// within the bounds of the test below. With a method too (SnapKV compresses at prefill only).
// Decodes r's prompt unchained with `spec`'s policy (none when empty) three times: unobserved,
// observed by `all`, and observed by `some`; both observed decodes give the unobserved one's
// tokens, bytes and logits (expect_same_decode).
void decode_observed_and_not(const SampleRun& r, const char* spec, DecodeRecorder& all,
                             const std::vector<AttentionObserver*>& some) {
  GenerateOptions u = r.g;
  u.chain_steps = false;
  auto policy = [&] { return *spec ? make_policy(spec) : nullptr; };
  auto p0 = policy(), p1 = policy(), p2 = policy();
  const DecodeResult plain = r.gpu.decode(r.st, p0.get(), u);
  expect_same_decode(r.gpu.decode(r.st, p1.get(), u, {&all}), plain);
  expect_same_decode(r.gpu.decode(r.st, p2.get(), u, some), plain);
}

TEST(CudaModel, ObservedStepsEndWhereTheObserversStop) {
  NEED_GPU();
  SampleRun r = sample_run(10);
  for (const char* spec : {"", "snapkv"}) {
    SCOPED_TRACE(spec);
    DecodeRecorder all(100), two(2), probs_only(3, false);
    decode_observed_and_not(r, spec, all, {&two, &probs_only});
    EXPECT_EQ(all.steps(), r.g.max_new_tokens - 1);
    EXPECT_EQ(two.steps(), 2);
    EXPECT_EQ(probs_only.steps(), 3);
    kvlens::testing::expect_events_of(two, all);
    // Steps 0 and 1 ran layer by layer (`two` reads rows): the same events. Step 2, which only
    // `probs_only` reads, handed its events over at its end (the bounds of
    // ObservedStepsWithoutRowsHandTheirEventsOverAtTheStepsEnd).
    for (const auto& e : probs_only.entries()) {
      const auto* ref = all.find(e.step, e.layer);
      ASSERT_NE(ref, nullptr);
      EXPECT_EQ(e.key_pos, ref->key_pos);
      ASSERT_EQ(e.probs.size(), ref->probs.size());
      for (size_t i = 0; i < e.probs.size(); ++i) {
        if (e.step < 2) {
          EXPECT_EQ(e.probs[i], ref->probs[i]) << "step " << e.step << " layer " << e.layer;
        } else {
          EXPECT_NEAR(e.probs[i], ref->probs[i], 0.02) << "step 2 layer " << e.layer;
        }
      }
      if (e.step < 2) {
        EXPECT_EQ(e.scores, ref->scores);
        EXPECT_EQ(e.q, ref->q);
      }
    }
  }
}

// Past the last step an observer reads, the rest of the caption is chained (each step launched
// before the previous one's logits are back): the same tokens, every step's logits and the
// cache's bytes as the unchained loop, and the observed steps' events the same bits, with and
// without a method; an observer of every step keeps the loop unchained.
TEST(CudaModel, StepsPastTheObservedOnesAreChained) {
  NEED_GPU();
  SampleRun r = sample_run(10);
  for (const char* spec : {"", "snapkv", "zipcache"}) {
    SCOPED_TRACE(spec);
    DecodeResult x[2];
    std::vector<std::unique_ptr<DecodeRecorder>> rec;
    for (int chained = 0; chained < 2; ++chained) {
      GenerateOptions g = r.g;
      g.chain_steps = chained != 0;
      rec.push_back(std::make_unique<DecodeRecorder>(2));
      rec.push_back(std::make_unique<DecodeRecorder>(3, false));
      auto p = *spec ? make_policy(spec) : nullptr;
      x[chained] = r.gpu.decode(r.st, p.get(), g, {rec[rec.size() - 2].get(), rec.back().get()});
    }
    EXPECT_FALSE(x[0].chained);
    EXPECT_TRUE(x[1].chained);
    EXPECT_EQ(x[1].generated_ids, x[0].generated_ids);
    EXPECT_EQ(x[1].step_logits, x[0].step_logits);
    EXPECT_EQ(x[1].bytes_final.total(), x[0].bytes_final.total());
    for (int i = 0; i < 2; ++i) {
      const DecodeRecorder &a = *rec[static_cast<size_t>(i)], &b = *rec[static_cast<size_t>(i + 2)];
      ASSERT_EQ(a.entries().size(), b.entries().size());
      EXPECT_GT(a.entries().size(), 0u);
      for (size_t k = 0; k < a.entries().size(); ++k) {
        EXPECT_EQ(a.entries()[k].step, b.entries()[k].step);
        EXPECT_EQ(a.entries()[k].probs, b.entries()[k].probs) << "step " << a.entries()[k].step;
      }
    }
    DecodeRecorder every(100);
    GenerateOptions g = r.g;
    auto p = *spec ? make_policy(spec) : nullptr;
    EXPECT_FALSE(r.gpu.decode(r.st, p.get(), g, {&every}).chained);
  }
}

// Steps no observer reads between observed ones (record_only) run on the device alone, their
// rows fetched to the host store together before the next observed step: the same tokens, bytes
// and logits as an unobserved decode, exactly the steps named recorded, and each event's key
// positions those an observer of every step sees, its probabilities within 0.02 of them (as
// above: the steps between append and attend in one kernel, an observed step in two) and each
// row summing to 1.
TEST(CudaModel, StepsBetweenObservedOnesRunOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(10);
  for (const char* spec : {"", "snapkv"}) {
    SCOPED_TRACE(spec);
    DecodeRecorder all(100), rows(8), probs(8, false);
    rows.record_only({0, 4});
    probs.record_only({2, 7});
    decode_observed_and_not(r, spec, all, {&rows, &probs});
    for (const auto* rec : {&rows, &probs}) {
      std::set<int> steps;
      for (const auto& e : rec->entries()) {
        steps.insert(e.step);
        const auto* ref = all.find(e.step, e.layer);
        ASSERT_NE(ref, nullptr);
        const std::string at = "step " + std::to_string(e.step) + " layer " + std::to_string(e.layer);
        EXPECT_EQ(e.key_pos, ref->key_pos) << at;
        ASSERT_EQ(e.probs.size(), ref->probs.size()) << at;
        if (rec->keeps_rows()) {
          ASSERT_EQ(e.k.size(), ref->k.size()) << at;
        }
        for (int h = 0; h < e.n_heads; ++h) {
          double sum = 0;
          for (int j = 0; j < e.n_k; ++j) {
            const size_t i = static_cast<size_t>(h) * e.n_k + j;
            sum += e.probs[i];
            EXPECT_NEAR(e.probs[i], ref->probs[i], 0.02) << at << " head " << h << " key " << j;
          }
          EXPECT_NEAR(sum, 1.0, 1e-5) << at << " head " << h;
        }
      }
      EXPECT_EQ(steps, rec == &rows ? (std::set<int>{0, 4}) : (std::set<int>{2, 7}));
    }
  }
}

// Observers that read no rows get a step's events at its end (the layers run without waiting
// for the host; their scores and rows come over together): the same tokens, cache bytes and
// logits within one fp16 rounding as the decode that hands each layer's event over as it runs
// (an observer with rows forces that path), the same key positions, and the first layer's first
// event equal: the same scores (the same scoring kernel on the same query and cache, and for a
// calibrating method the same transform on the host) and probabilities within their softmax's
// roundings (a device sum over at most 2¹⁰ keys in float, 2¹⁰·2⁻²⁴ of each value, and
// expf's two ulps); later events within 0.02 of each probability (the two paths round their
// attention outputs to fp16 apart, as the logits' bound allows), each row summing to 1.
// Calls check(r, u, p0, p1) on the sample run with 8 new tokens for the full cache, SnapKV and a
// calibrating method (2-bit CalibQuant): u its options unchained, p0 and p1 two policies of the
// method (null for the full cache), for two decodes to compare.
template <class Check>
void for_three_methods(const Check& check) {
  SampleRun r = sample_run(8);
  GenerateOptions u = r.g;
  u.chain_steps = false;
  for (const char* spec : {"", "snapkv", "calibquant:bits=2"}) {
    SCOPED_TRACE(spec);
    auto p0 = *spec ? make_policy(spec) : nullptr, p1 = *spec ? make_policy(spec) : nullptr;
    check(r, u, p0.get(), p1.get());
  }
}

TEST(CudaModel, ObservedStepsWithoutRowsHandTheirEventsOverAtTheStepsEnd) {
  NEED_GPU();
  for_three_methods([](const SampleRun& r, const GenerateOptions& u, KVPolicy* p0, KVPolicy* p1) {
    DecodeRecorder with_rows(4), staged(4, false);
    const DecodeResult a = r.gpu.decode(r.st, p0, u, {&with_rows});
    const DecodeResult b = r.gpu.decode(r.st, p1, u, {&staged});
    expect_same_decode(b, a);
    ASSERT_EQ(staged.entries().size(), with_rows.entries().size());
    ASSERT_EQ(staged.steps(), 4);
    for (const auto& e : staged.entries()) {
      const auto* ref = with_rows.find(e.step, e.layer);
      ASSERT_NE(ref, nullptr);
      const std::string at = "step " + std::to_string(e.step) + " layer " + std::to_string(e.layer);
      EXPECT_EQ(e.key_pos, ref->key_pos) << at;
      ASSERT_EQ(e.probs.size(), ref->probs.size()) << at;
      const bool first = e.step == 0 && e.layer == 0;
      if (first) {
        EXPECT_EQ(e.scores, ref->scores) << at;
        EXPECT_EQ(e.q, ref->q) << at;
      }
      for (int h = 0; h < e.n_heads; ++h) {
        double sum = 0;
        for (int j = 0; j < e.n_k; ++j) {
          const size_t i = static_cast<size_t>(h) * e.n_k + j;
          sum += e.probs[i];
          const double bound = first ? ref->probs[i] * (std::ldexp(1.0, 10 - 24) + 4 * std::ldexp(1.0, -24)) + 1e-12 : 0.02;
          EXPECT_LE(std::abs(double(e.probs[i]) - ref->probs[i]), bound) << at << " head " << h << " key " << j;
        }
        EXPECT_NEAR(sum, 1.0, 1e-5) << at << " head " << h;
      }
    }
  });
}

// An observer that hands every event to `to` and reads more than probabilities, so that a decode
// hands its steps' events over as they run (the path before recorded queries).
class HandOn final : public AttentionObserver {
 public:
  explicit HandOn(AttentionObserver& to) : to_(to) {}
  void on_attention(const AttentionEvent& e) override { to_.on_attention(e); }
  bool reads_decode_kv() const override { return false; }
  bool takes_concurrent_events() const override { return to_.takes_concurrent_events(); }

 private:
  AttentionObserver& to_;
};

// The prompt position of the sample run's first visual token (−1: none).
int first_visual(const SampleRun& r) {
  const auto at = std::find(r.st.kinds.begin(), r.st.kinds.end(), SegmentKind::Visual);
  return at == r.st.kinds.end() ? -1 : static_cast<int>(at - r.st.kinds.begin());
}

// Two recorders' attention over the patches at every step, layer and head: the same sizes, and
// each patch within bound(step, layer, head, the reference's value).
template <class Bound>
void expect_same_patches(const VisualAttentionRecorder& x, const VisualAttentionRecorder& ref, int steps, int layers,
                         int heads, int n_visual, const Bound& bound) {
  for (int s = 0; s < steps; ++s)
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < heads; ++h) {
        const std::vector<float> a = x.attention(s, l, h), b = ref.attention(s, l, h);
        const std::string where = "step " + std::to_string(s) + " layer " + std::to_string(l) + " head " + std::to_string(h);
        ASSERT_EQ(a.size(), static_cast<size_t>(n_visual)) << where;
        ASSERT_EQ(b.size(), a.size()) << where;
        for (int i = 0; i < n_visual; ++i)
          EXPECT_LE(std::abs(double(a[i]) - b[i]), bound(s, l, h, b[i])) << where << " patch " << i;
      }
}

// An observer that reads probabilities alone (the app's patch overlay) keeps no step on the host:
// the steps run on the device as unobserved ones do, each layer's query kept there, and the
// events come once the caption is done, computed from those queries over the cache as each step
// saw it. Against the decode that hands the events over as the steps run: the same tokens and
// bytes, logits within one fp16 rounding, and every step's and layer's attention over the patches
// within 0.02 (the two paths round their attention outputs to fp16 apart); the first step's first
// layer, where both read the same query and cache, within the softmax's roundings (as above: a
// device sum in float over at most 2¹⁰ keys against the host's in double, and expf's two ulps).
TEST(CudaModel, ObserversOfProbabilitiesAloneGetTheirEventsFromRecordedQueries) {
  NEED_GPU();
  for_three_methods([](const SampleRun& r, const GenerateOptions& u, KVPolicy* p0, KVPolicy* p1) {
    const int n_visual = r.st.n_visual, first = first_visual(r);
    ASSERT_GE(first, 0);
    VisualAttentionRecorder live(first, n_visual), recorded(first, n_visual);
    HandOn hand_on(live);
    const DecodeResult a = r.gpu.decode(r.st, p0, u, {&hand_on});
    const DecodeResult b = r.gpu.decode(r.st, p1, u, {&recorded});
    expect_same_decode(b, a);
    // (8 new tokens: the first from the prefill, then 7 forwards)
    ASSERT_EQ(live.steps(), 7);
    ASSERT_EQ(recorded.steps(), 7);
    expect_same_patches(recorded, live, 7, r.layers, r.gpu.info().n_heads, n_visual, [](int s, int l, int, double ref) {
      return s == 0 && l == 0 ? ref * (std::ldexp(1.0, 10 - 24) + 4 * std::ldexp(1.0, -24)) + 1e-12 : 0.02;
    });
  });
}

// An observer of probabilities alone that reads no span: its recorded steps come as whole events
// (recorded_attention: transform and softmax on the host), handed to a recorder; it keeps each
// step's, layer's and head's largest finite |score| after the transform.
class WholeRows final : public AttentionObserver {
 public:
  explicit WholeRows(VisualAttentionRecorder& to) : to_(to) {}
  void on_attention(const AttentionEvent& e) override {
    to_.on_attention(e);
    std::lock_guard<std::mutex> l(mu_);
    for (int h = 0; h < e.n_heads; ++h) {
      float m = 0;
      for (int j = 0; j < e.n_k; ++j) {
        const float x = e.scores[static_cast<size_t>(h) * e.n_k + j];
        if (std::isfinite(x)) m = std::max(m, std::abs(x));
      }
      top_[{e.step, e.layer, h}] = m;
    }
  }
  bool reads_decode_kv() const override { return false; }
  bool reads_probabilities_only() const override { return true; }
  bool takes_concurrent_events() const override { return true; }
  float top(int step, int layer, int head) const { return top_.at({step, layer, head}); }

 private:
  VisualAttentionRecorder& to_;
  std::mutex mu_;
  std::map<std::tuple<int, int, int>, float> top_;
};

// The overlay's recorded steps reduced on the device (Backend::recorded_span_attention: the span
// sums alone cross to the host) against the same recorded queries' whole events reduced on the
// host (recorded_attention, then span_attention_sums), for the full cache, SnapKV and calibrating
// CalibQuant. Both score with the same kernel, so each probability differs by the softmax's and
// g(x)'s roundings alone: expf's two ulps against the host's one and the final division's one
// (4·2⁻²⁴ of the value); a calibrated score may round differently where one side fuses
// a·(x − γ) + γ into an fma, by at most a few ulps of the scores' magnitude M (and of τ1, τ2):
// 8·2⁻²⁴·(M + |τ1| + |τ2| + 1) in the exponent, twice (the row and the maximum) and again in the
// sum: 32·2⁻²⁴·(M + |τ1| + |τ2| + 1) of the value. A visual position is one row of a head, so
// no sum's order differs.
TEST(CudaModel, RecordedStepsReduceToTheOverlaysSpanOnTheDevice) {
  NEED_GPU();
  for_three_methods([](const SampleRun& r, const GenerateOptions& u, KVPolicy* p0, KVPolicy* p1) {
    const int n_visual = r.st.n_visual, first = first_visual(r);
    ASSERT_GE(first, 0);
    VisualAttentionRecorder whole(first, n_visual);
    CountingRecorder spans(first, n_visual);
    WholeRows rows(whole);
    const DecodeResult a = r.gpu.decode(r.st, p0, u, {&rows});
    const DecodeResult b = r.gpu.decode(r.st, p1, u, {&spans});
    EXPECT_EQ(b.generated_ids, a.generated_ids);
    ASSERT_EQ(whole.steps(), 7);
    ASSERT_EQ(spans.steps(), 7);
    EXPECT_EQ(spans.events.load(), 0);
    EXPECT_EQ(spans.spans.load(), 7 * r.layers);
    const ScoreTransform t = p1 ? p1->score_transform() : ScoreTransform{};
    expect_same_patches(spans, whole, 7, r.layers, r.gpu.info().n_heads, n_visual, [&](int s, int l, int h, double ref) {
      const double m = rows.top(s, l, h) + std::abs(t.tau1) + std::abs(t.tau2) + 1;
      return ref * std::ldexp(4.0 + 32 * m, -24) + std::ldexp(1.0, -140);
    });
  });
}

}  // namespace

// `kvlens bench attention`'s JSON: each row's figures agree with each other (bytes ÷ time is the
// GB/s, the GB/s ÷ the copy bandwidth the share, fp16's time ÷ the row's the speed-up, the bytes
// those the kernel must read and write), and no call is timed faster than an empty kernel
// launched and timed the same way, which itself takes a positive time.
TEST(CudaModel, BenchAttentionRowsAreConsistent) {
  NEED_GPU();
  const std::string dir = kt::make_temp_dir("bench_attention");
  const std::string out = dir + "/attention.json";
  const auto r = kt::run(kt::cli() + " bench attention --contexts 1000 3000 --batches 1 2 --bits 16 2 1 --reps 5 --json " +
                         out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("an empty kernel launched and timed the same way"), std::string::npos) << r.output;
  const auto j = kt::read_json(out);
  const double copy = j.at("copy_bandwidth_gbs").get<double>(), floor = j.at("empty_kernel_ms").get<double>();
  EXPECT_GT(copy, 0.0);
  EXPECT_GT(floor, 0.0);
  EXPECT_EQ(j.at("timing").get<std::string>(), "isolated");
  const auto& rows = j.at("rows");
  ASSERT_EQ(rows.size(), 2u * 2u * 5u);  // fp16, q2, q1, and q2 and q1 with calibration at each shape
  double fp16_ms = 0;
  for (const auto& row : rows) {
    const int bits = row.at("bits").get<int>(), B = row.at("batch").get<int>(), n = row.at("context").get<int>();
    const double ms = row.at("ms").get<double>(), bytes = row.at("bytes").get<double>();
    SCOPED_TRACE(row.dump());
    if (bits == 16) fp16_ms = ms;
    EXPECT_GE(ms, floor);
    EXPECT_NEAR(row.at("gbs").get<double>(), bytes / (ms * 1e-3) / 1e9, 1e-6 * bytes / (ms * 1e-3) / 1e9);
    EXPECT_NEAR(row.at("share_of_copy").get<double>(), row.at("gbs").get<double>() / copy, 1e-9);
    EXPECT_NEAR(row.at("speedup_vs_fp16").get<double>(), fp16_ms / ms, 1e-9 * fp16_ms / ms);
    // K and V at `bits` a value (plus fp16 ranges for packed rows) for 32 heads × 128 channels.
    const double kv = 2.0 * B * 32 * n * 128 * (bits == 16 ? 2.0 : bits / 8.0);
    EXPECT_GE(bytes, kv);
    EXPECT_LT(bytes, kv + 2.0 * B * 32 * 128 * 8 + 1);
  }
  std::filesystem::remove_all(dir);
}
