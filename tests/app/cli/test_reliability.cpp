// Reliability: nothing written is lost or half-written, and every bad input is refused in one
// line naming the file, field or option (exit code 2), through one mechanism each: the atomic
// writer and regular-file reader (core/files), strict numbers (core/numbers), the non-finite
// check of the models.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/files.h"
#include "core/data/image.h"
#include "models/preprocess/clip_image.h"
#include "tests/test_util.h"

namespace kt = kvlens::testing;
namespace fs = std::filesystem;
using kvlens::InputError;

namespace {

const std::string kFix = kt::source_dir() + "/tests/fixtures/hf/";
const std::string kModel = kt::source_dir() + "/assets/models/kvlens-scenes-6m";

using kvlens::testing::error_of;

// Runs the CLI (with a time limit, so a hang fails instead of blocking the suite).
kt::RunResult cli(const std::string& args, int seconds = 60) {
  return kt::run("timeout " + std::to_string(seconds) + " " + kt::cli() + " " + args);
}

void expect_exit2(const std::string& args, const std::string& must_contain) {
  const auto r = cli(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
  EXPECT_NE(r.output.find(must_contain), std::string::npos) << args << "\n" << r.output;
  // One line, no "internal error", nothing after the message.
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

std::string copy_fixture(const std::string& name) {
  const std::string d = kt::make_temp_dir("rel") + "/" + name;
  EXPECT_EQ(kt::run("cp -r " + kFix + name + " " + d).code, 0);
  return d;
}

// Temporary files or folders in `dir` (of the target named `of`, when given).
// Starts the CLI with `args` (split on spaces) in a child process, output discarded.
pid_t spawn_cli(const std::string& args) {
  std::vector<std::string> words{kt::cli()};
  std::istringstream in(args);
  for (std::string w; in >> w;) words.push_back(w);
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

std::vector<std::string> temporaries(const std::string& dir, const std::string& of = "") {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (kvlens::is_temporary_name(n) && (of.empty() || n.rfind("." + of + ".", 0) == 0)) v.push_back(n);
  }
  return v;
}

// A PID that no process has: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t p = fork();
  if (p == 0) _exit(0);
  waitpid(p, nullptr, 0);
  return p;
}

}  // namespace

// ---- the atomic writer ------------------------------------------------------------------------

TEST(AtomicWriter, WritesReplacesAndLeavesNoTemporaries) {
  const std::string d = kt::make_temp_dir("aw");
  const std::string p = d + "/out.json";
  kvlens::write_file_atomic(p, "first", "report");
  EXPECT_EQ(kt::read_file(p), "first");
  chmod(p.c_str(), 0640);
  kvlens::write_file_atomic(p, std::string(1 << 20, 'x'), "report");
  EXPECT_EQ(kt::read_file(p).size(), 1u << 20);
  struct stat st {};
  ASSERT_EQ(stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u) << "an existing file keeps its permissions";
  EXPECT_TRUE(temporaries(d).empty());
  // A symlink keeps pointing at the new contents.
  ASSERT_EQ(symlink(p.c_str(), (d + "/link.json").c_str()), 0);
  kvlens::write_file_atomic(d + "/link.json", "via link", "report");
  EXPECT_TRUE(fs::is_symlink(d + "/link.json"));
  EXPECT_EQ(kt::read_file(p), "via link");
}

TEST(AtomicWriter, RefusesWhatCannotBeWrittenAndKeepsThePreviousFile) {
  const std::string d = kt::make_temp_dir("aw");
  EXPECT_EQ(error_of([] { kvlens::write_file_atomic("/dev/full", "x", "report"); }),
            "/dev/full: cannot write report: it exists and is not a regular file");
  EXPECT_NE(error_of([] { kvlens::write_file_atomic("/proc/kvlens.json", "x", "report"); })
                .find("/proc/kvlens.json: cannot write report: cannot create a file in /proc"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { kvlens::write_file_atomic(d + "/no/such/dir/x.json", "x", "report"); }),
            d + "/no/such/dir/x.json: cannot write report: folder " + d + "/no/such/dir does not exist");
  EXPECT_EQ(error_of([&] { kvlens::write_file_atomic(d, "x", "report"); }),
            d + ": cannot write report: it exists and is not a regular file");
  EXPECT_NE(error_of([] { kvlens::check_writable("/proc/self/x.json", "session file"); }), "");
  // The previous file survives a refused write.
  kt::write_file(d + "/keep.json", "{\"old\": 1}");
  ASSERT_EQ(symlink("/dev/full", (d + "/full").c_str()), 0);
  EXPECT_NE(error_of([&] { kvlens::write_file_atomic(d + "/full", "x", "report"); }), "");
  EXPECT_EQ(kt::read_file(d + "/keep.json"), "{\"old\": 1}");
  EXPECT_TRUE(temporaries(d).empty());
}

TEST(AtomicWriter, StaleTemporariesOfDeadWritersAreRemoved) {
  const std::string d = kt::make_temp_dir("aw");
  const pid_t dead = dead_pid();
  const std::string stale = d + "/.out.json.kvlens-tmp-" + std::to_string(dead) + "-0";
  const std::string live = d + "/.out.json.kvlens-tmp-" + std::to_string(getppid()) + "-0";
  const std::string other = d + "/.other.json.kvlens-tmp-" + std::to_string(dead) + "-0";
  for (const auto& f : {stale, live, other}) kt::write_file(f, "partial");
  kvlens::check_writable(d + "/out.json", "report");
  EXPECT_FALSE(fs::exists(stale)) << "a dead writer's temporary is removed";
  EXPECT_TRUE(fs::exists(live)) << "a running writer's temporary stays";
  EXPECT_TRUE(fs::exists(other)) << "only the target's own temporaries are touched";
  kvlens::remove_stale_temporaries(d);
  EXPECT_FALSE(fs::exists(other));
}

// ---- writes through the CLI -------------------------------------------------------------------

TEST(ReliableWrites, DiskFullAndProcPathsExitTwo) {
  for (const std::string& target : {std::string("/dev/full"), std::string("/proc/kvlens-out.json")}) {
    SCOPED_TRACE(target);
    expect_exit2("run --method full --max-new-tokens 2 --report " + target, target + ": cannot write report");
    expect_exit2("run --method full --max-new-tokens 2 --save-session " + target, target + ": cannot write session file");
    expect_exit2("caption --max-new-tokens 2 --json " + target, target + ": cannot write caption JSON");
    expect_exit2("caption --max-new-tokens 2 --dump-logits " + target, target + ": cannot write logits");
    expect_exit2("calibrate --taus 0 --max-new-tokens 2 --report " + target, target + ": cannot write report");
  }
}

TEST(ReliableWrites, NothingIsWrittenBeforeEverythingIsValidated) {
  const std::string d = kt::make_temp_dir("val");
  kt::write_file(d + "/k.json", "previous");
  expect_exit2("run --method full --save-session " + d + "/k.json --image /nonexistent.png", "/nonexistent.png");
  expect_exit2("run --method full --save-session " + d + "/k.json --model /nonexistent", "/nonexistent");
  expect_exit2("run --method 'calibquant:bits=3' --save-session " + d + "/k.json", "calibquant: bits");
  EXPECT_EQ(kt::read_file(d + "/k.json"), "previous");
}

// SIGKILL at random moments while each command replaces an existing output: the previous
// output stays complete and valid every time.
TEST(ReliableWrites, KilledWritersLeaveThePreviousOutputValid) {
  const std::string d = kt::make_temp_dir("kill");
  ASSERT_EQ(cli("scenes --n 3 --size 64 --seed 1 --out " + d + "/set").code, 0);
  struct Case {
    std::string args, output;
  };
  const std::vector<Case> cases = {
      {"run --method calibquant --method vlcache --max-new-tokens 8 --report " + d + "/r.json", d + "/r.json"},
      {"eval --scenes " + d + "/set --n 3 --max-new-tokens 6 --json " + d + "/e.json", d + "/e.json"},
      {"run --method zipcache --max-new-tokens 4 --save-session " + d + "/s.json", d + "/s.json"},
      {"caption --max-new-tokens 8 --json " + d + "/c.json", d + "/c.json"},
  };
  std::mt19937 rng(11);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    // A complete run first: its output is the one that must survive. (A longer limit than
    // cli()'s: under the sanitizers on a loaded 2-core machine, eval alone has taken over 60 s.)
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(cli(c.args, 240).code, 0);
    const double full_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const std::string before = kt::read_file(c.output);
    ASSERT_TRUE(nlohmann::json::accept(before));
    for (int i = 0; i < 4; ++i) {
      const pid_t pid = spawn_cli(c.args);
      std::uniform_real_distribution<double> at(0.0, full_ms * 1.1);
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(at(rng) * 1000)));
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      const std::string after = kt::read_file(c.output);
      ASSERT_FALSE(after.empty()) << "output emptied by a killed writer";
      EXPECT_TRUE(nlohmann::json::accept(after)) << "output left half-written";
    }
    // The next complete run removes what the killed ones left behind.
    ASSERT_EQ(cli(c.args, 240).code, 0);
    EXPECT_TRUE(temporaries(d, fs::path(c.output).filename().string()).empty());
  }
  // scenes --force: the old set stays complete, and the killed runs' partial folders are
  // removed by the next run.
  const std::string set = d + "/set";
  for (int i = 0; i < 4; ++i) {
    const pid_t pid = spawn_cli("scenes --force --n 400 --size 64 --seed 2 --out " + set);
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + 150 * i));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    const auto ann = nlohmann::json::parse(kt::read_file(set + "/annotations.json"));
    const size_t n = ann["images"].size();
    EXPECT_TRUE(n == 3 || n == 400) << n;
    for (const auto& im : ann["images"]) EXPECT_TRUE(fs::exists(set + "/" + im["file_name"].get<std::string>()));
  }
  ASSERT_EQ(cli("scenes --force --n 2 --size 64 --out " + set).code, 0);
  EXPECT_TRUE(temporaries(d, "set").empty()) << "stale partial folders are cleaned up by the next run";
}

