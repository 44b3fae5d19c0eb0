#include "coordinator/auth.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "tests/unit/coordinator/coordinator_fixture.h"

namespace aidn::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using test_util::TempDir;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

std::string Bearer(const std::string& token) { return "Bearer " + token; }

constexpr char kUserToken[] = "user-token-0123456789abcdef";
constexpr char kOpsToken[] = "ops-token-0123456789abcdef";
constexpr char kBotToken[] = "bot-token-0123456789abcdef";

TEST(Authenticator, CreateWritesAdminAndWorkerTokensWithMode0600) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::Create({dir.path(), ""});
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ((*auth)->admin_token_path(), dir.path() + "/admin.token");
  EXPECT_EQ((*auth)->worker_token_path(), dir.path() + "/worker.token");
  for (const std::string& path : {(*auth)->admin_token_path(), (*auth)->worker_token_path()}) {
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
    const std::string text = ReadFile(path);
    EXPECT_EQ(text.back(), '\n') << path;
    EXPECT_EQ(text.find('\n'), text.size() - 1) << path << " should hold one line";
    EXPECT_GE(absl::StripAsciiWhitespace(text).size(), 16u) << path;
  }

  const std::string admin(absl::StripAsciiWhitespace(ReadFile((*auth)->admin_token_path())));
  const std::string worker(absl::StripAsciiWhitespace(ReadFile((*auth)->worker_token_path())));
  EXPECT_NE(admin, worker);
  absl::StatusOr<Principal> p = (*auth)->Authenticate(Bearer(admin));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kAdmin);
  p = (*auth)->Authenticate(Bearer(worker));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kWorker);
}

TEST(Authenticator, SecondCreateReusesTheSameTokens) {
  TempDir dir;
  auto first = Authenticator::Create({dir.path(), ""});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string admin = ReadFile((*first)->admin_token_path());
  const std::string worker = ReadFile((*first)->worker_token_path());

  auto second = Authenticator::Create({dir.path(), ""});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(ReadFile((*second)->admin_token_path()), admin);
  EXPECT_EQ(ReadFile((*second)->worker_token_path()), worker);
  absl::StatusOr<Principal> p =
      (*second)->Authenticate(Bearer(std::string(absl::StripAsciiWhitespace(admin))));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kAdmin);
}

TEST(Authenticator, TwoStateDirsGetDifferentTokens) {
  TempDir a, b;
  auto first = Authenticator::Create({a.path(), ""});
  auto second = Authenticator::Create({b.path(), ""});
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(ReadFile((*first)->admin_token_path()), ReadFile((*second)->admin_token_path()));
}

TEST(Authenticator, RefusesAStateDirTokenThatIsTooShort) {
  TempDir dir;
  WriteFile(dir.path() + "/admin.token", "short\n");
  auto auth = Authenticator::Create({dir.path(), ""});
  EXPECT_FALSE(auth.ok());
}

TEST(Authenticator, TokenFileAddsTokensSkippingCommentsAndBlankLines) {
  TempDir dir;
  const std::string file = dir.path() + "/tokens";
  WriteFile(file, absl::StrCat("# extra tokens\n", "\n", "   \n", kUserToken, " user alice\n", "  ",
                               kOpsToken, "\tadmin   ops  \n", "# ", kBotToken,
                               " worker commented-out\n", kBotToken, " worker\n"));
  auto auth = Authenticator::Create({dir.path(), file});
  ASSERT_TRUE(auth.ok()) << auth.status();

  absl::StatusOr<Principal> p = (*auth)->Authenticate(Bearer(kUserToken));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kUser);
  EXPECT_EQ(p->name, "alice");

  p = (*auth)->Authenticate(Bearer(kOpsToken));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kAdmin);
  EXPECT_EQ(p->name, "ops");

  p = (*auth)->Authenticate(Bearer(kBotToken));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kWorker);

  // The generated tokens are still there beside them.
  const std::string admin(absl::StripAsciiWhitespace(ReadFile((*auth)->admin_token_path())));
  EXPECT_TRUE((*auth)->Authenticate(Bearer(admin)).ok());
}

TEST(Authenticator, TokenFileWithABadRoleNamesFileAndLine) {
  TempDir dir;
  const std::string file = dir.path() + "/tokens";
  WriteFile(file, absl::StrCat("# comment\n", kUserToken, " user alice\n", kOpsToken, " root\n"));
  auto auth = Authenticator::Create({dir.path(), file});
  ASSERT_FALSE(auth.ok());
  EXPECT_THAT(auth.status().message(), HasSubstr(file + ":3"));
  EXPECT_THAT(auth.status().message(), HasSubstr("root"));
}

