// Decode rows quantized on the device where they are appended (Backend::kv_reserve with a
// StepQuant; on CUDA, rope_quant_append into a packed decode tail): each new row's key and value
// codes and fp16 ranges equal quant::quantize_block (per token) on the same rotated row rounded
// to fp16 (for Hadamard-INT4 then through quant::block_hadamard), bit for bit; the cache's bytes are the host's count of such a segment; decode
// attention over the packed rows matches the fp64 attention over their dequantization; the rows
// read back (kv_hydrate) as a per-token payload, and fetched as an observed decode fetches them
// (kv_pull_rows) as the same rows; and the tail refuses rows from another path.
// A plain step (rope_append_attend) over such rows is one kernel with the same codes and output.
// TurboQuant's rows are coded the same way (StepQuant::coded, codec_tail_rows): codes, scales and
// the dequantized row equal turboquant::Codec::encode_row's, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/compress/quant_methods.h"
#include "core/compress/quantize.h"
#include "core/kv_format.h"
#include "tests/decode_ops_case.h"
#include "tests/op_harness.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

// The attention output O against fp64 attention of qv over the rows the cache of kv reads back
// (kv_hydrate).
void expect_output_over_rows_read_back(Backend& gpu, SeqKV& kv, const Buffer& O, const AttnLayout& l1,
                                       const DecodeCase& c, const std::vector<float>& qv, const std::string& what) {
  KVStore back;
  gpu.kv_hydrate(*kv.dev, back, true);
  std::vector<float> ref;
  std::vector<double> out_bound;
  std::vector<std::vector<float>> rs;
  reference(back, qv, c, l1, nullptr, ref, out_bound, rs);
  expect_within(read(gpu, O), ref, out_bound, what);
}

// Decode attention of the query in Xg over the cache of kv, against fp64 attention of qv over the
// rows the cache reads back.
void expect_attention_over_rows_read_back(Backend& gpu, SeqKV& kv, const Buffer& Xg, const AttnLayout& l1,
                                          const DecodeCase& c, const std::vector<float>& qv, const std::string& what) {
  Buffer O = poisoned(gpu, "out", {1, static_cast<int64_t>(c.NH) * c.D}, Dt::F32);
  gpu.decode_attention(Xg, l1, kv, 0, nullptr, O, DecodeTaps{});
  expect_output_over_rows_read_back(gpu, kv, O, l1, c, qv, what);
}

// The cache read back (kv_hydrate, with rows) into `back`: `n_segments` segments, the last the
// decode tail — generated rows labelled `label` with a payload of layout `kind`, in `pay`.
void read_tail(Backend& gpu, const DeviceKV& dev, size_t n_segments, const std::string& label,
               quant::CodeLayout::Kind kind, KVStore& back, const quant::QuantPayload*& pay) {
  gpu.kv_hydrate(dev, back, true);
  ASSERT_EQ(back.layer(0).segments.size(), n_segments);
  const KVSegment& tail = back.layer(0).segments.back();
  EXPECT_EQ(tail.kind, SegmentKind::Generated);
  EXPECT_EQ(tail.storage, label);
  pay = quant::landed(tail.payload.get());
  ASSERT_NE(pay, nullptr);
  EXPECT_EQ(pay->layout.kind, kind);
}

// The decode tail's `steps` rows (at positions T ..) fetched to a host store of fp16 rows as an
// observed decode fetches the rows its steps appended on the device alone (kv_pull_rows): the
// rows read back (kv_hydrate), bit for bit — a packed tail's dequantized values not rounded to the
// store's fp16, a coded tail's fp16 dequantizations — at the same positions.
void expect_pulled_rows_read_back(Backend& gpu, DeviceKV& dev, const KVSegment& tail, int NKV, int D, int T, int steps) {
  KVStore pulled(1, NKV, D, RowStorage::Fp16);
  SeqKV kv{&pulled, &dev, true};
  std::vector<int32_t> pos(static_cast<size_t>(steps));
  for (int s = 0; s < steps; ++s) pos[static_cast<size_t>(s)] = T + s;
  const std::vector<SegmentKind> kinds(static_cast<size_t>(steps), SegmentKind::Generated);
  gpu.kv_pull_rows(kv, {0}, pos.data(), kinds.data(), steps);
  ASSERT_EQ(pulled.layer(0).segments.size(), 1u);
  const KVSegment& got = pulled.layer(0).segments[0];
  for (int h = 0; h < NKV; ++h) {
    EXPECT_EQ(got.heads[h].pos, pos) << "head " << h << " pulled positions";
    EXPECT_EQ(got.heads[h].k, tail.heads[h].k) << "head " << h << " pulled keys";
    EXPECT_EQ(got.heads[h].v, tail.heads[h].v) << "head " << h << " pulled values";
  }
}

