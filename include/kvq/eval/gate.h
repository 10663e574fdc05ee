#pragma once
// The accuracy gate and `--kv-cache-dtype auto`: a spec whose perplexity rises by more than the
// threshold fails, and auto walks fp8 -> int8 -> bf16 until a spec passes.
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/eval/results.h"
#include "kvq/quant/spec.h"

namespace kvq::eval {

// "3%", "3" and "0.5%" are percentages of perplexity increase; must be finite and >= 0.
Result<double> parse_gate_pct(std::string_view s);

struct GateVerdict {
  bool pass = false;
  std::string note;  // e.g. "dPPL +4.12% > gate 3.00%"
};
// A NaN delta (a run that produced NaN logits) fails.
GateVerdict gate_verdict(double delta_ppl_pct, double gate_pct);
// Sets gate_pass/gate_note on every row: the baseline passes, rows with an error fail.
void apply_gate(std::vector<SpecResult>& results, double gate_pct);

// Two specs that store the cache identically (an unquantized cache ignores scale options and sink).
bool same_cache(const QuantSpec& a, const QuantSpec& b);

// The candidates auto tries, best compression first: `first` (fp8 flavour or int8), then int8,
// then bf16, each with `settings`' granularity, scale dtype, block size and sink.
std::vector<QuantSpec> auto_fallback_chain(const QuantSpec& settings, Format first = Format::kFp8E4m3);

struct AutoStep {
  bool decided = false;
  size_t index = 0;                // chain index: chosen (decided) or to evaluate next (!decided)
  std::vector<std::string> notes;  // why each earlier candidate was passed over, and the choice
};
// One step of auto's walk down `chain`, given the results found so far (`find` returns null for a
// spec not evaluated yet). Called again after each evaluation until decided.
AutoStep auto_step(const std::vector<QuantSpec>& chain,
                   const std::function<const SpecResult*(const QuantSpec&)>& find, double gate_pct);

}  // namespace kvq::eval
