// Every option changes what it should. A table of (method, parameter, value) cases, each run on
// a seeded prefilled prompt (tests/option_bench.h) next to the same method without that value:
// the outcome must differ from the default's (an ignored option fails), differ from every other
// value of the same parameter (an option wired to another value's branch fails), and show the
// change the parameter's help promises (checked by the case). The table is checked against the
// registry: a parameter value without a case fails the suite. `stack` is covered by cases
// generated from the registry: every evict/quant choice, preset and pass-through parameter must
// reach exactly the inner method(s) that declare it.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/evict_methods.h"
#include "core/compress/quant_methods.h"
#include "core/compress/registry.h"
#include "tests/option_bench.h"

using namespace kvlens;
using namespace kvlens::testing;
using quant::round_half;
using K = SegmentKind;

namespace {

using Check = std::function<void(const Bench&, const Outcome& def, const Outcome& got)>;

struct Case {
  std::string method, param, value;
  std::string base;  // other values set in both runs, e.g. "bits=2"
  Check check;
  Scene scene{};
  bool same_as_default = false;  // the value is what the default resolves to on this scene
};

const Bench& bench(const Scene& s) {
  static std::vector<std::unique_ptr<Bench>> cache;
  for (const auto& b : cache)
    if (b->sc == s) return *b;
  cache.push_back(std::make_unique<Bench>(s));
  return *cache.back();
}

std::string spec_of(const std::string& method, const std::string& base, const std::string& extra = "") {
  std::string items = base;
  if (!extra.empty()) items += (items.empty() ? "" : ",") + extra;
  return items.empty() ? method : method + ":" + items;
}

// ---- checks shared by several cases ------------------------------------------------------------

// Every prefill row of the given kinds (all when empty) carries `bits`.
Check row_bits(int bits, std::vector<K> only = {}) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh)
        for (const RowView& r : rows_of(got.prefill, l, kh))
          if (only.empty() || std::count(only.begin(), only.end(), r.kind)) {
            ASSERT_EQ(r.bits, bits) << "layer " << l << " pos " << r.pos << " " << r.storage;
          }
  };
}

// Rows of other kinds than visual are untouched fp32 copies, generated rows too; visual rows
// are quantized.
Check visual_only() {
  return [](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh)
        for (const RowView& r : rows_of(got.final, l, kh)) {
          const bool same = std::equal(r.k, r.k + b.sc.D, b.key(l, r.pos, kh)) &&
                            std::equal(r.v, r.v + b.sc.D, b.val(l, r.pos, kh));
          if (r.kind == K::Visual) {
            EXPECT_FALSE(same) << "visual row " << r.pos << " left unquantized";
          } else {
            ASSERT_EQ(r.storage, "fp32") << r.pos;
            ASSERT_TRUE(same) << "row " << r.pos << " changed";
          }
        }
  };
}

// The kept prompt positions of every layer and KV head, as a function of the layer.
Check kept_positions(std::function<std::vector<int32_t>(const Bench&, int layer)> want) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l) {
      const std::vector<int32_t> w = want(b, l);
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        std::vector<int32_t> p = positions(got.prefill, l, kh);
        std::vector<int32_t> kept;
        for (int32_t x : w)
          if (std::count(p.begin(), p.end(), x)) kept.push_back(x);
        ASSERT_EQ(kept, w) << "layer " << l << " head " << kh;
      }
    }
  };
}

// Each layer keeps `n(layer)` rows per KV head.
Check kept_count(std::function<int(const Bench&, int layer)> n) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh)
        ASSERT_EQ(static_cast<int>(positions(got.prefill, l, kh).size()), n(b, l)) << "layer " << l;
  };
}

std::vector<int32_t> range(int a, int b) {
  std::vector<int32_t> r;
  for (int i = a; i < b; ++i) r.push_back(i);
  return r;
}

// Quantized K (which = 0) or V (1) of each segment and KV head has at most 2^bits values per
// `axis` group ("row", "column" or "block"); for "column" some row has more than 2^bits values
// (so per-token or global ranges cannot pass for per-channel ones).
Check value_grid(int which, const std::string& axis, int bits) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    const int D = b.sc.D, most = 1 << bits;
    bool some_row_wider = false;
    for (int l = 0; l < b.sc.L; ++l)
      for (const KVSegment& s : got.prefill.layer(l).segments)
        for (const HeadRows& r : s.heads) {
          const std::vector<float>& x = which ? r.v : r.k;
          std::vector<double> block(x.begin(), x.end());
          if (axis == "block") {
            ASSERT_LE(levels(block), most) << s.storage;
          }
          for (int t = 0; t < r.n(); ++t) {
            std::vector<double> row(x.begin() + t * D, x.begin() + (t + 1) * D);
            if (axis == "row") {
              ASSERT_LE(levels(row), most) << s.storage;
            }
            some_row_wider = some_row_wider || levels(row) > most;
          }
          if (axis == "column")
            for (int c = 0; c < D; ++c) {
              std::vector<double> col;
              for (int t = 0; t < r.n(); ++t) col.push_back(x[t * D + c]);
              ASSERT_LE(levels(col), most) << s.storage << " channel " << c;
            }
        }
    if (axis == "column") {
      EXPECT_TRUE(some_row_wider);
    }
  };
}

