#include "aidnctl/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "yaml-cpp/yaml.h"

namespace aidn::ctl {
namespace {

// What the config file says; unset keys stay empty.
struct ConfigFile {
  std::optional<std::string> address;
  std::optional<std::string> token;
  std::optional<std::string> token_file;
  std::optional<std::string> tls_ca;
  std::optional<std::string> insecure;
};

absl::StatusOr<ConfigFile> ParseConfigFile(const std::string& text, const std::string& path) {
  ConfigFile config;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": line ", e.mark.line + 1, ", column ",
                                                   e.mark.column + 1, ": ", e.msg));
  }
  if (!root || root.IsNull()) return config;  // an empty file
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": expected a mapping with the keys addr, token, token_file, tls_ca, "
                     "insecure"));
  }
  for (const auto& entry : root) {
    const std::string key = entry.first.IsScalar() ? entry.first.Scalar() : "";
    const int line = entry.first.Mark().line + 1;
    std::optional<std::string>* slot = nullptr;
    if (key == "addr") {
      slot = &config.address;
    } else if (key == "token") {
      slot = &config.token;
    } else if (key == "token_file") {
      slot = &config.token_file;
    } else if (key == "tls_ca") {
      slot = &config.tls_ca;
    } else if (key == "insecure") {
      slot = &config.insecure;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", line, ": unknown key \"", key,
                       "\" (known: addr, token, token_file, tls_ca, insecure)"));
    }
    if (slot->has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", line, ": ", key, " is set twice"));
    }
    if (entry.second.IsNull()) continue;  // "token:" with nothing after it
    if (!entry.second.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": line ", line, ": ", key, " must be a string"));
    }
    *slot = entry.second.Scalar();
  }
  if (config.insecure.has_value() && *config.insecure != "true" && *config.insecure != "false") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": insecure must be true or false, got \"", *config.insecure, "\""));
  }
  if (config.token.has_value() && config.token_file.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": set either token or token_file, not both"));
  }
  return config;
}

std::string Lookup(const std::map<std::string, std::string>& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? "" : it->second;
}

// "~/x" under HOME; a relative path beside the config file.
std::string ConfigRelativePath(const std::string& token_file, const std::string& config_path,
                               const std::map<std::string, std::string>& env) {
  if (token_file == "~" || absl::StartsWith(token_file, "~/")) {
    return Lookup(env, "HOME") + token_file.substr(1);
  }
  if (absl::StartsWith(token_file, "/")) return token_file;
  const size_t slash = config_path.rfind('/');
  if (slash == std::string::npos) return token_file;
  return config_path.substr(0, slash + 1) + token_file;
}

std::string WithDefaultPort(const std::string& address) {
  // Only a bare host name or IPv4 address gets the port: anything with a
  // colon already names one (host:port, [v6]:port) or a scheme (unix:/path).
  if (address.find(':') != std::string::npos) return address;
  return absl::StrCat(address, ":", kDefaultPort);
}

}  // namespace

absl::StatusOr<ConnectionSettings> ResolveConnection(const ConnectionFlags& flags,
                                                     const std::map<std::string, std::string>& env,
                                                     const std::optional<std::string>& config_text,
                                                     const std::string& config_path,
                                                     const FileReader& read_file) {
  ConfigFile config;
  if (config_text.has_value()) {
    AIDN_ASSIGN_OR_RETURN(config, ParseConfigFile(*config_text, config_path));
  }

  ConnectionSettings settings;
  const std::string env_address = Lookup(env, "AIDN_ADDR");
  if (flags.address.has_value()) {
    if (flags.address->empty()) return absl::InvalidArgumentError("--addr is empty");
    settings.address = *flags.address;
  } else if (!env_address.empty()) {
    settings.address = env_address;
  } else if (config.address.has_value() && !config.address->empty()) {
    settings.address = *config.address;
  } else {
    settings.address = kDefaultAddress;
  }
  settings.address = WithDefaultPort(settings.address);

  const std::string env_token = Lookup(env, "AIDN_TOKEN");
  if (flags.token.has_value()) {
    settings.token = *flags.token;
  } else if (!env_token.empty()) {
    settings.token = env_token;
  } else if (config.token.has_value()) {
    settings.token = *config.token;
  } else if (config.token_file.has_value() && !config.token_file->empty()) {
    const std::string path = ConfigRelativePath(*config.token_file, config_path, env);
    absl::StatusOr<std::string> contents = read_file(path);
    if (!contents.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path, ": token_file: cannot read ", contents.status().message()));
    }
    settings.token = std::string(absl::StripAsciiWhitespace(*contents));
    if (settings.token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path, ": token_file: ", path, " is empty"));
    }
  }

  const std::string env_ca = Lookup(env, "AIDN_TLS_CA");
  const std::string env_insecure = Lookup(env, "AIDN_INSECURE");
  if (flags.insecure || flags.tls_ca.has_value()) {
    settings.insecure = flags.insecure;
    settings.tls_ca_file = flags.tls_ca.value_or("");
  } else if (!env_insecure.empty() || !env_ca.empty()) {
    settings.insecure = env_insecure == "1" || env_insecure == "true";
    settings.tls_ca_file = env_ca;
  } else {
    settings.insecure = config.insecure.value_or("false") == "true";
    if (config.tls_ca.has_value() && !config.tls_ca->empty()) {
      settings.tls_ca_file = ConfigRelativePath(*config.tls_ca, config_path, env);
    }
  }
  if (settings.insecure && !settings.tls_ca_file.empty() && flags.insecure) {
    return absl::InvalidArgumentError("--insecure and --tls-ca: pick one");
  }
  if (settings.insecure) settings.tls_ca_file.clear();
  return settings;
}

std::string DefaultConfigPath(const std::map<std::string, std::string>& env) {
  const std::string home = Lookup(env, "HOME");
  if (home.empty()) return "";
  return absl::StrCat(home, "/.config/aidn/config");
}

absl::StatusOr<ConnectionSettings> LoadConnection(const ConnectionFlags& flags) {
  std::map<std::string, std::string> env;
  for (const char* name : {"AIDN_ADDR", "AIDN_TOKEN", "AIDN_TLS_CA", "AIDN_INSECURE", "HOME"}) {
    if (const char* value = std::getenv(name)) env[name] = value;
  }
  const std::string path = DefaultConfigPath(env);
  std::optional<std::string> text;
  if (!path.empty()) {
    absl::StatusOr<std::string> contents = ReadFileToString(path);
    if (contents.ok()) {
      text = std::move(*contents);
    } else if (!absl::IsNotFound(contents.status())) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read config file ", contents.status().message()));
    }
  }
  return ResolveConnection(flags, env, text, path);
}

}  // namespace aidn::ctl
