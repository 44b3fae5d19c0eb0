#ifndef AIDN_COMMON_FLAGS_H_
#define AIDN_COMMON_FLAGS_H_

// Command-line helpers shared by the binaries' main.cc files. Header-only: it
// needs nothing beyond the standard library.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

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

}  // namespace aidn

#endif  // AIDN_COMMON_FLAGS_H_