// ---- inputs: regular files only ---------------------------------------------------------------

TEST(ReliableInputs, FifosAreRefusedNotWaitedOn) {
  const std::string d = kt::make_temp_dir("fifo");
  const std::string fifo = d + "/pipe";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_exit2("caption --image " + fifo, fifo + ": not a regular file (a FIFO), expected image file");
  expect_exit2("run --session " + fifo, fifo + ": not a regular file (a FIFO), expected session file");
  // Inside a model folder: the weights, the shard index, the config and the tokenizer.
  struct Case {
    std::string fixture, file, what;
  };
  for (const Case& c : {Case{"mha_fp32_hub", "model.safetensors", "safetensors file"},
                        Case{"bf16_sharded_inmem", "model.safetensors.index.json", "shard index"},
                        Case{"mha_fp32_hub", "config.json", "config"},
                        Case{"mha_fp32_hub", "tokenizer.model", "SentencePiece tokenizer.model"}}) {
    SCOPED_TRACE(c.file);
    const std::string m = copy_fixture(c.fixture);
    fs::remove(m + "/" + c.file);
    ASSERT_EQ(mkfifo((m + "/" + c.file).c_str(), 0600), 0);
    expect_exit2("caption --max-new-tokens 2 --model " + m, m + "/" + c.file + ": not a regular file (a FIFO), expected " + c.what);
  }
}

