// Tests of how aidnctl finds the coordinator: address and token from flags,
// environment, config file and defaults.

#include "aidnctl/config.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aidn::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

using Env = std::map<std::string, std::string>;

// ---------------------------------------------------------------------------
// Connection settings.

// A FileReader over a map; NOT_FOUND for other paths.
FileReader FakeFiles(std::map<std::string, std::string> files) {
  return [files = std::move(files)](const std::string& path) -> absl::StatusOr<std::string> {
    auto it = files.find(path);
    if (it == files.end()) return absl::NotFoundError(absl::StrCat(path, ": No such file"));
    return it->second;
  };
}

ConnectionSettings MustResolve(const ConnectionFlags& flags, const Env& env,
                               const std::optional<std::string>& config,
                               const FileReader& files = FakeFiles({})) {
  absl::StatusOr<ConnectionSettings> settings =
      ResolveConnection(flags, env, config, "/home/u/.config/aidn/config", files);
  EXPECT_TRUE(settings.ok()) << settings.status();
  ConnectionSettings failed;
  failed.address = failed.token = "<error>";
  return settings.ok() ? *settings : failed;
}

std::string ResolveError(const std::optional<std::string>& config,
                         const FileReader& files = FakeFiles({}), const Env& env = {}) {
  absl::StatusOr<ConnectionSettings> settings =
      ResolveConnection({}, env, config, "/home/u/.config/aidn/config", files);
  EXPECT_FALSE(settings.ok());
  return settings.ok() ? "" : std::string(settings.status().message());
}

TEST(ResolveConnection, UsesTheDefaultAddressAndNoTokenWhenNothingIsSet) {
  const ConnectionSettings settings = MustResolve({}, {}, std::nullopt);
  EXPECT_EQ(settings.address, "127.0.0.1:7070");
  EXPECT_EQ(settings.token, "");
}

TEST(ResolveConnection, PrefersFlagThenEnvironmentThenFileThenDefault) {
  const std::string file = "addr: file-host:1\ntoken: file-token\n";
  const Env env = {{"AIDN_ADDR", "env-host:2"}, {"AIDN_TOKEN", "env-token"}};
  ConnectionFlags flags;
  flags.address = "flag-host:3";
  flags.token = "flag-token";

  ConnectionSettings settings = MustResolve(flags, env, file);
  EXPECT_EQ(settings.address, "flag-host:3");
  EXPECT_EQ(settings.token, "flag-token");

  settings = MustResolve({}, env, file);
  EXPECT_EQ(settings.address, "env-host:2");
  EXPECT_EQ(settings.token, "env-token");

  settings = MustResolve({}, {}, file);
  EXPECT_EQ(settings.address, "file-host:1");
  EXPECT_EQ(settings.token, "file-token");

  settings = MustResolve({}, {}, "token: only-token\n");
  EXPECT_EQ(settings.address, "127.0.0.1:7070");
  EXPECT_EQ(settings.token, "only-token");
}

TEST(ResolveConnection, EachSettingFallsBackOnItsOwn) {
  ConnectionFlags flags;
  flags.token = "flag-token";
  const ConnectionSettings settings =
      MustResolve(flags, {{"AIDN_ADDR", "env-host:2"}}, "addr: file-host:1\ntoken: t\n");
  EXPECT_EQ(settings.address, "env-host:2");
  EXPECT_EQ(settings.token, "flag-token");
}

TEST(ResolveConnection, AnEmptyEnvironmentVariableCountsAsUnset) {
  const ConnectionSettings settings =
      MustResolve({}, {{"AIDN_ADDR", ""}, {"AIDN_TOKEN", ""}}, "addr: file-host:1\ntoken: t\n");
  EXPECT_EQ(settings.address, "file-host:1");
  EXPECT_EQ(settings.token, "t");
}

TEST(ResolveConnection, AnEmptyTokenFlagSendsNoToken) {
  ConnectionFlags flags;
  flags.token = "";
  EXPECT_EQ(MustResolve(flags, {{"AIDN_TOKEN", "env-token"}}, std::nullopt).token, "");
}

TEST(ResolveConnection, AnAddressWithoutPortGetsTheDefaultPort) {
  ConnectionFlags flags;
  flags.address = "coordinator.example.com";
  EXPECT_EQ(MustResolve(flags, {}, std::nullopt).address, "coordinator.example.com:7070");
  flags.address = "[::1]:9000";
  EXPECT_EQ(MustResolve(flags, {}, std::nullopt).address, "[::1]:9000");
}

TEST(ResolveConnection, ReadsATrimmedTokenFileBesideTheConfigFile) {
  const FileReader files = FakeFiles({{"/home/u/.config/aidn/token", "  s3cret\n"},
                                      {"/home/u/keys/aidn", "home-token\n"},
                                      {"/etc/aidn/token", "abs-token"}});
  EXPECT_EQ(MustResolve({}, {}, "token_file: token\n", files).token, "s3cret");
  EXPECT_EQ(MustResolve({}, {{"HOME", "/home/u"}}, "token_file: ~/keys/aidn\n", files).token,
            "home-token");
  EXPECT_EQ(MustResolve({}, {}, "token_file: /etc/aidn/token\n", files).token, "abs-token");
  // A token from the flag or the environment wins without reading the file.
  EXPECT_EQ(MustResolve({}, {{"AIDN_TOKEN", "env"}}, "token_file: /missing\n", files).token, "env");
}

