#include "kvq/eval/report.h"

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

namespace kvq::eval {

namespace {

std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "nan";
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string spec_name(const SpecResult& r) {
  if (r.is_baseline) return "bf16 (baseline)";
  std::string s = r.spec.to_string();
  return r.spec.from_auto ? "auto -> " + s : s;
}

std::vector<std::string> row_cells(const SpecResult& r) {
  std::string status = r.error.empty() ? (r.gate_pass ? "pass" : "FAIL") : "error";
  if (!r.error.empty())
    return {spec_name(r), "-", "-", "-", "-", "-", std::to_string(r.bytes_per_token), "-", "-", "-", status};
  return {spec_name(r),
          fmt("%.4f", r.ppl),
          r.is_baseline ? "-" : fmt("%+.3f%%", r.delta_ppl_pct),
          r.is_baseline ? "-" : fmt("%.3e", r.kl_mean),
          r.is_baseline ? "-" : fmt("%.2f%%", 100.0 * r.top1),
          fmt("%.0f", r.bytes_per_token_at_ctx),
          std::to_string(r.bytes_per_token),
          fmt("%.1f%%", r.saving_pct),
          fmt("%.1f", r.tokens_per_s),
          fmt("%.1f", r.forward_seconds),
          status};
}

}  // namespace

namespace {

// Left-aligned first column, numbers right; markdown: a pipe table.
std::string render(const std::vector<std::vector<std::string>>& rows, bool markdown) {
  const std::vector<std::string>& head = rows[0];
  std::string out;
  if (markdown) {
    auto line = [&](const std::vector<std::string>& c) {
      out += "|";
      for (const auto& x : c) out += " " + x + " |";
      out += "\n";
    };
    line(rows[0]);
    out += "|";
    for (size_t i = 0; i < head.size(); ++i) out += i == 0 ? " --- |" : " ---: |";
    out += "\n";
    for (size_t i = 1; i < rows.size(); ++i) line(rows[i]);
  } else {
    std::vector<size_t> w(head.size(), 0);
    for (const auto& r : rows)
      for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
    for (size_t k = 0; k < rows.size(); ++k) {
      const size_t start = out.size();
      for (size_t i = 0; i < rows[k].size(); ++i) {
        const std::string& c = rows[k][i];
        std::string pad(w[i] - c.size(), ' ');
        out += i == 0 ? c + pad : "  " + pad + c;
      }
      out += "\n";
      if (k == 0) out += std::string(out.size() - start - 1, '-') + "\n";
    }
  }
  return out;
}

// KL mean and NLL delta per position bucket, for the buckets some spec reached.
std::string bucket_table(const EvalReport& rep, bool markdown) {
  std::vector<int> used;
  for (int b = 0; b < kNumPositionBuckets; ++b)
    for (const auto& r : rep.results)
      if (!r.is_baseline && static_cast<size_t>(b) < r.buckets.size() && r.buckets[static_cast<size_t>(b)].predictions > 0) {
        used.push_back(b);
        break;
      }
  if (used.empty()) return "";
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head = {"by position"};
  for (int b : used) {
    head.push_back("KL " + position_bucket_name(b));
    head.push_back("dNLL " + position_bucket_name(b));
  }
  rows.push_back(head);
  for (const auto& r : rep.results) {
    if (r.is_baseline || r.buckets.empty()) continue;
    std::vector<std::string> c = {spec_name(r)};
    for (int b : used) {
      const BucketResult& br = r.buckets[static_cast<size_t>(b)];
      c.push_back(fmt("%.3e", br.kl_mean));
      c.push_back(fmt("%+.2e", br.nll_delta));
    }
    rows.push_back(c);
  }
  if (rows.size() < 2) return "";
  std::string out = "\n";  // a blank line between the two tables
  out += render(rows, markdown);
  return out;
}

}  // namespace

std::string format_table(const EvalReport& rep, bool markdown) {
  const std::vector<std::string> head = {"cache spec", "ppl",       "dPPL",   "KL mean", "top-1",
                                         "B/tok@ctx",  "B/tok",     "saving", "tok/s",   "time s", "gate"};
  std::vector<std::vector<std::string>> rows = {head};
  for (const auto& r : rep.results) rows.push_back(row_cells(r));
  return render(rows, markdown) + bucket_table(rep, markdown);
}

std::string report_json(const EvalReport& rep, const ReportContext& ctx, int indent) {
  using nlohmann::json;
  auto num = [](double v) -> json { return std::isfinite(v) ? json(v) : json(nullptr); };
  auto row = [&](const SpecResult& r) {
    json j;
    j["label"] = r.label;
    j["spec"] = r.is_baseline ? "bf16" : r.spec.to_string();
    j["format"] = r.spec.mixed() ? "mixed" : format_name(r.spec.format);
    j["granularity"] = r.spec.quantized() ? json(granularity_name(r.spec.granularity)) : json(nullptr);
    j["sink_tokens"] = r.spec.quantized() ? r.spec.sink_tokens : 0;
    j["block_size"] = r.spec.block_size;
    j["from_auto"] = r.spec.from_auto;
    j["baseline"] = r.is_baseline;
    j["error"] = r.error.empty() ? json(nullptr) : json(r.error);
    j["predictions"] = r.predictions;
    j["nll"] = num(r.nll);
    j["ppl"] = num(r.ppl);
    j["delta_ppl_pct"] = num(r.delta_ppl_pct);
    j["kl_mean"] = num(r.kl_mean);
    j["kl_max"] = num(r.kl_max);
    j["top1_agreement"] = num(r.top1);
    json wn = json::array();
    for (double v : r.window_nll) wn.push_back(num(v));
    j["window_nll"] = wn;
    json bk = json::array();
    for (const BucketResult& b : r.buckets)
      bk.push_back({{"bucket", b.name}, {"begin", b.begin}, {"end", b.end < 0 ? json(nullptr) : json(b.end)},
                    {"predictions", b.predictions}, {"kl_mean", num(b.kl_mean)}, {"kl_max", num(b.kl_max)},
                    {"nll_delta", num(b.nll_delta)}});
    j["position_buckets"] = bk;  // empty for the baseline
    j["rotation"] = rotation_name(r.spec.rotation);
    j["bytes_per_token"] = r.bytes_per_token;
    j["bytes_per_token_at_ctx"] = num(r.bytes_per_token_at_ctx);
    j["saving_pct"] = num(r.saving_pct);
    j["tokens_forwarded"] = r.tokens;
    j["forward_seconds"] = num(r.forward_seconds);
    j["tokens_per_s"] = num(r.tokens_per_s);
    j["gate_pass"] = r.gate_pass;
    j["gate_note"] = r.gate_note;
    return j;
  };
  json j;
  j["model"] = rep.model_name;
  j["model_path"] = ctx.model_path;
  j["text"] = {{"source", ctx.text_source}, {"bytes", ctx.text_bytes}, {"fnv1a64", [&] {
                 char b[32];
                 std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(ctx.text_hash));
                 return std::string(b);
               }()},
               {"tokens", rep.text_tokens}};
  j["ctx"] = rep.ctx;
  j["bos"] = rep.bos;
  j["windows"] = rep.num_windows;
  j["predictions_per_spec"] = rep.predictions;
  j["vocab"] = rep.vocab;
  j["gate_pct"] = rep.gate_pct;
  j["command"] = ctx.command;
  j["total_seconds"] = rep.total_seconds;
  j["notes"] = rep.notes;
  j["baseline"] = row(rep.baseline);
  json rows = json::array();
  for (const auto& r : rep.results) rows.push_back(row(r));
  j["results"] = rows;
  return j.dump(indent);
}

}  // namespace kvq::eval
