#ifndef AIDN_COMMON_TLS_H_
#define AIDN_COMMON_TLS_H_

// The coordinator's TLS material (OpenSSL). Without --tls-cert the
// coordinator makes its own certificate authority in its state directory
// at first start and a server certificate signed by it at every start:
//
//   <state-dir>/tls/ca.pem       the CA certificate: what clients verify with
//   <state-dir>/tls/ca.key       its private key (0600), never leaves the directory
//   <state-dir>/tls/server.pem   this start's server certificate (1 year) ...
//   <state-dir>/tls/server.key   ... and its key (0600)
//
// A new server certificate signed by the same CA is what rotation is:
// running clients reconnect to a restarted coordinator and verify it as
// before. Keys are ECDSA P-256, signatures SHA-256.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace aidn {

struct ServerTls {
  std::string cert_pem;  // the server certificate (and any chain after it)
  std::string key_pem;
  std::string ca_file;   // what clients verify with
  absl::Time not_after;  // of the server certificate
};

struct AutoTlsOptions {
  std::string dir;  // <state-dir>/tls
  // Names the server certificate covers besides localhost, 127.0.0.1, ::1
  // and the host name: the listen host and --tls-san's.
  std::vector<std::string> names;
  absl::Duration validity = absl::Hours(24 * 365);
};

// Makes the CA if `dir` has none (and `dir` itself, 0700), then a new server
// certificate for `names`. FAILED_PRECONDITION when only one of ca.pem and
// ca.key is there, or they do not belong together.
absl::StatusOr<ServerTls> EnsureAutoTls(const AutoTlsOptions& options);

// A client certificate for `name` (its common name; extended key usage
// clientAuth, 1 year) and its key, signed by the CA in `ca_dir` (ca.pem and
// ca.key, as EnsureAutoTls makes them), written to `cert_file` and
// `key_file` (0600): what a worker presents to a coordinator started with
// --tls-client-ca.
absl::Status IssueClientCertificate(const std::string& ca_dir, const std::string& name,
                                    const std::string& cert_file, const std::string& key_file);

// --tls-cert and --tls-key: read and checked (the key is the certificate's,
// the certificate is in its validity period). INVALID_ARGUMENT naming the
// file and what is wrong ("the certificate expired on ...").
absl::StatusOr<ServerTls> LoadServerTls(const std::string& cert_file, const std::string& key_file);

// Whether `host` (of a listen address: "127.0.0.1", "[::1]", "localhost")
// is a loopback one, where plaintext does not leave the machine.
bool IsLoopbackHost(const std::string& host);

// Why a client cannot talk to the server at `address` (host:port): a TLS
// handshake of its own, verifying with `ca_file` (empty: the system's
// roots) as gRPC does, said in words ("its certificate expired on ...",
// "is not signed by the CA in ...", "does not cover host ...", "serves
// plaintext: it runs with --insecure"). With `insecure`, whether it serves
// TLS instead. Empty when the handshake works, or no connection is made.
std::string DiagnoseTls(const std::string& address, const std::string& ca_file, bool insecure);

// A PEM file of CA certificates, read and checked to hold at least one.
// INVALID_ARGUMENT naming the file otherwise.
absl::StatusOr<std::string> ReadCaFile(const std::string& path);

}  // namespace aidn

#endif  // AIDN_COMMON_TLS_H_
