#include "bench/coordinator/options.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

namespace aidn::bench {
namespace {

using std::chrono::seconds;

bool ParseSeconds(const std::string& text, seconds* out) {
  int plain = 0;
  if (absl::SimpleAtoi(text, &plain)) {
    *out = seconds(plain);
    return plain > 0;
  }
  absl::Duration d;
  if (!absl::ParseDuration(text, &d) || d < absl::Seconds(1)) return false;
  *out = seconds(absl::ToInt64Seconds(d));
  return true;
}

// --duration, --warmup, --sample-every: true if `name` is one of them
// (*ok then says whether its value parsed).
bool ParseDurationFlag(const std::string& name, const std::string& v, Options* o, bool* ok) {
  seconds* duration = nullptr;
  if (name == "--duration") duration = &o->duration;
  if (name == "--warmup" && v == "auto") {
    o->warmup = seconds(-1);
    *ok = true;
    return true;
  }
  if (name == "--warmup") duration = &o->warmup;
  if (name == "--sample-every") duration = &o->sample_every;
  if (duration == nullptr) return false;
  *ok = ParseSeconds(v, duration);
  return true;
}

// The integer flags: false if `name` is none of them or its value is bad.
bool ParseIntFlag(const std::string& name, const std::string& v, Options* o) {
  int* target = nullptr;
  int min = 1;
  if (name == "--workers") target = &o->workers;
  if (name == "--ranks") target = &o->ranks, min = 0;
  if (name == "--ranks-per-job") target = &o->ranks_per_job;
  if (name == "--slots-per-worker") target = &o->slots_per_worker;
  if (name == "--records-per-second") target = &o->records_per_second;
  if (name == "--channels") target = &o->channels;
  if (name == "--probe-workers") target = &o->probe_workers, min = 0;
  if (name == "--rendezvous-world") target = &o->rendezvous_world, min = 0;
  if (name == "--register-concurrency") target = &o->register_concurrency;
  return target != nullptr && absl::SimpleAtoi(v, target) && *target >= min;
}

}  // namespace

void PrintUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: coordinator_load [--workers=10000] [--ranks=1000] [--ranks-per-job=8]\n"
               "  [--slots-per-worker=4] [--records-per-second=10] [--channels=32]\n"
               "  [--probe-workers=N (default 1%% of workers)] [--rendezvous-world=1024 (0: "
               "none)]\n"
               "  [--register-concurrency=64] [--duration=300s] [--warmup=auto|60s]\n"
               "  [--sample-every=30s] [--coordinator-arg=FLAG ...]\n");
}

ParseResult ParseFlags(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (kv[0] == "--help" || kv[0] == "-h") return ParseResult::kHelp;
    if (kv.size() != 2) {
      std::fprintf(stderr, "coordinator_load: bad flag \"%s\"\n", argv[i]);
      return ParseResult::kBadFlag;
    }
    if (kv[0] == "--coordinator-arg") {
      o->coordinator_args.push_back(kv[1]);
      continue;
    }
    bool ok = false;
    if (ParseDurationFlag(kv[0], kv[1], o, &ok)) {
      if (!ok) {
        std::fprintf(stderr, "coordinator_load: bad duration \"%s\"\n", argv[i]);
        return ParseResult::kBadFlag;
      }
      continue;
    }
    if (!ParseIntFlag(kv[0], kv[1], o)) {
      std::fprintf(stderr, "coordinator_load: bad flag \"%s\"\n", argv[i]);
      return ParseResult::kBadFlag;
    }
  }
  if (o->probe_workers < 0) o->probe_workers = std::max(1, o->workers / 100);
  if (o->warmup.count() < 0) o->warmup = seconds(kRecentSteps / o->records_per_second + 10);
  o->probe_workers = std::min(o->probe_workers, o->workers);
  return ParseResult::kRun;
}

}  // namespace aidn::bench
