#ifndef AIDN_AIDNCTL_CONFIG_H_
#define AIDN_AIDNCTL_CONFIG_H_

// Where aidnctl finds the coordinator, how it verifies it, and its bearer
// token.
//
// Each setting comes from the first of these that has it:
//   1. the flag (--addr, --token, --tls-ca, --insecure);
//   2. the environment (AIDN_ADDR, AIDN_TOKEN, AIDN_TLS_CA, AIDN_INSECURE=1;
//      an empty variable counts as unset);
//   3. the config file, $HOME/.config/aidn/config, YAML with the keys
//        addr: coordinator.example.com:7070
//        token: 3f9a...            # or:
//        token_file: ~/.aidn-token # its contents, trimmed, are the token
//        tls_ca: ~/.aidn-ca.pem    # the coordinator's <state-dir>/tls/ca.pem
//        insecure: true            # plaintext, to a coordinator run with --insecure
//      (a relative token_file or tls_ca is taken relative to the config
//      file's directory);
//   4. the default address 127.0.0.1:7070, no token, TLS verified with the
//      system's roots.
// An address without a port gets :7070.

#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/file.h"

namespace aidn::ctl {

inline constexpr char kDefaultAddress[] = "127.0.0.1:7070";
inline constexpr char kDefaultPort[] = "7070";

// What the command line said; nullopt where the flag was not given.
struct ConnectionFlags {
  std::optional<std::string> address;
  std::optional<std::string> token;
  std::optional<std::string> tls_ca;
  bool insecure = false;
};

struct ConnectionSettings {
  // host:port of the coordinator.
  std::string address = kDefaultAddress;
  // Bearer token; empty: none is sent.
  std::string token;
  // The CA file that verifies the coordinator (empty: the system's roots),
  // or plaintext.
  std::string tls_ca_file;
  bool insecure = false;
};

// Reads a whole file; NOT_FOUND if it does not exist.
using FileReader = std::function<absl::StatusOr<std::string>(const std::string& path)>;
using ::aidn::ReadFileToString;

// Resolves the settings without touching the process: `env` holds the
// environment (AIDN_ADDR, AIDN_TOKEN, HOME are read), `config_text` the config
// file's contents (nullopt: there is none) and `config_path` its name for
// errors and for resolving a relative token_file, which `read_file` reads
// (only when the token comes from it). A malformed config file, an unknown
// key in it, both token and token_file, or an unreadable or empty token file
// is INVALID_ARGUMENT naming the file.
absl::StatusOr<ConnectionSettings> ResolveConnection(
    const ConnectionFlags& flags, const std::map<std::string, std::string>& env,
    const std::optional<std::string>& config_text, const std::string& config_path,
    const FileReader& read_file = ReadFileToString);

// $HOME/.config/aidn/config, or "" without HOME.
std::string DefaultConfigPath(const std::map<std::string, std::string>& env);

// ResolveConnection over this process's environment and the config file at
// DefaultConfigPath (a missing file is no error).
absl::StatusOr<ConnectionSettings> LoadConnection(const ConnectionFlags& flags);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_CONFIG_H_
