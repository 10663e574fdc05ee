#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kernel.h"
#include "kvq/attention/cpu.h"

namespace kvq::attention::cpu {
namespace {

detail::Problem problem_of(const PrefillArgs& a) {
  return {a.geom, a.layer, a.tables, a.num_q_heads, a.softmax_scale};
}

}  // namespace

Status can_implement(const PrefillArgs& args) {
  const detail::Problem p = problem_of(args);
  if (p.tables.num_seqs != 1)
    return invalid_argument("prefill: tables must hold exactly one sequence, got " +
                            std::to_string(p.tables.num_seqs));
  KVQ_RETURN_IF_ERROR(detail::check_problem(p, args.q, args.out));
  if (args.n_q < 1) return invalid_argument("prefill: n_q must be at least 1, got " + std::to_string(args.n_q));
  if (args.q_pos0 < 0)
    return invalid_argument("prefill: q_pos0 must not be negative, got " + std::to_string(args.q_pos0));
  const int64_t end = static_cast<int64_t>(args.q_pos0) + args.n_q;
  if (end > p.tables.seq_lens[0])
    return invalid_argument("prefill: queries cover positions [" + std::to_string(args.q_pos0) + ", " +
                            std::to_string(end) + ") but the sequence holds only " +
                            std::to_string(p.tables.seq_lens[0]) +
                            " tokens; write the chunk's K/V to the cache first");
  return Status::ok();
}

Status prefill(const PrefillArgs& args) {
  KVQ_RETURN_IF_ERROR(can_implement(args));
  const detail::Problem p = problem_of(args);
  const int d = p.geom.head_dim, hkv = p.geom.num_kv_heads, group = p.num_q_heads / hkv;
  const int sink = p.tables.sink_lens[0];
  const int last = args.q_pos0 + args.n_q;  // tokens any query of the chunk can see
  const int sink_loaded = std::min(sink, last);
  const int quant_loaded = std::max(0, last - sink);
  const detail::TileLoader loader(p);
  detail::PartTile sink_tile, quant_tile;
  std::vector<float> logits;
  detail::Partial sink_part, quant_part;
  for (int g = 0; g < hkv; ++g) {
    loader.load_sink(0, g, sink_loaded, sink_tile);
    loader.load_quantized(0, g, quant_loaded, quant_tile);
    for (int i = 0; i < args.n_q; ++i) {
      const int visible = args.q_pos0 + i + 1;  // causal: tokens [0, pos]
      const int sink_visible = std::min(sink, visible);
      const int quant_visible = visible - sink_visible;
      for (int j = 0; j < group; ++j) {
        const size_t row = static_cast<size_t>(i) * p.num_q_heads + g * group + j;
        const float* q = args.q + row * d;
        detail::attend_part(q, p.softmax_scale, sink_tile, sink_visible, d, logits, sink_part);
        detail::attend_part(q, p.softmax_scale, quant_tile, quant_visible, d, logits, quant_part);
        detail::merge_parts(sink_part, quant_part, d, args.out + row * d,
                            args.lse != nullptr ? args.lse + row : nullptr);
      }
    }
  }
  return Status::ok();
}

}  // namespace kvq::attention::cpu