// A generated row appended without the tail's own kernel (kv_append, at position p): refused.
void expect_plain_append_refused(Backend& gpu, SeqKV& kv, const AttnLayout& l1, int32_t p) {
  const auto row = randn(static_cast<size_t>(l1.row_stride));
  const SegmentKind gen = SegmentKind::Generated;
  Buffer Xg = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pg = make_ids(gpu, "pos1", {p});
  EXPECT_THROW(gpu.kv_append(kv, 0, Xg, l1, Pg, &p, &gen, 1), InternalError);
}

struct TailCase {
  int k_bits, v_bits, D;
  int rotation = 0;  // Hadamard-INT4's blocks
};

void quantized_tail_case(const TailCase& tc) {
  const std::string what = "k" + std::to_string(tc.k_bits) + " v" + std::to_string(tc.v_bits) + " D" + std::to_string(tc.D) +
                           " rotation " + std::to_string(tc.rotation);
  SCOPED_TRACE(what);
  DecodeCase c;
  c.NH = 6;
  c.NKV = 2;
  c.D = tc.D;
  // A rotated query reads rotated keys alone: with a rotation the cache holds the decode rows only.
  const int T = tc.rotation ? 0 : 37, steps = 5;
  const AttnLayout l1 = layout_of(c, 1);
  Backend& cpu = *op_backends().cpu;
  Backend& gpu = *op_backends().gpu;
  const StepQuant q = StepQuant::rows(tc.k_bits, tc.v_bits, tc.rotation, "rows of " + what);
  ASSERT_TRUE(gpu.quantizes_steps(q, c.D));
  EXPECT_FALSE(cpu.quantizes_steps(q, c.D));
  EXPECT_FALSE(gpu.quantizes_steps(StepQuant::rows(tc.k_bits, tc.v_bits, 2 * c.D), c.D));  // a block wider than the head
  KVStore host(1, c.NKV, c.D);
  auto dev = gpu.kv_create(1, c.NKV, c.D);
  SeqKV kv{&host, dev.get(), false};
  if (T) append_prompt(gpu, kv, c, T);
  const int64_t prompt_bytes = dev->bytes().total();
  gpu.kv_reserve(*dev, 2, q);  // fewer rows than steps: the packed tail must grow
  std::vector<quant::QuantBlock> want_k(c.NKV), want_v(c.NKV);
  const SegmentKind gen = SegmentKind::Generated;
  for (int step = 0; step < steps; ++step) {
    const auto row = randn(static_cast<size_t>(l1.row_stride), 2.0f);
    const int32_t p = T + step;
    Buffer Xg = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pg = make_ids(gpu, "pos1", {p});
    gpu.rope_append(kv, 0, Xg, l1, Pg, &p, &gen, 1, 10000.0f);
    // RoPE as the CPU's (a few fp32 ulps), in place in q and k; with a Hadamard rotation the
    // query is rotated too (undone here: the transform is its own inverse).
    Buffer Xc = make(cpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pc = make_ids(cpu, "pos1", {p});
    cpu.rope(Xc, l1, Pc, 10000.0f);
    const std::vector<float> got = read(gpu, Xg), rotated = read(cpu, Xc);
    std::vector<float> want = rotated;
    std::vector<double> bound(want.size());
    for (size_t i = 0; i < want.size(); ++i) bound[i] = 16 * unit(Dt::F32) * (std::abs(want[i]) + 1);
    for (int hd = 0; tc.rotation && hd < c.NH; ++hd) {
      // log2(R) butterflies and a scale, each within an fp32 rounding of the block's norm.
      float* qh = want.data() + l1.q_col + hd * c.D;
      quant::block_hadamard(qh, c.D, tc.rotation);
      for (int b0 = 0; b0 < c.D; b0 += tc.rotation) {
        double norm = 0;
        for (int i = b0; i < b0 + tc.rotation; ++i) norm += double(qh[i]) * qh[i];
        for (int i = b0; i < b0 + tc.rotation; ++i)
          bound[l1.q_col + hd * c.D + i] += (std::log2(tc.rotation) + 2) * 16 * unit(Dt::F32) * std::sqrt(norm);
      }
    }
    expect_within(got, want, bound, what + ": rotated q and k in place");
    // The host's quantization of the device's rotated row, rounded to fp16 as the cache keeps rows.
    for (int h = 0; h < c.NKV; ++h) {
      std::vector<float> k(c.D), v(c.D);
      for (int d = 0; d < c.D; ++d) {
        k[d] = quant::round_half(got[l1.k_col + h * c.D + d]);
        v[d] = quant::round_half(row[l1.v_col + h * c.D + d]);
      }
      if (tc.rotation) quant::block_hadamard(k.data(), c.D, tc.rotation);  // Hadamard-INT4's keys
      quant::quantize_block(k.data(), 1, c.D, {tc.k_bits, quant::Axis::PerToken}, want_k[h]);
      quant::quantize_block(v.data(), 1, c.D, {tc.v_bits, quant::Axis::PerToken}, want_v[h]);
    }
    // Attention over the prompt's fp16 rows and the packed ones, against fp64 over the rows read back.
    const std::vector<float> qv(rotated.begin(), rotated.begin() + c.NH * c.D);  // (RoPE alone: the rows read back are rotated back)
    expect_attention_over_rows_read_back(gpu, kv, Xg, l1, c, qv, what + ": decode attention, step " + std::to_string(step));
  }
  KVStore back;
  const quant::QuantPayload* pay = nullptr;
  ASSERT_NO_FATAL_FAILURE(read_tail(gpu, *dev, T ? 2u : 1u, q.label, quant::CodeLayout::Kind::Blocks, back, pay));
  const KVSegment& tail = back.layer(0).segments.back();
  EXPECT_EQ(pay->layout.k_rotation, tc.rotation);
  expect_pulled_rows_read_back(gpu, *dev, tail, c.NKV, c.D, T, steps);
  int64_t want_bytes = 0;
  for (int h = 0; h < c.NKV; ++h) {
    ASSERT_EQ(tail.heads[h].n(), steps);
    for (int s = 0; s < steps; ++s) EXPECT_EQ(tail.heads[h].pos[s], T + s);
    EXPECT_EQ(pay->k[h].codes, want_k[h].codes) << "head " << h << " key codes";
    EXPECT_EQ(pay->k[h].scales, want_k[h].scales) << "head " << h << " key scales";
    EXPECT_EQ(pay->k[h].zeros, want_k[h].zeros) << "head " << h << " key zeros";
    EXPECT_EQ(pay->v[h].codes, want_v[h].codes) << "head " << h << " value codes";
    EXPECT_EQ(pay->v[h].scales, want_v[h].scales) << "head " << h << " value scales";
    EXPECT_EQ(pay->v[h].zeros, want_v[h].zeros) << "head " << h << " value zeros";
    // The rows read back are the payload's dequantization (rotated back).
    std::vector<float> k(c.D);
    for (int s = 0; s < steps; ++s) {
      quant::Affine a{quant::from_half(want_k[h].scales[s]), quant::from_half(want_k[h].zeros[s])};
      for (int d = 0; d < c.D; ++d)
        k[d] = quant::decode(quant::unpack_one(want_k[h].codes.data() + s * c.D * tc.k_bits / 8, d, tc.k_bits), a);
      if (tc.rotation) quant::block_hadamard(k.data(), c.D, tc.rotation);
      EXPECT_EQ(std::vector<float>(tail.heads[h].k.begin() + s * c.D, tail.heads[h].k.begin() + (s + 1) * c.D), k)
          << "head " << h << " row " << s;
    }
    for (const quant::QuantBlock* b : {&want_k[h], &want_v[h]})
      want_bytes += static_cast<int64_t>(b->codes.size() + 2 * b->scales.size() + 2 * b->zeros.size());
    want_bytes += 4 * steps;
  }
  // The host's count of the segment (quant::set_quantized: the payload's arrays and int32
  // positions) is what the device holds for the rows.
  EXPECT_EQ(tail.bytes.total(), want_bytes);
  EXPECT_EQ(dev->bytes().total(), prompt_bytes + want_bytes);
  // A row appended without the quantizing kernel, or a new storage once rows are there: refused.
  expect_plain_append_refused(gpu, kv, l1, T + steps);
  const int other = tc.k_bits == 8 ? 4 : 8;
  EXPECT_THROW(gpu.kv_reserve(*dev, 2, StepQuant::rows(other, other)), InternalError);
  if (!tc.rotation) return;
  // Unrotated keys beside a rotated query: attention is refused, not computed wrong.
  KVStore h2(1, c.NKV, c.D);
  auto d2 = gpu.kv_create(1, c.NKV, c.D);
  SeqKV kv2{&h2, d2.get(), false};
  append_prompt(gpu, kv2, c, 9);
  gpu.kv_reserve(*d2, 2, q);
  const Buffer Xg = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, randn(static_cast<size_t>(l1.row_stride)));
  Buffer O = make(gpu, "out", {1, static_cast<int64_t>(c.NH) * c.D}, Dt::F32, std::vector<float>(static_cast<size_t>(c.NH) * c.D));
  EXPECT_THROW(gpu.decode_attention(Xg, l1, kv2, 0, nullptr, O, DecodeTaps{}), InternalError);
}

