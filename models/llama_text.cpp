#include "models/llama_text.h"

#include <chrono>

#include "core/errors.h"

namespace kvlens {

using model_detail::first_present;
using model_detail::ms_since;
using model_detail::need_prefix;

LlamaTextModel LlamaTextModel::load(const std::string& dir, const BackendOptions& backend) {
  return model_detail::load_folder(dir, [&] { return load_checked(dir, backend); });
}

LlamaTextModel LlamaTextModel::load_checked(const std::string& dir, const BackendOptions& backend) {
  LlamaTextModel m;
  m.dir_ = dir;
  m.text_cfg_ = load_text_only_config(dir + "/config.json");
  m.tok_ = Tokenizer::load(dir, -1, false);
  const WeightStore ws = WeightStore::open_dir(dir);
  // LlamaForCausalLM's names ("model.layers…", "lm_head.weight"), or a bare LlamaModel's.
  const std::string tp = need_prefix(ws, {"model.", ""}, "embed_tokens.weight", "decoder");
  const std::string lm_head = first_present(ws, {"lm_head.weight"});
  if (lm_head.empty() && !m.text_cfg_.tie_word_embeddings)
    throw InputError(dir + ": no 'lm_head.weight', and config.json does not tie the word embeddings");
  m.load_decoder(ws, tp, lm_head, m.text_cfg_.tie_word_embeddings, backend);
  m.info_.architecture = m.text_cfg_.model_type;
  const std::string& t = m.text_cfg_.model_type;
  m.info_.family = (t == "mistral" ? "Mistral" : t == "qwen2" ? "Qwen2" : "Llama") + std::string(" (text only)");
  return m;
}

std::vector<int> LlamaTextModel::prompt_ids(const std::string& prompt, const std::string& templ,
                                            const VisualLayout&) const {
  return tokenize(prompt, templ).ids;
}

TextPrompt LlamaTextModel::tokenize(const std::string& prompt, const std::string& templ) const {
  static const std::string open = "<span>", close = "</span>";
  const size_t a = templ.find(open), b = templ.find(close);
  TextPrompt r;
  if (a == std::string::npos && b == std::string::npos) {
    r.ids = tok_.encode_prompt(templ, prompt, 0);
    return r;
  }
  if (a == std::string::npos || b == std::string::npos || b < a || templ.find(open, a + 1) != std::string::npos ||
      templ.find(close, b + 1) != std::string::npos)
    throw InputError("prompt template '" + templ + "': mark the methods' span once, as <span> … </span>");
  for (const std::string& m : {open, close, std::string("<image>")})
    if (prompt.find(m) != std::string::npos)
      throw InputError("prompt '" + prompt + "' contains " + m + "; markers belong in the template");
  if (templ.find("<image>") != std::string::npos)
    throw InputError("prompt template '" + templ + "' has an <image> marker, and the model takes no image");
  // The parts before, inside and after the span, the prompt in place of the first {prompt}
  // (as a template without a span takes it), each through the tokenizer on its own.
  std::string parts[3] = {templ.substr(0, a), templ.substr(a + open.size(), b - a - open.size()), templ.substr(b + close.size())};
  std::string* with = nullptr;
  for (std::string& p : parts)
    if (!with && p.find("{prompt}") != std::string::npos) with = &p;
  if (!with) throw InputError("prompt template '" + templ + "' has no {prompt} (a span marker must not split it)");
  with->replace(with->find("{prompt}"), 8, prompt);
  // The three parts are one text to the tokenizer's prefix rule: the first that is not empty
  // starts it. Spaces that end a part go to the start of the next (when it has text), where a
  // tokenizer puts them as the next word's "▁" or "Ġ": "Read: <span>the light</span> is" takes
  // the ids of "Read: the light is".
  for (int i = 0; i < 2; ++i)
    while (!parts[i].empty() && parts[i].back() == ' ' && !parts[i + 1].empty()) {
      parts[i].pop_back();
      parts[i + 1].insert(0, 1, ' ');
    }
  if (tok_.needs_bos(parts[0])) r.ids.push_back(tok_.bos_id());
  bool first = true;
  auto add = [&](const std::string& part) {
    for (int x : tok_.encode_section(part, first)) r.ids.push_back(x);
    if (!part.empty()) first = false;
  };
  add(parts[0]);
  r.span_first = static_cast<int>(r.ids.size());
  add(parts[1]);
  r.span_n = static_cast<int>(r.ids.size()) - r.span_first;
  add(parts[2]);
  if (r.span_n == 0) throw InputError("prompt template '" + templ + "': the span <span> … </span> holds no token");
  return r;
}

Tensor LlamaTextModel::pixel_values(const RGBImage&) const {
  throw InputError(dir_ + ": a text-only model (" + info_.architecture + ") takes no image");
}

ImageFeatures LlamaTextModel::encode_image(const Tensor&, const VisualLayout&) const {
  throw InputError(dir_ + ": a text-only model (" + info_.architecture + ") takes no image");
}

PrefillState LlamaTextModel::prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                                     bool keep_attention, const std::vector<AttentionObserver*>& observers) const {
  if (!img.data.empty()) throw InputError(dir_ + ": a text-only model (" + info_.architecture + ") takes no image");
  return prefill_features(ImageFeatures{}, prompt, templ, keep_attention, observers);
}

PrefillState LlamaTextModel::prefill_features(const ImageFeatures& image, const std::string& prompt, const std::string& templ,
                                              bool keep_attention, const std::vector<AttentionObserver*>& observers) const {
  if (!image.features.empty())
    throw InputError(dir_ + ": a text-only model (" + info_.architecture + ") takes no image features, got " +
                     image.features.shape_str());
  PrefillState st;
  const auto t0 = std::chrono::steady_clock::now();
  const TextPrompt tp = tokenize(prompt, templ);
  st.ids = tp.ids;
  const int T = static_cast<int>(st.ids.size());
  if (T == 0) throw InputError("the prompt and template '" + templ + "' give no tokens");
  st.n_visual = tp.span_n;
  check_prompt_length(T, st.n_visual);
  st.kinds.assign(static_cast<size_t>(T), SegmentKind::System);
  for (int t = tp.span_first; t < T && tp.span_n > 0; ++t)
    st.kinds[static_cast<size_t>(t)] = t < tp.span_first + tp.span_n ? SegmentKind::Visual : SegmentKind::PostVisionText;
  Buffer x = text_.embed_tokens(st.ids);
  x.name = "prompt_embeds";
  prefill_embedded(st, std::move(x), keep_attention, observers);
  st.prefill_ms = ms_since(t0);
  return st;
}

}  // namespace kvlens
