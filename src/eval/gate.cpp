#include "kvq/eval/gate.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvq::eval {

namespace {
std::string fmt_pct(double v, bool sign) {
  char b[64];
  std::snprintf(b, sizeof b, sign ? "%+.2f%%" : "%.2f%%", v);
  return b;
}
}  // namespace

Result<double> parse_gate_pct(std::string_view s) {
  std::string t(s);
  while (!t.empty() && t.back() == ' ') t.pop_back();
  if (!t.empty() && t.back() == '%') t.pop_back();
  if (t.empty()) return invalid_argument("--gate needs a percentage such as 3% (got '" + std::string(s) + "')");
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || !std::isfinite(v) || v < 0)
    return invalid_argument("--gate must be a non-negative percentage such as 3% or 0.5 (got '" +
                            std::string(s) + "')");
  return v;
}

GateVerdict gate_verdict(double d, double gate) {
  if (std::isnan(d)) return {false, "dPPL is NaN (non-finite logits) -> fails gate " + fmt_pct(gate, false)};
  if (d > gate) return {false, "dPPL " + fmt_pct(d, true) + " > gate " + fmt_pct(gate, false)};
  return {true, "dPPL " + fmt_pct(d, true) + " <= gate " + fmt_pct(gate, false)};
}

void apply_gate(std::vector<SpecResult>& results, double gate) {
  for (auto& r : results) {
    if (!r.error.empty()) {
      r.gate_pass = false;
      r.gate_note = "not evaluated: " + r.error;
    } else if (r.is_baseline) {
      r.gate_pass = true;
      r.gate_note = "baseline";
    } else {
      GateVerdict v = gate_verdict(r.delta_ppl_pct, gate);
      r.gate_pass = v.pass;
      r.gate_note = v.note;
    }
  }
}

bool same_cache(const QuantSpec& a, const QuantSpec& b) {
  if (a.rotation != b.rotation || a.plane_formats != b.plane_formats || a.outliers != b.outliers) return false;
  if (!a.mixed() && a.format != b.format) return false;
  if (!a.quantized()) return true;
  return a.granularity == b.granularity && a.scale_dtype == b.scale_dtype && a.block_size == b.block_size &&
         a.sink_tokens == b.sink_tokens && a.recent_tokens == b.recent_tokens;
}

std::vector<QuantSpec> auto_fallback_chain(const QuantSpec& settings, Format first) {
  std::vector<QuantSpec> chain;
  auto add = [&](Format f) {
    QuantSpec s = settings;
    s.format = f;
    s.from_auto = true;
    chain.push_back(s);
  };
  if (first != Format::kInt8 && first != Format::kBf16) add(first);
  if (first != Format::kBf16) add(Format::kInt8);
  add(Format::kBf16);
  return chain;
}

AutoStep auto_step(const std::vector<QuantSpec>& chain,
                   const std::function<const SpecResult*(const QuantSpec&)>& find, double gate) {
  AutoStep step;
  for (size_t i = 0; i < chain.size(); ++i) {
    const QuantSpec& c = chain[i];
    const SpecResult* r = find(c);
    if (!r) {
      step.index = i;
      return step;
    }
    const bool last = i + 1 == chain.size();
    std::string name = format_name(c.format);
    if (!r->error.empty()) {
      step.notes.push_back("auto: " + name + " could not run (" + r->error + ")" +
                           (last ? "" : " -> falling back to " + std::string(format_name(chain[i + 1].format))));
    } else {
      GateVerdict v = r->is_baseline ? GateVerdict{true, "the bf16 baseline"} : gate_verdict(r->delta_ppl_pct, gate);
      if (v.pass) {
        step.decided = true;
        step.index = i;
        step.notes.push_back("auto: chose " + name + " (" + v.note + ")");
        return step;
      }
      step.notes.push_back("auto: " + name + " " + v.note +
                           (last ? "" : " -> falling back to " + std::string(format_name(chain[i + 1].format))));
    }
    if (last) {
      // Nothing passed, not even the final candidate: keep it, it is the safest there is.
      step.decided = true;
      step.index = i;
      step.notes.push_back("auto: no candidate passed; keeping " + name);
      return step;
    }
  }
  step.decided = true;  // empty chain: nothing to do
  return step;
}

}  // namespace kvq::eval
