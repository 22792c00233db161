// Compression methods acting on the device cache while the host store holds the layout alone,
// against the same methods on host rows (fetched because an observer reads them): eviction
// gathers on the device, CalibQuant and ZipCache quantize there, LOOK-M assigns and merges there.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>

#include "core/compress/method.h"
#include "core/trace.h"
#include "core/diagnostics/diagnostics.h"
#include "core/kv_format.h"
#include "models/model.h"
#include "tests/device_decode.h"
#include "tests/policy_probe.h"
#include "tests/recorder_check.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::decode_on_layout_and_on_rows;
using kt::expect_same_decode;
using kt::expect_same_layout;
using kt::sample_run;
using kt::SampleRun;
using kt::TwoDecodes;

namespace {

// On the device the prefill store keeps the layout alone (the CPU's layout, no rows), and the
// eviction methods that read no rows select on it while the device gathers the kept rows: each
// gives the same kept positions, bytes, tokens and logits (within one fp16 rounding, as above)
// as when an observer that reads keys and values makes the decode fetch the prompt's rows first.
TEST(CudaModel, EvictionSelectsOnTheLayoutAloneAndTheDeviceGathers) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  EXPECT_FALSE(r.st.store.has_rows());
  const kt::CpuRun cpu = kt::cpu_sample_run();
  const PrefillState& c = cpu.st;
  EXPECT_TRUE(c.store.has_rows());
  KVStore cpu_fp16 = c.store;
  cpu_fp16.set_row_storage(RowStorage::Fp16);
  expect_same_layout(r.st.store, cpu_fp16);
  for (const char* spec : {"snapkv:budget=0.3", "h2o", "vlcache:budget=0.25", "pyramidkv", "streamingllm",
                           "lookm:merge=none", "stack:evict=snapkv,quant=none"}) {
    SCOPED_TRACE(spec);
    const TwoDecodes t = decode_on_layout_and_on_rows(r, spec);
    expect_same_decode(t.y, t.x);
    expect_same_layout(t.a, t.b);
  }
}

// A quantizing method (alone and stacked after an eviction) quantizes the prompt's rows where
// they are (Backend::quantize_rows) when the host store holds the layout alone: against the
// host's quantization of the same fp16 rows (fetched because an observer reads them), the same
// layout, bytes and fp16 ranges, codes equal but for values within an fp32 rounding of a
// decision boundary (one step apart, at most 1 in 1000 — the quant_pack kernels' bound,
// DecodeOps), the same tokens, and `per_layer` quantized segments a layer (< 0: at least one).
// With `rotated` (Hadamard-INT4's keys), the observed decode's device, which does not rotate the
// query, holds the quantized rows as fp16 values and reports their bytes: more than the codes'.
// Else the codes made on the device never crossed to the host (deferred until the checks here
// land them).
void expect_quantized_where_the_rows_are(const SampleRun& r, const char* spec, int per_layer, bool rotated = false) {
  SCOPED_TRACE(spec);
  const TwoDecodes t = decode_on_layout_and_on_rows(r, spec);
  const KVStore &a = t.a, &b = t.b;
  EXPECT_EQ(t.x.generated_ids, t.y.generated_ids);
  if (rotated) EXPECT_LT(t.x.bytes_after_prefill.total(), t.y.bytes_after_prefill.total());
  else EXPECT_EQ(t.x.bytes_after_prefill.total(), t.y.bytes_after_prefill.total());
  expect_same_layout(a, b, !rotated);
  int quantized = 0;
  for (int l = 0; l < a.n_layers(); ++l)
    for (size_t i = 0; i < a.layer(l).segments.size(); ++i) {
      const auto* made = dynamic_cast<const quant::QuantPayload*>(a.layer(l).segments[i].payload.get());
      if (made && !rotated) {
        EXPECT_TRUE(made->deferred()) << "layer " << l << " segment " << i << ": codes on the host";
      }
      const auto* pa = quant::landed(a.layer(l).segments[i].payload.get());
      const auto* pb = quant::landed(b.layer(l).segments[i].payload.get());
      ASSERT_EQ(!pa, !pb) << "layer " << l << " segment " << i;
      if (!pa) continue;
      ++quantized;
      EXPECT_EQ(a.layer(l).segments[i].storage, b.layer(l).segments[i].storage);
      const int bits = pa->layout.k_bits;
      ASSERT_EQ(pa->k.size(), pb->k.size());
      for (size_t h = 0; h < pa->k.size(); ++h)
        for (const auto& [ka, kb] : {std::make_pair(&pa->k[h], &pb->k[h]), std::make_pair(&pa->v[h], &pb->v[h])}) {
          EXPECT_EQ(ka->scales, kb->scales) << "layer " << l << " head " << h;
          EXPECT_EQ(ka->zeros, kb->zeros) << "layer " << l << " head " << h;
          ASSERT_EQ(ka->codes.size(), kb->codes.size());
          const int64_t n = static_cast<int64_t>(ka->codes.size()) * 8 / bits;
          int64_t differ = 0;
          for (int64_t c = 0; c < n; ++c) {
            const int x1 = static_cast<int>(quant::unpack_one(ka->codes.data(), c, bits));
            const int x2 = static_cast<int>(quant::unpack_one(kb->codes.data(), c, bits));
            if (x1 != x2) {
              ++differ;
              EXPECT_LE(std::abs(x1 - x2), 1) << "layer " << l << " head " << h << " code " << c;
            }
          }
          EXPECT_LE(differ, n / 1000 + 1) << "layer " << l << " head " << h;
        }
    }
  if (per_layer >= 0) EXPECT_EQ(quantized, per_layer * a.n_layers()) << "quantized segments a layer";
  else EXPECT_GE(quantized, a.n_layers()) << "quantized segments";
}