TEST(ReliableInputs, AFolderWhereAFileBelongsIsNamed) {
  const std::string m = copy_fixture("mha_fp32_hub");
  fs::remove(m + "/tokenizer.model");
  fs::create_directory(m + "/tokenizer.model");
  expect_exit2("caption --max-new-tokens 2 --model " + m,
               m + "/tokenizer.model: not a regular file (a directory), expected SentencePiece tokenizer.model");
}

// ---- numbers ----------------------------------------------------------------------------------

TEST(ReliableNumbers, ConfigIntegersAreStrictThroughTheCli) {
  auto edited = [](const std::function<void(nlohmann::json&)>& edit) {
    const std::string m = copy_fixture("mha_fp32_hub");
    auto j = nlohmann::json::parse(kt::read_file(m + "/config.json"));
    edit(j);
    kt::write_file(m + "/config.json", j.dump());
    return m;
  };
  expect_exit2("caption --model " + edited([](auto& j) { j["text_config"]["num_attention_heads"] = 4294967304LL; }),
               "num_attention_heads must be an integer in [1, 1024], got 4294967304");
  expect_exit2("caption --model " + edited([](auto& j) { j["text_config"]["num_attention_heads"] = 8.5; }),
               "num_attention_heads must be an integer in [1, 1024], got 8.5");
  expect_exit2("caption --model " + edited([](auto& j) { j["image_token_index"] = 640.5; }),
               "image_token_index must be an integer");
  expect_exit2("caption --model " + edited([](auto& j) { j["vision_feature_layer"] = nlohmann::json::array(); }),
               "'vision_feature_layer' is an empty list");
  expect_exit2("caption --model " + edited([](auto& j) { j["vision_config"]["num_hidden_layers"] = 2147483647; }),
               "num_hidden_layers must be an integer in [1, 512], got 2147483647");
}

