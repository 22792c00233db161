// How decode attention is laid out on a device (kernels.h): the split count of each head's rows
// for the kernel a cache runs, and which kernel that is. Host arithmetic only; the rules and the
// sweeps behind them are in kernels.h and docs/cuda.md.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

// The wave rule: from the split count that makes one wave of `slots` blocks 90 % full for `heads`
// heads, the first (up to `most`) whose last wave is at least `enough` full — else the fullest up
// to four times that count.
int wave_rule(double heads, double slots, int most, double enough) {
  const int first = std::max(1, static_cast<int>(std::ceil(0.9 * slots / heads)));
  int best = first;
  double best_fill = 0;
  for (int s = first; s <= std::min(most, 4 * first); ++s) {
    const double w = heads * s / slots, fill = w / std::ceil(w);
    if (fill > best_fill + 1e-9) best = s, best_fill = fill;
    if (fill >= enough) break;
  }
  return best;
}

}  // namespace

int decode_splits(int B, int NH, int rows, int n_sm, DecodePath path, int head_dim) {
  const int most = std::max(1, std::min((rows + 63) / 64, kDecodeMaxSplits));
  const int resident = path == DecodePath::kMma       ? kDecodeMmaMinBlocks
                       : path == DecodePath::kB1      ? kDecodeB1PairMinBlocks
                       : path == DecodePath::kF16Bulk ? kDecodeBulkMinBlocks
                                                      : kDecodeMinBlocks;
  const double slots = static_cast<double>(resident) * n_sm, heads = static_cast<double>(B) * NH;
  // The packed kernels and the bulk-copy one at few heads: the most splits that keep every
  // head's blocks within one wave (4 a multiprocessor for kMma, 2 for kB1 and kF16Bulk).
  const double wave = path == DecodePath::kMma || path == DecodePath::kB1 || path == DecodePath::kF16Bulk ? slots : 0.0;
  const int64_t cap = path == DecodePath::kF16Bulk ? kDecodeBulkSplitBytes : kDecodeSplitBytes;
  const bool f16 = (path == DecodePath::kF16 || path == DecodePath::kF16Bulk) && head_dim > 0;
  // Splits a block of at most `cap` bytes of fp16 K and V rows needs.
  int by_bytes = f16 ? static_cast<int>(std::min<int64_t>(
                           (static_cast<int64_t>(rows) * 4 * head_dim + cap - 1) / cap, kDecodeMaxSplits))
                     : 1;
  // The bulk-copy kernel at batch 16: 2–8 splits a head were no faster than one (kernels.h).
  if (path == DecodePath::kF16Bulk && by_bytes < kDecodeBulkMinSplits) by_bytes = 1;
  if (heads <= wave) {
    // Short packed caches: on the binary path one split a head up to kDecodeB1OneSplitRows rows,
    // then at most a block a multiprocessor up to kDecodeB1OneBlockRows; on the tensor-core one
    // half a wave of blocks of at least kDecodeMmaShortBlockRows rows while the call's rows are
    // at most kDecodeMmaShortRows (kernels.h).
    if (path == DecodePath::kB1 && rows <= kDecodeB1OneSplitRows) return 1;
    if (path == DecodePath::kB1 && rows <= kDecodeB1OneBlockRows)
      return std::min(most, std::max(1, static_cast<int>(n_sm / heads)));
    if (path == DecodePath::kMma && heads * rows <= static_cast<double>(kDecodeMmaShortRows))
      return std::min(std::max(1, rows / kDecodeMmaShortBlockRows), std::max(1, static_cast<int>(wave / 2 / heads)));
    return std::min(most, std::max(1, static_cast<int>(wave / heads)));
  }
  // The wave rule, 85 % on the binary path, whose short blocks cost more than a fuller last wave gains.
  const int best = wave_rule(heads, slots, most, path == DecodePath::kB1 ? 0.85 : 0.9);
  return std::min(std::max(best, by_bytes), most);
}

bool decode_b1_pair(int B, int NH, int rows, int splits, int n_sm) {
  const int64_t grid = static_cast<int64_t>(B) * NH * std::max(splits, 1);
  const int64_t pair_slots = static_cast<int64_t>(kDecodeB1PairMinBlocks) * n_sm;
  const int64_t single_slots = static_cast<int64_t>(kDecodeMinBlocks) * n_sm;
  if (grid <= pair_slots || (rows + splits - 1) / std::max(splits, 1) >= kDecodeB1PairRows) return true;
  // Shorter blocks: a wave of pairs takes about 3/4 of the time of a wave of three one-sub-tile
  // blocks a multiprocessor; pairs where their waves, so weighed, take less.
  const int64_t pair_waves = (grid + pair_slots - 1) / pair_slots;
  const int64_t single_waves = (grid + single_slots - 1) / single_slots;
  return 3 * pair_waves < 4 * single_waves;
}

bool decode_f16_bulk(int D, int rows, bool sm90) { return sm90 && D == 128 && rows >= kDecodeBulkRows; }

bool decode_f16_gqa(int D, int NH, int NKV) {
  return (D == 32 || D == 64 || D == 128) && NKV > 0 && NH % NKV == 0 && NH / NKV >= 2 &&
         NH / NKV <= kDecodeGqaMaxRatio;
}

int gqa_splits(int B, int NKV, int rows, int n_sm) {
  const int most = std::max(1, std::min(rows / kDecodeGqaMinRows, kDecodeMaxSplits));
  return std::min(wave_rule(static_cast<double>(B) * NKV, static_cast<double>(kDecodeGqaBlocks) * n_sm, most, 0.9), most);
}

DecodeLaunch decode_launch(int B, int NH, int rows, int n_sm, int D, bool all_f16, bool all_mma, bool b1,
                           int splits, bool sm90, int NKV) {
  DecodeLaunch l;
  if (sm90 && all_f16 && decode_f16_gqa(D, NH, NKV > 0 ? NKV : NH)) {
    const int s = splits > 0 ? splits : gqa_splits(B, NKV, rows, n_sm);
    if ((rows + s - 1) / s >= kDecodeGqaBlockRows || (B >= 2 && rows >= kDecodeGqaBatchRows)) {
      l.f16_gqa = true;
      l.splits = s;
      return l;
    }
  }
  l.f16_bulk = all_f16 && decode_f16_bulk(D, rows, sm90);
  const DecodePath path = l.f16_bulk ? DecodePath::kF16Bulk : decode_path(D, all_f16, all_mma, b1);
  l.splits = splits > 0 ? splits : decode_splits(B, NH, rows, n_sm, path, D);
  l.b1_pair = b1 && decode_b1_pair(B, NH, rows, l.splits, n_sm);
  l.bulk_fine = l.f16_bulk && l.splits > 1 && (rows + l.splits - 1) / l.splits >= kDecodeBulkFineRows;
  return l;
}

void set_launch(DecodeParams& p, const DecodeLaunch& l) {
  p.splits = l.splits;
  p.b1_pair = l.b1_pair ? 1 : 0;
  p.f16_bulk = l.f16_bulk ? 1 : 0;
  p.bulk_fine = l.bulk_fine ? 1 : 0;
  p.f16_gqa = l.f16_gqa ? 1 : 0;
}

DecodePath decode_path(int D, bool all_f16, bool all_mma, bool b1) {
  if (all_f16) return DecodePath::kF16;
  if (D != 128 || !all_mma) return DecodePath::kGeneral;
  return b1 ? DecodePath::kB1 : DecodePath::kMma;
}

}  // namespace kvlens::cuda
