// Captions panel: the full cache's caption, and each instance's with the words that differ from
// it highlighted (the full cache's words in their place on hover, dropped words marked) and the
// first divergence marked (both tokens and probabilities on hover), its
// KV bytes and ratio to the fp16 full cache, softmax MSE, and compression and decode time.
#include <algorithm>
#include <cstdio>

#include "app/gui/caption_diff.h"
#include "app/gui/panels.h"
#include "app/figures/figures.h"

namespace kvlens::gui {

namespace {

// Wrapped words; differing ones on a red background (hover: what the full cache said there), a
// red bar where the full cache had words this caption dropped (before a word, or after the last),
// the word holding the first differing token underlined, with `tip` shown when it is hovered.
// Where the row's first differing word and its underlined word lie goes to st.drawn
// ("caption_diff.<row>", "caption_diverge.<row>") and a hovered word's tooltip to
// st.hover_readout, so that scripts can point at them.
void draw_words(const std::vector<std::string>& words, const std::vector<WordDiff>& diff, int diverge_word,
                const std::string& tip, State& st, const std::string& row) {
  bool marked_diff = false;
  if (!row.empty()) {  // (this frame's places only)
    st.drawn.erase("caption_diff." + row);
    st.drawn.erase("caption_diverge." + row);
  }
  ImDrawList* dl = ImGui::GetWindowDrawList();
  const float right = ImGui::GetCursorScreenPos().x + ImGui::GetContentRegionAvail().x;
  const float space = ImGui::CalcTextSize(" ").x;
  for (size_t i = 0; i < words.size(); ++i) {
    const ImVec2 sz = ImGui::CalcTextSize(words[i].c_str());
    if (i > 0) {
      ImGui::SameLine(0, space);
      if (ImGui::GetCursorScreenPos().x + sz.x > right) ImGui::NewLine();
    }
    const ImVec2 p = ImGui::GetCursorScreenPos();
    const WordDiff* w = i < diff.size() ? &diff[i] : nullptr;
    if (w && w->differs)
      dl->AddRectFilled(ImVec2(p.x - 1, p.y), ImVec2(p.x + sz.x + 1, p.y + sz.y), IM_COL32(246, 180, 180, 255), 2);
    if (w && !w->dropped.empty())
      dl->AddLine(ImVec2(p.x - space / 2, p.y), ImVec2(p.x - space / 2, p.y + sz.y), IM_COL32(200, 30, 30, 255), 2);
    ImGui::TextUnformatted(words[i].c_str());
    const bool diverges = static_cast<int>(i) == diverge_word;
    if (w && !w->dropped_after.empty())
      dl->AddLine(ImVec2(p.x + sz.x + space / 2, p.y), ImVec2(p.x + sz.x + space / 2, p.y + sz.y), IM_COL32(200, 30, 30, 255), 2);
    if (diverges) dl->AddLine(ImVec2(p.x, p.y + sz.y), ImVec2(p.x + sz.x, p.y + sz.y), IM_COL32(200, 30, 30, 255), 2);
    if (!row.empty() && diverges) st.drawn["caption_diverge." + row] = {p.x, p.y, sz.x, sz.y};
    if (!row.empty() && w && (w->differs || !w->dropped.empty()) && !marked_diff) {
      st.drawn["caption_diff." + row] = {p.x, p.y, sz.x, sz.y};
      marked_diff = true;
    }
    if (!ImGui::IsItemHovered()) continue;  // (the tooltip's text only for the word under the mouse)
    std::vector<std::string> lines;
    if (diverges) lines.push_back(tip);
    if (w && w->differs)
      lines.push_back(w->replaced.empty() ? "added: the full cache has no words here"
                                          : "the full cache says here: \"" + w->replaced + "\"");
    if (w && !w->dropped.empty()) lines.push_back("dropped before this word: \"" + w->dropped + "\"");
    if (w && !w->dropped_after.empty()) lines.push_back("dropped after this word: \"" + w->dropped_after + "\"");
    std::string hover;
    for (const std::string& l : lines) hover += (hover.empty() ? "" : "\n") + l;
    if (!hover.empty()) ImGui::SetTooltip("%s", hover.c_str());
    st.hover_readout = lines;
  }
}

}  // namespace

void captions_panel(App& app, Ui&, const PanelRect& rect) {
  if (!begin_panel("Captions", rect)) {
    ImGui::End();
    return;
  }
  const Snapshot* s = app.st.results.get();
  if (!s || !s->base || !s->report) {
    no_results(app, "computing the full cache…", "no results");
    ImGui::End();
    return;
  }
  const nlohmann::json& rep = *s->report;
  const std::string full = rep["full"]["caption"].get<std::string>();
  const std::vector<std::string> fw = caption_words(full);
  const double full_bytes = rep["full"]["bytes_fp16"]["total"].get<double>();
  const ImGuiTableFlags flags = ImGuiTableFlags_RowBg | ImGuiTableFlags_BordersInnerH | ImGuiTableFlags_ScrollY |
                                ImGuiTableFlags_SizingStretchProp | ImGuiTableFlags_Resizable;
  if (ImGui::BeginTable("##captions", 3, flags)) {
    ImGui::TableSetupScrollFreeze(0, 1);
    const char* headers[] = {"method", "caption (differences highlighted)", "KV bytes · MSE · time"};
    ImGui::TableSetupColumn(headers[0], ImGuiTableColumnFlags_WidthStretch, 0.2f);
    ImGui::TableSetupColumn(headers[1], ImGuiTableColumnFlags_WidthStretch, 0.56f);
    ImGui::TableSetupColumn(headers[2], ImGuiTableColumnFlags_WidthStretch, 0.24f);
    // The headers, each shown whole on hover where its column cuts it.
    ImGui::TableNextRow(ImGuiTableRowFlags_Headers);
    for (int c = 0; c < 3; ++c) {
      ImGui::TableSetColumnIndex(c);
      const float room = ImGui::GetContentRegionAvail().x;
      ImGui::TableHeader(headers[c]);
      cut_if_wider(app, headers[c], room);
    }
    // Where each row lies and what the table shows of them (for scripted checks): a row's top
    // when it starts, its bottom the lowest of its columns' ends.
    const ImVec2 view_at = ImGui::GetWindowPos(), view_size = ImGui::GetWindowSize();
    app.st.drawn["captions_view"] = {view_at.x, view_at.y, view_size.x, view_size.y};
    float row_top = 0, row_bottom = 0;
    auto row_start = [&] { row_top = row_bottom = ImGui::GetCursorScreenPos().y; };
    auto column_end = [&] { row_bottom = std::max(row_bottom, ImGui::GetCursorScreenPos().y); };
    auto row_end = [&](const std::string& key) {
      column_end();
      app.st.drawn["caption row " + key] = {view_at.x, row_top, view_size.x, row_bottom - row_top};
    };
    ImGui::TableNextRow();
    ImGui::TableNextColumn();
    row_start();
    ImGui::TextUnformatted("full cache");
    ImGui::TableNextColumn();
    draw_words(fw, {}, -1, "", app.st, "");
    column_end();
    ImGui::TableNextColumn();
    char fb[64];
    std::snprintf(fb, sizeof fb, "%.0f KiB fp16 (1×)", full_bytes / 1024);
    fitted_text(app, fb);
    std::snprintf(fb, sizeof fb, "decode %.0f ms", rep["timings_ms"]["decode"].get<double>());
    fitted_text(app, fb, true);
    row_end("full");
    for (size_t i = 0; i < s->runs.size(); ++i) {
      const RunResult& r = s->runs[i];
      const auto& m = rep["methods"][i];
      const MethodInstance* inst = app.find(r.id);
      ImGui::PushID(r.id);
      ImGui::TableNextRow();
      ImGui::TableNextColumn();
      row_start();
      const bool stale = !app.result(r.id);
      if (fitted_selectable(app, inst ? app.display_name(*inst) : m["short_spec"].get<std::string>(),
                            app.st.views.method == r.id))
        app.st.views.method = r.id;
      if (stale) ImGui::TextDisabled("updating…");
      column_end();
      ImGui::TableNextColumn();
      const std::string cap = m["caption"].get<std::string>();
      const std::vector<std::string> mw = caption_words(cap);
      int dword = -1;
      std::string tip;
      const auto& d = m["first_divergence"];
      const int pos = d["position"].get<int>();
      if (pos >= 0) {
        // The word that holds the first differing token: count the words before it, and
        // whether that token starts a new word (SentencePiece marks word starts with "▁").
        const std::string mark = "\xe2\x96\x81";
        std::string prefix;
        for (int t = 0; t < pos && t < static_cast<int>(r.pieces.size()); ++t) prefix += r.pieces[t];
        for (size_t at; (at = prefix.find(mark)) != std::string::npos;) prefix.replace(at, mark.size(), " ");
        const int before = static_cast<int>(caption_words(prefix).size());
        // (a byte-level BPE piece starts a word with its space)
        const std::string mp = d["method_piece"].get<std::string>();
        const bool starts_word = mp.rfind(mark, 0) == 0 || mp.rfind(" ", 0) == 0 || before == 0;
        dword = std::clamp(starts_word ? before : before - 1, 0, std::max(0, static_cast<int>(mw.size()) - 1));
        tip = "first divergence at generated token " + std::to_string(pos) + ":\nfull cache '" +
              d["full_piece"].get<std::string>() + "' (p = " + fig::format_value(d["full_prob"].get<double>()) + ")\n" +
              "this method '" + mp + "' (p = " +
              fig::format_value(d["method_prob"].get<double>()) + ")";
      }
      draw_words(mw, caption_word_diff(fw, mw), dword, tip, app.st, std::to_string(r.id));
      if (pos >= 0) {
        ImGui::TextDisabled("↳ diverges at token %d", pos);
        if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", tip.c_str());
      }
      column_end();
      ImGui::TableNextColumn();
      char b[96];
      std::snprintf(b, sizeof b, "%.0f KiB (%.2f×)", m["bytes_after_prefill"]["total"].get<double>() / 1024,
                    m["compression_vs_fp16"].get<double>());
      fitted_text(app, b);
      fitted_text(app, "MSE " + fig::format_value(m["mean_softmax_mse"].get<double>()));
      std::snprintf(b, sizeof b, "compress %.1f ms", m["timings_ms"]["compress"].get<double>());
      fitted_text(app, b, true);
      std::snprintf(b, sizeof b, "decode %.0f ms", m["timings_ms"]["decode"].get<double>());
      fitted_text(app, b, true);
      row_end(std::to_string(r.id));
      ImGui::PopID();
    }
    for (const auto& [id, e] : s->run_errors) {
      ImGui::TableNextRow();
      ImGui::TableNextColumn();
      const MethodInstance* inst = app.find(id);
      ImGui::TextUnformatted(inst ? app.display_name(*inst).c_str() : "worker");
      ImGui::TableNextColumn();
      ImGui::PushTextWrapPos(0);
      ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "%s", e.c_str());
      ImGui::PopTextWrapPos();
    }
    ImGui::EndTable();
  }
  ImGui::End();
}

}  // namespace kvlens::gui
