// `full`: no compression, the baseline every ratio is relative to. Rows stay as the KV cache
// stores dense rows: fp16 (x̂ = half(x), 2 B/value; the run's default and the papers' full
// cache, ratio 1.00) or fp32 (exact, 4 B/value). `storage=cache` follows the run's
// --kv-storage; fp16 / fp32 ask for that storage whatever the run's is.
#include "core/compress/quant_methods.h"

namespace kvlens {

namespace {

class FullPolicy : public KVPolicy {
 public:
  explicit FullPolicy(std::optional<RowStorage> rows) : rows_(rows) {}
  std::string name() const override { return "full"; }
  std::optional<RowStorage> row_storage() const override { return rows_; }
  bool acts_on_decode() const override { return false; }
  bool reads_rows() const override { return false; }

 private:
  std::optional<RowStorage> rows_;
};

}  // namespace

MethodSpec full_method() {
  MethodSpec m;
  m.name = "full";
  m.family = "reference";
  m.summary = "No compression: every row dense, as the cache stores rows (fp16 by default, ratio 1.00)";
  m.params = {param::choice("storage", {"cache", "fp16", "fp32"}, "cache",
                            "dense rows: cache = the run's --kv-storage (fp16 by default), fp16 = x̂ = half(x) "
                            "(2 B/value), fp32 = exact x (4 B/value)")};
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    const std::string s = p.str("storage");
    return std::make_unique<FullPolicy>(s == "cache" ? std::nullopt
                                                     : std::optional<RowStorage>(parse_row_storage(s, "full: storage")));
  };
  return m;
}

}  // namespace kvlens
