#include <algorithm>
#include <vector>

#include "kernel.h"
#include "kvq/attention/cpu.h"

namespace kvq::attention::cpu {
namespace {

detail::Problem problem_of(const DecodeArgs& a) {
  return {a.geom, a.layer, a.tables, a.num_q_heads, a.softmax_scale};
}

}  // namespace

Status can_implement(const DecodeArgs& args) { return detail::check_problem(problem_of(args), args.q, args.out); }

// The CPU backend owns its scratch; this reports how much decode allocates (two decoded parts of
// the longest sequence plus logits), for parity with the GPU backends' contract.
size_t workspace_size(const DecodeArgs& args) {
  if (args.tables.num_seqs <= 0 || args.tables.seq_lens == nullptr) return 0;
  int max_len = 0;
  for (int s = 0; s < args.tables.num_seqs; ++s) max_len = std::max(max_len, args.tables.seq_lens[s]);
  const size_t per_token = 2 * static_cast<size_t>(std::max(args.geom.head_dim, 0)) + 3;  // k, v, scales, logit
  const size_t accs = 2 * static_cast<size_t>(std::max(args.num_q_heads, 0)) * std::max(args.geom.head_dim, 0);
  return (per_token * static_cast<size_t>(max_len) + accs) * sizeof(float);
}

Status decode(const DecodeArgs& args) {
  const detail::Problem p = problem_of(args);
  KVQ_RETURN_IF_ERROR(detail::check_problem(p, args.q, args.out));
  const int d = p.geom.head_dim, hkv = p.geom.num_kv_heads, group = p.num_q_heads / hkv;
  const detail::TileLoader loader(p);
  detail::PartTile sink_tile, quant_tile, recent_tile;
  std::vector<float> logits;
  detail::Partial sink_part, quant_part, recent_part;
  for (int s = 0; s < p.tables.num_seqs; ++s) {
    const int len = p.tables.seq_lens[s], sink = p.tables.sink_lens[s];
    // Main tokens from `coded` on are read from their bf16 twins (the query sits at len - 1).
    const int coded = cache::recent_first_main(len - 1, sink, len - sink, p.geom.recent_tokens);
    for (int g = 0; g < hkv; ++g) {
      // One kv head's tiles serve its whole GQA group, as one CTA does on the GPU.
      loader.load_sink(s, g, sink, sink_tile);
      loader.load_quantized(s, g, coded, quant_tile);
      loader.load_recent(s, g, coded, len - sink - coded, recent_tile);
      for (int j = 0; j < group; ++j) {
        const int h = g * group + j;
        const size_t row = static_cast<size_t>(s) * p.num_q_heads + h;
        const float* q = args.q + row * d;
        float* lse = args.lse != nullptr ? args.lse + row : nullptr;
        detail::attend_part(q, p.softmax_scale, sink_tile, sink, d, logits, sink_part);
        detail::attend_part(q, p.softmax_scale, quant_tile, coded, d, logits, quant_part);
        if (coded == len - sink) {  // no window: the two-part merge, bit for bit as without one
          detail::merge_parts(sink_part, quant_part, d, args.out + row * d, lse);
          continue;
        }
        detail::attend_part(q, p.softmax_scale, recent_tile, recent_tile.n, d, logits, recent_part);
        detail::merge_parts(sink_part, quant_part, recent_part, d, args.out + row * d, lse);
      }
    }
  }
  return Status::ok();
}

}  // namespace kvq::attention::cpu
