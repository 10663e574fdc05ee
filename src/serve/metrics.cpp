// Latency histograms and the Prometheus text format.
#include "kvq/serve/metrics.h"

#include <algorithm>
#include <cstdio>

namespace kvq::serve {
namespace {

std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
          7.5, 10.0, 20.0, 40.0, 80.0};
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  std::sort(bounds_.begin(), bounds_.end());
}

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];
  ++count_;
  sum_ += v;
}

Histogram::Snapshot Histogram::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.bounds = bounds_;
  uint64_t acc = 0;
  for (uint64_t c : counts_) s.cumulative.push_back(acc += c);
  s.count = count_;
  s.sum = sum_;
  return s;
}

Metrics::Metrics() : ttft(latency_bounds()), tpot(latency_bounds()), e2e(latency_bounds()) {}

void render_histogram(std::string* out, const std::string& name, const std::string& help, const Histogram& h) {
  const Histogram::Snapshot s = h.snapshot();
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  for (size_t i = 0; i < s.bounds.size(); ++i)
    *out += name + "_bucket{le=\"" + num(s.bounds[i]) + "\"} " + std::to_string(s.cumulative[i]) + "\n";
  *out += name + "_bucket{le=\"+Inf\"} " + std::to_string(s.cumulative.back()) + "\n";
  *out += name + "_sum " + num(s.sum) + "\n" + name + "_count " + std::to_string(s.count) + "\n";
}

void render_sample(std::string* out, const std::string& name, const std::string& type, const std::string& help,
                   double value, const std::string& labels) {
  // HELP/TYPE once per metric family: callers emit a family's labelled samples consecutively.
  const std::string head = "# TYPE " + name + " ";
  if (out->find(head) == std::string::npos) *out += "# HELP " + name + " " + help + "\n" + head + type + "\n";
  *out += name + (labels.empty() ? "" : "{" + labels + "}") + " " + num(value) + "\n";
}

}  // namespace kvq::serve