// The K (which = 0) or V (1) prompt rows after prefill equal the default run's.
Check unchanged(int which) {
  return [=](const Bench& b, const Outcome& def, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        const auto a = rows_of(def.prefill, l, kh), g = rows_of(got.prefill, l, kh);
        ASSERT_EQ(a.size(), g.size());
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_TRUE(std::equal(g[i].k + 0, g[i].k + b.sc.D, which ? g[i].k : a[i].k) &&
                      std::equal(g[i].v + 0, g[i].v + b.sc.D, which ? a[i].v : g[i].v))
              << (which ? "V" : "K") << " of row " << g[i].pos << " changed";
      }
  };
}

// CalibQuant's 1-bit channel-wise visual rows: each channel's range [α, β] over the visual
// tokens of a KV head, shrunk by s about zero ([sα, sβ]) or about its centre c = (α+β)/2
// ([c − s(c−α), c + s(β−c)]), stored as fp16 zero a and step st; each value becomes a or a+st,
// whichever (x − a)/st rounds to, clamped.
Check one_bit_channels(int which, double s, bool about_zero) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (const KVSegment& seg : got.prefill.layer(l).segments) {
        if (seg.kind != K::Visual) continue;
        for (int kh = 0; kh < b.sc.KH; ++kh) {
          const HeadRows& r = seg.heads[kh];
          for (int c = 0; c < b.sc.D; ++c) {
            float lo = INFINITY, hi = -INFINITY;
            for (int32_t p : r.pos) {
              const float x = (which ? b.val(l, p, kh) : b.key(l, p, kh))[c];
              lo = std::min(lo, x), hi = std::max(hi, x);
            }
            const double cen = about_zero ? 0.0 : (static_cast<double>(lo) + hi) / 2;
            const float a = round_half(static_cast<float>(cen + s * (lo - cen)));
            const float st = round_half(static_cast<float>(cen + s * (hi - cen)) - static_cast<float>(cen + s * (lo - cen)));
            for (int t = 0; t < r.n(); ++t) {
              const float x = (which ? b.val(l, r.pos[t], kh) : b.key(l, r.pos[t], kh))[c];
              const float code = std::clamp(std::nearbyint((x - a) / st), 0.0f, 1.0f);
              ASSERT_EQ((which ? r.v : r.k)[t * b.sc.D + c], code * st + a) << "channel " << c << " token " << r.pos[t];
            }
          }
        }
      }
  };
}

// Calibration of the final query's visual scores: [γ, δ] → [γ − τ1, δ − τ2]; other keys as they
// were. (τ1, τ2) < 0 means no calibration: transformed scores equal the raw ones.
Check calibrated(double tau1, double tau2) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    for (size_t i = 0; i < got.scores.size(); ++i) {
      if (tau1 < 0) {
        ASSERT_EQ(got.scores[i], got.raw[i]);
        continue;
      }
      double g = INFINITY, d = -INFINITY, ng = INFINITY, nd = -INFINITY;
      for (size_t j = 0; j < got.raw[i].size(); ++j) {
        if (got.kinds[i][j] != K::Visual) {
          ASSERT_EQ(got.scores[i][j], got.raw[i][j]);
          continue;
        }
        g = std::min<double>(g, got.raw[i][j]), d = std::max<double>(d, got.raw[i][j]);
        ng = std::min<double>(ng, got.scores[i][j]), nd = std::max<double>(nd, got.scores[i][j]);
      }
      const double tol = 1e-5 * (std::fabs(g) + std::fabs(d) + 8);
      ASSERT_NEAR(std::min(ng, nd), std::min(g - tau1, d - tau2), tol);
      ASSERT_NEAR(std::max(ng, nd), std::max(g - tau1, d - tau2), tol);
    }
  };
}

// ZipCache's high-bit (salient) rows per KV head in the prefill store.
std::vector<int32_t> salient(const Outcome& o, int l, int kh, int hi) {
  std::vector<int32_t> s;
  for (const RowView& r : rows_of(o.prefill, l, kh))
    if (r.bits == hi) s.push_back(r.pos);
  return s;
}

// The top n positions by score (ties to the earlier), ascending.
std::vector<int32_t> top(const std::vector<double>& score, int n) {
  std::vector<int32_t> idx = range(0, static_cast<int>(score.size()));
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[a] > score[b]; });
  idx.resize(n);
  std::sort(idx.begin(), idx.end());
  return idx;
}

// Saliency of every prompt token for KV head kh with every query as a probe: Σ_{i ≥ j} A_ij over
// the head's query group (accumulated), divided by the T − j probes that see j (normalized).
std::vector<double> saliency_all_probes(const Bench& b, int l, int kh, bool normalized) {
  std::vector<double> s(b.T, 0.0);
  for (int h = kh * b.group(); h < (kh + 1) * b.group(); ++h)
    for (int j = 0; j < b.T; ++j)
      for (int i = j; i < b.T; ++i) s[j] += b.prob(l, h, i, j) / b.group();
  if (normalized)
    for (int j = 0; j < b.T; ++j) s[j] /= b.T - j;
  return s;
}

