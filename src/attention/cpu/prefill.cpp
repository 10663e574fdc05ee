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
  // Queries go through the two parts in blocks (two sgemms per part), which bounds the logits
  // scratch to kBlock rows of the sequence.
  constexpr int kBlock = 128;
  const detail::TileLoader loader(p);
  detail::PartTile sink_tile, quant_tile;
  detail::BlockPartial sink_part, quant_part;
  std::vector<int> sink_visible, quant_visible;
  const size_t q_stride = static_cast<size_t>(p.num_q_heads) * d;
  for (int g = 0; g < hkv; ++g) {
    loader.load_sink(0, g, std::min(sink, last), sink_tile);
    loader.load_quantized(0, g, std::max(0, last - sink), quant_tile);
    for (int i0 = 0; i0 < args.n_q; i0 += kBlock) {
      const int rows = std::min(kBlock, args.n_q - i0);
      sink_visible.resize(rows);
      quant_visible.resize(rows);
      for (int r = 0; r < rows; ++r) {
        const int visible = args.q_pos0 + i0 + r + 1;  // causal: tokens [0, pos]
        sink_visible[r] = std::min(sink, visible);
        quant_visible[r] = visible - sink_visible[r];
      }
      for (int j = 0; j < group; ++j) {
        const int h = g * group + j;
        const float* q = args.q + static_cast<size_t>(i0) * q_stride + static_cast<size_t>(h) * d;
        detail::attend_part_block(q, q_stride, rows, sink_visible.data(), p.softmax_scale, sink_tile, d, sink_part);
        detail::attend_part_block(q, q_stride, rows, quant_visible.data(), p.softmax_scale, quant_tile, d,
                                  quant_part);
        for (int r = 0; r < rows; ++r) {
          const size_t row = static_cast<size_t>(i0 + r) * p.num_q_heads + h;
          detail::merge_block_row(sink_part, quant_part, r, d, args.out + row * d,
                                  args.lse != nullptr ? args.lse + row : nullptr);
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace kvq::attention::cpu