TEST(DecodeQuantTail, RowsQuantizedWhereTheyAreAppended) {
  KVLENS_NEED_GPU();
  for (const TailCase& c : {TailCase{4, 4, 128}, TailCase{2, 2, 128}, TailCase{1, 1, 64}, TailCase{3, 3, 128},
                            TailCase{8, 8, 64}, TailCase{4, 2, 256}, TailCase{4, 4, 128, 16}, TailCase{4, 4, 64, 8},
                            TailCase{4, 4, 128, 128}})
    quantized_tail_case(c);
}

// A plain decode step (rope_append_attend) over a cache of decode rows alone, against the same
// steps taken as rope_append and then decode_attention on a twin cache. Packed rows (StepQuant
// rows): where the token-wise kernel takes the cache (one width of 2, 4 or 8 bits on both sides,
// head size 64 or 128) the step is one kernel. KIVI's groups (`group` > 0: the rows kept as fp16
// and quantized in groups before a step, kv_before_step, on both caches): where the mixed kernel
// takes the cache (2 or 4 bits) the step is one kernel too. One kernel leaves qkv as it was.
// Both caches end with the same storages and bytes; packed rows with the same rows, positions,
// codes and ranges, bit for bit (RoPE, fp16 rounding, the Hadamard blocks and the range per row
// with the same operations), and every checked step's output of either matching fp64 attention
// over the rows its cache reads back; KIVI's groups, which are not read back, with the fused
// step's output equal to the two ops'. Enough query heads that each head's rows take few splits, so
// that a block walks more rows than its two register stages hold.
struct FusedCase {
  TailCase t;
  int NH, NKV, steps;
  int group = 0, residual = 0;
  bool coded = false;  // TurboQuant's rows (t.k_bits a side, no sketch) instead
};

