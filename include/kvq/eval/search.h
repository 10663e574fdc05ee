#pragma once
// `kvq eval --search --budget-kl X`: a per-layer, per-K/V cache config that keeps the mean KL
// against the bf16 cache within a budget with the fewest bytes.
//
// 1. Sensitivity: for every plane (layer l, K or V) and candidate format f, one eval lane stores
//    that plane in f and every other plane in bf16; its mean KL vs the bf16 cache, less the KL of
//    the all-bf16 lane with the same global settings (the floor: a rotation alone moves bf16
//    rounding), is kl[plane][f]. The floor is common to every lane, so it is counted once.
// 2. Choice: assuming the planes' errors add up (total KL ~ sum of the planes' KLs: small,
//    independent perturbations of the logits, to first order), pick one option per plane (bf16 at
//    KL 0, or a candidate) minimising bytes per page subject to sum KL <= budget. That is a
//    multiple-choice knapsack, solved exactly by dynamic programming over byte totals.
// 3. Verification: a real eval of the chosen mix (and, once, of each candidate stored uniformly,
//    for comparison). When the measured KL exceeds the budget (the planes interact, or the
//    verification windows are longer than the sensitivity ones), the choice is redone against a
//    budget scaled by budget / measured (which upgrades the planes that buy back the most KL per
//    byte) and verified again, at most `max_rounds` times in all.
#include <cstddef>
#include <string>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/eval/eval.h"

namespace kvq::eval {

// Quantized formats the cache can store now, one per storage size and kind (fp8_fnuz is left out:
// it costs what fp8_e4m3 costs and measures the same).
std::vector<Format> default_search_formats();

// The pure choice of step 2. kl[p][o] is plane p's KL with option o; bytes[o] the bytes per page of
// one plane in option o (every plane has the same shape). Option 0 must be the lossless one
// (kl 0). `feasible` is false when even all-option-0 misses the budget (a negative budget).
struct MixChoice {
  std::vector<int> option;  // [plane]
  double predicted_kl = 0;
  size_t bytes_per_page = 0;  // sum over planes
  bool feasible = false;
};
MixChoice choose_mix(const std::vector<std::vector<double>>& kl, const std::vector<size_t>& bytes, double budget);

struct SearchOptions {
  QuantSpec base;                 // global settings: granularity, block, sink, rotation
  std::vector<Format> candidates; // quantized formats to try (default_search_formats())
  double budget_kl = 2e-3;
  EvalOptions sensitivity;        // windows of the per-plane runs (short: 2 * layers * candidates lanes)
  EvalOptions verify;             // windows of the verification runs
  int max_rounds = 3;             // verification runs of the mix, at most
  int lanes_per_pass = 32;        // sensitivity lanes forwarded together (each holds an engine)
};

struct SearchRound {
  double target_kl = 0;     // budget the choice was made against (floor included)
  double predicted_kl = 0;  // sum of the chosen planes' sensitivity KLs
  SpecResult measured;      // the verification run
};

struct SearchReport {
  std::string model_name;
  int num_layers = 0;
  std::vector<Format> candidates;
  std::vector<std::vector<double>> plane_kl;  // [2 * layer + kv][candidate], floor included
  double floor_kl = 0;  // every plane bf16 with the same global settings (rotation, sink)
  double budget_kl = 0;
  std::vector<SearchRound> rounds;
  QuantSpec chosen;                     // the last round's mix
  bool met = false;                     // its measured KL is within the budget
  SpecResult baseline;                  // bf16, verification windows
  std::vector<SpecResult> uniform;      // each candidate on every plane, verification windows
  int sens_ctx = 0, verify_ctx = 0, sens_windows = 0, verify_windows = 0;
  double seconds = 0;
};

Result<SearchReport> run_search(const model::Model& model, const std::vector<int32_t>& text_ids,
                                const SearchOptions& opts, const ProgressFn& progress = {});

// Human-readable summary: sensitivity table, rounds, the mix vs uniform formats.
std::string format_search(const SearchReport& r);
// Extra keys for the config file (quant/layer_config.h's kv_config_json): budget, predicted and
// measured KL, bytes per token of the mix and of the uniform formats.
std::string search_json_extra(const SearchReport& r);

}  // namespace kvq::eval