// Hadamard-INT4 rows: rotating a stored row by blocks of `block` (an fp64 Walsh–Hadamard
// written here) gives at most 16 values per row (INT4 per token), up to float rounding.
Check int4_after_rotation(int which, int block) {
  return [=](const Bench& b, const Outcome&, const Outcome& got) {
    const int D = b.sc.D;
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh)
        for (const RowView& r : rows_of(got.prefill, l, kh)) {
          std::vector<double> x((which ? r.v : r.k), (which ? r.v : r.k) + D);
          for (int o = 0; o < D; o += block) {
            for (int len = 1; len < block; len *= 2)
              for (int i = o; i < o + block; i += 2 * len)
                for (int j = i; j < i + len; ++j) {
                  const double a = x[j], c = x[j + len];
                  x[j] = a + c, x[j + len] = a - c;
                }
            for (int j = o; j < o + block; ++j) x[j] /= std::sqrt(static_cast<double>(block));
          }
          const double span = *std::max_element(x.begin(), x.end()) - *std::min_element(x.begin(), x.end());
          ASSERT_LE(levels(x, 1e-4 * span), 16) << "layer " << l << " pos " << r.pos;
        }
  };
}

const Scene kWide = [] {
  Scene s;
  s.D = 256, s.n_vis = 12, s.n_txt = 5, s.L = 2;
  return s;
}();
const Scene kLongDecode = [] {
  Scene s;
  s.decode = 5;
  return s;
}();

