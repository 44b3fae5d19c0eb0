#ifndef AIDN_COMMON_CRC32C_H_
#define AIDN_COMMON_CRC32C_H_

// CRC-32C (Castagnoli, the iSCSI / ext4 / leveldb checksum): SSE4.2's crc32
// instruction where the CPU has it, a table otherwise; both give the same
// value. Checkpoint manifests record one per file.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace aidn {

// Extends `crc` (0 to start) over `size` bytes at `data`.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

struct FileChecksum {
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

// Reads the whole file. The errno's code for I/O errors, naming the path.
absl::StatusOr<FileChecksum> ChecksumFile(const std::string& path);

}  // namespace aidn

#endif  // AIDN_COMMON_CRC32C_H_
