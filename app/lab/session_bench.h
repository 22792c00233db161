// `kvlens bench session`: the desktop app's loop without a window. A session's setup goes to the
// same worker the app uses; then each parameter edit is submitted as the app submits a slider's
// release, and the time is taken from the edit to the edited method's caption, and to every
// plot's data (the report of all methods rebuilt, the worker idle).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "app/lab/session.h"
#include "core/backend.h"

namespace kvlens {

struct SessionEdit {
  int method = 0;  // index into the session's methods
  std::string param, value;
  std::string text(const Session& s) const;  // "calibquant:tau1 = 0.5"
};

// "INDEX:param=value" or "LABEL:param=value" (LABEL: a method's label or its short spec); the
// value is validated by the method's schema. Throws InputError naming `text` and what is wrong.
SessionEdit parse_session_edit(const std::string& text, const Session& s);
// For each enabled method, its first number parameter moved a tenth of its range towards the
// range's middle (what a short slider drag gives).
std::vector<SessionEdit> default_session_edits(const Session& s);

struct EditTiming {
  SessionEdit edit;
  std::string spec;        // the edited method's spec after the edit
  double caption_ms = 0;   // edit → the edited method's caption (and its diagnostics)
  double ready_ms = 0;     // edit → every method's results and the report: all plots' data
  // Where the caption's time went: compression and decode (the method's own timings; of decode,
  // the observers' events handed over after the steps), the rest of run_method (diagnostics and
  // views), the report (the method's entry and the report's assembly), and what none of those
  // timers covers (the worker's own work around them).
  double compress_ms = 0, decode_ms = 0, handover_ms = 0, diagnostics_ms = 0, report_ms = 0, other_ms = 0;
  std::string caption;
};

struct SessionBench {
  std::string backend;
  int prompt_tokens = 0;
  double first_ms = 0;  // model load, vision, prefill, full cache and every method
  std::vector<EditTiming> edits;
};

// Runs the session (model_dir / image_path: resolved paths) on `backend` and then each edit in
// turn. Throws InputError for a model or image that does not load, or a method that fails.
SessionBench bench_session(const Session& s, const std::string& model_dir, const std::string& image_path,
                           const BackendOptions& backend, const std::vector<SessionEdit>& edits);

}  // namespace kvlens