TEST(Authenticator, TokenFileWithAShortTokenIsRefused) {
  TempDir dir;
  const std::string file = dir.path() + "/tokens";
  WriteFile(file, "tooshort user bob\n");
  auto auth = Authenticator::Create({dir.path(), file});
  ASSERT_FALSE(auth.ok());
  EXPECT_THAT(auth.status().message(), HasSubstr(file + ":1"));
  EXPECT_THAT(auth.status().message(), HasSubstr("16"));
}

TEST(Authenticator, TokenFileLineWithoutARoleOrWithTooManyFieldsIsRefused) {
  TempDir dir;
  const std::string file = dir.path() + "/tokens";
  WriteFile(file, absl::StrCat(kUserToken, "\n"));
  auto auth = Authenticator::Create({dir.path(), file});
  ASSERT_FALSE(auth.ok());
  EXPECT_THAT(auth.status().message(), HasSubstr(file + ":1"));

  WriteFile(file, absl::StrCat(kUserToken, " user alice extra\n"));
  auth = Authenticator::Create({dir.path(), file});
  ASSERT_FALSE(auth.ok());
  EXPECT_THAT(auth.status().message(), HasSubstr(file + ":1"));
}

TEST(Authenticator, TokenFileNamesAUsersProjects) {
  TempDir dir;
  const std::string file = dir.path() + "/tokens";
  WriteFile(file, absl::StrCat(kUserToken, " user alice projects=vision,nlp\n"));
  auto auth = Authenticator::Create({dir.path(), file});
  ASSERT_TRUE(auth.ok()) << auth.status();
  absl::StatusOr<Principal> p = (*auth)->Authenticate(Bearer(kUserToken));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "alice");
  EXPECT_EQ(p->projects, (std::vector<std::string>{"vision", "nlp"}));

  WriteFile(file, absl::StrCat(kUserToken, " user alice projects=\n"));
  auth = Authenticator::Create({dir.path(), file});
  ASSERT_FALSE(auth.ok());
  EXPECT_THAT(auth.status().message(), HasSubstr("projects= names none"));
}

TEST(MayAccess, OwnersTheirProjectsAndAdminsOnly) {
  v1::Job job;
  job.set_id("job-7");
  job.set_owner("alice");
  const Principal alice{Role::kUser, "alice", "", {}};
  const Principal bob{Role::kUser, "bob", "", {"nlp"}};
  const Principal admin{Role::kAdmin, "admin", "", {}};
  const Principal worker{Role::kWorker, "worker", "", {}};
  EXPECT_TRUE(MayAccess(alice, job));
  EXPECT_FALSE(MayAccess(bob, job));
  EXPECT_TRUE(MayAccess(admin, job));
  EXPECT_FALSE(MayAccess(worker, job));
  EXPECT_THAT(RequireAccess(bob, job).message(), HasSubstr("job-7 belongs to alice"));
  (*job.mutable_spec()->mutable_labels())["project"] = "nlp";
  EXPECT_TRUE(MayAccess(bob, job));
  (*job.mutable_spec()->mutable_labels())["project"] = "vision";
  EXPECT_FALSE(MayAccess(bob, job));
  EXPECT_THAT(RequireAccess(bob, job).message(), HasSubstr("(project vision)"));
}

TEST(Authenticator, MissingTokenFileIsAnError) {
  TempDir dir;
  auto auth = Authenticator::Create({dir.path(), dir.path() + "/no-such-file"});
  ASSERT_FALSE(auth.ok());
  EXPECT_THAT(auth.status().message(), HasSubstr("no-such-file"));
}

TEST(Authenticate, MissingMalformedAndUnknownAreUnauthenticatedWithoutEchoingTheToken) {
  std::unique_ptr<Authenticator> auth = Authenticator::CreateEmpty();
  const std::string secret = "s3cret-token-0123456789abcdef";
  auth->AddToken(secret, Principal{Role::kUser, "alice", ""});
  const std::string unknown = "unknown-token-0123456789abcdef";

  const std::vector<std::string> bad = {
      "",                       // missing
      "Basic " + secret,        // wrong scheme
      "Basic x",                // wrong scheme
      secret,                   // no scheme
      "Bearer",                 // no token
      "Bearer" + secret,        // no space
      "Bearer " + unknown,      // unknown
      "Bearer " + secret + "x"  // near miss
  };
  for (const std::string& header : bad) {
    absl::StatusOr<Principal> p = auth->Authenticate(header);
    ASSERT_FALSE(p.ok()) << "accepted \"" << header << "\"";
    EXPECT_EQ(p.status().code(), absl::StatusCode::kUnauthenticated) << header;
    EXPECT_THAT(std::string(p.status().message()), Not(HasSubstr(secret))) << header;
    EXPECT_THAT(std::string(p.status().message()), Not(HasSubstr(unknown))) << header;
    EXPECT_THAT(std::string(p.status().message()), Not(HasSubstr("Basic x"))) << header;
  }
}

