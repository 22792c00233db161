#include "app/lab/session_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cctype>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>

#include "app/lab/worker.h"
#include "core/compress/method.h"
#include "core/errors.h"
#include "core/numbers.h"
#include "core/trace.h"

namespace kvlens {

namespace {

std::string method_name(const Session& s, size_t i) {
  const std::string l = s.method_label(i);
  return l.empty() ? s.methods[i].short_spec() : l;
}

const ParamSpec* find_param(const std::string& method, const std::string& name) {
  for (const ParamSpec& p : find_method(method).params)
    if (p.name == name) return &p;
  return nullptr;
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

std::string SessionEdit::text(const Session& s) const {
  return method_name(s, static_cast<size_t>(method)) + ": " + param + " = " + value;
}

SessionEdit parse_session_edit(const std::string& text, const Session& s) {
  const std::string what = "--edit '" + text + "'";
  // The method may be a spec with its own ':' and '=': PARAM=VALUE is what follows the last ':'
  // before the last '='.
  const size_t eq = text.rfind('='), colon = eq == std::string::npos ? std::string::npos : text.rfind(':', eq);
  if (colon == std::string::npos || eq == std::string::npos || colon == 0 || eq == colon + 1)
    throw InputError(what + ": expected METHOD:PARAM=VALUE (METHOD: the method's index from 0 or its label)");
  const std::string who = text.substr(0, colon);
  SessionEdit e;
  e.param = text.substr(colon + 1, eq - colon - 1);
  e.value = text.substr(eq + 1);
  e.method = -1;
  if (!who.empty() && std::all_of(who.begin(), who.end(), [](unsigned char c) { return std::isdigit(c); })) {
    if (s.methods.empty()) throw InputError(what + ": the session has no methods");
    e.method = static_cast<int>(parse_integer(who, what + " method index", 0, static_cast<int64_t>(s.methods.size()) - 1));
  } else {
    for (size_t i = 0; i < s.methods.size(); ++i)
      if (method_name(s, i) == who || s.methods[i].spec() == who) {
        if (e.method >= 0)
          throw InputError(what + ": '" + who + "' names more than one method; give its index from 0");
        e.method = static_cast<int>(i);
      }
    if (e.method < 0) {
      std::string names;
      for (size_t i = 0; i < s.methods.size(); ++i) names += (i ? ", " : "") + std::to_string(i) + " = " + method_name(s, i);
      throw InputError(what + ": no method '" + who + "' in the session (" + names + ")");
    }
  }
  if (!s.method_enabled(static_cast<size_t>(e.method)))
    throw InputError(what + ": method " + std::to_string(e.method) + " is disabled in the session");
  const std::string& m = s.methods[static_cast<size_t>(e.method)].method();
  const ParamSpec* p = find_param(m, e.param);
  if (!p) {
    std::string names;
    for (const ParamSpec& q : find_method(m).params) names += (names.empty() ? "" : ", ") + q.name;
    throw InputError(what + ": " + m + " has no parameter '" + e.param + "' (" + names + ")");
  }
  try {
    e.value = validate_param(m, *p, e.value);
  } catch (const InputError& x) {
    throw InputError(what + ": " + x.what());
  }
  return e;
}

std::vector<SessionEdit> default_session_edits(const Session& s) {
  std::vector<SessionEdit> out;
  for (size_t i = 0; i < s.methods.size(); ++i) {
    if (!s.method_enabled(i)) continue;
    const Params& p = s.methods[i];
    for (const ParamSpec& q : find_method(p.method()).params) {
      if ((q.type != ParamSpec::Type::Float && q.type != ParamSpec::Type::Int) || !(q.max > q.min) || !p.has(q.name))
        continue;
      const double cur = p.num(q.name), mid = 0.5 * (q.min + q.max);
      double step = (q.max - q.min) / 10;
      if (q.type == ParamSpec::Type::Int) step = std::max(1.0, std::round(step));
      double next = cur < mid ? cur + step : cur - step;
      // Two significant digits of the step, so that the value reads as typed (0.2, not 0.1999).
      const double unit = std::pow(10.0, std::floor(std::log10(step)) - 1);
      next = std::clamp(std::round(next / unit) * unit, q.min, q.max);
      if (next == cur) continue;
      SessionEdit e;
      e.method = static_cast<int>(i);
      e.param = q.name;
      e.value = validate_param(p.method(), q, format_number(next));
      out.push_back(e);
      break;
    }
  }
  return out;
}

SessionBench bench_session(const Session& s, const std::string& model_dir, const std::string& image_path,
                           const BackendOptions& backend, const std::vector<SessionEdit>& edits) {
  std::vector<Params> params = s.methods;
  Setup setup;
  setup.model_dir = model_dir;
  setup.image_path = image_path;
  setup.backend = backend;
  apply_session_run(s, setup.opt);
  auto methods_of = [&] {
    std::vector<Setup::Method> m;
    for (size_t i = 0; i < params.size(); ++i)
      if (s.method_enabled(i)) m.push_back({static_cast<int>(i) + 1, params[i], s.method_label(i)});
    return m;
  };

  Worker w;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t published = 0;
  w.set_on_publish([&] {
    {
      std::lock_guard<std::mutex> l(mu);
      ++published;
    }
    cv.notify_all();
  });
  // The newest snapshot once `done` holds for it (woken by each publish).
  auto wait = [&](const std::function<bool(const Snapshot&)>& done) {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<const Snapshot> snap = w.latest();
      if (done(*snap)) return snap;
      std::unique_lock<std::mutex> l(mu);
      cv.wait_for(l, std::chrono::milliseconds(20), [&] { return published != seen; });
      seen = published;
    }
  };
  // What stopped the setup of version v, once the worker is idle for it.
  auto check = [&](const Snapshot& snap) {
    if (!snap.model_error.empty()) throw InputError(snap.model_error);
    if (!snap.base_error.empty()) throw InputError(snap.base_error);
    for (const auto& [id, msg] : snap.run_errors)
      if (id >= 1 && id <= static_cast<int>(params.size()))
        throw InputError(method_name(s, static_cast<size_t>(id - 1)) + ": " + msg);
  };
  auto idle = [&](uint64_t v) { return [v](const Snapshot& x) { return x.setup_version == v && !x.busy; }; };

  SessionBench out;
  setup.methods = methods_of();
  auto t0 = std::chrono::steady_clock::now();
  uint64_t v = w.submit(setup);
  auto snap = wait(idle(v));
  out.first_ms = ms_since(t0);
  check(*snap);
  if (snap->model) out.backend = snap->model->backend;
  if (snap->base && snap->base->ex) out.prompt_tokens = static_cast<int>(snap->base->ex->prefill.ids.size());
  if (trace::on()) trace::enable(true);  // (a trace covers the edits, not the first run)

  for (const SessionEdit& e : edits) {
    if (e.method < 0 || e.method >= static_cast<int>(params.size()))
      throw InputError("edit of method " + std::to_string(e.method) + ": the session has " +
                       std::to_string(params.size()) + " methods");
    const int id = e.method + 1;
    std::map<std::string, std::string> values = params[static_cast<size_t>(e.method)].values();
    values[e.param] = e.value;
    params[static_cast<size_t>(e.method)] = make_params(params[static_cast<size_t>(e.method)].method(), "", values);
    EditTiming t;
    t.edit = e;
    t.spec = params[static_cast<size_t>(e.method)].spec();
    setup.methods = methods_of();
    setup.priority = {id};
    t0 = std::chrono::steady_clock::now();
    v = w.submit(setup);
    const std::string spec = t.spec;
    auto has_run = [&](const Snapshot& x) {
      if (x.setup_version != v) return false;
      if (!x.busy) return true;  // finished (or failed: checked below)
      for (const RunResult& r : x.runs)
        if (r.id == id && r.spec == spec) return true;
      return false;
    };
    snap = wait(has_run);
    t.caption_ms = ms_since(t0);
    for (const RunResult& r : snap->runs)
      if (r.id == id && r.spec == spec && r.run) {
        t.compress_ms = r.run->result.compress_ms;
        t.decode_ms = r.run->result.decode_ms;
        t.handover_ms = r.run->result.handover_ms;
        t.diagnostics_ms = std::max(0.0, r.run_ms - t.compress_ms - t.decode_ms);
        t.report_ms = r.json_ms + snap->report_ms;
        t.other_ms = std::max(0.0, t.caption_ms - t.compress_ms - t.decode_ms - t.diagnostics_ms - t.report_ms);
      }
    snap = wait(idle(v));
    t.ready_ms = ms_since(t0);
    check(*snap);
    for (const RunResult& r : snap->runs)
      if (r.id == id && r.run) t.caption = r.run->result.text;
    out.edits.push_back(t);
  }
  return out;
}

}  // namespace kvlens
