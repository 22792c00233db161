// Reference captions of the image a run analyses, when it belongs to a caption dataset kvlens
// reads (a scene set from `kvlens scenes`, or a COCO-style folder, as `kvlens eval` loads them):
// the image's folder, its parent or the folder above holds the annotations and lists the image
// by its file name. A caption is then scored by CIDEr-D against the image's references with the
// dataset's document frequencies (every annotated image's references): what `kvlens eval` gives
// that image when it evaluates the whole set.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/eval/caption_metrics.h"

namespace kvlens {

struct ImageReferences {
  std::string annotations;        // the file the references come from
  std::vector<std::string> refs;  // the image's references, tokenized as pycocoevalcap does
  std::shared_ptr<const CiderDocuments> documents;  // over every annotated image's references
  // CIDEr-D of `caption` (as generated: tokenized here) against refs.
  double cider_d(const std::string& caption) const;
};

// Null where no dataset nearby lists the image (or what is there cannot be read: a dataset is
// optional, never an error of the run).
std::shared_ptr<const ImageReferences> find_image_references(const std::string& image_path);

}  // namespace kvlens
