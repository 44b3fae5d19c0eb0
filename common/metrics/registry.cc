#include "common/metrics/registry.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace aidn::metrics {
namespace {

// Adds `delta` to an atomic double. std::atomic<double>::fetch_add exists
// in C++20 but libstdc++ 12 implements it with the same CAS loop; writing it
// out keeps the intent (and the relaxed ordering: a metric orders nothing
// else) explicit.
void AtomicAdd(std::atomic<double>& value, double delta) {
  double current = value.load(std::memory_order_relaxed);
  while (!value.compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
  }
}

bool IsAsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

bool IsValidMetricName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAsciiAlpha(c) || c == '_' || c == ':' || (i > 0 && IsAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

// Label names are fixed by code, so an invalid one is a programming error;
// rather than abort a daemon over a metric we write a valid name: invalid
// characters become '_', a leading digit gets a '_' prefix, and the
// reserved "__" prefix loses underscores until one is left.
std::string SanitizeLabelName(const std::string& name) {
  std::string out;
  out.reserve(name.size() + 1);
  for (char c : name) out.push_back(IsAsciiAlpha(c) || IsAsciiDigit(c) || c == '_' ? c : '_');
  if (out.empty() || IsAsciiDigit(out[0])) out.insert(out.begin(), '_');
  size_t underscores = 0;
  while (underscores < out.size() && out[underscores] == '_') ++underscores;
  if (underscores >= 2) out.erase(0, underscores - 1);
  return out;
}

// Appends `{a="x",b="y"}` (nothing when there are no labels). Histogram
// samples pass `histogram`: a series label called "le" would clash with the
// bucket label, so it is written as "le_" on every line of the series, and
// the bucket's `le`, when given, goes last as the format expects.
void AppendLabels(std::string& out, const Labels& labels, bool histogram, const std::string* le) {
  if (labels.empty() && le == nullptr) return;
  out.push_back('{');
  bool first = true;
  for (const auto& [name, value] : labels) {
    if (!first) out.push_back(',');
    first = false;
    std::string sanitized = SanitizeLabelName(name);
    if (histogram && sanitized == "le") sanitized = "le_";
    absl::StrAppend(&out, sanitized, "=\"", EscapeLabelValue(value), "\"");
  }
  if (le != nullptr) {
    if (!first) out.push_back(',');
    absl::StrAppend(&out, "le=\"", *le, "\"");
  }
  out.push_back('}');
}

// One sample line: `name{labels} value`.
void AppendSample(std::string& out, const std::string& name, const Labels& labels, double value,
                  bool histogram = false, const std::string* le = nullptr) {
  out.append(name);
  AppendLabels(out, labels, histogram, le);
  absl::StrAppend(&out, " ", FormatValue(value), "\n");
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AppendHeader(std::string& out, const std::string& name, const std::string& help,
                  MetricType type) {
  absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(help), "\n");
  absl::StrAppend(&out, "# TYPE ", name, " ", TypeName(type), "\n");
}

}  // namespace

// ---------------------------------------------------------------------------
// Counter, Gauge, Histogram.

void Counter::Increment(double v) {
  // `!(v >= 0)` also drops NaN, which would poison the counter for good.
  if (!(v >= 0)) return;
  AtomicAdd(value_, v);
}

double Counter::Value() const { return value_.load(std::memory_order_relaxed); }

void Gauge::Set(double v) { value_.store(v, std::memory_order_relaxed); }
void Gauge::Increment(double v) { AtomicAdd(value_, v); }
void Gauge::Decrement(double v) { AtomicAdd(value_, -v); }
double Gauge::Value() const { return value_.load(std::memory_order_relaxed); }

namespace {

// A trailing +Inf bound is tolerated (and dropped) because every histogram
// has that bucket anyway; writing it twice would be invalid output.
std::vector<double> CheckedBounds(std::vector<double> bounds) {
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    AIDN_CHECK(!std::isnan(bounds[i])) << "histogram bound " << i << " is NaN";
    AIDN_CHECK(i == 0 || bounds[i - 1] < bounds[i])
        << "histogram bounds must increase strictly, bound " << i;
  }
  return bounds;
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(CheckedBounds(std::move(bounds))), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  // The first bucket whose bound is >= v (`le` is inclusive). NaN compares
  // false with everything and so lands in the +Inf bucket only, as in the Go
  // client.
  const auto it =
      std::partition_point(bounds_.begin(), bounds_.end(), [v](double b) { return !(v <= b); });
  const size_t bucket = static_cast<size_t>(std::distance(bounds_.begin(), it));
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += v;
  ++count_;
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot snapshot;
  snapshot.bounds = bounds_;
  snapshot.cumulative_counts.reserve(bounds_.size() + 1);
  absl::MutexLock lock(&mu_);
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    snapshot.cumulative_counts.push_back(running);
  }
  snapshot.sum = sum_;
  snapshot.count = count_;
  return snapshot;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  if (count <= 0) return bounds;
  bounds.reserve(static_cast<size_t>(count));
  double bound = start;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(bound);
    bound *= factor;
  }
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  std::vector<double> bounds;
  if (count <= 0) return bounds;
  bounds.reserve(static_cast<size_t>(count));
  // start + i * width rather than repeated addition, so that rounding errors
  // do not accumulate along the buckets.
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  return bounds;
}

