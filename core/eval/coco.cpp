#include "core/eval/coco.h"

#include <cmath>
#include <set>

#include "core/eval/caption_metrics.h"
#include "core/errors.h"
#include "core/json_file.h"
#include "core/eval/meteor.h"
#include "core/numbers.h"
#include "core/eval/ptb_tokenizer.h"

namespace kvlens {

namespace {

std::string text_field(const nlohmann::json& e, const char* key, const std::string& where) {
  if (!e.is_object() || !e.contains(key)) throw InputError(where + ": missing \"" + key + "\"");
  if (!e[key].is_string()) throw InputError(where + ": \"" + key + "\" must be a string, got " + e[key].dump());
  return e[key].get<std::string>();
}

int64_t id_field(const nlohmann::json& e, const char* key, const std::string& where) {
  if (!e.is_object() || !e.contains(key)) throw InputError(where + ": missing \"" + key + "\"");
  return json_integer(e[key], where + ": " + key, INT64_MIN, INT64_MAX);
}

const nlohmann::json& list_field(const nlohmann::json& j, const char* key, const std::string& path) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_array())
    throw InputError(path + ": expected a \"" + key + "\" list (COCO caption annotations)");
  return j[key];
}

std::vector<CocoQuestion> parse_questions(const nlohmann::json& list, const std::string& path) {
  std::vector<CocoQuestion> qs;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = path + ": questions[" + std::to_string(i) + "]";
    CocoQuestion q;
    q.image_id = id_field(list[i], "image_id", where);
    q.question = text_field(list[i], "question", where);
    q.answer = text_field(list[i], "answer", where);
    q.type = list[i].contains("type") ? text_field(list[i], "type", where) : "other";
    qs.push_back(std::move(q));
  }
  return qs;
}

}  // namespace

CocoAnnotations load_coco_annotations(const std::string& path) {
  const nlohmann::json j = read_json_file(path, "COCO caption annotations");
  CocoAnnotations a;
  a.path = path;
  const nlohmann::json& images = list_field(j, "images", path);
  const nlohmann::json& anns = list_field(j, "annotations", path);
  std::set<int64_t> ids;
  for (size_t i = 0; i < images.size(); ++i) {
    const std::string where = path + ": images[" + std::to_string(i) + "]";
    CocoAnnotations::Image im;
    im.id = id_field(images[i], "id", where);
    im.file_name = images[i].contains("file_name") ? text_field(images[i], "file_name", where) : "";
    if (!ids.insert(im.id).second) throw InputError(where + ": image id " + std::to_string(im.id) + " appears twice");
    a.images.push_back(std::move(im));
  }
  for (size_t i = 0; i < anns.size(); ++i) {
    const std::string where = path + ": annotations[" + std::to_string(i) + "]";
    const int64_t id = id_field(anns[i], "image_id", where);
    if (!ids.count(id)) throw InputError(where + ": image_id " + std::to_string(id) + " is not in \"images\"");
    a.captions[id].push_back(text_field(anns[i], "caption", where));
  }
  if (j.contains("questions")) {
    if (!j["questions"].is_array()) throw InputError(path + ": \"questions\" must be a list");
    a.questions = parse_questions(j["questions"], path);
    for (const CocoQuestion& q : a.questions)
      if (!ids.count(q.image_id))
        throw InputError(path + ": question for image_id " + std::to_string(q.image_id) + " that is not in \"images\"");
  }
  return a;
}

std::vector<CocoResult> load_coco_results(const std::string& path) {
  const nlohmann::json j = read_json_file(path, "COCO caption results");
  if (!j.is_array()) throw InputError(path + ": expected a list of {\"image_id\", \"caption\"} (COCO results)");
  std::vector<CocoResult> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = path + ": [" + std::to_string(i) + "]";
    out.push_back({id_field(j[i], "image_id", where), text_field(j[i], "caption", where)});
  }
  return out;
}

std::vector<CocoQuestion> load_coco_questions(const std::string& path) {
  const nlohmann::json j = read_json_file(path, "questions file");
  if (j.is_array()) return parse_questions(j, path);
  if (j.is_object() && j.contains("questions") && j["questions"].is_array()) return parse_questions(j["questions"], path);
  throw InputError(path + ": expected a list of {\"image_id\", \"question\", \"answer\"} or {\"questions\": [...]}");
}

