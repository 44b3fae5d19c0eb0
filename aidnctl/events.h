#ifndef AIDN_AIDNCTL_EVENTS_H_
#define AIDN_AIDNCTL_EVENTS_H_

// `aidnctl events [JOB] --follow`: the coordinator's event log, of one job or
// of the whole cluster (jobs and workers), as it grows. (Without --follow,
// RunEvents prints one page.)
//
// It prints every event from --after on and then each new one as the
// coordinator records it (polling ListEvents after the last seq shown, every
// `interval`): table output as aligned lines under one header, -o json as
// JSON Lines (one Event per line), -o yaml as a stream of documents. With a
// job it ends once the job has ended and its last event is out; without one
// it runs until interrupted. A coordinator that is away or restarting
// (rpc::Transient) is asked again after a backoff, from the last seq shown,
// so nothing is missed or printed twice; it gives up when no call has
// succeeded for `reconnect_timeout`.

#include <string>

#include "absl/status/status.h"
#include "aidnctl/commands.h"

namespace aidn::ctl {

// RunEvents with options.follow (commands.h).
absl::Status FollowEvents(const CommandEnv& env, const EventsOptions& options);

// One event as --follow prints it in a table: SEQ TIME JOB TYPE MESSAGE in
// columns as wide as FollowedEventHeader's, wider values pushing the rest right.
std::string FollowedEventHeader();
std::string FollowedEventLine(const v1::Event& event);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_EVENTS_H_