TEST(ReliableNumbers, OptionsAreStrictInEveryCommand) {
  const std::string d = kt::make_temp_dir("opt");
  ASSERT_EQ(cli("scenes --n 1 --size 64 --out " + d + "/set").code, 0);
  const std::string scenes = "eval --scenes " + d + "/set ";
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"caption --temperature nan", "--temperature must be a finite number in [0, 100], got 'nan'"},
      {"caption --top-p nan", "--top-p must be a finite number in [0, 1], got 'nan'"},
      {"caption --top-p 0", "--top-p must be in (0, 1], got 0"},
      {"caption --max-new-tokens 8.5", "--max-new-tokens must be an integer in [1, 4096], got '8.5'"},
      {"caption --seed 18446744073709551616", "--seed must be an integer in [0, 18446744073709551615], got 18446744073709551616"},
      {"caption --seed -1", "--seed must be an integer in [0, 18446744073709551615], got '-1'"},
      {"run --method full --sparsity-p nan", "--sparsity-p must be a finite number in [0, 1], got 'nan'"},
      {"run --method full --hit-budget nan", "--hit-budget must be a finite number in [0.0001, 1], got 'nan'"},
      {"run --method full --hit-budget inf", "--hit-budget must be a finite number"},
      {"run --method full --max-new-tokens 0", "--max-new-tokens must be an integer in [1, 4096], got 0"},
      {scenes + "--max-new-tokens 0", "--max-new-tokens must be an integer in [1, 4096], got 0"},
      {scenes + "--max-new-tokens -1", "--max-new-tokens must be an integer in [1, 4096], got -1"},
      {scenes + "--n -1", "--n must be an integer in [0, 10000000], got -1"},
      {"bench --max-new-tokens 0", "--max-new-tokens must be an integer in [1, 4096], got 0"},
      {"bench --max-new-tokens -1", "--max-new-tokens must be an integer in [1, 4096], got -1"},
      {"bench --threads 100000", "--threads must be an integer in [0, 256], got 100000"},
      {"bench --repeat 1e3", "--repeat must be an integer in [1, 10000], got '1e3'"},
      {"scenes --n 1e12 --out " + d + "/x", "--n must be an integer in [1, 1000000], got '1e12'"},
      {"scenes --n 2000000 --out " + d + "/x", "--n must be an integer in [1, 1000000], got 2000000"},
      {"scenes --n 2 --seed 18446744073709551616 --out " + d + "/x", "--seed must be an integer in [0, 18446744073709551615]"},
      {"calibrate --taus 1 nan", "--taus must be a finite number in [0, 8], got 'nan'"},
      {"run --method 'calibquant:'", "calibquant: ':' must be followed by name=value pairs"},
      {"run --method 'vlcache:budget=0'", "vlcache: budget must be in [0.001, 1], got 0"},
      {"run --method 'vlcache:budget=1e-300'", "vlcache: budget must be in [0.001, 1], got 1e-300"},
      {"bench attention --heads 32 --kv-heads 5", "--kv-heads must divide --heads (32), got 5"},
      {"bench attention --gqa-kernel sometimes", "--gqa-kernel: sometimes not in {auto,on,off}"},
