#ifndef AIDN_TESTS_SUPPORT_FILES_H_
#define AIDN_TESTS_SUPPORT_FILES_H_

// Files and directories for tests: a temporary directory that removes
// itself, and whole-file reads and writes.

#include <string>

namespace aidn::testing {

// A new empty directory under $TMPDIR (or /tmp), named after `prefix`,
// removed with everything under it when the TempDir goes, unless Keep() was
// called (a failed test keeps its logs for a look). Not thread-safe.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // `path()/name`.
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  void Keep() { keep_ = true; }

 private:
  std::string path_;
  bool keep_ = false;
};

// A new empty directory under $TMPDIR (or /tmp), named after `prefix`; the
// caller removes it.
std::string MakeTempDir(const std::string& prefix);
// Removes `path` and everything under it; errors are ignored.
void RemoveTree(const std::string& path);

// The whole file, or "" if it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);
// The tensor bytes of a safetensors file: everything after the header (the
// header carries the job id in its metadata, which differs between runs);
// "" if it cannot be read.
std::string TensorBytes(const std::string& path);
// Replaces the file's contents; aborts the test binary if it cannot.
void WriteFileOrDie(const std::string& path, const std::string& contents);

}  // namespace aidn::testing

#endif  // AIDN_TESTS_SUPPORT_FILES_H_
