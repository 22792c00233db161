#include "core/eval/meteor.h"

#include <cstdlib>

#include "core/errors.h"
#include "core/files.h"
#include "core/numbers.h"
#include "core/eval/subprocess.h"

namespace kvlens {

namespace {

std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t i = 0; (i = s.find(from, i)) != std::string::npos; i += to.size()) s.replace(i, from.size(), to);
  return s;
}

}  // namespace

MeteorSetup find_meteor(const std::string& jar, const std::vector<std::string>& pythons) {
  MeteorSetup s;
  const char* home = std::getenv("JAVA_HOME");
  if (home && *home && !find_on_path(std::string(home) + "/bin/java").empty()) s.java = std::string(home) + "/bin/java";
  if (s.java.empty()) s.java = find_on_path("java");
  if (!jar.empty()) {
    if (!file_exists(jar)) throw InputError(jar + ": METEOR jar not found");
    s.jar = jar;
  } else {
    for (const std::string& py : pythons) {
      bool ok = false;
      const std::string dir = trim(run_capture(
          {py, "-c",
           "import importlib.util as u; s = u.find_spec('pycocoevalcap'); "
           "print(list(s.submodule_search_locations)[0] if s else '')"},
          ok));
      if (ok && !dir.empty() && file_exists(dir + "/meteor/meteor-1.5.jar")) {
        s.jar = dir + "/meteor/meteor-1.5.jar";
        break;
      }
    }
  }
  if (s.java.empty())
    s.status = "METEOR unavailable: no Java runtime (install default-jre-headless, or set JAVA_HOME)";
  else if (s.jar.empty())
    s.status = "METEOR unavailable: pycocoevalcap's meteor-1.5.jar not found (pip install pycocoevalcap, or "
               "--meteor-jar FILE)";
  return s;
}

MeteorScorer::MeteorScorer(const MeteorSetup& setup) : what_("METEOR (" + setup.jar + ")") {
  if (!setup.available()) throw InputError(setup.status);
  proc_ = std::make_unique<Subprocess>(
      std::vector<std::string>{setup.java, "-jar", "-Xmx2G", setup.jar, "-", "-", "-stdio", "-l", "en", "-norm"},
      folder_of(setup.jar));
}

MeteorScorer::~MeteorScorer() = default;

double MeteorScorer::score(const TokenizedCorpus& c) {
  if (c.refs.size() != c.cands.size() || c.cands.empty())
    throw InputError("METEOR: " + std::to_string(c.cands.size()) + " hypotheses for " + std::to_string(c.refs.size()) +
                     " images");
  std::string eval = "EVAL";
  for (size_t i = 0; i < c.cands.size(); ++i) {
    const std::string hyp = replace_all(replace_all(c.cands[i], "|||", ""), "  ", " ");
    std::string line = "SCORE";
    std::string refs;
    for (size_t k = 0; k < c.refs[i].size(); ++k) refs += (k ? " ||| " : "") + c.refs[i][k];
    line += " ||| " + refs + " ||| " + hyp;
    proc_->write_line(line, what_);
    // The first answer waits for the JVM and the paraphrase table to load.
    eval += " ||| " + trim(proc_->read_line(started_ ? 120 : 600, what_));
    started_ = true;
  }
  proc_->write_line(eval, what_);
  for (size_t i = 0; i < c.cands.size(); ++i) proc_->read_line(120, what_);
  return parse_real(trim(proc_->read_line(120, what_)), what_ + " score", 0, 1);
}

}  // namespace kvlens
