#pragma once
// Latency histograms of the serving layer, rendered in the Prometheus text format (version 0.0.4).
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace kvq::serve {

// Cumulative histogram over fixed upper bounds (seconds). Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (non-cumulative), last = +Inf
  uint64_t count_ = 0;
  double sum_ = 0;
};

struct Metrics {
  Metrics();
  Histogram ttft;   // submit -> first token, seconds
  Histogram tpot;   // mean time per output token after the first, per request, seconds
  Histogram e2e;    // submit -> done, seconds
};

// Appends one histogram in Prometheus text format (# HELP, # TYPE, _bucket{le=...}, _sum, _count).
void render_histogram(std::string* out, const std::string& name, const std::string& help, const Histogram& h);
// Appends a gauge or counter sample with optional labels ("pool=\"main\"").
void render_sample(std::string* out, const std::string& name, const std::string& type, const std::string& help,
                   double value, const std::string& labels = "");

}  // namespace kvq::serve