TEST(ResolveConnection, ABadTokenFileIsAnErrorNamingTheConfigFile) {
  const FileReader files = FakeFiles({{"/empty", " \n"}});
  EXPECT_THAT(ResolveError("token_file: /missing\n", files),
              HasSubstr("/home/u/.config/aidn/config: token_file: cannot read /missing"));
  EXPECT_THAT(ResolveError("token_file: /empty\n", files),
              HasSubstr("/home/u/.config/aidn/config: token_file: /empty is empty"));
  EXPECT_THAT(ResolveError("token: a\ntoken_file: /empty\n", files), HasSubstr("not both"));
}

TEST(ResolveConnection, AMalformedConfigFileIsAnErrorNamingTheFile) {
  EXPECT_THAT(ResolveError("addr: [unclosed\n"), StartsWith("/home/u/.config/aidn/config: line "));
  EXPECT_THAT(ResolveError("- a\n- b\n"), StartsWith("/home/u/.config/aidn/config: expected"));
  EXPECT_THAT(ResolveError("addr: x\nadress: y\n"),
              HasSubstr("/home/u/.config/aidn/config: line 2: unknown key \"adress\""));
  EXPECT_THAT(ResolveError("addr: {host: x}\n"), HasSubstr("addr must be a string"));
}

TEST(ResolveConnection, TlsSettingsComeFromTheFlagTheEnvironmentOrTheConfigFile) {
  // Default: TLS verified with the system's roots.
  ConnectionSettings s = MustResolve({}, {}, std::nullopt);
  EXPECT_EQ(s.tls_ca_file, "");
  EXPECT_FALSE(s.insecure);
  // The config file: tls_ca beside it, or insecure.
  EXPECT_EQ(MustResolve({}, {}, "tls_ca: ca.pem\n").tls_ca_file, "/home/u/.config/aidn/ca.pem");
  EXPECT_EQ(MustResolve({}, {{"HOME", "/home/u"}}, "tls_ca: ~/ca.pem\n").tls_ca_file,
            "/home/u/ca.pem");
  EXPECT_TRUE(MustResolve({}, {}, "insecure: true\n").insecure);
  EXPECT_THAT(ResolveError("insecure: maybe\n"), HasSubstr("insecure must be true or false"));
  // The environment over the file, the flags over both.
  s = MustResolve({}, {{"AIDN_TLS_CA", "/etc/aidn/ca.pem"}}, "insecure: true\n");
  EXPECT_EQ(s.tls_ca_file, "/etc/aidn/ca.pem");
  EXPECT_FALSE(s.insecure);
  ConnectionFlags insecure;
  insecure.insecure = true;
  s = MustResolve(insecure, {{"AIDN_TLS_CA", "/etc/aidn/ca.pem"}}, std::nullopt);
  EXPECT_TRUE(s.insecure);
  EXPECT_EQ(s.tls_ca_file, "");
  ConnectionFlags ca;
  ca.tls_ca = "/x.pem";
  s = MustResolve(ca, {{"AIDN_INSECURE", "1"}}, std::nullopt);
  EXPECT_EQ(s.tls_ca_file, "/x.pem");
  EXPECT_FALSE(s.insecure);
}

TEST(ResolveConnection, AnEmptyConfigFileIsNoError) {
  EXPECT_EQ(MustResolve({}, {}, "").address, "127.0.0.1:7070");
  EXPECT_EQ(MustResolve({}, {}, "# nothing yet\n").address, "127.0.0.1:7070");
}

// Sets an environment variable for the life of the object.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(LoadConnection, ReadsTheConfigFileUnderHome) {
  const std::filesystem::path home =
      std::filesystem::path(testing::TempDir()) / absl::StrCat("aidnctl-home-", getpid());
  std::filesystem::create_directories(home / ".config/aidn");
  std::ofstream(home / ".config/aidn/config") << "addr: from-file:9\ntoken_file: t\n";
  std::ofstream(home / ".config/aidn/t") << "file-token\n";
  ScopedEnv home_env("HOME", home.string());
  ScopedEnv addr_env("AIDN_ADDR", "");
  ScopedEnv token_env("AIDN_TOKEN", "");

  absl::StatusOr<ConnectionSettings> settings = LoadConnection({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->address, "from-file:9");
  EXPECT_EQ(settings->token, "file-token");

  std::ofstream(home / ".config/aidn/config") << "addr: [\n";
  EXPECT_THAT(std::string(LoadConnection({}).status().message()),
              HasSubstr((home / ".config/aidn/config").string()));

  std::filesystem::remove_all(home / ".config");
  settings = LoadConnection({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->address, "127.0.0.1:7070");
  std::filesystem::remove_all(home);
}

}  // namespace
}  // namespace aidn::ctl
