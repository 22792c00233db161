// Composition: one eviction / merge policy, then one quantization policy on what is kept, e.g.
//   "stack:evict=vlcache,quant=calibquant,budget=0.2,bits=1"
//
// Spec: `evict=<eviction method|none>`, `quant=<quantization method|none>`,
// `evict_preset=` / `quant_preset=` (a preset of the inner method, "none" by default), and every
// parameter of every eviction and quantization method. Those pass-through parameters are
// strings that default to "default" (= the inner method's own default; the schema validator
// refuses empty strings); a value that is set goes to each of the two chosen methods that
// declares a parameter of that name (both, when both do), and is validated by that method's own
// schema, so errors read "vlcache: budget must be in [0, 1], got 2". A name used by both an
// eviction and a quantization method (e.g. a recent ratio) also exists as `evict.<name>` and
// `quant.<name>`, which reach one side only. A set parameter that neither chosen method
// declares is an error naming both.
//
// Hooks run in order: prefill evicts first, then quantizes the kept rows; each decode step runs
// the eviction policy's hook, then the quantization policy's; score transforms compose the same
// way. The quantization policy sees the same PrefillContexts as the eviction policy: their
// attention still covers the whole prompt, so it must find its rows by position (HeadRows::pos).
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "core/errors.h"
#include "core/compress/evict_methods.h"
#include "core/compress/registry.h"

namespace kvlens {

namespace {

const char* kNone = "none";
const char* kInner = "default";  // a pass-through parameter left to the inner method

class StackPolicy : public KVPolicy {
 public:
  StackPolicy(std::unique_ptr<KVPolicy> evict, std::unique_ptr<KVPolicy> quant)
      : evict_(std::move(evict)), quant_(std::move(quant)) {}

  std::string name() const override { return "stack"; }
  bool needs_prefill_attention() const override {
    return (evict_ && evict_->needs_prefill_attention()) ||
           (quant_ && quant_->needs_prefill_attention());
  }
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) override {
    if (evict_) evict_->on_prefill(layers, store);
    if (quant_) quant_->on_prefill(layers, store);
  }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    if (evict_) evict_->on_prefill_layer(ctx, layer);
    if (quant_) quant_->on_prefill_layer(ctx, layer);
  }
  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (evict_) evict_->on_decode_step(ctx, layer);
    if (quant_) quant_->on_decode_step(ctx, layer);
  }
  bool reads_rows() const override {
    return (evict_ && evict_->reads_rows()) || (quant_ && quant_->reads_rows());
  }
  int rotated_keys(int head_dim) const override { return quant_ ? quant_->rotated_keys(head_dim) : 0; }
  bool acts_on_decode() const override {
    return (evict_ && evict_->acts_on_decode()) || (quant_ && quant_->acts_on_decode());
  }
  bool acts_on_decode_within(int new_tokens) const override {
    return (evict_ && evict_->acts_on_decode_within(new_tokens)) || (quant_ && quant_->acts_on_decode_within(new_tokens));
  }
  bool acts_at_step(const DecodeContext& ctx, const LayerKV& layer) const override {
    return (evict_ && evict_->acts_at_step(ctx, layer)) || (quant_ && quant_->acts_at_step(ctx, layer));
  }
  // The quantization stage's, when the eviction stage does nothing while decoding.
  StepQuant step_quant(int head_dim) const override {
    return quant_ && !(evict_ && evict_->acts_on_decode()) ? quant_->step_quant(head_dim) : StepQuant{};
  }
  // The quantization stage's transform as it describes it, when it is the only one; any other
  // combination is applied on the host (transform_scores).
  ScoreTransform score_transform() const override {
    if (!(evict_ && evict_->has_score_transform()) && quant_) {
      ScoreTransform t = quant_->score_transform();
      if (t.any()) t.apply = KVPolicy::score_transform().apply;
      return t;
    }
    return KVPolicy::score_transform();
  }
  // The row storage the inner methods ask for (the quantization side's ask wins).
  std::optional<RowStorage> row_storage() const override {
    const std::optional<RowStorage> q = quant_ ? quant_->row_storage() : std::nullopt;
    return q ? q : evict_ ? evict_->row_storage() : std::nullopt;
  }
  bool has_score_transform() const override {
    return (evict_ && evict_->has_score_transform()) || (quant_ && quant_->has_score_transform());
  }
  void transform_scores(int layer, int head, float* scores, const SegmentKind* kinds,
                        int n_k) const override {
    if (evict_ && evict_->has_score_transform())
      evict_->transform_scores(layer, head, scores, kinds, n_k);
    if (quant_ && quant_->has_score_transform())
      quant_->transform_scores(layer, head, scores, kinds, n_k);
  }

 private:
  std::unique_ptr<KVPolicy> evict_, quant_;
};

bool declares(const MethodSpec& m, const std::string& param) {
  for (const ParamSpec& p : m.params)
    if (p.name == param) return true;
  return false;
}

const char* kControl[] = {"evict", "quant", "evict_preset", "quant_preset"};

struct InnerParams {
  std::optional<Params> evict, quant;
};

