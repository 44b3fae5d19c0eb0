#ifndef AIDN_COMMON_FLAGS_H_
#define AIDN_COMMON_FLAGS_H_

// Command-line helpers shared by the binaries' main.cc files. Header-only;
// PrintFlagsHelpIfAsked needs the binary to link absl::flags_parse (which
// brings absl::flags_reflection).

#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"

namespace aidn {

// Abseil flags are spelled with underscores; people type dashes
// (--state-dir). Accept both by rewriting the name part of each "--flag" or
// "--flag=value" argument (values are left alone, and so is argv[0]). The
// returned pointers point into `*storage`, which must outlive them.
inline std::vector<char*> NormalizeFlagNames(int argc, char** argv,
                                             std::vector<std::string>* storage) {
  storage->clear();
  storage->reserve(argc);
  std::vector<char*> out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0 && arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
      const size_t end = std::min(arg.find('='), arg.size());
      for (size_t j = 2; j < end; ++j) {
        if (arg[j] == '-') arg[j] = '_';
      }
    }
    storage->push_back(std::move(arg));
  }
  // Pointers are taken only once the vector is complete: it no longer moves.
  out.reserve(storage->size());
  for (std::string& s : *storage) out.push_back(s.data());
  return out;
}

// Abseil's own --help lists only flags defined in a file named after the
// binary (aidn-coordinator.cc), so none of ours, and exits 1. If argv asks
// for help (-h, --help, --helpshort), this prints `usage` and every flag
// defined in a file whose path ends in `main_file` ("coordinator/main.cc"),
// dashed, sorted, with its default, to stdout and returns true: main then
// exits 0. --helpfull stays Abseil's (its own flags too).
inline bool PrintFlagsHelpIfAsked(int argc, char** argv, std::string_view usage,
                                  std::string_view main_file) {
  bool asked = false;
  for (int i = 1; i < argc && !asked; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") break;
    asked = arg == "-h" || arg == "--help" || arg == "-help" || arg == "--helpshort";
  }
  if (!asked) return false;
  struct Row {
    std::string name, help, default_value;
  };
  std::vector<Row> rows;
  size_t width = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = flag->Filename();
    if (file.size() < main_file.size() ||
        file.compare(file.size() - main_file.size(), main_file.size(), main_file) != 0) {
      continue;
    }
    Row row{"--" + std::string(name), flag->Help(), flag->DefaultValue()};
    std::replace(row.name.begin(), row.name.end(), '_', '-');
    if (flag->IsOfType<std::string>()) row.default_value = "\"" + row.default_value + "\"";
    width = std::max(width, row.name.size());
    rows.push_back(std::move(row));
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.name < b.name; });
  std::printf(
      "%.*s\n\nFlags (--flag=value; dashes or underscores; --helpfull lists Abseil's too):\n",
      static_cast<int>(usage.size()), usage.data());
  for (const Row& row : rows) {
    std::printf("  %-*s  %s (default: %s)\n", static_cast<int>(width), row.name.c_str(),
                row.help.c_str(), row.default_value.c_str());
  }
  std::fflush(stdout);
  return true;
}

}  // namespace aidn

#endif  // AIDN_COMMON_FLAGS_H_