std::vector<Case> cases() {
  std::vector<Case> c;
  auto add = [&](std::string m, std::string p, std::string v, Check check = nullptr, std::string base = "",
                 Scene sc = Scene{}, bool same = false) {
    c.push_back({std::move(m), std::move(p), std::move(v), std::move(base), std::move(check), sc, same});
  };
  // ---- full
  add("full", "storage", "fp16", [](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh)
        for (const RowView& r : rows_of(got.final, l, kh)) {
          ASSERT_EQ(r.storage, "fp16");
          for (int x = 0; x < b.sc.D; ++x) ASSERT_EQ(r.k[x], round_half(b.key(l, r.pos, kh)[x]));
        }
  });
  // The bench's rows are exact, as a decode with --kv-storage fp32 keeps them: asking for fp32
  // is what the default (the run's storage) resolves to here.
  add("full", "storage", "fp32", [](const Bench& b, const Outcome&, const Outcome& got) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh)
        for (const RowView& r : rows_of(got.final, l, kh)) {
          ASSERT_EQ(r.storage, "fp32");
          ASSERT_TRUE(std::equal(r.k, r.k + b.sc.D, b.key(l, r.pos, kh)));
        }
  }, "", Scene{}, true);
  // ---- uniform (default 4 bits, per-token K and V)
  for (int bits : {1, 2, 3, 8})
    add("uniform", "bits", std::to_string(bits), [bits](const Bench& b, const Outcome& d, const Outcome& g) {
      row_bits(bits)(b, d, g);
      value_grid(0, "row", bits)(b, d, g);
    });
  for (const char* which : {"k_granularity", "v_granularity"})
    for (const char* g : {"global", "per-channel"}) {
      const int kv = std::string(which) == "v_granularity";
      add("uniform", which, g, [kv, g](const Bench& b, const Outcome& d, const Outcome& o) {
        value_grid(kv, std::string(g) == "global" ? "block" : "column", 2)(b, d, o);
        unchanged(1 - kv)(b, d, o);
      }, "bits=2");
    }
  add("uniform", "scope", "visual", visual_only());
  // ---- kivi (default 2 bits, group 32, residual 32: nothing of a 60-token prompt is quantized)
  add("kivi", "bits", "4", row_bits(4, {K::System, K::Visual}), "residual=4,group=8");
  add("kivi", "group", "8", [](const Bench& b, const Outcome& d, const Outcome& g) {
    // floor((60 − 4)/8)·8 = 56 rows quantized: 4 stay fp32; each 8-row group has its own
    // per-channel range (cut at segment ends).
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        int fp32 = 0;
        for (const RowView& r : rows_of(g.prefill, l, kh)) fp32 += r.storage == "fp32";
        ASSERT_EQ(fp32, 4);
      }
    for (int l = 0; l < b.sc.L; ++l)
      for (const KVSegment& s : g.prefill.layer(l).segments) {
        if (s.storage == "fp32") continue;
        for (const HeadRows& r : s.heads)
          for (int g0 = 0; g0 < r.n(); g0 += 8)
            for (int c = 0; c < b.sc.D; ++c) {
              std::vector<double> col;
              for (int t = g0; t < std::min(r.n(), g0 + 8); ++t) col.push_back(r.k[t * b.sc.D + c]);
              ASSERT_LE(levels(col), 4);
            }
      }
  }, "residual=4");
  add("kivi", "residual", "0", [](const Bench& b, const Outcome&, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l) {  // floor(60/32)·32 = 32 rows quantized, 28 fp32
      int fp32 = 0;
      for (const RowView& r : rows_of(g.prefill, l, 0)) fp32 += r.storage == "fp32";
      ASSERT_EQ(fp32, 28);
    }
  });
  // ---- calibquant (default 1 bit, τ1 0, τ2 3, calibrate auto, no shrink)
  for (int bits : {2, 4, 8})
    add("calibquant", "bits", std::to_string(bits), [bits](const Bench& b, const Outcome& d, const Outcome& g) {
      row_bits(bits, {K::Visual})(b, d, g);
      calibrated(bits <= 2 ? 0 : -1, 3)(b, d, g);
    });
  add("calibquant", "tau1", "1", calibrated(1, 3));
  add("calibquant", "tau2", "1", calibrated(0, 1));
  add("calibquant", "calibrate", "force", calibrated(0, 3), "bits=4");
  add("calibquant", "calibrate", "off", calibrated(-1, -1));
  add("calibquant", "k_shrink", "0.5", [](const Bench& b, const Outcome& d, const Outcome& g) {
    one_bit_channels(0, 0.5, true)(b, d, g);
    unchanged(1)(b, d, g);
  });
  add("calibquant", "v_shrink", "0.3", [](const Bench& b, const Outcome& d, const Outcome& g) {
    one_bit_channels(1, 0.3, true)(b, d, g);
    unchanged(0)(b, d, g);
  });
  add("calibquant", "shrink_about", "centre", [](const Bench& b, const Outcome& d, const Outcome& g) {
    one_bit_channels(0, 0.5, false)(b, d, g);
    one_bit_channels(1, 0.3, false)(b, d, g);
  }, "k_shrink=0.5,v_shrink=0.3");
  // ---- zipcache (default 4/2 bits, ratio 0.4: round(0.4 · 60) = 24 salient rows per head)
  auto salient_count = [](int hi, int lo, int n_hi) {
    return [=](const Bench& b, const Outcome&, const Outcome& g) {
      for (int l = 0; l < b.sc.L; ++l)
        for (int kh = 0; kh < b.sc.KH; ++kh) {
          int nh = 0;
          for (const RowView& r : rows_of(g.prefill, l, kh)) {
            ASSERT_TRUE(r.bits == hi || r.bits == lo) << r.bits;
            nh += r.bits == hi;
          }
          ASSERT_EQ(nh, n_hi);
        }
    };
  };
  for (int hi : {2, 3, 8}) add("zipcache", "high_bits", std::to_string(hi), salient_count(hi, 2, hi == 2 ? 60 : 24));
  for (int lo : {1, 3, 4}) add("zipcache", "low_bits", std::to_string(lo), salient_count(4, lo, lo == 4 ? 60 : 24));
  add("zipcache", "saliency_ratio", "0.2", salient_count(4, 2, 12));
  add("zipcache", "saliency", "accumulated", [](const Bench& b, const Outcome& d, const Outcome& g) {
    // Every query probes: accumulated p_j = Σ_{i≥j} A_ij, normalized p̃_j = p_j / (T − j).
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        ASSERT_EQ(salient(g, l, kh, 4), top(saliency_all_probes(b, l, kh, false), 24)) << l;
        ASSERT_EQ(salient(d, l, kh, 4), top(saliency_all_probes(b, l, kh, true), 24)) << l;
      }
  }, "probe=all");
  for (const char* p : {"all", "random", "special", "recent"}) add("zipcache", "probe", p);
  add("zipcache", "recent_ratio", "0.2");
  add("zipcache", "random_ratio", "0.2");
  add("zipcache", "seed", "7");
  add("zipcache", "saliency_heads", "shared", [](const Bench& b, const Outcome& d, const Outcome& g) {
    bool default_differs = false;
    for (int l = 0; l < b.sc.L; ++l) {
      ASSERT_EQ(salient(g, l, 0, 4), salient(g, l, 1, 4)) << "one ranking for every KV head";
      default_differs = default_differs || salient(d, l, 0, 4) != salient(d, l, 1, 4);
    }
    EXPECT_TRUE(default_differs);
  });
  // Range granularity: a payload per layer (default) or per segment; V token ranges per token
  // over the heads (default, in the payload's shared block) or per head and token; channel
  // factors per subset (default) or per layer.
  auto zip_payloads = [](const KVStore& s, int l) {
    std::vector<std::shared_ptr<quant::QuantPayload>> out;
    for (const KVSegment& seg : s.layer(l).segments)
      if (auto q = std::dynamic_pointer_cast<quant::QuantPayload>(seg.payload)) out.push_back(q);
    return out;
  };
  add("zipcache", "ranges", "segment", [zip_payloads](const Bench& b, const Outcome& d, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l) {
      const auto pg = zip_payloads(g.prefill, l), pd = zip_payloads(d.prefill, l);
      ASSERT_EQ(pg.size(), 3u);
      EXPECT_TRUE(pg[0] != pg[1] && pg[1] != pg[2]) << "one payload per segment";
      ASSERT_EQ(pd.size(), 3u);
      EXPECT_TRUE(pd[0] == pd[1] && pd[1] == pd[2]) << "the default: one payload per layer";
    }
  });
  add("zipcache", "value_token_range", "head", [zip_payloads](const Bench& b, const Outcome& d, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        EXPECT_EQ(zip_payloads(g.prefill, l)[0]->v[kh].scales.size(), static_cast<size_t>(b.T)) << "a range per row";
        EXPECT_TRUE(zip_payloads(d.prefill, l)[0]->v[kh].scales.empty()) << "the default's ranges span heads";
      }
  });
  add("zipcache", "channel_scales", "layer", [zip_payloads](const Bench& b, const Outcome& d, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        EXPECT_EQ(zip_payloads(g.prefill, l)[0]->v[kh].meta.size(), static_cast<size_t>(b.sc.D));
        EXPECT_EQ(zip_payloads(d.prefill, l)[0]->v[kh].meta.size(), static_cast<size_t>(2 * b.sc.D));
      }
  });
  add("zipcache", "gap", "2", [](const Bench& b, const Outcome& d, const Outcome& g) {
    // 5 generated tokens, gap 2: the first 4 are quantized as two gaps, the last stays fp32.
    for (int l = 0; l < b.sc.L; ++l) {
      int q = 0, dq = 0;
      for (const RowView& r : rows_of(g.final, l, 0)) q += r.kind == K::Generated && r.bits != 0;
      for (const RowView& r : rows_of(d.final, l, 0)) dq += r.kind == K::Generated && r.bits != 0;
      ASSERT_EQ(q, 4);
      ASSERT_EQ(dq, 0);
    }
  }, "", kLongDecode);
  // ---- turboquant (default 3 bits, no QJL)
  for (int bits : {1, 2, 4}) add("turboquant", "bits", std::to_string(bits), row_bits(bits));
  add("turboquant", "qjl", "true", [](const Bench& b, const Outcome& d, const Outcome& g) {
    row_bits(3)(b, d, g);  // keys: 2 codebook bits + 1 sign bit
    unchanged(1)(b, d, g);  // values keep the 3-bit MSE codebook
    EXPECT_NE(g.prefill.layer(0).segments[0].storage.find("+qjl"), std::string::npos);
  });
  add("turboquant", "seed", "5", [](const Bench& b, const Outcome& d, const Outcome& g) {
    EXPECT_EQ(g.prefill.bytes().total(), d.prefill.bytes().total());  // same format, other rotation
  });
  add("turboquant", "scope", "visual", visual_only());
  // ---- hadamard_int4 (default block auto = 16 when 16 divides head_dim)
  for (int block : {8, 16, 32, 64, 128, 256})
    add("hadamard_int4", "block", std::to_string(block), int4_after_rotation(0, block), "", kWide, block == 16);
  add("hadamard_int4", "quantize_v", "false", [](const Bench& b, const Outcome&, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l)
      for (const RowView& r : rows_of(g.final, l, 1)) ASSERT_TRUE(std::equal(r.v, r.v + b.sc.D, b.val(l, r.pos, 1)));
  });
  add("hadamard_int4", "rotate_v", "true", int4_after_rotation(1, 16));
  add("hadamard_int4", "scope", "visual", visual_only());
  // ---- vlcache (default budget 0.1, p 0.01, recent 10 %, sparsity budgets)
  add("vlcache", "budget", "0.3", [](const Bench& b, const Outcome&, const Outcome& g) {
    // Algorithm 1 shares α·L·T rows over the layers (floors lose < 1 row per layer).
    int total = 0;
    for (int l = 0; l < b.sc.L; ++l) total += static_cast<int>(positions(g.prefill, l, 0).size());
    EXPECT_LE(total, 0.3 * b.sc.L * b.T + 1e-9);
    EXPECT_GT(total, 0.3 * b.sc.L * b.T - b.sc.L);
  });
  add("vlcache", "p", "0.2");
  add("vlcache", "recent_ratio", "0.5", kept_positions([](const Bench& b, int) { return range(b.T - 3, b.T); }),
      "budget_mode=uniform");
  add("vlcache", "budget_mode", "uniform", [](const Bench& b, const Outcome& d, const Outcome& g) {
    kept_count([](const Bench&, int) { return 6; })(b, d, g);  // floor(0.1 · 60)
    std::set<size_t> sizes;
    for (int l = 0; l < b.sc.L; ++l) sizes.insert(positions(d.prefill, l, 0).size());
    EXPECT_GT(sizes.size(), 1u) << "sparsity budgets differ between these layers";
  });
  // ---- lookm (default α1 = α2 = 0.1: M = N = 6; text prior; pivotal merge)
  add("lookm", "alpha1", "0.3", [](const Bench& b, const Outcome& d, const Outcome& g) {
    kept_count([](const Bench&, int) { return 18 + 6; })(b, d, g);
    kept_positions([](const Bench& b, int) { return range(b.T - 18, b.T); })(b, d, g);
  });
  add("lookm", "alpha2", "0.3", kept_count([](const Bench&, int) { return 6 + 18; }));
  add("lookm", "text_prior", "false", [](const Bench& b, const Outcome& d, const Outcome& g) {
    // With the prior the 6 important slots go to text (3 system + 3 text before the window).
    int vis_d = 0, vis_g = 0;
    for (const RowView& r : rows_of(d.prefill, 0, 0)) vis_d += r.kind == K::Visual;
    for (const RowView& r : rows_of(g.prefill, 0, 0)) vis_g += r.kind == K::Visual;
    EXPECT_EQ(vis_d, 0);
    EXPECT_GT(vis_g, 0);
  });
  add("lookm", "text_keep", "all", kept_positions([](const Bench& b, int) {
    std::vector<int32_t> t = range(0, b.sc.n_sys);
    for (int32_t x : range(b.T - b.sc.n_txt, b.T)) t.push_back(x);
    return t;
  }), "text_prior=false");
  for (const char* m : {"none", "average", "weighted"})
    add("lookm", "merge", m, [m](const Bench& b, const Outcome&, const Outcome& g) {
      for (int l = 0; l < b.sc.L; ++l)
        for (int kh = 0; kh < b.sc.KH; ++kh) {
          const auto rows = rows_of(g.prefill, l, kh);
          int merged = 0;
          for (const RowView& r : rows) merged += r.merged;
          ASSERT_EQ(merged, std::string(m) == "none" ? 0 : b.T - static_cast<int>(rows.size()));
          if (std::string(m) == "none") {
            for (const RowView& r : rows) ASSERT_TRUE(std::equal(r.k, r.k + b.sc.D, b.key(l, r.pos, kh)));
          }
        }
    });
  // Merge filter: above-mean similarity only (every merge kind), or as the authors' code paths
  // (average and weighted filter, pivotal does not); average sources paired by position.
  auto merged_total = [](const Bench& b, const Outcome& o, int l, int kh) {
    int m = 0, kept = 0;
    for (const RowView& r : rows_of(o.prefill, l, kh)) m += r.merged, ++kept;
    return std::make_pair(m, b.T - kept);  // (rows merged, rows evicted)
  };
  auto filtered = [merged_total](const Bench& b, const Outcome&, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        const auto [m, e] = merged_total(b, g, l, kh);
        EXPECT_GT(m, 0);
        EXPECT_LT(m, e) << "some evicted rows are below the mean similarity";
      }
  };
  add("lookm", "merge_filter", "above_mean", filtered, "merge=pivotal");
  add("lookm", "merge_filter", "code", filtered, "merge=weighted");
  add("lookm", "merge_filter", "code", [merged_total](const Bench& b, const Outcome&, const Outcome& g) {
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        const auto [m, e] = merged_total(b, g, l, kh);
        EXPECT_EQ(m, e) << "the pivotal code path merges every evicted row";
      }
  }, "merge=pivotal", Scene{}, true);
  add("lookm", "average_source", "prefix", [](const Bench& b, const Outcome& d, const Outcome& g) {
    // The same rows receive merges (the assignments are the same), from other source rows.
    bool values_differ = false;
    for (int l = 0; l < b.sc.L; ++l)
      for (int kh = 0; kh < b.sc.KH; ++kh) {
        const auto rg = rows_of(g.prefill, l, kh), rd = rows_of(d.prefill, l, kh);
        ASSERT_EQ(rg.size(), rd.size());
        for (size_t i = 0; i < rg.size(); ++i) {
          ASSERT_EQ(rg[i].merged, rd[i].merged);
          values_differ = values_differ || !std::equal(rg[i].k, rg[i].k + b.sc.D, rd[i].k);
        }
      }
    EXPECT_TRUE(values_differ);
  }, "merge=average,merge_filter=above_mean");
  add("lookm", "sinks", "4", kept_positions([](const Bench&, int) { return range(0, 4); }), "text_prior=false");
  // ---- h2o (default budget 0.1: 6 rows, recent half)
  add("h2o", "budget", "0.3", kept_count([](const Bench&, int) { return 18; }));
  add("h2o", "recent_ratio", "1", kept_positions([](const Bench& b, int) { return range(b.T - 6, b.T); }));
  // ---- snapkv (default budget 0.1, window 32, kernel 7, max pooling)
  add("snapkv", "budget", "0.3", kept_count([](const Bench&, int) { return 18; }));
  add("snapkv", "window", "4", kept_positions([](const Bench& b, int) { return range(b.T - 4, b.T); }));
  // 18 rows: the window of 4 and 14 voted (with the default budget the window fills it).
  add("snapkv", "kernel", "1", nullptr, "budget=0.3,window=4");
  add("snapkv", "pooling", "avg", nullptr, "budget=0.3,window=4");
  // ---- streamingllm (default budget 0.1: 6 rows, 4 sinks)
  add("streamingllm", "budget", "0.3", kept_positions([](const Bench& b, int) {
    std::vector<int32_t> p = range(0, 4);
    for (int32_t x : range(b.T - 14, b.T)) p.push_back(x);
    return p;
  }));
  add("streamingllm", "sinks", "0", kept_positions([](const Bench& b, int) { return range(b.T - 6, b.T); }));
  // ---- pyramidkv (default budget 0.1, β 20, window 32, kernel 7, max)
  auto pyramid = [](double alpha, double beta) {
    return kept_count([=](const Bench& b, int l) {
      double last = alpha / beta, first = 2 * alpha - last;
      if (first > 1) first = 1, last = 2 * alpha - 1;
      const double f = first + (last - first) * l / (b.sc.L - 1);
      return std::max(1, static_cast<int>(std::floor(f * b.T + 1e-6)));
    });
  };
  add("pyramidkv", "budget", "0.3", pyramid(0.3, 20));
  add("pyramidkv", "beta", "2", pyramid(0.1, 2));
  add("pyramidkv", "window", "8");
  add("pyramidkv", "kernel", "3", nullptr, "budget=0.5,window=8");
  add("pyramidkv", "pooling", "avg", nullptr, "budget=0.5,window=8");
  return c;
}