TEST(Authenticate, BearerPrefixIsCaseInsensitive) {
  std::unique_ptr<Authenticator> auth = Authenticator::CreateEmpty();
  auth->AddToken(kUserToken, Principal{Role::kUser, "alice", ""});
  for (const char* scheme : {"Bearer ", "bearer ", "BEARER ", "bEaReR "}) {
    absl::StatusOr<Principal> p = auth->Authenticate(std::string(scheme) + kUserToken);
    ASSERT_TRUE(p.ok()) << scheme << ": " << p.status();
    EXPECT_EQ(p->name, "alice");
  }
}

TEST(Authenticate, TokensThemselvesAreCaseSensitive) {
  std::unique_ptr<Authenticator> auth = Authenticator::CreateEmpty();
  auth->AddToken("abcdefabcdefabcdef", Principal{Role::kUser, "alice", ""});
  EXPECT_FALSE(auth->Authenticate("Bearer ABCDEFABCDEFABCDEF").ok());
}

TEST(Authenticate, EmptyAuthenticatorKnowsNoToken) {
  std::unique_ptr<Authenticator> auth = Authenticator::CreateEmpty();
  EXPECT_EQ(auth->Authenticate(Bearer(kUserToken)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(Authenticate, TrainerTokensCanBeAddedAndRemoved) {
  std::unique_ptr<Authenticator> auth = Authenticator::CreateEmpty();
  const std::string token = "trainer-token-0123456789abcdef";
  auth->AddToken(token, Principal{Role::kTrainer, "trainer:job-1", "job-1"});
  absl::StatusOr<Principal> p = auth->Authenticate(Bearer(token));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->role, Role::kTrainer);
  EXPECT_EQ(p->job_id, "job-1");
  EXPECT_EQ(p->name, "trainer:job-1");

  auth->RemoveToken(token);
  p = auth->Authenticate(Bearer(token));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnauthenticated);
  // Removing an unknown token is harmless.
  auth->RemoveToken("never-added-0123456789abcdef");
}

Principal Admin() { return Principal{Role::kAdmin, "admin", ""}; }
Principal User() { return Principal{Role::kUser, "alice", ""}; }
Principal Worker() { return Principal{Role::kWorker, "worker", ""}; }
Principal TrainerOf(const std::string& job) {
  return Principal{Role::kTrainer, "trainer:" + job, job};
}

void ExpectDenied(const absl::Status& status, const std::string& what) {
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << what << ": " << status;
}

TEST(RequireUser, AllowsAdminAndUserOnly) {
  EXPECT_TRUE(RequireUser(Admin()).ok());
  EXPECT_TRUE(RequireUser(User()).ok());
  ExpectDenied(RequireUser(Worker()), "worker");
  ExpectDenied(RequireUser(TrainerOf("job-1")), "trainer");
}

TEST(RequireWorker, AllowsAdminAndWorkerOnly) {
  EXPECT_TRUE(RequireWorker(Admin()).ok());
  EXPECT_TRUE(RequireWorker(Worker()).ok());
  ExpectDenied(RequireWorker(User()), "user");
  ExpectDenied(RequireWorker(TrainerOf("job-1")), "trainer");
}

TEST(RequireTrainerOf, AllowsAdminWorkerAndThatJobsTrainer) {
  EXPECT_TRUE(RequireTrainerOf(Admin(), "job-1").ok());
  EXPECT_TRUE(RequireTrainerOf(Worker(), "job-1").ok());
  EXPECT_TRUE(RequireTrainerOf(TrainerOf("job-1"), "job-1").ok());
  ExpectDenied(RequireTrainerOf(User(), "job-1"), "user");
}

TEST(RequireTrainerOf, TrainerOfAnotherJobIsDenied) {
  absl::Status status = RequireTrainerOf(TrainerOf("job-1"), "job-2");
  ExpectDenied(status, "trainer of job-1 on job-2");
  // "job-1" is a prefix of "job-10": no prefix matching.
  ExpectDenied(RequireTrainerOf(TrainerOf("job-1"), "job-10"), "trainer of job-1 on job-10");
  ExpectDenied(RequireTrainerOf(TrainerOf(""), "job-1"), "trainer of no job");
}

TEST(RoleName, NamesEveryRole) {
  EXPECT_STREQ(RoleName(Role::kAdmin), "admin");
  EXPECT_STREQ(RoleName(Role::kUser), "user");
  EXPECT_STREQ(RoleName(Role::kWorker), "worker");
  EXPECT_STREQ(RoleName(Role::kTrainer), "trainer");
}

}  // namespace
}  // namespace aidn::coordinator