// CalibQuant: the visual segment of each layer.
TEST(CudaModel, CalibQuantQuantizesTheVisualRowsOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"calibquant:bits=1", "calibquant:preset=official", "calibquant:bits=4",
                           "stack:evict=snapkv,quant=calibquant,budget=0.4"})
    expect_quantized_where_the_rows_are(r, spec, 1);
}

// Uniform: every prompt segment (system, visual, post-vision text) with per-token, global and
// per-channel ranges, or the visual one alone.
TEST(CudaModel, UniformQuantizesThePromptsRowsOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"uniform:bits=4", "uniform:bits=2,k_granularity=per-channel,v_granularity=global",
                           "stack:evict=snapkv,quant=uniform,budget=0.4,bits=8"})
    expect_quantized_where_the_rows_are(r, spec, 3);
  expect_quantized_where_the_rows_are(r, "uniform:bits=4,scope=visual", 1);
}

// KIVI: the prompt's oldest rows in key groups of G rows, pieces cut at segment boundaries (a
// segment split where the quantized prefix ends in it), after an eviction too.
TEST(CudaModel, KiviQuantizesThePromptsRowsOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"kivi:bits=2", "kivi:bits=4,group=7,residual=5", "stack:evict=snapkv,quant=kivi,budget=0.4,group=8"})
    expect_quantized_where_the_rows_are(r, spec, -1);
}

// Hadamard-INT4: every prompt segment's keys rotated by the Hadamard blocks and quantized per
// token, values per token, after an eviction too; where the device will not rotate the query
// (an observer reads the steps), the host's rows are quantized instead.
TEST(CudaModel, HadamardInt4QuantizesThePromptsRowsOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"hadamard_int4", "hadamard_int4:block=8", "stack:evict=snapkv,quant=hadamard_int4,budget=0.4"})
    expect_quantized_where_the_rows_are(r, spec, 3, true);
  EXPECT_EQ(make_policy("hadamard_int4:block=8")->rotated_keys(64), 8);
  EXPECT_EQ(make_policy("hadamard_int4:rotate_v=on")->rotated_keys(64), 0);
  EXPECT_TRUE(make_policy("hadamard_int4:scope=visual")->reads_rows());
  DecodeRecorder probs_only(3, false);
  auto p = make_policy("hadamard_int4");
  const DecodeResult d = r.gpu.decode(r.st, p.get(), r.g, {&probs_only});
  EXPECT_EQ(d.generated_ids.size(), static_cast<size_t>(r.g.max_new_tokens));
}