const MethodSpec* method_named(const std::string& name) {
  for (const MethodSpec& m : methods())
    if (m.name == name) return &m;
  return nullptr;
}

const ParamSpec* param_named(const MethodSpec& m, const std::string& name) {
  for (const ParamSpec& p : m.params)
    if (p.name == name) return &p;
  return nullptr;
}

}  // namespace

// Every value of every parameter of every method (but `stack`, generated below) has a case:
// every non-default choice and flag value, at least one non-default number.
TEST(OptionTable, EverySchemaValueHasACase) {
  const std::vector<Case> all = cases();
  std::set<std::string> have;
  for (const Case& c : all) {
    const MethodSpec* m = method_named(c.method);
    ASSERT_NE(m, nullptr) << "case names unknown method " << c.method;
    const ParamSpec* p = param_named(*m, c.param);
    ASSERT_NE(p, nullptr) << "case names unknown parameter " << c.method << "." << c.param;
    const std::string v = validate_param(c.method, *p, c.value);
    EXPECT_NE(v, validate_param(c.method, *p, p->def)) << c.method << "." << c.param << "=" << c.value << " is the default";
    have.insert(c.method + "." + c.param + "=" + v);
    have.insert(c.method + "." + c.param);
  }
  for (const MethodSpec& m : methods()) {
    if (m.name == "stack") continue;
    for (const ParamSpec& p : m.params) {
      const std::string def = validate_param(m.name, p, p.def);
      switch (p.type) {
        case ParamSpec::Type::Choice:
          for (const std::string& c : p.choices)
            if (c != def) {
              EXPECT_TRUE(have.count(m.name + "." + p.name + "=" + c)) << "no case for " << m.name << "." << p.name << "=" << c;
            }
          break;
        case ParamSpec::Type::Bool: {
          const std::string other = def == "on" ? "off" : "on";
          EXPECT_TRUE(have.count(m.name + "." + p.name + "=" + other)) << "no case for " << m.name << "." << p.name << "=" << other;
          break;
        }
        default:
          EXPECT_TRUE(have.count(m.name + "." + p.name)) << "no case for " << m.name << "." << p.name;
      }
    }
  }
}