// ---------------------------------------------------------------------------
// Family.

template <typename T>
Family<T>::Family(std::string name, std::string help, Labels constant_labels,
                  std::function<std::unique_ptr<T>()> make)
    : name_(std::move(name)),
      help_(std::move(help)),
      constant_labels_(std::move(constant_labels)),
      make_(std::move(make)) {}

template <typename T>
T& Family<T>::Add(const Labels& labels) {
  Labels merged = labels;
  // Constant labels win over a series label of the same name: they describe
  // the whole family (e.g. the daemon's role) and must not vary per series.
  for (const auto& [name, value] : constant_labels_) merged[name] = value;
  absl::MutexLock lock(&mu_);
  auto& slot = series_[std::move(merged)];
  if (slot == nullptr) slot = make_();
  return *slot;
}

template <typename T>
void Family<T>::Remove(T* series) {
  absl::MutexLock lock(&mu_);
  for (auto it = series_.begin(); it != series_.end(); ++it) {
    if (it->second.get() == series) {
      series_.erase(it);
      return;
    }
  }
}

template <typename T>
int Family<T>::RemoveMatching(const Labels& match) {
  absl::MutexLock lock(&mu_);
  int removed = 0;
  for (auto it = series_.begin(); it != series_.end();) {
    const Labels& labels = it->first;
    const bool matches = std::all_of(match.begin(), match.end(), [&labels](const auto& kv) {
      const auto found = labels.find(kv.first);
      return found != labels.end() && found->second == kv.second;
    });
    if (matches) {
      it = series_.erase(it);
      ++removed;
    } else {
      ++it;
    }
  }
  return removed;
}

template <typename T>
int Family<T>::RemoveWhere(const std::string& name,
                           const std::function<bool(const std::string&)>& doomed) {
  absl::MutexLock lock(&mu_);
  int removed = 0;
  for (auto it = series_.begin(); it != series_.end();) {
    const auto found = it->first.find(name);
    if (found != it->first.end() && doomed(found->second)) {
      it = series_.erase(it);
      ++removed;
    } else {
      ++it;
    }
  }
  return removed;
}

template <typename T>
int Family<T>::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(series_.size());
}

template <typename T>
void Family<T>::ForEach(const std::function<void(const Labels&, const T&)>& fn) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, series] : series_) fn(labels, *series);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---------------------------------------------------------------------------
// Registry.

struct Registry::Entry {
  MetricType type;
  std::string name;
  // Exactly one of these is set, matching `type`.
  std::unique_ptr<Family<Counter>> counter;
  std::unique_ptr<Family<Gauge>> gauge;
  std::unique_ptr<Family<Histogram>> histogram;
};

Registry::Registry() = default;
Registry::~Registry() = default;

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help,
                                      const Labels& constant_labels) {
  AIDN_CHECK(IsValidMetricName(name)) << "invalid metric name \"" << name << "\"";
  absl::MutexLock lock(&mu_);
  for (const auto& entry : entries_) {
    if (entry->name != name) continue;
    AIDN_CHECK(entry->type == MetricType::kCounter)
        << "metric \"" << name << "\" is already registered with another type";
    return *entry->counter;
  }
  auto entry = std::make_unique<Entry>();
  entry->type = MetricType::kCounter;
  entry->name = name;
  entry->counter = std::make_unique<Family<Counter>>(name, help, constant_labels,
                                                     [] { return std::make_unique<Counter>(); });
  entries_.push_back(std::move(entry));
  return *entries_.back()->counter;
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help,
                                  const Labels& constant_labels) {
  AIDN_CHECK(IsValidMetricName(name)) << "invalid metric name \"" << name << "\"";
  absl::MutexLock lock(&mu_);
  for (const auto& entry : entries_) {
    if (entry->name != name) continue;
    AIDN_CHECK(entry->type == MetricType::kGauge)
        << "metric \"" << name << "\" is already registered with another type";
    return *entry->gauge;
  }
  auto entry = std::make_unique<Entry>();
  entry->type = MetricType::kGauge;
  entry->name = name;
  entry->gauge = std::make_unique<Family<Gauge>>(name, help, constant_labels,
                                                 [] { return std::make_unique<Gauge>(); });
  entries_.push_back(std::move(entry));
  return *entries_.back()->gauge;
}

