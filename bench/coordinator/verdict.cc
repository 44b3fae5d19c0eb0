#include "bench/coordinator/verdict.h"

#include <algorithm>
#include <chrono>
#include <set>

#include "tests/integration/cluster_fixture.h"

namespace aidn::bench {

using std::chrono::seconds;

Verdict ReadVerdict(v1::CoordinatorService::Stub* stub, const std::string& token,
                    const std::string& rendezvous_job) {
  Verdict v;
  {
    v1::ListWorkersResponse r;
    grpc::Status s = stub->ListWorkers(testing::Context(token, seconds(60)).get(), {}, &r);
    if (!s.ok()) {
      v.read_ok = false;
      v.error = "ListWorkers: " + s.error_message();
    }
    v.workers_listed = r.workers_size();
    for (const v1::Worker& w : r.workers()) v.workers_lost_now += w.state() == v1::Worker::LOST;
  }
  const std::set<std::string> kinds = {"worker.lost",       "worker.back", "worker.reregistered",
                                       "job.restarting",    "job.failed",  "job.hang",
                                       "rendezvous.timeout"};
  for (const std::string& k : kinds) v.events[k] = 0;
  int64_t after = 0;
  while (true) {
    v1::ListEventsRequest request;
    request.set_after_seq(after);
    request.set_limit(10'000);
    v1::ListEventsResponse r;
    grpc::Status s = stub->ListEvents(testing::Context(token, seconds(60)).get(), request, &r);
    if (!s.ok()) {
      v.read_ok = false;
      v.error = "ListEvents: " + s.error_message();
      break;
    }
    for (const v1::Event& e : r.events()) {
      if (kinds.contains(e.type())) ++v.events[e.type()];
      after = std::max(after, e.seq());
    }
    if (r.events_size() < 10'000) break;
  }
  std::string page;
  do {
    v1::ListJobsRequest request;
    request.set_page_size(1000);
    request.set_page_token(page);
    v1::ListJobsResponse r;
    grpc::Status s = stub->ListJobs(testing::Context(token, seconds(60)).get(), request, &r);
    if (!s.ok()) {
      v.read_ok = false;
      v.error = "ListJobs: " + s.error_message();
      break;
    }
    for (const v1::Job& j : r.jobs()) {
      v.restarts += j.restarts();
      v.jobs_failed += j.state() == v1::Job::FAILED;
      if (j.id() == rendezvous_job) v.rendezvous_job_state = v1::Job::State_Name(j.state());
    }
    page = r.next_page_token();
  } while (!page.empty());
  return v;
}

}  // namespace aidn::bench