// The codes quantize_rows made on the device (every layer's landing together, quantize_rows_later,
// or layer by layer: the same payloads) are what kv_sync stores for their payload, in place
// of an upload of the same bytes: a cache synced from them, and one synced from a copy of each
// payload (a new payload, so uploaded), hold the same bytes and decode the same, every logit
// equal (the same kernels read the same codes). Bits 1 (the values regrouped channel-major on
// the device) and 4, and after an eviction (each head its own rows).
TEST(CudaModel, CodesQuantizedOnTheDeviceAreStoredWhereTheyWereMade) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  Backend& be = r.gpu.backend();
  for (const char* spec : {"calibquant:bits=1", "calibquant:bits=4", "stack:evict=snapkv,quant=calibquant,budget=0.4",
                           "zipcache", "zipcache:value_token_range=head,ranges=segment",
                           "stack:evict=snapkv,quant=zipcache,budget=0.4"}) {
    SCOPED_TRACE(spec);
    std::unique_ptr<DeviceKV> made = r.st.device->clone(), uploaded = r.st.device->clone();
    KVStore a = r.st.store;
    a.set_row_storage(RowStorage::Fp16);
    std::vector<PrefillContext> cs = r.gpu.prefill_contexts(r.st);
    for (PrefillContext& c : cs) c.device = made.get();
    make_policy(spec)->on_prefill(cs, a);
    // Layer by layer (each layer's codes in their own wait, not landing together): the same
    // payloads.
    {
      std::unique_ptr<DeviceKV> one = r.st.device->clone();
      KVStore c = r.st.store;
      c.set_row_storage(RowStorage::Fp16);
      std::vector<PrefillContext> cl = cs;
      for (PrefillContext& x : cl) x.device = one.get();
      std::unique_ptr<KVPolicy> pol = make_policy(spec);
      if (std::string(spec).rfind("calibquant", 0) == 0) {
        for (const PrefillContext& x : cl) pol->on_prefill_layer(x, c.layer(x.layer));
        int compared = 0;
        for (int l = 0; l < r.layers; ++l)
          for (size_t i = 0; i < a.layer(l).segments.size(); ++i) {
            const auto* pa = quant::landed(a.layer(l).segments[i].payload.get());
            const auto* pc = quant::landed(c.layer(l).segments.at(i).payload.get());
            ASSERT_EQ(!pa, !pc) << "layer " << l << " segment " << i;
            if (!pa) continue;
            ++compared;
            for (size_t h = 0; h < pa->k.size(); ++h) {
              EXPECT_TRUE(pa->k[h].codes == pc->k[h].codes && pa->v[h].codes == pc->v[h].codes) << "layer " << l << " head " << h;
              EXPECT_TRUE(pa->k[h].scales == pc->k[h].scales && pa->k[h].zeros == pc->k[h].zeros &&
                          pa->v[h].scales == pc->v[h].scales && pa->v[h].zeros == pc->v[h].zeros)
                  << "layer " << l << " head " << h;
            }
          }
        EXPECT_EQ(compared, r.layers);
      }
    }
    KVStore b = a;
    int copies = 0;
    for (int l = 0; l < b.n_layers(); ++l) {
      std::map<const SegmentPayload*, std::shared_ptr<SegmentPayload>> copy;  // (a group's segments share one)
      for (KVSegment& seg : b.layer(l).segments)
        if (const auto* p = quant::landed(seg.payload.get())) {
          std::shared_ptr<SegmentPayload>& c = copy[p];
          if (!c) {
            c = std::make_shared<quant::QuantPayload>(*p);
            ++copies;
          }
          seg.payload = c;
        }
    }
    EXPECT_GE(copies, r.layers) << "a quantized payload a layer at least";
    be.kv_sync(*made, a, -1);
    be.kv_sync(*uploaded, b, -1);
    EXPECT_EQ(made->bytes().total(), uploaded->bytes().total());
    for (int l = 0; l < r.layers; ++l) EXPECT_EQ(made->storage(l), uploaded->storage(l)) << "layer " << l;
    // Each cache decoded as the prompt's (no method, so nothing changes it further).
    DecodeResult x[2];
    for (int i = 0; i < 2; ++i) {
      PrefillState st = r.st;
      st.store = i ? b : a;
      st.device = std::shared_ptr<const DeviceKV>(i ? std::move(uploaded) : std::move(made));
      x[i] = r.gpu.decode(st, nullptr, r.g);
    }
    EXPECT_EQ(x[0].generated_ids, x[1].generated_ids);
    ASSERT_EQ(x[0].step_logits.size(), x[1].step_logits.size());
    for (size_t i = 0; i < x[0].step_logits.size(); ++i)
      EXPECT_TRUE(x[0].step_logits[i] == x[1].step_logits[i]) << "step " << i << ": logits differ";
  }
}

// ZipCache (each of its layouts, and stacked after an eviction) quantizes the prompt's rows where
// they are (Backend::zip_quantize_rows) when the host store holds the layout alone, and a decode
// shorter than its gap runs on the device alone: against the host's quantization of the same
// fp16 rows (fetched because an observer reads them), the same layout and bytes, every array of
// every payload byte for byte (the kernels do the host's arithmetic, Ops.ZipCacheQuantizeKernels),
// and the same tokens, logits within one fp16 rounding.
TEST(CudaModel, ZipCacheQuantizesOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"zipcache", "zipcache:preset=official", "zipcache:value_token_range=head,high_bits=8,low_bits=1",
                           "zipcache:ranges=segment,saliency_heads=shared", "stack:evict=snapkv,quant=zipcache,budget=0.4"}) {
    SCOPED_TRACE(spec);
    const TwoDecodes t = decode_on_layout_and_on_rows(r, spec);
    expect_same_decode(t.y, t.x);
    expect_same_layout(t.a, t.b);
    // (reads no rows at prefill, and acts on no step: the decode without observers fetches none)
    EXPECT_EQ(step_policy(make_policy(spec).get(), r.g.max_new_tokens), nullptr);
    std::map<const SegmentPayload*, int> groups;
    for (int l = 0; l < t.a.n_layers(); ++l)
      for (size_t i = 0; i < t.a.layer(l).segments.size(); ++i) {
        const auto* pa = quant::landed(t.a.layer(l).segments[i].payload.get());
        const auto* pb = quant::landed(t.b.layer(l).segments[i].payload.get());
        ASSERT_EQ(!pa, !pb) << "layer " << l << " segment " << i;
        if (!pa || groups.count(pa)) continue;
        groups[pa] = l;
        EXPECT_EQ(t.a.layer(l).segments[i].storage, t.b.layer(l).segments[i].storage);
        ASSERT_EQ(pa->k.size(), pb->k.size());
        for (size_t h = 0; h < pa->k.size(); ++h) {
          EXPECT_TRUE(pa->k[h].codes == pb->k[h].codes && pa->v[h].codes == pb->v[h].codes) << "layer " << l << " head " << h;
          EXPECT_TRUE(pa->k[h].scales == pb->k[h].scales && pa->k[h].zeros == pb->k[h].zeros &&
                      pa->k[h].flags == pb->k[h].flags)
              << "layer " << l << " head " << h;
          EXPECT_TRUE(pa->v[h].meta == pb->v[h].meta && pa->v[h].scales == pb->v[h].scales &&
                      pa->v[h].zeros == pb->v[h].zeros)
              << "layer " << l << " head " << h;
        }
        EXPECT_TRUE(pa->tokens.scales == pb->tokens.scales && pa->tokens.zeros == pb->tokens.zeros) << "layer " << l;
      }
    EXPECT_GE(static_cast<int>(groups.size()), r.layers) << "a quantized group a layer at least";
  }
}

