// kvlens eval / merge on a few scenes with the embedded model: the table's layout and its
// agreement with kvlens score on the results files it writes, resuming after a kill, and the
// same table from one run, from two --shard processes joined by merge, and from mpirun -np 2.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kt = kvlens::testing;
namespace fs = std::filesystem;

namespace {

// Small and quick: three methods, two bit-widths, short answers.
const std::string kMethods =
    " --method calibquant --method 'vlcache:budget=0.2' --method kivi --bits 4,1 --max-new-tokens 12 --no-meteor";

// One scene set for every test of this file.
const std::string& scenes() {
  static const std::string dir = [] {
    const std::string d = kt::make_temp_dir("evalset") + "/set";
    const kt::RunResult r = kt::run(kt::cli() + " scenes --n 4 --seed 1000001 --out " + d);
    EXPECT_EQ(r.code, 0) << r.output;
    return d;
  }();
  return dir;
}

kt::RunResult eval(const std::string& args) { return kt::run(kt::cli() + " eval --dataset " + scenes() + kMethods + " " + args); }

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

TEST(EvalCli, TableInTheLayoutOfCalibQuantTable1) {
  const std::string out = kt::make_temp_dir("evaltable");
  const kt::RunResult r = eval("--out " + out);  // with the scenes' questions
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<std::string> md = lines(kt::read_file(out + "/table.md"));
  ASSERT_GE(md.size(), 7u);
  EXPECT_EQ(md[0], "| Method | Bits | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | METEOR | ROUGE-L | CIDEr-D | VQA | KV bytes | Ratio |");
  // full, calibquant 4 and 1, vlcache, kivi 4 (kivi has no 1-bit mode: listed as skipped).
  const nlohmann::json t = kt::read_json(out + "/table.json");
  ASSERT_EQ(t.at("rows").size(), 5u);
  EXPECT_EQ(t.at("images").get<int>(), 4);
  EXPECT_NE(t.at("notes").dump().find("kivi: bits=1 not accepted"), std::string::npos);
  std::vector<std::string> labels;
  for (const auto& row : t.at("rows")) labels.push_back(row.at("method").get<std::string>() + "/" + row.at("bits").get<std::string>());
  EXPECT_EQ(labels, (std::vector<std::string>{"full/16", "calibquant/4", "calibquant/1", "vlcache:budget=0.2/–", "kivi/4"}));
  for (const auto& row : t.at("rows")) {
    SCOPED_TRACE(row.at("spec").get<std::string>());
    EXPECT_TRUE(row.at("METEOR").is_null());
    EXPECT_GT(row.at("questions").get<int>(), 8);
    EXPECT_GT(row.at("kv_bytes").get<double>(), 0);
    // Each row's results file scores to the row's numbers through kvlens score.
    const std::string res = out + "/" + row.at("results_file").get<std::string>();
    const nlohmann::json coco = kt::read_json(res);
    ASSERT_EQ(coco.size(), 4u);
    const kt::RunResult s = kt::run(kt::cli() + " score --no-meteor --annotations " + scenes() +
                                    "/annotations.json --results " + res + " --json " + out + "/s.json");
    ASSERT_EQ(s.code, 0) << s.output;
    const nlohmann::json sj = kt::read_json(out + "/s.json");
    for (const char* m : {"BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr-D"}) EXPECT_DOUBLE_EQ(sj.at(m).get<double>(), row.at(m).get<double>());
  }
  // Compression shows: 1-bit CalibQuant stores fewer bytes than 4-bit, and both fewer than full.
  const auto& rows = t.at("rows");
  EXPECT_LT(rows[2].at("kv_bytes").get<double>(), rows[1].at("kv_bytes").get<double>());
  EXPECT_LT(rows[1].at("kv_bytes").get<double>(), rows[0].at("kv_bytes").get<double>());
  EXPECT_EQ(lines(kt::read_file(out + "/table.csv")).size(), 6u);  // header + 5 rows
}

TEST(EvalCli, CocoSplitFolderWithoutQuestions) {
  // The scene images laid out as a COCO split: annotations/captions_val2014.json + val2014/.
  const std::string d = kt::make_temp_dir("evalcoco"), out = d + "/out";
  fs::create_directories(d + "/annotations");
  fs::create_directories(d + "/val2014");
  nlohmann::json a = kt::read_json(scenes() + "/annotations.json");
  a.erase("questions");
  for (auto& im : a["images"]) {
    const std::string f = im["file_name"].get<std::string>();
    const std::string name = "COCO_val2014_" + fs::path(f).filename().string();
    fs::copy_file(scenes() + "/" + f, d + "/val2014/" + name);
    im["file_name"] = name;
  }
  kt::write_file(d + "/annotations/captions_val2014.json", a.dump());
  const kt::RunResult r = kt::run(kt::cli() + " eval --dataset " + d + " --limit 2 --method calibquant --max-new-tokens 12 "
                                  "--no-meteor --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(lines(kt::read_file(out + "/table.md"))[0],
            "| Method | Bits | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | METEOR | ROUGE-L | CIDEr-D | KV bytes | Ratio |");
  const nlohmann::json res = kt::read_json(out + "/results/full.json");
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(res[0]["image_id"], a["images"][0]["id"]);
  EXPECT_EQ(res[1]["image_id"], a["images"][1]["id"]);
}

TEST(EvalCli, KilledRunResumesToTheSameTable) {
  const std::string ref = kt::make_temp_dir("evalref"), out = kt::make_temp_dir("evalkill");
  ASSERT_EQ(eval("--no-vqa --out " + ref).code, 0);
  // Kill a run once it has finished at least one image, then run again: it reuses the records.
  const std::vector<std::string> args{kt::cli(), "eval", "--dataset", scenes(), "--method", "calibquant", "--method",
                                      "vlcache:budget=0.2", "--method", "kivi", "--bits", "4,1", "--max-new-tokens",
                                      "12", "--no-meteor", "--no-vqa", "--out", out};
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    std::vector<char*> argv;
    for (const std::string& w : args) argv.push_back(const_cast<char*>(w.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  for (int i = 0; i < 12000 && !fs::exists(out + "/images/0.json"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(fs::exists(out + "/images/0.json"));
  EXPECT_TRUE(nlohmann::json::accept(kt::read_file(out + "/images/0.json")));
  const kt::RunResult r = eval("--no-vqa --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("from earlier runs"), std::string::npos) << r.output;
  EXPECT_EQ(kt::read_file(out + "/table.md"), kt::read_file(ref + "/table.md"));
  EXPECT_EQ(kt::read_file(out + "/table.csv"), kt::read_file(ref + "/table.csv"));
}

TEST(EvalCli, ShardsMergedAndMpiRanksGiveTheUnshardedTable) {
  const std::string one = kt::make_temp_dir("evalone"), a = kt::make_temp_dir("evala"), b = kt::make_temp_dir("evalb"),
                    merged = kt::make_temp_dir("evalmerged");
  ASSERT_EQ(eval("--no-vqa --out " + one).code, 0);
  ASSERT_EQ(eval("--no-vqa --shard 0/2 --out " + a).code, 0);
  ASSERT_EQ(eval("--no-vqa --shard 1/2 --out " + b).code, 0);
  EXPECT_EQ(fs::exists(a + "/images/0.json") + fs::exists(a + "/images/1.json"), 1);  // every second image
  // Merging one shard alone is refused, naming the missing image.
  kt::RunResult r = kt::run(kt::cli() + " merge " + a + " --no-meteor --out " + merged);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("no complete record of image"), std::string::npos) << r.output;
  r = kt::run(kt::cli() + " merge " + a + " " + b + " --no-meteor --out " + merged);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* f : {"/table.md", "/table.csv", "/table.json", "/results/calibquant_b1.json"})
    EXPECT_EQ(kt::read_file(merged + f), kt::read_file(one + f)) << f;
#ifdef KVLENS_MPIEXEC
  const std::string mpi = kt::make_temp_dir("evalmpi");
  // Under LeakSanitizer (tests/sanitize.sh) the ranks skip the leak check: OpenMPI keeps its
  // runtime's allocations past MPI_Finalize in plugins it unloads, so they cannot be attributed
  // or suppressed; the same eval code is leak-checked above without mpirun.
  const char* asan = std::getenv("ASAN_OPTIONS");
  const std::string leak_off = "-x ASAN_OPTIONS=" + std::string(asan ? asan : "") + (asan && *asan ? ":" : "") + "detect_leaks=0 ";
  r = kt::run(std::string(KVLENS_MPIEXEC) + " --allow-run-as-root --oversubscribe -np 2 " + leak_off + kt::cli() + " eval --dataset " +
              scenes() + kMethods + " --no-vqa --out " + mpi);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("[eval rank 1/2]"), std::string::npos) << r.output;
  for (const char* f : {"/table.md", "/table.csv", "/table.json", "/results/calibquant_b1.json"})
    EXPECT_EQ(kt::read_file(mpi + f), kt::read_file(one + f)) << f;
#else
  GTEST_SKIP() << "kvlens was built without MPI (libopenmpi-dev and openmpi-bin; ./setup.sh --tests installs them)";
#endif
}

TEST(SweepCli, OneCsvLinePerGridPointAfterTheFullCache) {
  const std::string out = kt::make_temp_dir("sweep");
  const kt::RunResult r = kt::run(kt::cli() + " sweep --dataset " + scenes() +
                                  " --method vlcache --param budget=0.1:0.4:3:log --max-new-tokens 12 --no-vqa --no-meteor"
                                  " --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<std::string> csv = lines(kt::read_file(out + "/sweep.csv"));
  ASSERT_EQ(csv.size(), 5u);  // header, full, 0.1, 0.2, 0.4
  EXPECT_EQ(csv[0].substr(0, 14), "budget,BLEU-1,");
  EXPECT_EQ(csv[1].substr(0, 1), ",");  // the full cache: no parameter value
  EXPECT_EQ(csv[2].substr(0, 4), "0.1,");
  EXPECT_EQ(csv[3].substr(0, 4), "0.2,");  // 0.1·4^(1/2), rounded to 12 digits
  EXPECT_EQ(csv[4].substr(0, 4), "0.4,");
  // KV bytes grow with the budget.
  const nlohmann::json t = kt::read_json(out + "/table.json");
  ASSERT_EQ(t.at("rows").size(), 4u);
  EXPECT_LT(t["rows"][1]["kv_bytes"].get<double>(), t["rows"][2]["kv_bytes"].get<double>());
  EXPECT_LT(t["rows"][2]["kv_bytes"].get<double>(), t["rows"][3]["kv_bytes"].get<double>());
  // Figures: CIDEr-D against the budget and against KV bytes (Cairo builds; others say why not).
  if (r.output.find("built without Cairo") == std::string::npos) {
    EXPECT_NE(r.output.find("2 figures (8 files) written"), std::string::npos) << r.output;
    EXPECT_TRUE(fs::exists(out + "/figures/sweep_cider_d_vs_budget.svg"));
    EXPECT_TRUE(fs::exists(out + "/figures/sweep_cider_d_vs_kv_bytes.pdf"));
  }
  const kt::RunResult bad = kt::run(kt::cli() + " sweep --dataset " + scenes() + " --method vlcache --param budget=0.1:2:3 --out " + out);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("vlcache: budget must be in"), std::string::npos) << bad.output;
}

TEST(CalibrateCli, GridByCiderAndBySoftmaxMse) {
  const std::string out = kt::make_temp_dir("calib");
  const kt::RunResult r = kt::run(kt::cli() + " calibrate --by cider --dataset " + scenes() +
                                  " --taus 0 3 --max-new-tokens 12 --no-vqa --no-meteor --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json j = kt::read_json(out + "/calibration.json");
  ASSERT_EQ(j.at("grid").size(), 4u);
  double best_cider = -1, best_mse = 1e30;
  for (const auto& p : j["grid"]) {
    best_cider = std::max(best_cider, p.at("CIDEr-D").get<double>());
    best_mse = std::min(best_mse, p.at("softmax_mse").get<double>());
    EXPECT_GT(p.at("softmax_mse").get<double>(), 0.0);
  }
  EXPECT_EQ(j["best_by_cider"]["CIDEr-D"].get<double>(), best_cider);
  EXPECT_EQ(j["best_by_mse"]["softmax_mse"].get<double>(), best_mse);
  EXPECT_EQ(j["best"], j["best_by_cider"]);
  const std::vector<std::string> heat = lines(kt::read_file(out + "/cider_heatmap.csv"));
  ASSERT_EQ(heat.size(), 3u);
  EXPECT_EQ(heat[0], "tau1\\tau2,0,3");
  EXPECT_NE(r.output.find("best by softmax MSE: tau1="), std::string::npos);
  if (r.output.find("built without Cairo") == std::string::npos) {
    EXPECT_TRUE(fs::exists(out + "/figures/calibration_cider_d.png")) << r.output;
  }
  const kt::RunResult bad = kt::run(kt::cli() + " calibrate --by cider --taus 0 3");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("--by cider needs --dataset"), std::string::npos) << bad.output;
}

TEST(EvalCli, BadInputsAreOneLineErrors) {
  const std::string out = kt::make_temp_dir("evalbad");
  kt::RunResult r = kt::run(kt::cli() + " eval --dataset " + out + " --out " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("no annotations.json or captions_*.json"), std::string::npos) << r.output;
  r = eval("--shard 2/2 --out " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--shard I must be an integer in [0, 1]"), std::string::npos) << r.output;
  r = eval("--bits 8,x --out " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--bits"), std::string::npos) << r.output;
  r = kt::run(kt::cli() + " eval --dataset " + scenes() + " --method 'vlcache:budget=7' --out " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("vlcache: budget must be in"), std::string::npos) << r.output;
}

// --kv-storage reaches every decode cache of the run: the full cache holds twice the bytes with
// fp32 rows, the full row's bit-width says so, and records of one storage are not reused for the
// other. --backend is accepted (cpu here) and a bad storage name is refused naming the option.
TEST(EvalCli, KvStorageAndBackendReachTheRun) {
  const std::string out = kt::make_temp_dir("evalstorage");
  const std::string cmd = kt::cli() + " eval --dataset " + scenes() +
                          " --limit 2 --no-vqa --no-meteor --max-new-tokens 6 --backend cpu --method calibquant --bits 1";
  auto full_row = [](const nlohmann::json& t) {
    for (const auto& row : t.at("rows"))
      if (row.at("method") == "full") return row;
    ADD_FAILURE() << "no full row in " << t.dump();
    return nlohmann::json();
  };
  kt::RunResult r = kt::run(cmd + " --kv-storage fp16 --out " + out + "/a");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json a = kt::read_json(out + "/a/table.json");
  r = kt::run(cmd + " --kv-storage fp32 --out " + out + "/a");  // same folder: fp16 records must not be reused
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json b = kt::read_json(out + "/a/table.json");
  const nlohmann::json fa = full_row(a), fb = full_row(b);
  EXPECT_EQ(fa.at("bits").get<std::string>(), "16");
  EXPECT_EQ(fb.at("bits").get<std::string>(), "32");
  // Bytes per row and KV head: 2·D values at 2 or 4 B, plus a 4 B position. So fp32 − fp16 is
  // the fp16 codes (4·D per row) and 2·fp16 − fp32 the positions (4 per row): their ratio is D.
  const nlohmann::json text = kt::read_json(kt::source_dir() + "/assets/models/kvlens-scenes-6m/config.json").at("text_config");
  const double D = text.at("hidden_size").get<double>() / text.at("num_attention_heads").get<double>();
  const double b16 = fa.at("kv_bytes").get<double>(), b32 = fb.at("kv_bytes").get<double>();
  ASSERT_GT(2 * b16 - b32, 0);
  EXPECT_DOUBLE_EQ((b32 - b16) / (2 * b16 - b32), D);
  EXPECT_DOUBLE_EQ(fa.at("ratio").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(fb.at("ratio").get<double>(), b16 / b32);
  EXPECT_EQ(kt::read_json(out + "/a/manifest.json").at("settings").at("kv_storage"), "fp32");
  r = kt::run(cmd + " --kv-storage bf16 --out " + out + "/c");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--kv-storage must be fp16 or fp32, got 'bf16'"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out + "/c/table.md"));
}

}  // namespace
