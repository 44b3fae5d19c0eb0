#ifndef AIDN_COORDINATOR_SQLITE_UTIL_H_
#define AIDN_COORDINATOR_SQLITE_UTIL_H_

// Private to the store's implementation files (store.cc, store_logs.cc):
// SQLite result codes as absl::Status, prepared statements and
// transactions that clean up after themselves, proto blobs in and out.
// Nothing here is thread-safe; callers hold the store's mutex.

#include <sqlite3.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "google/protobuf/message_lite.h"

namespace aidn::coordinator::sqlite_util {

inline absl::StatusCode CodeForSqlite(int rc) {
  switch (rc & 0xff) {
    case SQLITE_CONSTRAINT:
      // A duplicate key is the caller's to resolve; other constraints (NOT
      // NULL, triggers) mean the row cannot go in as it is.
      if (rc == SQLITE_CONSTRAINT_PRIMARYKEY || rc == SQLITE_CONSTRAINT_UNIQUE) {
        return absl::StatusCode::kAlreadyExists;
      }
      return absl::StatusCode::kFailedPrecondition;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_IOERR:
    case SQLITE_PROTOCOL:
      // Another connection held the lock past busy_timeout, or the disk
      // failed: worth retrying.
      return absl::StatusCode::kUnavailable;
    case SQLITE_CORRUPT:
      return absl::StatusCode::kDataLoss;
    case SQLITE_NOTADB:
    case SQLITE_CANTOPEN:
      return absl::StatusCode::kFailedPrecondition;
    case SQLITE_FULL:
    case SQLITE_NOMEM:
    case SQLITE_TOOBIG:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_AUTH:
      return absl::StatusCode::kPermissionDenied;
    case SQLITE_INTERRUPT:
      return absl::StatusCode::kCancelled;
    case SQLITE_ABORT:
      return absl::StatusCode::kAborted;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "store: <context>: <what SQLite said>". Call right after the failing call,
// under the store's mutex, before anything else touches the connection.
inline absl::Status SqliteError(sqlite3* db, int rc, absl::string_view context) {
  const char* message = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  return absl::Status(CodeForSqlite(rc), absl::StrCat("store: ", context, ": ", message));
}

// Runs SQL without parameters or results (DDL, BEGIN, COMMIT, PRAGMA set).
inline absl::Status Exec(sqlite3* db, const char* sql, absl::string_view context) {
  char* message = nullptr;
  int rc = sqlite3_exec(db, sql, nullptr, nullptr, &message);
  if (rc == SQLITE_OK) return absl::OkStatus();
  absl::Status status(
      CodeForSqlite(rc),
      absl::StrCat("store: ", context, ": ", message != nullptr ? message : sqlite3_errstr(rc)));
  sqlite3_free(message);
  return status;
}

// One prepared statement, finalized on destruction. Bind errors are kept and
// reported by the next Step, so call sites bind without checking each one.
class Statement {
 public:
  static absl::StatusOr<Statement> Prepare(sqlite3* db, const char* sql, std::string context) {
    sqlite3_stmt* stmt = nullptr;
    int rc = sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr);
    if (rc != SQLITE_OK) {
      sqlite3_finalize(stmt);
      return SqliteError(db, rc, context);
    }
    return Statement(db, stmt, std::move(context));
  }

  Statement(Statement&& other) noexcept
      : db_(other.db_),
        stmt_(std::exchange(other.stmt_, nullptr)),
        context_(std::move(other.context_)),
        bind_rc_(other.bind_rc_) {}
  Statement& operator=(Statement&&) = delete;
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  ~Statement() { sqlite3_finalize(stmt_); }

  // Indexes count from 1, as in SQL.
  void BindInt64(int index, int64_t value) { Keep(sqlite3_bind_int64(stmt_, index, value)); }
  void BindText(int index, absl::string_view text) {
    Keep(
        sqlite3_bind_text64(stmt_, index, text.data(), text.size(), SQLITE_TRANSIENT, SQLITE_UTF8));
  }
  void BindBlob(int index, absl::string_view blob) {
    // data() of an empty string is not null, so an empty blob stays a blob
    // (a null pointer would bind NULL and trip the NOT NULL columns).
    Keep(sqlite3_bind_blob64(stmt_, index, blob.empty() ? "" : blob.data(), blob.size(),
                             SQLITE_TRANSIENT));
  }

  // True with a row to read, false when done.
  absl::StatusOr<bool> Step() {
    if (bind_rc_ != SQLITE_OK) {
      return absl::Status(CodeForSqlite(bind_rc_),
                          absl::StrCat("store: ", context_, ": bind: ", sqlite3_errstr(bind_rc_)));
    }
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqliteError(db_, rc, context_);
  }

  // Steps a statement that returns no rows.
  absl::Status Run() {
    AIDN_ASSIGN_OR_RETURN(bool row, Step());
    (void)row;
    return absl::OkStatus();
  }

  // Makes the statement ready to bind and step again.
  void Reset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    bind_rc_ = SQLITE_OK;
  }

  // Columns count from 0. Views are valid until the next Step or Reset.
  int64_t ColumnInt64(int column) { return sqlite3_column_int64(stmt_, column); }
  absl::string_view ColumnBytes(int column) {
    // Blob (or text) first, then its size: the order SQLite documents.
    const void* data = sqlite3_column_blob(stmt_, column);
    int size = sqlite3_column_bytes(stmt_, column);
    if (data == nullptr) return absl::string_view();
    return absl::string_view(static_cast<const char*>(data), static_cast<size_t>(size));
  }
  std::string ColumnText(int column) { return std::string(ColumnBytes(column)); }

 private:
  Statement(sqlite3* db, sqlite3_stmt* stmt, std::string context)
      : db_(db), stmt_(stmt), context_(std::move(context)) {}

  void Keep(int rc) {
    if (bind_rc_ == SQLITE_OK) bind_rc_ = rc;
  }

  sqlite3* db_;
  sqlite3_stmt* stmt_;
  std::string context_;
  int bind_rc_ = SQLITE_OK;
};

// BEGIN IMMEDIATE ... COMMIT; rolls back on destruction unless committed.
// IMMEDIATE takes the write lock up front, so a second connection waits in
// the busy handler instead of failing at a read-to-write upgrade.
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) {}
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  ~Transaction() {
    // Some errors (SQLITE_FULL, ...) already rolled back: then there is no
    // transaction to end.
    if (active_ && sqlite3_get_autocommit(db_) == 0) {
      sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    }
  }

  absl::Status Begin(absl::string_view context) {
    AIDN_RETURN_IF_ERROR(Exec(db_, "BEGIN IMMEDIATE", absl::StrCat(context, ": begin")));
    active_ = true;
    return absl::OkStatus();
  }
  absl::Status Commit(absl::string_view context) {
    AIDN_RETURN_IF_ERROR(Exec(db_, "COMMIT", absl::StrCat(context, ": commit")));
    active_ = false;
    return absl::OkStatus();
  }

 private:
  sqlite3* db_;
  bool active_ = false;
};

inline absl::StatusOr<std::string> Serialize(const google::protobuf::MessageLite& message,
                                             absl::string_view context) {
  std::string bytes;
  if (!message.SerializeToString(&bytes)) {
    return absl::InternalError(
        absl::StrCat("store: ", context, ": cannot serialize ", message.GetTypeName()));
  }
  return bytes;
}

// DATA_LOSS naming the table and the row's key.
inline absl::Status Parse(absl::string_view bytes, absl::string_view table, absl::string_view key,
                          google::protobuf::MessageLite* message) {
  if (!message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::DataLossError(absl::StrCat("store: table ", table, ", row ", key, ": ",
                                            bytes.size(), " bytes do not parse as ",
                                            message->GetTypeName()));
  }
  return absl::OkStatus();
}

}  // namespace aidn::coordinator::sqlite_util

#endif  // AIDN_COORDINATOR_SQLITE_UTIL_H_