void fused_step_case(const FusedCase& fc) {
  const TailCase& tc = fc.t;
  const std::string what = "fused k" + std::to_string(tc.k_bits) + " v" + std::to_string(tc.v_bits) + " D" +
                           std::to_string(tc.D) + " rotation " + std::to_string(tc.rotation) + " group " +
                           std::to_string(fc.group);
  SCOPED_TRACE(what);
  DecodeCase c;
  c.NH = fc.NH;
  c.NKV = fc.NKV;
  c.D = tc.D;
  const AttnLayout l1 = layout_of(c, 1);
  Backend& cpu = *op_backends().cpu;
  Backend& gpu = *op_backends().gpu;
  StepQuant q = StepQuant::rows(tc.k_bits, tc.v_bits, tc.rotation, "rows of " + what);
  q.group = fc.group;
  q.residual = fc.residual;
  if (fc.coded) {
    const auto kc = std::make_shared<const turboquant::Codec>(turboquant::make_codec(c.D, tc.k_bits, false, 5));
    const auto vc = std::make_shared<const turboquant::Codec>(turboquant::make_codec(c.D, tc.v_bits, false, 5));
    q = StepQuant::coded(kc, vc, tc.k_bits, "coded rows " + what);
  }
  ASSERT_TRUE(gpu.quantizes_steps(q, c.D));
  const bool width_taken = fc.group ? tc.k_bits == 2 || tc.k_bits == 4 : tc.k_bits == 2 || tc.k_bits == 4 || tc.k_bits == 8;
  const bool fused = !fc.coded && tc.k_bits == tc.v_bits && width_taken && (tc.D == 64 || tc.D == 128);
  KVStore host_a(1, c.NKV, c.D), host_b(1, c.NKV, c.D);
  auto dev_a = gpu.kv_create(1, c.NKV, c.D), dev_b = gpu.kv_create(1, c.NKV, c.D);
  SeqKV plain{&host_a, dev_a.get(), false}, one{&host_b, dev_b.get(), false};
  gpu.kv_reserve(*dev_a, 2, q);
  gpu.kv_reserve(*dev_b, 2, q);
  const SegmentKind gen = SegmentKind::Generated;
  for (int step = 0; step < fc.steps; ++step) {
    const auto row = randn(static_cast<size_t>(l1.row_stride), 2.0f);
    const int32_t p = step;
    Buffer Xa = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pa = make_ids(gpu, "pos1", {p});
    Buffer Xb = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, row);
    Buffer Ob = poisoned(gpu, "out", {1, static_cast<int64_t>(c.NH) * c.D}, Dt::F32);
    if (fc.group) {
      gpu.kv_before_step(plain);
      gpu.kv_before_step(one);
    }
    gpu.rope_append(plain, 0, Xa, l1, Pa, &p, &gen, 1, 10000.0f);
    gpu.rope_append_attend(one, 0, Xb, l1, Pa, &p, &gen, 10000.0f, Ob);
    if (fused) {
      ASSERT_EQ(read(gpu, Xb), row) << "step " << step << ": the fused step rewrote qkv";
    }
    if (step % 64 != 63 && step != fc.steps - 1) continue;
    const std::string at = ", step " + std::to_string(step);
    if (fc.group) {
      // (groups quantized on the device are not read back: the fused step against the two ops,
      // the same kernel over the same rows, bit for bit)
      Buffer Oa = poisoned(gpu, "out", {1, static_cast<int64_t>(c.NH) * c.D}, Dt::F32);
      gpu.decode_attention(Xa, l1, plain, 0, nullptr, Oa, DecodeTaps{});
      EXPECT_EQ(read(gpu, Ob), read(gpu, Oa)) << what << at;
      continue;
    }
    Buffer Xc = make(cpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pc = make_ids(cpu, "pos1", {p});
    cpu.rope(Xc, l1, Pc, 10000.0f);
    const std::vector<float> rotated = read(cpu, Xc);
    const std::vector<float> qv(rotated.begin(), rotated.begin() + c.NH * c.D);
    expect_attention_over_rows_read_back(gpu, plain, Xa, l1, c, qv, what + ": rope_append, decode_attention" + at);
    expect_output_over_rows_read_back(gpu, one, Ob, l1, c, qv, what + ": rope_append_attend" + at);
  }
  EXPECT_EQ(dev_b->bytes().total(), dev_a->bytes().total());
  EXPECT_EQ(dev_b->storage(0), dev_a->storage(0));
  if (fc.group) {
    EXPECT_GT(dev_a->storage(0).size(), 2u) << "no groups quantized";
    return;
  }
  KVStore back_a, back_b;
  gpu.kv_hydrate(*dev_a, back_a, true);
  gpu.kv_hydrate(*dev_b, back_b, true);
  const auto& sa = back_a.layer(0).segments;
  const auto& sb = back_b.layer(0).segments;
  ASSERT_EQ(sb.size(), sa.size());
  for (size_t i = 0; i < sa.size(); ++i)
    for (int h = 0; h < c.NKV; ++h) {
      EXPECT_EQ(sb[i].storage, sa[i].storage) << "segment " << i;
      EXPECT_EQ(sb[i].heads[h].pos, sa[i].heads[h].pos) << "segment " << i << " head " << h;
      EXPECT_EQ(sb[i].heads[h].k, sa[i].heads[h].k) << "segment " << i << " head " << h << " keys";
      EXPECT_EQ(sb[i].heads[h].v, sa[i].heads[h].v) << "segment " << i << " head " << h << " values";
    }
  const auto kind = fc.coded ? quant::CodeLayout::Kind::None : quant::CodeLayout::Kind::Blocks;
  const quant::QuantPayload* pa = nullptr;
  const quant::QuantPayload* pb = nullptr;
  ASSERT_NO_FATAL_FAILURE(read_tail(gpu, *dev_a, 1u, q.label, kind, back_a, pa));
  ASSERT_NO_FATAL_FAILURE(read_tail(gpu, *dev_b, 1u, q.label, kind, back_b, pb));
  for (int h = 0; h < c.NKV; ++h) {
    EXPECT_EQ(pb->k[h].codes, pa->k[h].codes) << "head " << h << " key codes";
    EXPECT_EQ(pb->k[h].scales, pa->k[h].scales) << "head " << h << " key scales";
    EXPECT_EQ(pb->k[h].zeros, pa->k[h].zeros) << "head " << h << " key zeros";
    EXPECT_EQ(pb->v[h].codes, pa->v[h].codes) << "head " << h << " value codes";
    EXPECT_EQ(pb->v[h].scales, pa->v[h].scales) << "head " << h << " value scales";
    EXPECT_EQ(pb->v[h].zeros, pa->v[h].zeros) << "head " << h << " value zeros";
  }
}