// The prompt's store as a device decode starts from it (the layout alone, the decode's own copy
// of the cache) compressed by `spec` and synced, then read back with its rows; against the same
// policy on the host's copy of the prompt's fp16 rows. Returns {device, host}.
std::pair<KVStore, KVStore> compress_on_device_and_on_host(const SampleRun& r, const std::string& spec) {
  Backend& be = r.gpu.backend();
  std::unique_ptr<DeviceKV> dev = r.st.device->clone();
  KVStore a = r.st.store;
  a.set_row_storage(RowStorage::Fp16);
  EXPECT_FALSE(a.has_rows());
  std::vector<PrefillContext> cs = r.gpu.prefill_contexts(r.st);
  for (PrefillContext& c : cs) c.device = dev.get();
  make_policy(spec)->on_prefill(cs, a);
  be.kv_sync(*dev, a, -1);
  KVStore got;
  be.kv_hydrate(*dev, got, true);
  KVStore b;
  be.kv_hydrate(*r.st.device, b, true);  // the prompt's fp16 rows on the host
  // (no device cache and no backend: assignment and merge on the CPU)
  std::vector<PrefillContext> hs = r.gpu.prefill_contexts(r.st);
  for (PrefillContext& c : hs) c.backend = nullptr;
  make_policy(spec)->on_prefill(hs, b);
  return {std::move(got), std::move(b)};
}

// LOOK-M assigns, filters and merges where the cache is (Backend::kv_lookm_merge), every
// layer at once, when the host store holds the layout alone. Against the CPU's assignment and
// merge of the same fp16 rows: the same kept positions and merge counts, and every merged and
// kept row equal bit for bit (the kernels do the host's double operations in its order,
// Ops.LookMAssignmentOnTheDevice and Ops.LookMMergeKernels), for each merge rule and the
// authors' similarity filter. Decoded, the same tokens and logits within one
// fp16 rounding (the paths' kernels differ, as above), stacked before CalibQuant too.
TEST(CudaModel, LookMMergesOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"lookm", "lookm:merge=average,preset=official", "lookm:merge=weighted,merge_filter=above_mean",
                           "lookm:merge=average,merge_filter=above_mean,alpha1=0.05,alpha2=0.3"}) {
    SCOPED_TRACE(spec);
    const auto [dev, host] = compress_on_device_and_on_host(r, spec);
    expect_same_layout(dev, host);
    int merged = 0;
    for (int l = 0; l < host.n_layers(); ++l)
      for (size_t i = 0; i < host.layer(l).segments.size(); ++i)
        for (size_t h = 0; h < host.layer(l).segments[i].heads.size(); ++h) {
          const HeadRows &x = dev.layer(l).segments.at(i).heads.at(h), &y = host.layer(l).segments[i].heads[h];
          for (uint16_t m : y.merged) merged += m > 0;
          ASSERT_EQ(x.k.size(), y.k.size());
          for (size_t j = 0; j < y.k.size(); ++j) {
            ASSERT_EQ(x.k[j], y.k[j]) << "layer " << l << " segment " << i << " head " << h << " value " << j;
            ASSERT_EQ(x.v[j], y.v[j]) << "layer " << l << " segment " << i << " head " << h << " value " << j;
          }
        }
    EXPECT_GT(merged, 10 * host.n_layers()) << "rows merged into";
  }
  for (const char* spec : {"lookm", "lookm:merge=weighted,preset=official", "stack:evict=lookm,quant=calibquant,bits=2"}) {
    SCOPED_TRACE(spec);
    const TwoDecodes t = decode_on_layout_and_on_rows(r, spec);
    expect_same_decode(t.y, t.x);
    expect_same_layout(t.a, t.b);
  }
}

