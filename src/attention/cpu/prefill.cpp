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
  KVQ_RETURN_IF_ERROR(detail::check_problem(p, args.q, args.out, std::max(args.q_pos0, 0)));
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
  const int R = p.geom.recent_tokens;
  // Main tokens the chunk's first query reads in bf16 start at u_lo; later queries' windows start later.
  const int main_last = std::max(0, last - sink);
  const int u_lo = cache::recent_first_main(args.q_pos0, sink, main_last, R);
  detail::PartTile sink_tile, quant_tile, recent_tile;
  detail::BlockPartial sink_part, quant_part, recent_part;
  std::vector<int> sink_visible, quant_visible, recent_first, recent_visible;
  const size_t q_stride = static_cast<size_t>(p.num_q_heads) * d;
  for (int g = 0; g < hkv; ++g) {
    loader.load_sink(0, g, std::min(sink, last), sink_tile);
    loader.load_quantized(0, g, main_last, quant_tile);
    loader.load_recent(0, g, u_lo, main_last - u_lo, recent_tile);
    for (int i0 = 0; i0 < args.n_q; i0 += kBlock) {
      const int rows = std::min(kBlock, args.n_q - i0);
      sink_visible.resize(rows);
      quant_visible.resize(rows);
      recent_first.resize(rows);
      recent_visible.resize(rows);
      bool any_recent = false;
      for (int r = 0; r < rows; ++r) {
        const int pos = args.q_pos0 + i0 + r, visible = pos + 1;  // causal: tokens [0, pos]
        sink_visible[r] = std::min(sink, visible);
        const int main_visible = visible - sink_visible[r];
        // Codes before the query's window, bf16 twins inside it (tile indices relative to u_lo).
        quant_visible[r] = cache::recent_first_main(pos, sink, main_visible, R);
        recent_first[r] = quant_visible[r] - u_lo;
        recent_visible[r] = main_visible - u_lo;
        any_recent |= quant_visible[r] < main_visible;
      }
      for (int j = 0; j < group; ++j) {
        const int h = g * group + j;
        const float* q = args.q + static_cast<size_t>(i0) * q_stride + static_cast<size_t>(h) * d;
        detail::attend_part_block(q, q_stride, rows, sink_visible.data(), p.softmax_scale, sink_tile, d, sink_part);
        detail::attend_part_block(q, q_stride, rows, quant_visible.data(), p.softmax_scale, quant_tile, d,
                                  quant_part);
        if (any_recent)
          detail::attend_part_block(q, q_stride, rows, recent_visible.data(), p.softmax_scale, recent_tile, d,
                                    recent_part, recent_first.data());
        for (int r = 0; r < rows; ++r) {
          const size_t row = static_cast<size_t>(i0 + r) * p.num_q_heads + h;
          float* lse = args.lse != nullptr ? args.lse + row : nullptr;
          // Without a window the two-part merge, bit for bit as before the window existed.
          if (any_recent) detail::merge_block_row(sink_part, quant_part, recent_part, r, d, args.out + row * d, lse);
          else detail::merge_block_row(sink_part, quant_part, r, d, args.out + row * d, lse);
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace kvq::attention::cpu