TEST(DecodeQuantTail, FusedStepsQuantizeAndAttendInOneKernel) {
  KVLENS_NEED_GPU();
  fused_step_case({{4, 4, 128}, 128, 2, 320});
  fused_step_case({{2, 2, 128, 128}, 128, 2, 320});
  fused_step_case({{8, 8, 64, 8}, 128, 2, 640});
  fused_step_case({{4, 4, 128, 16}, 6, 2, 40});
  fused_step_case({{4, 2, 128}, 6, 2, 20});  // two widths: the steps' own kernels
  // KIVI's groups beside fp16 rows.
  fused_step_case({{2, 2, 128}, 128, 2, 200, 16, 8});
  fused_step_case({{4, 4, 64}, 128, 2, 320, 32, 32});
  fused_step_case({{2, 2, 128}, 6, 2, 30, 7, 5});
  // TurboQuant's coded rows: the fp16 kernel reads the coder's row after the wait, the others
  // before it.
  fused_step_case({{3, 3, 128}, 128, 2, 320, 0, 0, true});
  fused_step_case({{4, 4, 64}, 6, 2, 40, 0, 0, true});
}

struct CodecCase {
  int D, bits;
  bool qjl;
};

// TurboQuant's decode rows coded where they are appended: for each step, every KV head's key and
// value codes and fp16 scales equal the host coder's (turboquant::Codec::encode_row) on the
// device's RoPE'd row rounded to fp16, bit for bit, and the cache holds the host's dequantized row
// rounded to fp16; attention over the prompt's fp16 rows and the coded ones matches fp64 over the
// rows read back; the rows read back carry the host coder's payload; the bytes are the host's
// count of such a segment plus the fp16 rows the device reads; a row from another path, or
// another codec, is refused.
void coded_tail_case(const CodecCase& tc) {
  const std::string what = "D" + std::to_string(tc.D) + " bits " + std::to_string(tc.bits) + (tc.qjl ? " qjl" : "");
  SCOPED_TRACE(what);
  DecodeCase c;
  c.NH = 6;
  c.NKV = 2;
  c.D = tc.D;
  const int T = 23, steps = 5;
  const AttnLayout l1 = layout_of(c, 1);
  Backend& cpu = *op_backends().cpu;
  Backend& gpu = *op_backends().gpu;
  const auto kc = std::make_shared<const turboquant::Codec>(turboquant::make_codec(c.D, tc.qjl ? tc.bits - 1 : tc.bits, tc.qjl, 5));
  const auto vc = std::make_shared<const turboquant::Codec>(turboquant::make_codec(c.D, tc.bits, false, 5));
  const StepQuant q = StepQuant::coded(kc, vc, tc.bits, "coded rows " + what);
  ASSERT_TRUE(gpu.quantizes_steps(q, c.D));
  EXPECT_FALSE(cpu.quantizes_steps(q, c.D));
  if (tc.qjl) {
    EXPECT_FALSE(gpu.quantizes_steps(StepQuant::coded(vc, kc, tc.bits, "sketched values"), c.D));
  }
  KVStore host(1, c.NKV, c.D);
  auto dev = gpu.kv_create(1, c.NKV, c.D);
  SeqKV kv{&host, dev.get(), false};
  append_prompt(gpu, kv, c, T);
  const int64_t prompt_bytes = dev->bytes().total();
  gpu.kv_reserve(*dev, 2, q);  // fewer rows than steps: the tail and its codes must grow
  std::vector<quant::QuantBlock> want_k(c.NKV), want_v(c.NKV);
  std::vector<std::vector<float>> rows_k(c.NKV), rows_v(c.NKV);
  const SegmentKind gen = SegmentKind::Generated;
  std::vector<float> xh(c.D);
  for (int step = 0; step < steps; ++step) {
    const auto row = randn(static_cast<size_t>(l1.row_stride), 2.0f);
    const int32_t p = T + step;
    Buffer Xg = make(gpu, "qkv1", {1, l1.row_stride}, Dt::F32, row), Pg = make_ids(gpu, "pos1", {p});
    gpu.rope_append(kv, 0, Xg, l1, Pg, &p, &gen, 1, 10000.0f);
    const std::vector<float> got = read(gpu, Xg);
    for (int h = 0; h < c.NKV; ++h) {
      std::vector<float> k(c.D), v(c.D);
      for (int d = 0; d < c.D; ++d) {
        k[d] = quant::round_half(got[l1.k_col + h * c.D + d]);
        v[d] = quant::round_half(row[l1.v_col + h * c.D + d]);
      }
      kc->encode_row(k.data(), want_k[h], xh.data());
      for (float x : xh) rows_k[h].push_back(quant::round_half(x));
      vc->encode_row(v.data(), want_v[h], xh.data());
      for (float x : xh) rows_v[h].push_back(quant::round_half(x));
    }
    const std::vector<float> qv(got.begin() + l1.q_col, got.begin() + l1.q_col + c.NH * c.D);
    expect_attention_over_rows_read_back(gpu, kv, Xg, l1, c, qv, what + ": decode attention, step " + std::to_string(step));
  }
  KVStore back;
  const quant::QuantPayload* pay = nullptr;
  ASSERT_NO_FATAL_FAILURE(read_tail(gpu, *dev, 2u, q.label, quant::CodeLayout::Kind::None, back, pay));
  const KVSegment& tail = back.layer(0).segments.back();
  expect_pulled_rows_read_back(gpu, *dev, tail, c.NKV, c.D, T, steps);
  int64_t want_bytes = 0;
  for (int h = 0; h < c.NKV; ++h) {
    ASSERT_EQ(tail.heads[h].n(), steps);
    EXPECT_EQ(tail.heads[h].bits, std::vector<uint8_t>(steps, static_cast<uint8_t>(tc.bits)));
    EXPECT_EQ(pay->k[h].codes, want_k[h].codes) << "head " << h << " key codes";
    EXPECT_EQ(pay->k[h].scales, want_k[h].scales) << "head " << h << " key norms";
    EXPECT_EQ(pay->v[h].codes, want_v[h].codes) << "head " << h << " value codes";
    EXPECT_EQ(pay->v[h].scales, want_v[h].scales) << "head " << h << " value norms";
    EXPECT_EQ(tail.heads[h].k, rows_k[h]) << "head " << h << " dequantized keys";
    EXPECT_EQ(tail.heads[h].v, rows_v[h]) << "head " << h << " dequantized values";
    for (const quant::QuantBlock* b : {&want_k[h], &want_v[h]})
      want_bytes += static_cast<int64_t>(b->codes.size() + 2 * b->scales.size());
    want_bytes += 4 * steps + 2 * 2 * steps * c.D;  // (positions; the fp16 K and V rows)
  }
  EXPECT_EQ(tail.bytes.total(), want_bytes);
  EXPECT_EQ(dev->bytes().total(), prompt_bytes + want_bytes);
  expect_plain_append_refused(gpu, kv, l1, T + steps);
  const auto other = std::make_shared<const turboquant::Codec>(turboquant::make_codec(c.D, tc.bits, false, 6));
  EXPECT_THROW(gpu.kv_reserve(*dev, 2, StepQuant::coded(other, vc, tc.bits, q.label)), InternalError);
  // Room alone keeps the rows and their storage.
  gpu.kv_reserve(*dev, 64);
  EXPECT_EQ(dev->storage(0).back(), q.label + " (decode tail)");
  EXPECT_EQ(dev->bytes().total(), prompt_bytes + want_bytes);
}

TEST(DecodeQuantTail, RowsCodedWhereTheyAreAppended) {
  KVLENS_NEED_GPU();
  for (const CodecCase& c : {CodecCase{128, 3, false}, CodecCase{128, 3, true}, CodecCase{64, 1, true},
                             CodecCase{80, 2, true}, CodecCase{128, 4, false}, CodecCase{64, 2, false},
                             CodecCase{256, 3, true}})  // (S staged in shared memory up to 128, read from memory above)
    coded_tail_case(c);
}

}  // namespace
