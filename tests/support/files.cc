#include "tests/support/files.h"

#include <stdio.h>
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace aidn::testing {
namespace {

std::string TempRoot() {
  const char* tmpdir = getenv("TMPDIR");
  return (tmpdir != nullptr && tmpdir[0] != '\0') ? tmpdir : "/tmp";
}

}  // namespace

TempDir::TempDir(const std::string& prefix) : path_(MakeTempDir(prefix)) {}

TempDir::~TempDir() {
  if (keep_) {
    fprintf(stderr, "kept %s\n", path_.c_str());
  } else {
    RemoveTree(path_);
  }
}

std::string MakeTempDir(const std::string& prefix) {
  std::string path = TempRoot() + "/" + prefix + ".XXXXXX";
  if (mkdtemp(path.data()) == nullptr) {
    fprintf(stderr, "mkdtemp %s: %s\n", path.c_str(), strerror(errno));
    abort();
  }
  return path;
}

void RemoveTree(const std::string& path) {
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

void WriteFileOrDie(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
  out.close();
  if (!out) {
    fprintf(stderr, "cannot write %s\n", path.c_str());
    abort();
  }
}

std::string TensorBytes(const std::string& path) {
  const std::string all = ReadFileOrEmpty(path);
  if (all.size() < 8) return "";
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(all[i]);
  if (8 + n > all.size()) return "";
  return all.substr(8 + n);
}

}  // namespace aidn::testing
