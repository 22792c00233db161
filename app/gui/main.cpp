// kvlens-gui: the desktop lab. Init, main loop and shutdown follow Dear ImGui's
// example_glfw_opengl3 (GLFW window, OpenGL 3.3 core context, ImGui with its GLFW and OpenGL3
// backends); the panels live in their own files and the model runs only on the worker thread.
//
//   kvlens-gui [--session FILE | --image FILE --model DIR] [--no-seed-methods]
//   kvlens-gui --script steps.json [--screenshot out.png]    (headless runs, see script.h)
//
// Where no display can be opened (no X server), an interactive start runs `kvlens demo`, the
// CLI demo, instead.
#include <imgui.h>
#include <backends/imgui_impl_glfw.h>
#include <backends/imgui_impl_opengl3.h>
#include <unistd.h>
#include <GLFW/glfw3.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "app/cli/defaults.h"
#include "app/gui/app.h"
#include "app/gui/panels.h"
#include "app/gui/script.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/data/image.h"
#include "core/numbers.h"
#include "core/parallel.h"

namespace {

const char* kFont = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

void glfw_error(int code, const char* text) { std::fprintf(stderr, "kvlens-gui: GLFW error %d: %s\n", code, text); }

// The CLI demo, for machines without a display: the kvlens binary next to this one.
int run_cli_demo(const char* why) {
  std::fprintf(stderr, "kvlens-gui: %s; running the CLI demo (kvlens demo) instead\n", why);
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::string dir = ".";
  if (n > 0) {
    self[n] = '\0';
    dir = self;
    dir = dir.substr(0, dir.rfind('/'));
  }
  const std::string cli = dir + "/kvlens";
  ::execl(cli.c_str(), cli.c_str(), "demo", static_cast<char*>(nullptr));
  std::fprintf(stderr, "kvlens-gui: cannot run %s\n", cli.c_str());
  return 1;
}

// DejaVu Sans with Latin, Greek (τ, γ, δ, α, β, ψ), punctuation (…, ‖), superscripts (10⁻⁴ on
// log axes), arrows, math (√, ≤, −), and block elements (SentencePiece's ▁).
void load_fonts(ImGuiIO& io, float size) {
  static const ImWchar extra[] = {0x0370, 0x03FF, 0x2000, 0x206F, 0x2070, 0x209F, 0x2190, 0x21FF,
                                  0x2200, 0x22FF, 0x2580, 0x259F, 0};
  ImFontGlyphRangesBuilder b;
  b.AddRanges(io.Fonts->GetGlyphRangesDefault());
  b.AddRanges(extra);
  static ImVector<ImWchar> ranges;  // must outlive the atlas build
  b.BuildRanges(&ranges);
  ImFontConfig cfg;
  cfg.OversampleH = 2;
  if (!kvlens::file_exists(kFont) || !io.Fonts->AddFontFromFileTTF(kFont, size, &cfg, ranges.Data)) {
    static bool told = false;
    if (!told) std::fprintf(stderr, "kvlens-gui: %s not found (fonts-dejavu-core); Greek letters will not show\n", kFont);
    told = true;
    ImFontConfig d;
    d.SizePixels = 13.0f * size / 16.0f;
    io.Fonts->AddFontDefault(&d);
  }
}

void style() {
  ImGui::StyleColorsLight();
  ImGuiStyle& s = ImGui::GetStyle();
  s.WindowRounding = 0;
  s.FrameRounding = 3;
  s.GrabRounding = 3;
  s.WindowPadding = ImVec2(8, 6);
  s.ItemSpacing = ImVec2(6, 5);
  s.Colors[ImGuiCol_WindowBg] = ImVec4(0.975f, 0.975f, 0.98f, 1);
  s.Colors[ImGuiCol_TitleBg] = s.Colors[ImGuiCol_TitleBgActive] = ImVec4(0.80f, 0.85f, 0.92f, 1);
  // A slider's value is printed across its frame: a thin, translucent handle keeps it readable
  // ("opacity 0.60", "layer 1") wherever the handle sits.
  s.GrabMinSize = 5;
  s.Colors[ImGuiCol_SliderGrab] = ImVec4(0.26f, 0.52f, 0.90f, 0.45f);
  s.Colors[ImGuiCol_SliderGrabActive] = ImVec4(0.20f, 0.45f, 0.85f, 0.65f);
}

void screenshot(GLFWwindow* w, const std::string& path) {
  int fw = 0, fh = 0;
  glfwGetFramebufferSize(w, &fw, &fh);
  kvlens::RGBImage img;
  img.width = fw;
  img.height = fh;
  std::vector<uint8_t> px(static_cast<size_t>(fw) * fh * 3);
  glPixelStorei(GL_PACK_ALIGNMENT, 1);
  glReadBuffer(GL_BACK);
  glReadPixels(0, 0, fw, fh, GL_RGB, GL_UNSIGNED_BYTE, px.data());
  img.data.resize(px.size());
  const size_t row = static_cast<size_t>(fw) * 3;
  for (int y = 0; y < fh; ++y) std::copy_n(&px[(fh - 1 - y) * row], row, &img.data[y * row]);  // GL rows run upwards
  kvlens::write_png(path, img);
}

void on_drop(GLFWwindow* w, int n, const char** paths) {
  auto* app = static_cast<kvlens::gui::App*>(glfwGetWindowUserPointer(w));
  for (int i = 0; i < n; ++i) {
    const std::string p = paths[i];
    if (p.size() > 5 && p.substr(p.size() - 5) == ".json") app->open_session(p);
    else app->open_image(p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  kvlens::threads_from_environment();
  CLI::App cli{"kvlens-gui: the kvlens desktop lab"};
  std::string script_path, shot_path, session_path, image_path, model_dir, size_text = "1680x1050", scale_text;
  bool no_seed = false;
  cli.add_option("--script", script_path, "Run the steps of this JSON script (headless runs; see app/gui/script.h)");
  cli.add_option("--screenshot", shot_path, "Write a PNG of the window once results are shown, then quit");
  cli.add_option("--session", session_path, "Open this session");
  cli.add_option("--image", image_path, "Open this image (default: the sample image)");
  cli.add_option("--model", model_dir, "Model folder, or an embedded model's name: kvlens-scenes-14m (the default, unless KVLENS_MODEL names another) or kvlens-scenes-6m");
  cli.add_option("--size", size_text, "Window size WIDTHxHEIGHT")->capture_default_str();
  cli.add_option("--ui-scale", scale_text, "UI scale for this run, 0.75 to 2.5 (default: the one View → UI scale saved)");
  cli.add_flag("--no-seed-methods", no_seed, "Start without the four seed methods (calibquant, zipcache, vlcache, lookm)");
  int width = 1680, height = 1050;
  float ui_scale = 0;  // --ui-scale (0: the saved one)
  try {
    cli.parse(argc, argv);
    const size_t x = size_text.find('x');
    if (x == std::string::npos) throw kvlens::InputError("--size must be WIDTHxHEIGHT, got '" + size_text + "'");
    width = static_cast<int>(kvlens::parse_integer(size_text.substr(0, x), "--size width", 640, 8192));
    height = static_cast<int>(kvlens::parse_integer(size_text.substr(x + 1), "--size height", 480, 8192));
    if (!scale_text.empty())
      ui_scale = static_cast<float>(
          kvlens::parse_real(scale_text, "--ui-scale", kvlens::gui::kMinUiScale, kvlens::gui::kMaxUiScale));
  } catch (const CLI::CallForHelp& e) {
    return cli.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "kvlens-gui: error: %s (see kvlens-gui --help)\n", what.c_str());
    return 2;
  } catch (const kvlens::InputError& e) {
    std::fprintf(stderr, "kvlens-gui: error: %s\n", e.what());
    return 2;
  }
  kvlens::gui::Script script;
  bool scripted = false;
  try {
    if (!script_path.empty()) {
      script = kvlens::gui::Script::load(script_path);
      scripted = true;
    } else if (!shot_path.empty()) {
      script = kvlens::gui::Script::screenshot_only(shot_path);
      scripted = true;
    }
    if (!shot_path.empty()) kvlens::check_writable(shot_path, "screenshot");
  } catch (const kvlens::InputError& e) {
    std::fprintf(stderr, "kvlens-gui: error: %s\n", e.what());
    return 2;
  }

  // Setup window
  glfwSetErrorCallback(glfw_error);
  if (!glfwInit()) {
    if (scripted) {
      std::fprintf(stderr, "kvlens-gui: error: no display (run headless under xvfb-run)\n");
      return 2;
    }
    return run_cli_demo("no display can be opened");
  }
  const char* glsl_version = "#version 330";
  glfwWindowHint(GLFW_CONTEXT_VERSION_MAJOR, 3);
  glfwWindowHint(GLFW_CONTEXT_VERSION_MINOR, 3);
  glfwWindowHint(GLFW_OPENGL_PROFILE, GLFW_OPENGL_CORE_PROFILE);
  glfwWindowHint(GLFW_OPENGL_FORWARD_COMPAT, GL_TRUE);
  GLFWwindow* window = glfwCreateWindow(width, height, "kvlens", nullptr, nullptr);
  if (window == nullptr) {
    glfwTerminate();
    if (scripted) {
      std::fprintf(stderr, "kvlens-gui: error: cannot open an OpenGL 3.3 window\n");
      return 2;
    }
    return run_cli_demo("no OpenGL 3.3 window can be opened");
  }
  glfwMakeContextCurrent(window);
  glfwSwapInterval(scripted ? 0 : 1);  // vsync for people; as fast as possible for scripts

  // Setup Dear ImGui context
  IMGUI_CHECKVERSION();
  ImGui::CreateContext();
  ImGuiIO& io = ImGui::GetIO();
  io.IniFilename = nullptr;  // nothing is written behind the user's back
  io.LogFilename = nullptr;
  style();
  ImGui_ImplGlfw_InitForOpenGL(window, true);
  ImGui_ImplOpenGL3_Init(glsl_version);

  int exit_code = 0;
  {
    kvlens::gui::App app(KVLENS_SOURCE_DIR);
    if (ui_scale > 0) {
      app.st.ui_scale = ui_scale;  // this run only: not saved
    } else if (!app.st.ui_scale_saved) {
      // Until a UI scale is chosen, the monitor's content scale (2 on a HiDPI display).
      float xs = 1, ys = 1;
      glfwGetWindowContentScale(window, &xs, &ys);
      app.st.ui_scale = std::clamp(std::max(xs, ys), 1.0f, kvlens::gui::kMaxUiScale);
    }
    float applied_scale = 0;  // the scale the fonts and the style were built for
    kvlens::gui::Ui ui;
    glfwSetWindowUserPointer(window, &app);
    glfwSetDropCallback(window, on_drop);
    app.worker.set_on_publish([] { glfwPostEmptyEvent(); });
    if (!session_path.empty()) {
      app.open_session(session_path);
    } else {
      if (!model_dir.empty()) app.open_model(model_dir);
      if (!image_path.empty()) app.open_image(image_path);
      if (!no_seed) app.add_seed_methods();
      app.submit();
    }
    // Main loop
    auto frame_start = std::chrono::steady_clock::now();
    while (!glfwWindowShouldClose(window)) {
      // Power saving: with nothing to do the loop sleeps until input arrives or the worker
      // reports (it posts an empty event at every stage), and redraws twice a second for the
      // progress bar. The CPU stays with the worker, which matters where the frames are
      // rasterized in software. A script paces its frames as a 60 Hz display would.
      if (scripted && !script.idle()) {
        std::this_thread::sleep_until(frame_start + std::chrono::microseconds(16667));
        glfwPollEvents();
      } else {
        glfwWaitEventsTimeout(0.5);
      }
      frame_start = std::chrono::steady_clock::now();
      app.poll();
      if (scripted) script.before_frame(app);

      // The UI scale: fonts rebuilt at their new size, the style's sizes scaled, figures magnified.
      if (app.st.ui_scale != applied_scale) {
        applied_scale = app.st.ui_scale;
        io.Fonts->Clear();
        load_fonts(io, 16.0f * applied_scale);
        io.Fonts->Build();
        ImGui_ImplOpenGL3_DestroyFontsTexture();
        ImGui_ImplOpenGL3_CreateFontsTexture();
        style();
        ImGui::GetStyle().ScaleAllSizes(applied_scale);
        kvlens::gui::set_figure_scale(applied_scale);
      }
      // Start the Dear ImGui frame
      const auto build_start = std::chrono::steady_clock::now();
      ImGui_ImplOpenGL3_NewFrame();
      ImGui_ImplGlfw_NewFrame();
      if (scripted && app.st.script_pointer)  // (a script's hover: the pointer where it asks)
        io.MousePos = ImVec2(app.st.script_pointer->first, app.st.script_pointer->second);
      ImGui::NewFrame();

      app.st.figures.shown_keys.clear();
      app.st.figures.shown_live.clear();
      kvlens::gui::handle_shortcuts(app);
      kvlens::gui::menu_bar(app, ui);
      const float top = ImGui::GetFrameHeight();
      const kvlens::gui::PanelLayout l = kvlens::gui::layout_panels(io.DisplaySize, top);
      const kvlens::gui::Views views_before = app.st.views;
      app.st.cut_texts.clear();  // (the panels list this frame's)
      app.st.hover_readout.clear();
      kvlens::gui::image_panel(app, ui, l.image);
      kvlens::gui::model_panel(app, ui, l.model);
      kvlens::gui::session_panel(app, ui, l.session);
      kvlens::gui::plots_panel(app, ui, l.plots);
      kvlens::gui::captions_panel(app, ui, l.captions);
      kvlens::gui::calibration_panel(app, ui, l.calibration);
      kvlens::gui::methods_panel(app, ui, l.methods);
      kvlens::gui::link_views(app.st.views, views_before);
      kvlens::gui::status_bar(app, l.status_pos, l.status_size);
      kvlens::gui::log_window(app);
      kvlens::gui::file_dialog(app);

      // Rendering
      ImGui::Render();
      if (app.st.timing.measuring)
        app.st.timing.build_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - build_start).count());
      int display_w, display_h;
      glfwGetFramebufferSize(window, &display_w, &display_h);
      glViewport(0, 0, display_w, display_h);
      glClearColor(0.93f, 0.93f, 0.95f, 1.0f);
      glClear(GL_COLOR_BUFFER_BIT);
      ImGui_ImplOpenGL3_RenderDrawData(ImGui::GetDrawData());
      if (scripted && !script.screenshot_path().empty()) {
        try {
          screenshot(window, script.screenshot_path());
        } catch (const kvlens::InputError& e) {
          app.error(e.what());
        }
        script.screenshot_taken();
      }
      glfwSwapBuffers(window);
      {
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - frame_start).count();
        double& f = app.st.timing.frame_ms;
        f = f > 0 ? 0.9 * f + 0.1 * ms : ms;
      }
      ui.textures.end_frame();
      app.autosave();
      if (scripted && script.failed()) {
        std::fprintf(stderr, "kvlens-gui: script failed: %s\n", script.failure().c_str());
        exit_code = 1;
        break;
      }
      if (app.st.quit || (scripted && script.done())) break;
    }
  }  // the textures go before the GL context

  // Cleanup
  ImGui_ImplOpenGL3_Shutdown();
  ImGui_ImplGlfw_Shutdown();
  ImGui::DestroyContext();

  glfwDestroyWindow(window);
  glfwTerminate();
  return exit_code;
}