// A method whose only decode-time action is each new row quantized with its own range (uniform
// with per-token ranges; a stack whose eviction does nothing while decoding; Hadamard-INT4, its
// keys rotated first) has the device do it inside its steps (StepQuant): no hook, steps chained —
// the same tokens, cache bytes and logits (within one fp16 rounding, as above) as the loop that
// keeps the host rows and calls the hook each layer and step; unchained steps give exactly the
// chained ones; and the bytes are the CPU's. Hadamard-INT4's host loop holds its keys on the
// device as fp16 values rotated back (every key rounded to fp16 once more, and more bytes),
// where the device's own steps read the codes with a rotated query: its logits within 2^-8.
TEST(CudaModel, PerTokenQuantizationRunsInTheDevicesSteps) {
  NEED_GPU();
  SampleRun r = sample_run(12);
  const kt::CpuRun cpu = kt::cpu_sample_run();
  const PrefillState& c = cpu.st;
  for (const char* spec : {"uniform:bits=4", "uniform:bits=2", "uniform:bits=8", "uniform:bits=3",
                           "stack:evict=snapkv,quant=uniform,bits=4", "hadamard_int4", "hadamard_int4:block=8"}) {
    SCOPED_TRACE(spec);
    EXPECT_TRUE(kt::PolicyProbe(make_policy(spec), false).step_quant(r.gpu.info().head_dim).any());
    EXPECT_FALSE(kt::PolicyProbe(make_policy(spec), true).step_quant(r.gpu.info().head_dim).any());
    const kt::ThreeDecodes t = kt::decode_three_ways(r, spec);
    const DecodeResult &a = t.host, &b = t.device;
    if (std::string(spec).rfind("hadamard", 0) == 0) {
      EXPECT_EQ(b.generated_ids, a.generated_ids);
      ASSERT_EQ(b.step_logits.size(), a.step_logits.size());
      for (size_t i = 0; i < a.step_logits.size(); ++i)
        EXPECT_LE(kt::max_rel(b.step_logits[i], a.step_logits[i]), std::ldexp(1.0, -8)) << "step " << i;
      // (the host loop's device holds fp16 values, and says so in its bytes; the packed bytes are the CPU's, below)
      EXPECT_GT(a.bytes_final.total(), b.bytes_final.total());
    } else {
      expect_same_decode(b, a);
    }
    auto on_cpu = make_policy(spec);
    const DecodeResult e = cpu.model->decode(c, on_cpu.get(), r.g);
    EXPECT_EQ(b.bytes_after_prefill.total(), e.bytes_after_prefill.total());
    EXPECT_EQ(b.bytes_final.total(), e.bytes_final.total());
    EXPECT_GT(b.bytes_final.total(), b.bytes_after_prefill.total());
  }
  // Per-channel ranges need other rows: the hook stays on the host.
  EXPECT_FALSE(make_policy("uniform:k_granularity=per-channel")->step_quant(64).any());
  EXPECT_FALSE(make_policy("uniform:scope=visual")->step_quant(64).any());
}

// TurboQuant's generated rows coded by the device inside its steps (StepQuant::coded,
// codec_tail_rows): no hook, steps chained — the same tokens and logits (within one fp16
// rounding) as the loop that keeps the host rows and calls the hook each layer and step (the
// kernel codes each row as the host's coder does, bit for bit: DecodeQuantTail); unchained steps
// exactly the chained ones; and the CPU backend's tokens. Both device loops hold the rows as fp16
// dequantizations; the device's own steps also keep each row's codes and scales on the device,
// which are the bytes the CPU counts for the generated rows besides their positions. With
// scope=visual nothing acts while decoding.
TEST(CudaModel, TurboQuantRowsAreCodedInTheDevicesSteps) {
  NEED_GPU();
  SampleRun r = sample_run(12);
  const kt::CpuRun cpu = kt::cpu_sample_run();
  const int D = r.gpu.info().head_dim;
  for (const char* spec : {"turboquant", "turboquant:bits=2,qjl=on", "turboquant:bits=4,seed=7", "turboquant:bits=1,qjl=on",
                           "stack:evict=snapkv,quant=turboquant,bits=3,qjl=on"}) {
    SCOPED_TRACE(spec);
    EXPECT_TRUE(kt::PolicyProbe(make_policy(spec), false).step_quant(D).k_codec);
    EXPECT_FALSE(kt::PolicyProbe(make_policy(spec), true).step_quant(D).any());
    const kt::ThreeDecodes t = kt::decode_three_ways(r, spec);
    const DecodeResult &a = t.host, &b = t.device;
    EXPECT_EQ(b.generated_ids, a.generated_ids);
    ASSERT_EQ(b.step_logits.size(), a.step_logits.size());
    for (size_t i = 0; i < a.step_logits.size(); ++i)
      EXPECT_LE(kt::max_rel(b.step_logits[i], a.step_logits[i]), std::ldexp(1.0, -11)) << "step " << i;
    EXPECT_EQ(b.bytes_after_prefill.total(), a.bytes_after_prefill.total());
    auto on_cpu = make_policy(spec);
    const DecodeResult e = cpu.model->decode(cpu.st, on_cpu.get(), r.g);
    EXPECT_EQ(b.generated_ids, e.generated_ids);
    const int64_t positions = a.bytes_final.indices - a.bytes_after_prefill.indices;
    EXPECT_GT(positions, 0);
    EXPECT_EQ(b.bytes_final.total() - a.bytes_final.total(), e.bytes_final.total() - e.bytes_after_prefill.total() - positions);
  }
  EXPECT_FALSE(make_policy("turboquant:scope=visual")->step_quant(D).any());
}

