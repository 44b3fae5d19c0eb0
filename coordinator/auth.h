#ifndef AIDN_COORDINATOR_AUTH_H_
#define AIDN_COORDINATOR_AUTH_H_

// Bearer-token authentication and role checks.
//
// Roles: admin (everything), user (CoordinatorService, for its own jobs
// and its projects'), worker (ClusterService), trainer (a token scoped to one
// job, for that job's trainer calls only). At first start the state dir gets
// an admin token and a worker join token (files admin.token and
// worker.token, mode 0600); later starts reuse them. A token file adds more,
// one per line:
//   <token> <admin|user|worker> [<name>] [projects=<p>,<q>,...]
// A job belongs to the name of the token that submitted it (Job.owner). A
// user sees and changes its own jobs, and those whose spec has the label
// project=<p> for one of its projects; admins every job.
//
// Thread-safe.

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "aidn/v1/job.pb.h"

namespace aidn::coordinator {

enum class Role { kAdmin, kUser, kWorker, kTrainer };
const char* RoleName(Role role);

struct Principal {
  Role role = Role::kUser;
  // For logs and Job.owner: the token file's name, "admin", "worker", or
  // "trainer:<job>".
  std::string name;
  // kTrainer only: the job the token belongs to.
  std::string job_id;
  // kUser: the projects whose jobs it shares (the job label "project").
  std::vector<std::string> projects;
};

// The job label that shares a job with a project's users.
inline constexpr char kProjectLabel[] = "project";

// Whether `p` may see and change `job` (see above).
bool MayAccess(const Principal& p, const v1::Job& job);
// PERMISSION_DENIED naming the job's owner unless MayAccess.
absl::Status RequireAccess(const Principal& p, const v1::Job& job);

struct AuthOptions {
  // Where admin.token and worker.token live (created if missing).
  std::string state_dir;
  // Optional extra tokens.
  std::string token_file;
};

class Authenticator {
 public:
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(const AuthOptions& options);
  // An authenticator with no tokens, for tests that add their own.
  static std::unique_ptr<Authenticator> CreateEmpty();

  // `authorization` is the metadata value, "Bearer <token>". UNAUTHENTICATED
  // when it is missing, malformed or unknown (the message never echoes it).
  absl::StatusOr<Principal> Authenticate(absl::string_view authorization) const;

  void AddToken(const std::string& token, const Principal& principal);
  // Mutual TLS (--tls-client-ca): a worker token counts only over a
  // connection whose client certificate the server verified.
  void set_worker_certificates_required(bool required) { worker_certificates_required_ = required; }
  bool worker_certificates_required() const { return worker_certificates_required_; }
  void RemoveToken(const std::string& token);

  // Paths of the generated token files.
  const std::string& admin_token_path() const { return admin_token_path_; }
  const std::string& worker_token_path() const { return worker_token_path_; }

 private:
  Authenticator() = default;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Principal> tokens_ ABSL_GUARDED_BY(mu_);
  std::string admin_token_path_;
  bool worker_certificates_required_ = false;
  std::string worker_token_path_;
};

// PERMISSION_DENIED unless the principal may use CoordinatorService.
absl::Status RequireUser(const Principal& principal);
// PERMISSION_DENIED unless the principal is an admin (operating the
// cluster: cordoning, draining, removing workers).
absl::Status RequireAdmin(const Principal& principal);
// PERMISSION_DENIED unless the principal may act as a worker daemon.
absl::Status RequireWorker(const Principal& principal);
// PERMISSION_DENIED unless the principal may make trainer calls for `job_id`
// (admin, worker, or that job's trainer token).
absl::Status RequireTrainerOf(const Principal& principal, const std::string& job_id);

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_AUTH_H_