class OptionCases : public ::testing::TestWithParam<std::string> {};

// Each case against the method's defaults (plus the case's base values): the value changes the
// outcome (or, where marked, is what the default resolves to), differs from every other value
// of the same parameter, and does what its check says.
TEST_P(OptionCases, EachValueChangesWhatItShould) {
  const std::string method = GetParam();
  std::map<std::string, std::vector<std::pair<std::string, Outcome>>> by_param;
  int n = 0;
  for (const Case& c : cases()) {
    if (c.method != method) continue;
    ++n;
    SCOPED_TRACE(spec_of(c.method, c.base, c.param + "=" + c.value));
    const Bench& b = bench(c.scene);
    const Outcome def = run_methods(b, {spec_of(c.method, c.base)});
    const Outcome got = run_methods(b, {spec_of(c.method, c.base, c.param + "=" + c.value)});
    if (c.same_as_default) {
      EXPECT_TRUE(same_outcome(got, def)) << "expected the default's outcome on this scene";
    } else {
      EXPECT_FALSE(same_outcome(got, def)) << "the value changes nothing: ignored?";
    }
    if (c.check) c.check(b, def, got);
    auto& seen = by_param[c.param + "|" + c.base + "|" + std::to_string(c.scene.D) + "/" + std::to_string(c.scene.decode)];
    for (const auto& [v, o] : seen) EXPECT_FALSE(same_outcome(o, got)) << c.param << "=" << v << " gives the same outcome";
    seen.push_back({c.value, got});
  }
  EXPECT_GT(n, 0) << method << " has no cases";
}