// TurboQuant's prompt coded where its rows are (Backend::code_rows) when the host store holds the
// layout alone: every coded segment's codes and scales equal the host coder's on the same fp16
// rows (the decode that observes rows brings them to the host and codes them there), bit for
// bit; the same tokens and logits (within one fp16 rounding) and the same bytes after the prompt;
// visual rows alone, and after SnapKV too.
TEST(CudaModel, TurboQuantCodesThePromptOnTheDevice) {
  NEED_GPU();
  SampleRun r = sample_run(8);
  for (const char* spec : {"turboquant", "turboquant:bits=2,qjl=on", "turboquant:bits=4,scope=visual",
                           "stack:evict=snapkv,quant=turboquant,bits=3,qjl=on"}) {
    SCOPED_TRACE(spec);
    const TwoDecodes t = decode_on_layout_and_on_rows(r, spec);
    EXPECT_EQ(t.x.generated_ids, t.y.generated_ids);
    ASSERT_EQ(t.x.step_logits.size(), t.y.step_logits.size());
    for (size_t i = 0; i < t.y.step_logits.size(); ++i)
      EXPECT_LE(kt::max_rel(t.x.step_logits[i], t.y.step_logits[i]), std::ldexp(1.0, -11)) << "step " << i;
    EXPECT_EQ(t.x.bytes_after_prefill.total(), t.y.bytes_after_prefill.total());
    expect_same_layout(t.a, t.b);
    int coded = 0;
    for (int l = 0; l < t.b.n_layers(); ++l)
      for (size_t i = 0; i < t.b.layer(l).segments.size(); ++i) {
        const KVSegment &sa = t.a.layer(l).segments[i], &sb = t.b.layer(l).segments[i];
        const auto* pa = quant::landed(sa.payload.get());
        const auto* pb = quant::landed(sb.payload.get());
        ASSERT_EQ(!pa, !pb) << "layer " << l << " segment " << i;
        if (!pa) continue;
        ++coded;
        EXPECT_EQ(sa.storage, sb.storage);
        ASSERT_EQ(pa->k.size(), pb->k.size());
        for (size_t h = 0; h < pa->k.size(); ++h) {
          EXPECT_TRUE(pa->k[h].codes == pb->k[h].codes && pa->k[h].scales == pb->k[h].scales)
              << "layer " << l << " segment " << i << " head " << h << " keys";
          EXPECT_TRUE(pa->v[h].codes == pb->v[h].codes && pa->v[h].scales == pb->v[h].scales)
              << "layer " << l << " segment " << i << " head " << h << " values";
        }
      }
    EXPECT_GE(coded, r.layers) << "a coded segment a layer at least";
  }
}

// KIVI's streaming groups quantized on the device before the steps that need them
// (kv_before_step): the hook never called and the steps chained; the same tokens, bytes and
// logits (within one fp16 rounding) as the host loop that runs KIVI's on_decode_step, unchained
// steps exactly the chained ones, and the CPU backend's bytes. Groups of 3 to 5 rows flush
// several times within 14 tokens; the first flushes cut the prompt's dense rows, the SnapKV stack
// starts from evicted segments, and residual 1 leaves a single dense row.
TEST(CudaModel, KiviGroupsAreQuantizedInTheDevicesSteps) {
  NEED_GPU();
  SampleRun r = sample_run(14);
  const kt::CpuRun cpu = kt::cpu_sample_run();
  const PrefillState& c = cpu.st;
  const int D = r.gpu.info().head_dim;
  for (const char* spec : {"kivi:bits=2,group=4,residual=3", "kivi:bits=4,group=5,residual=2", "kivi:bits=2,group=3,residual=1",
                           "kivi:bits=2,group=32,residual=32", "stack:evict=snapkv,quant=kivi,group=4,residual=3"}) {
    SCOPED_TRACE(spec);
    EXPECT_GT(kt::PolicyProbe(make_policy(spec), false).step_quant(D).group, 0);
    const kt::ThreeDecodes t = kt::decode_three_ways(r, spec);
    expect_same_decode(t.device, t.host);
    auto on_cpu = make_policy(spec);
    const DecodeResult e = cpu.model->decode(c, on_cpu.get(), r.g);
    EXPECT_EQ(t.device.bytes_final.total(), e.bytes_final.total());
    EXPECT_EQ(t.device.generated_ids, e.generated_ids);
  }
  EXPECT_FALSE(make_policy("kivi:residual=0")->step_quant(D).any());  // (the new row itself would be quantized)
}

// ZipCache's streamed gaps quantized by the device before its steps (StepQuant::zip,
// kv::zip_gap): the hook never called and the steps chained; the same tokens, bytes and logits
// (within one fp16 rounding) as the host loop that runs ZipCache's on_decode_step, unchained
// steps exactly the chained ones, and the CPU backend's tokens. Gaps of 3 to 5 flush several times
// within 14 tokens, with probes by recency and at random (more of them than the defaults keep in
// so short a gap), per-head and shared rankings, accumulated saliency, V ranges per head with
// the official channel factors, and after SnapKV.
TEST(CudaModel, ZipCacheGapsAreQuantizedInTheDevicesSteps) {
  NEED_GPU();
  SampleRun r = sample_run(14);
  const kt::CpuRun cpu = kt::cpu_sample_run();
  const int D = r.gpu.info().head_dim;
  for (const char* spec : {"zipcache:gap=4,recent_ratio=0.25,random_ratio=0.3",
                           "zipcache:gap=5,recent_ratio=0.4,random_ratio=0.5,seed=3,saliency_ratio=0.6",
                           "zipcache:gap=3,saliency_heads=shared,saliency=accumulated,random_ratio=0.6",
                           "zipcache:preset=official,value_token_range=head,gap=4,recent_ratio=0.5",
                           "zipcache:gap=4", "stack:evict=snapkv,quant=zipcache,gap=4,random_ratio=0.4"}) {
    SCOPED_TRACE(spec);
    EXPECT_GT(kt::PolicyProbe(make_policy(spec), false).step_quant(D).zip.gap, 0);
    const kt::ThreeDecodes t = kt::decode_three_ways(r, spec);
    expect_same_decode(t.device, t.host);
    auto on_cpu = make_policy(spec);
    const DecodeResult e = cpu.model->decode(cpu.st, on_cpu.get(), r.g);
    EXPECT_EQ(t.device.generated_ids, e.generated_ids);
  }
}

