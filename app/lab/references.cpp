#include "app/lab/references.h"

#include <filesystem>
#include <mutex>
#include <system_error>

#include "core/errors.h"
#include "core/eval/eval_dataset.h"
#include "core/eval/ptb_tokenizer.h"

namespace kvlens {

namespace fs = std::filesystem;

namespace {

// A dataset's references, tokenized, and their document frequencies: read once and kept while
// the annotations file stays as it was (the same size and time), so that moving from image to
// image of one dataset (a COCO split: 200k captions) tokenizes it once.
struct DatasetRefs {
  std::string annotations;
  uintmax_t size = 0;
  fs::file_time_type time;
  EvalDataset ds;
  std::vector<std::vector<std::string>> refs;  // per ds.images entry
  std::shared_ptr<const CiderDocuments> documents;
};

std::shared_ptr<const DatasetRefs> dataset_refs(const std::string& dir) {
  static std::mutex mu;
  static std::shared_ptr<const DatasetRefs> kept;  // the latest dataset read
  const std::string ann = find_annotations(dir);   // (InputError: none here)
  std::error_code ec;
  const uintmax_t size = fs::file_size(ann, ec);
  const fs::file_time_type time = fs::last_write_time(ann, ec);
  if (ec) throw InputError(ann + ": cannot be read");
  {
    std::lock_guard<std::mutex> lock(mu);
    if (kept && kept->annotations == ann && kept->size == size && kept->time == time) return kept;
  }
  auto d = std::make_shared<DatasetRefs>();
  d->annotations = ann;
  d->size = size;
  d->time = time;
  d->ds = load_eval_dataset(dir, ann);
  for (size_t p : d->ds.images) d->refs.push_back(coco_tokenize(d->ds.ann.captions.at(d->ds.ann.images[p].id)));
  d->documents = std::make_shared<const CiderDocuments>(cider_documents(d->refs));
  std::lock_guard<std::mutex> lock(mu);
  kept = d;
  return d;
}

}  // namespace

double ImageReferences::cider_d(const std::string& caption) const {
  return cider_d_one(*documents, refs, coco_tokenize({caption}).at(0));
}

std::shared_ptr<const ImageReferences> find_image_references(const std::string& image_path) {
  std::error_code ec;
  const fs::path image = fs::absolute(image_path, ec);
  if (ec || !fs::is_regular_file(image, ec)) return nullptr;
  fs::path dir = image.parent_path();
  for (int up = 0; up < 3 && !dir.empty(); ++up, dir = dir.parent_path()) {
    std::shared_ptr<const DatasetRefs> d;
    try {
      d = dataset_refs(dir.string());
    } catch (const InputError&) {
      continue;  // (no dataset here, or one that cannot be read: look further up)
    }
    for (size_t i = 0; i < d->ds.images.size(); ++i) {
      const std::string path = d->ds.image_path(d->ds.images[i]);
      if (fs::path(path).filename() != image.filename() || !fs::equivalent(path, image, ec) || ec) continue;
      auto r = std::make_shared<ImageReferences>();
      r->annotations = d->annotations;
      r->refs = d->refs[i];
      r->documents = d->documents;
      return r;
    }
  }
  return nullptr;
}

}  // namespace kvlens
