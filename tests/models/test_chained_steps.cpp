// Chained greedy decode steps (Backend::chains_steps): the device's next_token against
// std::max_element (the host's greedy pick, models/llava.cpp), readbacks that carry their own
// step's logits, token and finiteness checks, and dropping a step launched ahead. The model end
// to end, chained against unchained, is in test_cuda_model.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/errors.h"
#include "tests/op_harness.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();

// The greedy pick of models/llava.cpp's sample().
int host_greedy(const std::vector<float>& x) {
  return static_cast<int>(std::max_element(x.begin(), x.end()) - x.begin());
}

// next_token on `x`: the token left in ids and the position left in pos (from 41).
std::pair<int, int> device_next(Backend& be, const std::vector<float>& x) {
  Buffer L = make(be, "logits", {1, static_cast<int64_t>(x.size())}, Dt::F32, x);
  Buffer ids = make_ids(be, "ids", {-7}), pos = make_ids(be, "pos", {41});
  be.next_token(L, ids, pos);
  int32_t t = 0, p = 0;
  be.download(ids, &t);
  be.download(pos, &p);
  return {t, p};
}

}  // namespace

TEST(ChainedSteps, TheCpuBackendDoesNotChain) {
  Backend& cpu = *op_backends().cpu;
  EXPECT_FALSE(cpu.chains_steps());
  Buffer L = make(cpu, "logits", {1, 3}, Dt::F32, {1, 2, 3});
  Buffer ids = make_ids(cpu, "ids", {0}), pos = make_ids(cpu, "pos", {0});
  EXPECT_THROW(cpu.next_token(L, ids, pos), InternalError);
  EXPECT_THROW(cpu.start_readback(L, ids), InternalError);
}

TEST(ChainedSteps, NextTokenIsTheHostsGreedyPick) {
  KVLENS_NEED_GPU();
  Backend& be = *op_backends().gpu;
  ASSERT_TRUE(be.chains_steps());
  std::vector<std::pair<std::string, std::vector<float>>> cases;
  for (int n : {1, 7, 1000, 1023, 1025, 32064 + 5}) {
    auto x = randn(static_cast<size_t>(n), 4.0f);
    cases.push_back({"random n=" + std::to_string(n), x});
    if (n < 7) continue;
    // The largest value twice, the later copy in a lower thread's stride: the first one wins.
    const int a = n / 3 + 1, b = n / 2 + 2;
    const float top = *std::max_element(x.begin(), x.end()) + 1.0f;
    x[a] = top, x[b] = top;
    cases.push_back({"tie n=" + std::to_string(n), x});
    auto y = x;
    y[0] = kNan;  // a NaN first value is kept by std::max_element
    cases.push_back({"NaN first n=" + std::to_string(n), y});
    y = x;
    y[a - 1] = kNan, y[n - 1] = kNan;  // NaN elsewhere is never larger
    cases.push_back({"NaN inside n=" + std::to_string(n), y});
    y = x;
    y[n - 1] = kInf;
    cases.push_back({"+inf last n=" + std::to_string(n), y});
  }
  cases.push_back({"signed zeros", {-1.0f, -0.0f, 0.0f, -0.0f}});
  cases.push_back({"all equal", std::vector<float>(3001, 0.25f)});
  cases.push_back({"all -inf", std::vector<float>(77, -kInf)});
  cases.push_back({"all NaN", std::vector<float>(77, kNan)});
  for (const auto& [name, x] : cases) {
    const auto [tok, pos] = device_next(be, x);
    EXPECT_EQ(tok, host_greedy(x)) << name;
    EXPECT_EQ(pos, 42) << name;
  }
}

// Two steps in flight, as the chained decode loop keeps them: each readback returns its own
// step's logits and token and raises only its own step's failed checks, in ticket order.
TEST(ChainedSteps, ReadbacksCarryTheirOwnStep) {
  KVLENS_NEED_GPU();
  Backend& be = *op_backends().gpu;
  const int K = 264, N = 1003;
  const Dt dt = Dt::F16;
  const auto w = rounded(dt, randn(static_cast<size_t>(N) * K, 0.05f)), g = randn(K);
  HostTensor wt;
  std::vector<uint16_t> wh;
  for (float v : w) wh.push_back(quant::to_half(v));
  wt.name = "w", wt.dt = dt, wt.shape = {N, K}, wt.data = wh.data();
  Buffer W = be.matrix("w", {wt}), G = make(be, "g", {K}, Dt::F32, g);
  Buffer X = be.alloc("x", {1, K}, dt), Y = poisoned(be, "y", {1, N}, Dt::F32);
  Buffer ids = make_ids(be, "ids", {0}), pos = make_ids(be, "pos", {5});
  // A step: logits y from h (checked under `name`), the greedy token, the readback.
  auto step = [&](const std::vector<float>& h, const std::string& name, std::vector<float>* logits) {
    Buffer H = make(be, "h", {1, K}, Dt::F32, h);
    be.norm_linear(H, G, 1e-5f, X, W, nullptr, Y, &name);
    if (logits) *logits = read(be, Y);  // (synchronous: what the readback must return)
    be.next_token(Y, ids, pos);
    return be.start_readback(Y, ids);
  };
  auto h0 = randn(K, 2.0f), h1 = randn(K, 2.0f), h2 = randn(K, 2.0f);
  h1[17] = kInf;
  std::vector<float> y0, y1;
  const int t0 = step(h0, "step 0 output", &y0);
  const int t1 = step(h1, "step 1 output", nullptr);
  std::vector<float> got(N, kNan);
  int32_t tok = -1;
  EXPECT_THROW(be.finish_readback(t1, got.data(), &tok), InternalError) << "tickets finish in order";
  be.finish_readback(t0, got.data(), &tok);
  ASSERT_EQ(got, y0) << "step 0's logits, not step 1's";
  EXPECT_EQ(tok, host_greedy(y0));
  std::string msg;
  try {
    be.finish_readback(t1, got.data(), &tok);
  } catch (const NonFiniteError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("step 1 output is not finite"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at index 17)"), std::string::npos) << msg;
  // A step launched ahead and dropped: its failed check is not raised later, and the next
  // readback starts clean.
  auto bad = randn(K, 2.0f);
  bad[3] = kNan;
  step(bad, "dropped step output", nullptr);
  be.drop_readbacks();
  EXPECT_NO_THROW(be.finish_checks());
  const int t2 = step(h2, "step 2 output", &y1);
  be.finish_readback(t2, got.data(), &tok);
  EXPECT_EQ(got, y1);
  EXPECT_EQ(tok, host_greedy(y1));
  int32_t p = 0;
  be.download(pos, &p);
  EXPECT_EQ(p, 5 + 4) << "four next_token calls";
}
