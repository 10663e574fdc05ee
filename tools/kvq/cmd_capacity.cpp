// `kvq capacity`: KV bytes of one long sequence per cache spec, from the cache geometry (default:
// the design's 27B-class model at 32k tokens), against bf16, and how many such sequences a KV
// budget holds.
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/command.h"
#include "kvq/common/file_io.h"
#include "kvq/model/model.h"
#include "kvq/serve/capacity.h"

namespace kvq::tools {
namespace {

struct CapacityCli {
  std::string model;  // empty: the 27B-class geometry (or --layers/--kv-heads/--head-dim)
  int layers = 46, kv_heads = 16, head_dim = 128, q_heads = 32;
  long long tokens = 32768;
  double budget_gib = 0;
  std::string specs = "bf16,fp8_e4m3,fp8_fnuz,int8";
  std::string granularity = "per_token_head";
  std::string scale_dtype = "fp32";
  int block_size = 16, sink = 256;
  std::string json_out, md_out;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t c = s.find(',', at);
    const std::string item = s.substr(at, c == std::string::npos ? std::string::npos : c - at);
    if (!item.empty()) out.push_back(item);
    if (c == std::string::npos) break;
    at = c + 1;
  }
  return out;
}

int run_capacity(const CapacityCli& o) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "kvq capacity: %s\n", s.to_string().c_str());
    return 1;
  };
  serve::KvGeometry g = serve::geometry_27b_class();
  if (!o.model.empty()) {
    auto path = model::resolve_model_path(o.model);
    if (!path.is_ok()) return fail(path.status());
    auto m = model::Model::load(path.value());
    if (!m.is_ok()) return fail(m.status());
    const auto& c = m.value()->config();
    g = serve::KvGeometry{c.name, c.n_layers, c.n_kv_heads, c.head_dim, c.n_heads};
  } else if (o.layers != 46 || o.kv_heads != 16 || o.head_dim != 128 || o.q_heads != 32) {
    g = serve::KvGeometry{"custom", o.layers, o.kv_heads, o.head_dim, o.q_heads};
  }
  std::vector<QuantSpec> specs;
  for (const std::string& item : split(o.specs)) {
    // "int8:fp16_scales" (eval's spelling) overrides --kv-scale-dtype for that entry, so one table
    // can set fp32 and fp16 scales side by side.
    const size_t colon = item.find(':');
    QuantOptions q;
    q.kv_cache_dtype = item.substr(0, colon);
    q.scale_dtype = o.scale_dtype;
    if (colon != std::string::npos) {
      const std::string opt = item.substr(colon + 1);
      if (opt != "fp16_scales" && opt != "fp32_scales")
        return fail(invalid_argument("--specs entry '" + item + "': unknown option '" + opt +
                                     "'; accepted: fp16_scales, fp32_scales"));
      q.scale_dtype = opt.substr(0, 4);
    }
    q.granularity = o.granularity;
    q.block_size = o.block_size;
    q.sink_tokens = o.sink;
    auto s = parse_quant_spec(q);
    if (!s.is_ok()) return fail(s.status());
    specs.push_back(s.value());
  }
  const size_t budget = static_cast<size_t>(o.budget_gib * double(1ull << 30));
  auto rows = serve::capacity_table(specs, g, o.tokens, budget);
  if (!rows.is_ok()) return fail(rows.status());
  const std::string md = serve::capacity_markdown(rows.value(), g, o.tokens, budget);
  std::fputs(md.c_str(), stdout);
  if (rows.value().size() > 1)
    std::printf("\nThe design expects ~6 GB saved at 32k tokens for this model class; the table's 'saved' column is "
                "the measured-from-geometry figure.\n");
  if (!o.md_out.empty())
    if (Status st = write_file_atomic(o.md_out, md, "--md output"); !st.is_ok()) return fail(st);
  if (!o.json_out.empty()) {
    nlohmann::json j = {{"model", g.name}, {"layers", g.num_layers}, {"kv_heads", g.num_kv_heads},
                        {"head_dim", g.head_dim}, {"q_heads", g.num_q_heads}, {"tokens", o.tokens},
                        {"budget_bytes", budget}, {"rows", nlohmann::json::array()}};
    for (const auto& r : rows.value())
      j["rows"].push_back({{"spec", r.spec.to_string()}, {"main_bytes", r.seq.main_bytes}, {"sink_bytes", r.seq.sink_bytes},
                           {"total_bytes", r.seq.total()}, {"bytes_per_token", r.bytes_per_token},
                           {"saved_vs_baseline_bytes", r.saved_vs_baseline}, {"ratio_vs_baseline", r.ratio_vs_baseline},
                           {"seqs_in_budget", r.seqs_in_budget}, {"seqs_vs_baseline", r.seqs_vs_baseline}});
    if (Status st = write_file_atomic(o.json_out, j.dump(2) + "\n", "--json output"); !st.is_ok()) return fail(st);
  }
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto o = std::make_shared<CapacityCli>();
  CLI::App* sub = app.add_subcommand("capacity", "KV bytes of one long sequence per cache spec (scales and bf16 sink "
                                                 "included) vs bf16, from the cache geometry; sequences per KV budget");
  sub->add_option("--model", o->model, "Take the geometry from this model (smollm2, stories260K, a file); default: "
                  "the 27B-class geometry");
  sub->add_option("--layers", o->layers, "Layers")->capture_default_str();
  sub->add_option("--kv-heads", o->kv_heads, "KV heads")->capture_default_str();
  sub->add_option("--head-dim", o->head_dim, "Head dimension")->capture_default_str();
  sub->add_option("--q-heads", o->q_heads, "Query heads (informational)")->capture_default_str();
  sub->add_option("--tokens", o->tokens, "Sequence length")->capture_default_str()->check(CLI::Range(1LL, 1LL << 30));
  sub->add_option("--kv-cache-memory", o->budget_gib, "KV budget in GiB: how many such sequences fit");
  sub->add_option("--specs", o->specs, "Comma-separated --kv-cache-dtype values, each optionally with :fp16_scales or "
                  ":fp32_scales (e.g. int8:fp16_scales); the first is the baseline")
      ->capture_default_str();
  sub->add_option("--kv-scale-dtype", o->scale_dtype, "Scale dtype of entries without :fp16_scales / :fp32_scales (fp32|fp16)")
      ->capture_default_str();
  sub->add_option("--kv-scale-granularity", o->granularity, "per_token_head|per_block_head|per_tensor")->capture_default_str();
  sub->add_option("--block-size", o->block_size, "Tokens per page (16 or 32)")->capture_default_str();
  sub->add_option("--kv-sink-tokens", o->sink, "bf16 sink tokens per sequence")->capture_default_str();
  sub->add_option("--json", o->json_out, "Also write JSON here");
  sub->add_option("--md", o->md_out, "Also write the markdown table here");
  return [o] { return run_capacity(*o); };
}}};

}  // namespace
}  // namespace kvq::tools
