// What the report figures share (figures_report.cpp, figures_patches.cpp): reading a run report
// with the path of every value for messages that name the key, and the axes of a heatmap.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/figures/figures_report.h"
#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens::fig::report_json {

// The axes of a heatmap of `rows` × `cols` cells: x from 0 to cols, y from 0 to rows, row 0 on top.
inline void matrix_axes(Figure& f, const std::string& x_label, double cols, const std::string& y_label, double rows) {
  f.x.label = x_label;
  f.x.min = 0;
  f.x.max = cols;
  f.y.label = y_label;
  f.y.min = 0;
  f.y.max = rows;
  f.y.inverted = true;
}

constexpr double kBig = 1e300;

// A JSON value with the path that leads to it, for messages that name the key.
struct J {
  const nlohmann::json& v;
  std::string where;

  bool has(const std::string& k) const { return v.is_object() && v.contains(k); }
  J at(const std::string& k) const {
    if (!v.is_object()) throw InputError(where + " must be an object");
    if (!v.contains(k)) throw InputError(where + " lacks '" + k + "'");
    return {v[k], where + "." + k};
  }
  J at(size_t i) const {
    if (!v.is_array()) throw InputError(where + " must be a list");
    if (i >= v.size()) throw InputError(where + " has no item " + std::to_string(i));
    return {v[i], where + "[" + std::to_string(i) + "]"};
  }
  size_t size() const {
    if (!v.is_array()) throw InputError(where + " must be a list");
    return v.size();
  }
  double num() const { return json_real(v, where, -kBig, kBig); }
  int integer() const { return json_int(v, where, -1000000000, 1000000000); }
  std::string str() const {
    if (!v.is_string()) throw InputError(where + " must be a string, got " + v.dump());
    return v.get<std::string>();
  }
  std::vector<double> nums() const {
    std::vector<double> r;
    for (size_t i = 0; i < size(); ++i) r.push_back(at(i).num());
    return r;
  }
  std::vector<int> ints() const {
    std::vector<int> r;
    for (size_t i = 0; i < size(); ++i) r.push_back(at(i).integer());
    return r;
  }
};

inline J root(const nlohmann::json& r) { return {r, "report"}; }

inline J method_at(const nlohmann::json& r, int m) {
  const J ms = root(r).at("methods");
  if (m < 0 || static_cast<size_t>(m) >= ms.size())
    throw InputError("report has " + std::to_string(ms.size()) + " methods, no method " + std::to_string(m));
  return ms.at(static_cast<size_t>(m));
}

inline J layer_at(const J& method, int l) {
  const J ls = method.at("layers");
  if (l < 0 || static_cast<size_t>(l) >= ls.size())
    throw InputError(method.where + " has " + std::to_string(ls.size()) + " layers, no layer " + std::to_string(l));
  return ls.at(static_cast<size_t>(l));
}

// A file-name stem of method m: its index and label.
inline std::string method_id(const nlohmann::json& r, int m) {
  return "m" + std::to_string(m) + "_" + slug(method_labels(r)[m]);
}

}  // namespace kvlens::fig::report_json
