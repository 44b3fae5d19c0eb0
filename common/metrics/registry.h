#ifndef AIDN_COMMON_METRICS_REGISTRY_H_
#define AIDN_COMMON_METRICS_REGISTRY_H_

// Prometheus metrics: a registry of counter, gauge and histogram families
// with labels, and the text exposition format (version 0.0.4). Shaped like
// prometheus-cpp's API, which is not packaged here:
//
//   metrics::Registry registry;
//   auto& rpcs = registry.AddCounter("aidn_rpcs_total", "RPCs handled.");
//   rpcs.Add({{"method", "SubmitJob"}, {"code", "OK"}}).Increment();
//   auto& steps = registry.AddHistogram("aidn_rank_step_seconds", "Step time.",
//                                       metrics::ExponentialBuckets(1e-4, 2, 16));
//   steps.Add({{"job_id", "job-1"}, {"rank", "0"}}).Observe(0.012);
//   steps.RemoveMatching({{"job_id", "job-1"}});  // the job's series go
//   std::string text = registry.Serialize();
//
// Thread-safe throughout. A reference returned by Family::Add stays valid
// until that series is removed; Add with the same labels returns the same
// series. Families live as long as the registry.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace aidn::metrics {

// Label name -> value. Names must match [a-zA-Z_][a-zA-Z0-9_]* and not start
// with "__"; values may hold anything (escaped on output).
using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  // `v` must be >= 0; a negative value is ignored (counters only go up).
  void Increment(double v = 1.0);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v);
  void Increment(double v = 1.0);
  void Decrement(double v = 1.0);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: the buckets' upper bounds, strictly increasing, without +Inf
  // (which every histogram has).
  explicit Histogram(std::vector<double> bounds);

  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;
    // Cumulative: counts[i] observations <= bounds[i]; one more entry for +Inf.
    std::vector<uint64_t> cumulative_counts;
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Collect() const;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// `count` bounds: start, start*factor, start*factor^2, ...
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// `count` bounds: start, start+width, ...
std::vector<double> LinearBuckets(double start, double width, int count);

enum class MetricType { kCounter, kGauge, kHistogram };

// The series of one metric name, one per distinct label set.
template <typename T>
class Family {
 public:
  // Finds or creates the series with these labels (merged with the family's
  // constant labels). Invalid label names are a programming error: the
  // series is still returned but the name is sanitised on output.
  T& Add(const Labels& labels);
  // Removes one series (a reference from Add). Unknown pointers are ignored.
  void Remove(T* series);
  // Removes every series whose labels include all of `match`; returns how
  // many went.
  int RemoveMatching(const Labels& match);
  // Removes every series with label `name` whose value `doomed` accepts
  // (one pass, however many values it accepts); returns how many went.
  int RemoveWhere(const std::string& name, const std::function<bool(const std::string&)>& doomed);
  // Number of series.
  int size() const;

  // For the registry and tests.
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }

  Family(std::string name, std::string help, Labels constant_labels,
         std::function<std::unique_ptr<T>()> make);
  // Calls `fn(labels, series)` for every series, in label order, under the
  // family's lock.
  void ForEach(const std::function<void(const Labels&, const T&)>& fn) const;

 private:
  const std::string name_;
  const std::string help_;
  const Labels constant_labels_;
  const std::function<std::unique_ptr<T>()> make_;
  mutable absl::Mutex mu_;
  std::map<Labels, std::unique_ptr<T>> series_ ABSL_GUARDED_BY(mu_);
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Names must match [a-zA-Z_:][a-zA-Z0-9_:]* and be unique in the registry
  // (registering a name twice returns the first family when the type
  // matches, and aborts when it does not). Counter names should end in
  // "_total", as promtool's linter asks.
  Family<Counter>& AddCounter(const std::string& name, const std::string& help,
                              const Labels& constant_labels = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help,
                          const Labels& constant_labels = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> bounds, const Labels& constant_labels = {});

  // Runs before every Serialize, in the order added: refresh gauges that
  // are computed on demand (ages, counts of things). Not under any lock of
  // the registry, so a hook may Add and Remove series.
  void AddCollectHook(std::function<void()> hook);

  // Every family in registration order, in the Prometheus text format
  // version 0.0.4 (# HELP, # TYPE, then one line per sample). Families with
  // no series are written with HELP and TYPE only.
  std::string Serialize() const;

 private:
  struct Entry;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// Escaping as the text format wants it: label values escape backslash,
// double quote and newline; HELP text escapes backslash and newline.
std::string EscapeLabelValue(const std::string& value);
std::string EscapeHelp(const std::string& help);
// A sample value: integers without a fraction, others in the shortest form
// that reads back exactly, and +Inf, -Inf, NaN.
std::string FormatValue(double v);

}  // namespace aidn::metrics

#endif  // AIDN_COMMON_METRICS_REGISTRY_H_