Family<Histogram>& Registry::AddHistogram(const std::string& name, const std::string& help,
                                          std::vector<double> bounds,
                                          const Labels& constant_labels) {
  AIDN_CHECK(IsValidMetricName(name)) << "invalid metric name \"" << name << "\"";
  // Validate the bounds now rather than at the first Add, so a bad bucket
  // layout fails where it is written.
  bounds = CheckedBounds(std::move(bounds));
  absl::MutexLock lock(&mu_);
  for (const auto& entry : entries_) {
    if (entry->name != name) continue;
    AIDN_CHECK(entry->type == MetricType::kHistogram)
        << "metric \"" << name << "\" is already registered with another type";
    return *entry->histogram;
  }
  auto entry = std::make_unique<Entry>();
  entry->type = MetricType::kHistogram;
  entry->name = name;
  entry->histogram = std::make_unique<Family<Histogram>>(
      name, help, constant_labels,
      [bounds = std::move(bounds)] { return std::make_unique<Histogram>(bounds); });
  entries_.push_back(std::move(entry));
  return *entries_.back()->histogram;
}

void Registry::AddCollectHook(std::function<void()> hook) {
  absl::MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Serialize() const {
  // Copy the hooks and run them unlocked, so that a hook may register
  // families or hooks and Add/Remove series without deadlocking.
  std::vector<std::function<void()>> hooks;
  {
    absl::MutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (const auto& hook : hooks) hook();

  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& entry : entries_) {
    switch (entry->type) {
      case MetricType::kCounter: {
        const Family<Counter>& family = *entry->counter;
        AppendHeader(out, family.name(), family.help(), entry->type);
        family.ForEach([&](const Labels& labels, const Counter& counter) {
          AppendSample(out, family.name(), labels, counter.Value());
        });
        break;
      }
      case MetricType::kGauge: {
        const Family<Gauge>& family = *entry->gauge;
        AppendHeader(out, family.name(), family.help(), entry->type);
        family.ForEach([&](const Labels& labels, const Gauge& gauge) {
          AppendSample(out, family.name(), labels, gauge.Value());
        });
        break;
      }
      case MetricType::kHistogram: {
        const Family<Histogram>& family = *entry->histogram;
        AppendHeader(out, family.name(), family.help(), entry->type);
        const std::string bucket_name = family.name() + "_bucket";
        const std::string sum_name = family.name() + "_sum";
        const std::string count_name = family.name() + "_count";
        const std::string inf = "+Inf";
        family.ForEach([&](const Labels& labels, const Histogram& histogram) {
          // One snapshot per series so that buckets, sum and count agree.
          const Histogram::Snapshot snapshot = histogram.Collect();
          for (size_t i = 0; i < snapshot.bounds.size(); ++i) {
            const std::string le = FormatValue(snapshot.bounds[i]);
            AppendSample(out, bucket_name, labels,
                         static_cast<double>(snapshot.cumulative_counts[i]), /*histogram=*/true,
                         &le);
          }
          AppendSample(out, bucket_name, labels,
                       static_cast<double>(snapshot.cumulative_counts.back()), /*histogram=*/true,
                       &inf);
          AppendSample(out, sum_name, labels, snapshot.sum, /*histogram=*/true);
          AppendSample(out, count_name, labels, static_cast<double>(snapshot.count),
                       /*histogram=*/true);
        });
        break;
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Text format helpers.

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out.append("\\\\");
        break;
      case '"':
        out.append("\\\"");
        break;
      case '\n':
        out.append("\\n");
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    switch (c) {
      case '\\':
        out.append("\\\\");
        break;
      case '\n':
        out.append("\\n");
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Integers up to 2^53 (all exactly representable) print as integers:
  // shortest round-trip would write 1000000 as "1e+06", which is correct but
  // odd for a count. -0 prints as "0".
  constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53
  if (std::trunc(v) == v && std::fabs(v) <= kMaxExactInteger) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  // Shortest representation that reads back to the same double.
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, result.ptr);
}

}  // namespace aidn::metrics