// The two inner methods' Params, each value validated by its own method's schema.
InnerParams inner_params(const Params& p) {
  const std::string ev = p.str("evict"), qu = p.str("quant");
  // Inner methods get their values as parsed values, never joined into a spec string.
  std::map<std::string, std::map<std::string, std::string>> given;  // inner method -> values
  std::map<std::string, std::string> preset;
  if (ev != kNone && p.str("evict_preset") != kNone) preset[ev] = p.str("evict_preset");
  if (qu != kNone && p.str("quant_preset") != kNone) preset[qu] = p.str("quant_preset");
  for (const auto& [key, value] : p.values()) {
    bool control = false;
    for (const char* c : kControl) control = control || key == c;
    if (control || value == kInner) continue;
    // "evict.x" / "quant.x" go to one side only; a bare name to every side that declares it.
    std::vector<std::string> targets{ev, qu};
    std::string name = key;
    for (const std::string& side : {std::string("evict."), std::string("quant.")})
      if (key.rfind(side, 0) == 0) {
        targets = {side == "evict." ? ev : qu};
        name = key.substr(side.size());
      }
    bool used = false;
    for (const std::string& m : targets) {
      if (m == kNone || !declares(find_method(m), name)) continue;
      given[m][name] = value;
      used = true;
    }
    if (!used)
      throw InputError("stack: parameter '" + key + "' belongs to neither evict=" + ev +
                       " nor quant=" + qu);
  }
  InnerParams r;
  if (ev != kNone) r.evict = make_params(ev, preset[ev], given[ev]);
  if (qu != kNone) r.quant = make_params(qu, preset[qu], given[qu]);
  return r;
}

std::unique_ptr<KVPolicy> build_stack(const Params& p) {
  const InnerParams in = inner_params(p);
  return std::make_unique<StackPolicy>(in.evict ? make_policy(*in.evict) : nullptr,
                                       in.quant ? make_policy(*in.quant) : nullptr);
}

}  // namespace

MethodSpec stack_method() {
  const std::vector<MethodSpec> evict = plain_eviction_methods();
  const std::vector<MethodSpec> quant = quantization_methods();
  ParamSpec e{"evict", ParamSpec::Type::Choice, 0, 0, {}, "vlcache",
              "eviction / merge method applied first (none: no eviction)"};
  for (const MethodSpec& m : evict) e.choices.push_back(m.name);
  e.choices.push_back(kNone);
  ParamSpec q{"quant", ParamSpec::Type::Choice, 0, 0, {}, kNone,
              "quantization method applied to the kept rows (none: no quantization)"};
  for (const MethodSpec& m : quant) {
    q.choices.push_back(m.name);
    if (m.calibration_stage && q.def == kNone) q.def = m.name;  // the first that calibrates
  }
  q.choices.push_back(kNone);

  MethodSpec s;
  s.name = "stack";
  s.family = "composition";
  s.summary = "composition: an eviction/merge method, then a quantization method on the kept rows";
  s.params = {e, q,
              {"evict_preset", ParamSpec::Type::String, 0, 0, {}, kNone,
               "preset of the eviction method (none: its defaults)"},
              {"quant_preset", ParamSpec::Type::String, 0, 0, {}, kNone,
               "preset of the quantization method (none: its defaults)"}};
  // Pass-through parameters, in registry order; the help names who takes each one. A name
  // that both families use also gets "evict.<name>" and "quant.<name>" to reach one side only.
  std::map<std::string, std::vector<std::string>> owners;
  std::map<std::string, std::string> first_help, family_help[3];
  std::map<std::string, int> families;  // bit 1: eviction, bit 2: quantization
  std::vector<std::string> order;
  for (int fam = 1; fam <= 2; ++fam)
    for (const MethodSpec& m : fam == 1 ? evict : quant)
      for (const ParamSpec& p : m.params) {
        bool control = false;
        for (const char* c : kControl) control = control || p.name == c;
        if (control) continue;  // an inner parameter named like a stack control is unreachable
        if (!owners.count(p.name)) {
          order.push_back(p.name);
          first_help[p.name] = p.help;
        }
        if (!family_help[fam].count(p.name)) family_help[fam][p.name] = p.help;
        owners[p.name].push_back(m.name);
        families[p.name] |= fam;
      }
  auto pass = [&](const std::string& key, const std::string& who, const std::string& help) {
    s.params.push_back({key, ParamSpec::Type::String, 0, 0, {}, kInner,
                        "to " + who + " (default: its own default): " + help});
  };
  for (const std::string& name : order) {
    std::string who;
    for (const std::string& m : owners[name]) who += (who.empty() ? "" : "/") + m;
    pass(name, who, first_help[name]);
  }
  for (const std::string& name : order)
    if (families[name] == 3) {
      pass("evict." + name, "the eviction method", family_help[1][name]);
      pass("quant." + name, "the quantization method", family_help[2][name]);
    }
  s.make = build_stack;
  s.check = [](const Params& p) { inner_params(p); };
  // The quantization stage calibrates, when its method does.
  s.calibration_stage = [](const Params& p) -> std::optional<Params> {
    const InnerParams in = inner_params(p);
    return in.quant ? calibration_stage(*in.quant) : std::nullopt;
  };
  return s;
}

}  // namespace kvlens