#ifdef KVLENS_HAVE_CUDA
      {"bench attention --heads 32 --kv-heads 2 --gqa-kernel on",
       "--gqa-kernel on: the GQA kernel takes head sizes 32, 64 and 128 and 2 to 8 query heads a KV head; got head "
       "size 128, 32 / 2 heads"},
#endif
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_exit2(c.args, c.message);
  }
  EXPECT_FALSE(fs::exists(d + "/x"));
}

TEST(ReliableNumbers, CliParseErrorsAreOneLineNamingTheOption) {
  expect_exit2("run --no-such-option", "The following argument was not expected: --no-such-option (see kvlens run --help)");
  expect_exit2("scenes --out x", "--n is required (see kvlens scenes --help)");
  expect_exit2("caption --max-new-tokens", "--max-new-tokens");
  const auto help = cli("run --help");
  EXPECT_EQ(help.code, 0);
  // The option's line shows its type and default: CLI11 prints "INT=48" or "INT [48]" by version.
  EXPECT_TRUE(std::regex_search(help.output, std::regex(R"(--max-new-tokens +INT(=| +\[)48\b)"))) << help.output;
}

TEST(ReliableNumbers, SessionNumbersAndVersionsThroughTheCli) {
  const std::string d = kt::make_temp_dir("sess");
  auto session = [&](const std::string& body) {
    kt::write_file(d + "/s.json", body);
    return "run --session " + d + "/s.json";
  };
  expect_exit2(session(R"({"max_new_tokens": 4294967297, "methods": ["full"]})"),
               "max_new_tokens must be an integer in [1, 4096], got 4294967297");
  expect_exit2(session(R"({"kvlens_session": 3, "methods": ["full"]})"),
               "session version 3 is newer than this kvlens reads (version 2)");
  expect_exit2(session(R"({"kvlens_session": "x", "methods": ["full"]})"), "'kvlens_session' must be a version number");
  expect_exit2(session(R"({"methods": [{"method": "calibquant", "params": {"bits": "1,tau1=5"}}]})"),
               "calibquant: bits must be one of 1|2|4|8, got '1,tau1=5'");
}

// ---- images and models ------------------------------------------------------------------------

TEST(ReliableImages, TopDownBmpAndExtremeAspectRatiosCaption) {
  const std::string img = kt::source_dir() + "/tests/fixtures/image/";
  for (const std::string f : {"topdown.bmp", "tall_1x2000.png", "wide_3000x1.png"}) {
    SCOPED_TRACE(f);
    const auto r = cli("caption --max-new-tokens 3 --image " + img + f);
    EXPECT_EQ(r.code, 0) << r.output;
  }
}

