// A checkpoint's chat template rendered as HF transformers renders it: Jinja2 with trim_blocks,
// lstrip_blocks and loop controls, HF's raise_exception, tojson and strftime_now, over the subset
// of Jinja2 that chat templates use (if / elif / else, for with loop.*, set and namespace
// attributes, the {% generation %} block, comments, whitespace control; expressions with
// filters, tests, subscripts, slices and string / dict methods). The app keeps it beside the
// tokenizer: rendered with the user's prompt as one message, it is a model's default template.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace kvlens {

// Renders `tmpl` with the variables of `context` (messages, add_generation_prompt, bos_token,
// ...). Throws InputError naming `where`, the line and what could not be parsed or evaluated
// (raise_exception's message among them).
std::string render_chat_template(const std::string& tmpl, const nlohmann::ordered_json& context, const std::string& where);

}  // namespace kvlens