nlohmann::json coco_results_json(const std::vector<CocoResult>& results) {
  nlohmann::json j = nlohmann::json::array();
  for (const CocoResult& r : results) j.push_back({{"image_id", r.image_id}, {"caption", r.caption}});
  return j;
}

const std::vector<std::string>& caption_metric_names() {
  static const std::vector<std::string> names{"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D"};
  return names;
}

double metric_value(const CaptionScores& s, const std::string& name) {
  for (int k = 0; k < 4; ++k)
    if (name == "BLEU-" + std::to_string(k + 1)) return s.bleu[k];
  if (name == "METEOR") return s.meteor ? *s.meteor : std::nan("");
  if (name == "ROUGE-L") return s.rouge_l;
  if (name == "CIDEr-D") return s.cider_d;
  throw InternalError("unknown caption metric " + name);
}

nlohmann::json CaptionScores::to_json() const {
  nlohmann::json j;
  for (const std::string& m : caption_metric_names()) {
    const double v = metric_value(*this, m);
    j[m] = std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v);
  }
  return j;
}

CaptionScores score_captions(const CocoAnnotations& ann, const std::vector<CocoResult>& results,
                             MeteorScorer* meteor, const std::string& meteor_status) {
  std::map<int64_t, const CocoResult*> by_image;
  for (const CocoResult& r : results) {
    if (!ann.captions.count(r.image_id)) {
      bool known = false;
      for (const auto& im : ann.images) known = known || im.id == r.image_id;
      throw InputError("results: image_id " + std::to_string(r.image_id) + (known ? " has no caption in " : " is not in ") +
                       ann.path);
    }
    if (!by_image.emplace(r.image_id, &r).second)
      throw InputError("results: image_id " + std::to_string(r.image_id) + " has more than one caption");
  }
  if (by_image.empty()) throw InputError("results: no caption to score");
  // pycocoevalcap tokenizes all references in one call and all candidates in another, in the
  // annotation file's image order.
  std::vector<std::string> ref_text, cand_text;
  std::vector<size_t> ref_count;
  for (const auto& im : ann.images) {
    const auto it = by_image.find(im.id);
    if (it == by_image.end()) continue;
    const std::vector<std::string>& caps = ann.captions.at(im.id);
    ref_text.insert(ref_text.end(), caps.begin(), caps.end());
    ref_count.push_back(caps.size());
    cand_text.push_back(it->second->caption);
  }
  const std::vector<std::string> ref_tok = coco_tokenize(ref_text), cand_tok = coco_tokenize(cand_text);
  // Each joining '\n' ends a tokenizer line, so there are never fewer lines than captions.
  if (ref_tok.size() < ref_text.size() || cand_tok.size() < cand_text.size())
    throw InternalError("coco_tokenize returned fewer lines than captions");
  TokenizedCorpus corpus;
  size_t k = 0;
  for (size_t i = 0; i < ref_count.size(); ++i) {
    corpus.refs.emplace_back(ref_tok.begin() + k, ref_tok.begin() + k + ref_count[i]);
    k += ref_count[i];
  }
  corpus.cands = cand_tok;
  CaptionScores s;
  s.images = corpus.cands.size();
  for (const auto* list : {&ref_text, &cand_text}) {
    size_t n = 0;
    for (const std::string& t : *list)
      n += t.find_first_of("\r\v\f") != std::string::npos || t.find("\u2028") != std::string::npos ||
           t.find("\u2029") != std::string::npos;
    if (n)
      s.warnings.push_back(std::to_string(n) + (list == &ref_text ? " reference" : " result") +
                           " caption(s) hold line breaks other than \\n (\\r, \\v, \\f, U+2028, U+2029): the PTB "
                           "tokenizer splits them into extra lines and pycocoevalcap pairs later captions with the "
                           "wrong lines; the scores reproduce that");
  }
  s.bleu = bleu_scores(corpus);
  s.rouge_l = rouge_l_score(corpus);
  s.cider_d = cider_d_score(corpus);
  if (meteor) {
    s.meteor = meteor->score(corpus);
    s.meteor_status.clear();
  } else {
    s.meteor_status = meteor_status;
  }
  return s;
}

}  // namespace kvlens