INSTANTIATE_TEST_SUITE_P(Methods, OptionCases, ::testing::ValuesIn([] {
                           std::vector<std::string> names;
                           for (const MethodSpec& m : methods())
                             if (m.name != "stack") names.push_back(m.name);
                           return names;
                         }()));

// `stack`, generated from the registry: each evict / quant choice, each preset of each inner
// method, and each pass-through parameter (with the value of that inner method's case) gives
// exactly what running the two inner methods in sequence with those values gives, and the
// pass-through value changes the outcome where the inner case says it does.
TEST(OptionTable, StackRoutesEveryParameterToItsMethods) {
  const MethodSpec& stack = *method_named("stack");
  const std::vector<Case> all = cases();
  std::set<std::string> evict_names, quant_names;
  for (const MethodSpec& m : plain_eviction_methods()) evict_names.insert(m.name);
  for (const MethodSpec& m : quantization_methods()) quant_names.insert(m.name);
  auto join = [](const std::string& a, const std::string& b) { return a.empty() ? b : b.empty() ? a : a + "," + b; };
  auto side_spec = [](const std::string& m, const std::string& items) { return items.empty() ? m : m + ":" + items; };
  // Runs the stack spec and the inner methods in sequence; they must agree.
  auto expect_stack = [&](const Bench& b, const std::string& ev, const std::string& qu, const std::string& extra,
                          const std::string& ev_items, const std::string& qu_items) {
    const std::string spec = "stack:" + join("evict=" + ev + ",quant=" + qu, extra);
    SCOPED_TRACE(spec);
    std::vector<std::string> seq;
    if (ev != "none") seq.push_back(side_spec(ev, ev_items));
    if (qu != "none") seq.push_back(side_spec(qu, qu_items));
    const Outcome got = run_methods(b, {spec});
    EXPECT_TRUE(same_outcome(got, run_methods(b, seq))) << "differs from the inner methods run in sequence";
    return got;
  };
  const Bench& b0 = bench(Scene{});
  std::set<std::string> covered;
  for (const ParamSpec& p : stack.params) {
    if (p.name == "evict" || p.name == "quant") {
      for (const std::string& c : p.choices) {
        if (p.name == "evict") expect_stack(b0, c, "none", "", "", "");
        else expect_stack(b0, "none", c, "", "", "");
      }
      covered.insert(p.name);
    } else if (p.name == "evict_preset" || p.name == "quant_preset") {
      const bool ev = p.name == "evict_preset";
      for (const MethodSpec& m : ev ? plain_eviction_methods() : quantization_methods())
        for (const auto& pr : m.presets) {
          if (ev) expect_stack(b0, m.name, "none", p.name + "=" + pr.first, "preset=" + pr.first, "");
          else expect_stack(b0, "none", m.name, p.name + "=" + pr.first, "", "preset=" + pr.first);
          covered.insert(p.name);
        }
    } else {
      // A pass-through parameter: "name", "evict.name" or "quant.name". The value (and base
      // values) of the first case of an inner method that declares it.
      std::string name = p.name, side;
      for (const char* s : {"evict.", "quant."})
        if (name.rfind(s, 0) == 0) side = std::string(s, 5), name = name.substr(6);
      for (const Case& c : all) {
        if (c.param != name) continue;
        const bool is_ev = evict_names.count(c.method) > 0;
        if (!side.empty() && (side == "evict") != is_ev) continue;
        const Bench& b = bench(c.scene);
        // "evict.name" / "quant.name": the other side is a method that declares the name too
        // (with its defaults), so a value that leaked to it would show.
        std::string other = "none";
        if (!side.empty())
          for (const MethodSpec& m : is_ev ? quantization_methods() : plain_eviction_methods())
            if (param_named(m, name) && other == "none") other = m.name;
        const std::string ev = is_ev ? c.method : other, qu = is_ev ? other : c.method;
        const std::string inner = join(c.base, name + "=" + c.value);
        const Outcome got = expect_stack(b, ev, qu, join(c.base, p.name + "=" + c.value), is_ev ? inner : "",
                                         is_ev ? "" : inner);
        if (!c.same_as_default) {
          EXPECT_FALSE(same_outcome(got, run_methods(b, {"stack:" + join("evict=" + ev + ",quant=" + qu, c.base)})))
              << "stack." << p.name << " ignored";
        }
        covered.insert(p.name);
        break;
      }
      // A bare name that both chosen methods declare reaches both.
      if (side.empty()) {
        const Case* e = nullptr;
        const Case* q = nullptr;
        for (const Case& c : all)
          if (c.param == name && c.base.empty() && c.scene == Scene{}) {
            if (evict_names.count(c.method) && !e) e = &c;
            if (quant_names.count(c.method) && !q) q = &c;
          }
        if (e && q) {
          const std::string kv = name + "=" + e->value;
          expect_stack(b0, e->method, q->method, kv, kv, kv);
        }
      }
    }
  }
  for (const ParamSpec& p : stack.params) EXPECT_TRUE(covered.count(p.name)) << "stack." << p.name << " has no generated case";
}