// After its first gap a ZipCache decode's gaps only move rows between the parts of the gaps'
// store (CudaKV::rows_moved): the steps after them replay the step captured after the first gap,
// reading the tables uploaded before them. A 14-token decode with gaps of 3 runs two steps eagerly
// and captures two (the first step's, and after the first gap) however many gaps follow; one
// eager step and one capture a gap would be 2 + 2 a further gap. (Its tokens, bytes and logits
// are ZipCacheGapsAreQuantizedInTheDevicesSteps'.)
TEST(CudaModel, ZipCacheGapsAfterTheFirstReplayTheCapturedStep) {
  NEED_GPU();
  SampleRun r = sample_run(14);
  kt::PolicyProbe p(make_policy("zipcache:gap=3"), false);
  trace::enable(true);
  const DecodeResult d = r.gpu.decode(r.st, &p, r.g);
  const std::vector<trace::Span> spans = trace::take();
  trace::enable(false);
  auto count = [&](const std::string& name) {
    return std::count_if(spans.begin(), spans.end(), [&](const trace::Span& s) { return name == s.name; });
  };
  EXPECT_TRUE(d.chained);
  EXPECT_EQ(p.decode_calls, 0);
  ASSERT_GE(count("kv.zip_gap"), 3) << "gaps quantized on the device";
  EXPECT_EQ(count("cuda.step_eager"), 2);
  EXPECT_EQ(count("cuda.step_capture"), 2);
}

// An observed decode whose observers the device serves (a recorder comparing each query with the
// prefill's capture, as `kvlens run` attaches one, and one reading probabilities alone) keeps a
// method's per-row quantization, coding or KIVI's groups in the device's own steps: the hook
// never called, the steps past the observed ones chained, the tokens and logits of the
// unobserved decode (within one fp16 rounding: the observed steps' attention runs unfused).
// Each observed step's comparison with its exact attention — the generated rows as the method
// holds them, dequantized from the device's codes, KIVI's requantized as its groups flush
// (several times within the steps, and over steps put off between observed ones) — is the host
// loop's, which calls the hook each layer and step and keeps the host rows: per query head,
// softmax MSE, KL and output error within 5 %, or for the smallest terms 1e-6 of KL and 2^-11 of
// output error (one fp16 rounding of the output: the host loop's attention over host rows runs
// other kernels, and its TurboQuant rows are the coder's fp32 dequantization where the device
// keeps them rounded to fp16). Hadamard-INT4's steps read its rotated keys' codes with a rotated
// query and hand the observers the query back unrotated; its host loop holds the keys as fp16
// values rotated back, rounded once more (its logits within 2^-8 of the device steps',
// PerTokenQuantizationRunsInTheDevicesSteps): its terms within 10 %. Every step's attention over
// the prompt, recorded on the device or staged, is within 2 % of the host loop's (or 0.001).
// ZipCache's streamed steps stay on the host when observed.
// The overlay of the first `n` decode steps alone.
class FirstSteps final : public VisualAttentionRecorder {
 public:
  FirstSteps(int first_visual, int n_visual, int n) : VisualAttentionRecorder(first_visual, n_visual), n_(n) {}
  int decode_steps() const override { return n_; }

 private:
  int n_;
};

