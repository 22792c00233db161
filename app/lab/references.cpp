#include "app/lab/references.h"

#include <filesystem>
#include <system_error>

#include "core/errors.h"
#include "core/eval/eval_dataset.h"
#include "core/eval/ptb_tokenizer.h"

namespace kvlens {

namespace fs = std::filesystem;

double ImageReferences::cider_d(const std::string& caption) const {
  return cider_d_one(documents, refs, coco_tokenize({caption}).at(0));
}

std::shared_ptr<const ImageReferences> find_image_references(const std::string& image_path) {
  std::error_code ec;
  const fs::path image = fs::absolute(image_path, ec);
  if (ec || !fs::is_regular_file(image, ec)) return nullptr;
  fs::path dir = image.parent_path();
  for (int up = 0; up < 3 && !dir.empty(); ++up, dir = dir.parent_path()) {
    EvalDataset ds;
    try {
      ds = load_eval_dataset(dir.string());
    } catch (const InputError&) {
      continue;  // (no dataset here, or one that cannot be read: look further up)
    }
    for (size_t pos : ds.images) {
      if (!fs::equivalent(ds.image_path(pos), image, ec) || ec) continue;
      auto r = std::make_shared<ImageReferences>();
      r->annotations = ds.ann.path;
      std::vector<std::vector<std::string>> all;
      for (size_t p : ds.images) {
        all.push_back(coco_tokenize(ds.ann.captions.at(ds.ann.images[p].id)));
        if (p == pos) r->refs = all.back();
      }
      r->documents = cider_documents(all);
      return r;
    }
  }
  return nullptr;
}

}  // namespace kvlens