TEST(ReliableModels, NanWeightsAreReportedAtTheFirstNonFiniteTensor) {
  const std::string m = copy_fixture("mha_fp32_hub");
  // Poison one weight of text layer 1's MLP with NaN, in place in the safetensors file.
  const std::string path = m + "/model.safetensors";
  std::string bytes = kt::read_file(path);
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, hlen));
  const auto& t = header.at("language_model.model.layers.1.mlp.down_proj.weight");
  ASSERT_EQ(t["dtype"], "F32");
  const size_t at = 8 + hlen + t["data_offsets"][0].get<size_t>();
  const float nan = std::nanf("");
  std::memcpy(&bytes[at], &nan, 4);
  kt::write_file(path, bytes);
  expect_exit2("caption --max-new-tokens 2 --model " + m,
               m + ": text layer 1 output (prefill) is not finite");
  const auto r = cli("caption --max-new-tokens 2 --model " + m);
  EXPECT_NE(r.output.find("the checkpoint's weights hold NaN or Inf"), std::string::npos) << r.output;
}

// Inputs the image fuzzer found that made stb_image read or write out of bounds: refused
// before the decoder sees them.
TEST(ReliableImages, FuzzerFindingsAreRefusedBeforeDecoding) {
  const std::string dir = kt::source_dir() + "/tests/fuzz/corpus/fuzz_image/";
  const std::string jpeg = dir + "regress_jpeg_huffman_257.jpg", pnm = dir + "regress_pnm16.pnm";
  // libjpeg says "Bogus Huffman table definition"; without it, kvlens's own check before stb_image
  // says how many codes the table lists.
  expect_exit2("caption --image " + jpeg, "Huffman table");
  expect_exit2("caption --image " + pnm, pnm + ": 16-bit PNM (maxval 789) is not supported");
  expect_exit2("caption --image " + dir + "regress_pnm_header_overflow.pgm", "PNM header holds a number larger than 2147483647");
  // Fill bytes before the start-of-image marker: no JPEG to libjpeg (and PIL), which needs FF D8 FF
  // at the start, so refused as such; a JPEG to stb_image, whose input is checked first (the
  // second file's Huffman header is cut off by the end of the file, its counts exceed 256).
#ifdef KVLENS_HAVE_LIBJPEG
  for (const char* f : {"regress_jpeg_fill_before_soi.jpg", "regress_jpeg_huffman_cut_counts.jpg"})
    expect_exit2("caption --image " + dir + f, "without the JPEG signature FF D8 FF");
#else
  expect_exit2("caption --image " + dir + "regress_jpeg_fill_before_soi.jpg", "a Huffman table lists 299 codes");
  expect_exit2("caption --image " + dir + "regress_jpeg_huffman_cut_counts.jpg", "a Huffman table lists 537 codes");
#endif
  // Every regression input kept in the corpus is refused in one line naming it.
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().string();
    if (e.path().filename().string().rfind("regress_", 0) != 0) continue;
    SCOPED_TRACE(f);
    expect_exit2("caption --image " + f, f + ": ");
    ++n;
  }
  EXPECT_GE(n, 4);
}

TEST(ReliableImages, PaddingAnElongatedImageIsRefusedBeforeAllocating) {
  // LLaVA's pad to square turns a 1x9000 image into a 9000x9000 canvas (243 MB); past the
  // pixel limit it is refused naming the image, not allocated.
  kvlens::RGBImage img;
  img.width = 1;
  img.height = 9000;
  img.data.assign(9000 * 3, 7);
  img.source = "tall.png";
  kvlens::PreprocessConfig cfg;
  cfg.pad_to_square = true;
  EXPECT_NE(error_of([&] { kvlens::preprocess(img, cfg); })
                .find("tall.png: padding the 1x9000 image to a square gives 9000x9000 pixels"),
            std::string::npos);
  cfg.pad_to_square = false;
  EXPECT_EQ(kvlens::preprocess(img, cfg).shape, (std::vector<int64_t>{3, 224, 224}));
}