TEST(CudaModel, ObservedDecodesKeepTheDevicesStepQuantization) {
  NEED_GPU();
  SampleRun r = sample_run(10);
  PrefillView pv;
  pv.full = &r.st.store;
  pv.attention = r.st.capture.attention.get();
  pv.kinds = &r.st.kinds;
  pv.n_heads = r.gpu.info().n_heads;
  pv.prompt_len = static_cast<int>(r.st.ids.size());
  constexpr int kSteps = 6;
  const int T = pv.prompt_len;
  // KIVI with 5 residual rows and a group whose first rows fall due at decode step 2 (the prompt
  // leaves 5 + (T − 5) mod G dense rows; step s quantizes when s + 1 more make 5 + G): its
  // overlay's steps 0 and 1 are recorded and handed over before that step, the later ones staged.
  int due_group = 0;
  for (int g = 4; g <= 64 && !due_group; ++g)
    if ((T - 5) % g == g - 3) due_group = g;
  ASSERT_GT(due_group, 0) << T << "-token prompt";
  const std::string kivi_due = "kivi:bits=2,group=" + std::to_string(due_group) + ",residual=5";
  for (const std::string& spec_text : {std::string("uniform:bits=4"), std::string("uniform:bits=2"),
                                       std::string("turboquant"), std::string("turboquant:bits=2,qjl=on"),
                                       std::string("stack:evict=snapkv,quant=uniform,bits=4"),
                                       std::string("kivi:bits=2,group=3,residual=2"),
                                       std::string("kivi:bits=4,group=4,residual=1"), kivi_due,
                                       std::string("stack:evict=snapkv,quant=kivi,bits=2,group=3,residual=2"),
                                       std::string("hadamard_int4"), std::string("hadamard_int4:block=8")}) {
    const char* spec = spec_text.c_str();
    SCOPED_TRACE(spec);
    kt::PolicyProbe host(make_policy(spec), true), device(make_policy(spec), false), plain(make_policy(spec), false),
        visual(make_policy(spec), false);
    DecodeRecorder ra(kSteps, pv), rb(kSteps, pv);
    rb.record_only({0, 1, 4, 5});  // (steps 2 and 3 put off: their rows fetched before step 4's)
    ra.record_only({0, 1, 4, 5});
    VisualAttentionRecorder va(0, T);
    kt::CountingRecorder vb(0, T);  // every step (its queries recorded on the device, over KIVI's groups until rows are due, or staged)
    const DecodeResult a = r.gpu.decode(r.st, &host, r.g, {&ra, &va});
    const DecodeResult b = r.gpu.decode(r.st, &device, r.g, {&rb});
    const DecodeResult c = r.gpu.decode(r.st, &plain, r.g);
    const DecodeResult d = r.gpu.decode(r.st, &visual, r.g, {&vb});
    EXPECT_GT(host.decode_calls, 0);
    EXPECT_EQ(device.decode_calls + plain.decode_calls + visual.decode_calls, 0);
    EXPECT_TRUE(b.chained);
    EXPECT_FALSE(a.chained);
    EXPECT_EQ(b.generated_ids, c.generated_ids);
    EXPECT_EQ(d.generated_ids, c.generated_ids);
    EXPECT_EQ(b.generated_ids, a.generated_ids);
    ASSERT_EQ(b.step_logits.size(), c.step_logits.size());
    for (size_t i = 0; i < c.step_logits.size(); ++i)
      EXPECT_LE(kt::max_rel(b.step_logits[i], c.step_logits[i]), std::ldexp(1.0, -11)) << "step " << i;
    EXPECT_EQ(b.bytes_final.total(), c.bytes_final.total());
    ASSERT_EQ(rb.entries().size(), static_cast<size_t>(4 * r.layers));
    ASSERT_EQ(ra.entries().size(), rb.entries().size());
    for (const DecodeRecorder::Entry& y : rb.entries()) {
      const DecodeRecorder::Entry* x = ra.find(y.step, y.layer);
      ASSERT_TRUE(x && x->compared && y.compared) << "step " << y.step << " layer " << y.layer;
      const QueryComparison &p = x->comparison, &q = y.comparison;
      const double rel = std::string(spec).rfind("hadamard", 0) == 0 ? 0.1 : 0.05;
      ASSERT_EQ(p.softmax_mse.size(), q.softmax_mse.size());
      for (size_t h = 0; h < p.softmax_mse.size(); ++h) {
        const std::string at = "step " + std::to_string(y.step) + " layer " + std::to_string(y.layer) + " head " +
                               std::to_string(h);
        EXPECT_LE(std::abs(q.softmax_mse[h] - p.softmax_mse[h]), rel * p.softmax_mse[h] + 1e-9) << at;
        EXPECT_LE(std::abs(q.softmax_kl[h] - p.softmax_kl[h]), rel * p.softmax_kl[h] + 1e-6) << at;
        EXPECT_LE(std::abs(q.output_rel_error[h] - p.output_rel_error[h]),
                  rel * p.output_rel_error[h] + std::ldexp(1.0, -11))
            << at;
      }
    }
    ASSERT_EQ(vb.steps(), va.steps());
    for (int s = 0; s < va.steps(); ++s)
      for (int l = 0; l < r.layers; ++l) {
        const std::vector<float> x = va.attention(s, l, -1), y = vb.attention(s, l, -1);
        ASSERT_EQ(x.size(), y.size());
        for (size_t i = 0; i < x.size(); ++i)
          EXPECT_NEAR(y[i], x[i], 1e-3 + 0.02 * x[i]) << "step " << s << " layer " << l << " token " << i;
      }
    if (spec_text != kivi_due) continue;
    EXPECT_EQ(vb.spans.load(), 2 * r.layers);  // steps 0 and 1 recorded, as span sums
    EXPECT_GT(vb.events.load(), 0);            // the steps from 2 on staged
    // An overlay of steps 0 and 1 alone: recorded, and handed over before the chained steps
    // that follow quantize rows into groups.
    FirstSteps early(0, T, 2);
    kt::PolicyProbe chained(make_policy(spec), false);
    const DecodeResult e = r.gpu.decode(r.st, &chained, r.g, {&early});
    EXPECT_TRUE(e.chained);
    EXPECT_EQ(chained.decode_calls, 0);
    EXPECT_EQ(e.generated_ids, c.generated_ids);
    ASSERT_EQ(early.steps(), 2);
    for (int s = 0; s < 2; ++s)
      for (int l = 0; l < r.layers; ++l) {
        const std::vector<float> x = va.attention(s, l, -1), y = early.attention(s, l, -1);
        ASSERT_EQ(x.size(), y.size());
        for (size_t i = 0; i < x.size(); ++i)
          EXPECT_NEAR(y[i], x[i], 1e-3 + 0.02 * x[i]) << "step " << s << " layer " << l << " token " << i;
      }
  }
  for (const char* spec : {"zipcache:gap=4", "zipcache:gap=5,random_ratio=0.5"}) {
    SCOPED_TRACE(spec);
    kt::PolicyProbe device(make_policy(spec), false);
    DecodeRecorder rec(kSteps, pv);
    const DecodeResult b = r.gpu.decode(r.st, &device, r.g, {&rec});
    EXPECT_GT(device.decode_calls, 0);
    EXPECT_EQ(rec.entries().size(), static_cast<size_t>(kSteps * r.layers));
  }
}

}  // namespace
