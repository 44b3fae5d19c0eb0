#include "common/tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <filesystem>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file.h"
#include "common/status.h"

namespace aidn {
namespace {

struct Free {
  void operator()(X509* x) const { X509_free(x); }
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
  void operator()(BIO* b) const { BIO_free(b); }
  void operator()(X509_EXTENSION* e) const { X509_EXTENSION_free(e); }
};
using Cert = std::unique_ptr<X509, Free>;
using Key = std::unique_ptr<EVP_PKEY, Free>;
using Bio = std::unique_ptr<BIO, Free>;

// OpenSSL's error queue, as text, emptied.
std::string SslErrors() {
  std::string text;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!text.empty()) text += "; ";
    text += buf;
  }
  return text.empty() ? "unknown OpenSSL error" : text;
}

absl::Status SslError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", SslErrors()));
}

// Through <path>.tmp and a rename, with `mode` from the start.
absl::Status WriteFile(const std::string& path, const std::string& text, mode_t mode) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return PosixError(absl::StrCat("create ", tmp), errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      return PosixError(absl::StrCat("write ", tmp), e);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) return PosixError(absl::StrCat("sync ", tmp), errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return PosixError(absl::StrCat("rename ", tmp), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<Key> NewKey() {
  Key key(EVP_EC_gen("P-256"));
  if (key == nullptr) return SslError("generating a P-256 key");
  return key;
}

absl::StatusOr<std::string> KeyPem(EVP_PKEY* key) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr)) {
    return SslError("writing a key");
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<std::string> CertPem(X509* cert) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!PEM_write_bio_X509(bio.get(), cert)) return SslError("writing a certificate");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<Key> ParseKey(const std::string& pem, const std::string& path) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(path, ": no PEM private key in it"));
  }
  return key;
}

absl::StatusOr<Cert> ParseCert(const std::string& pem, const std::string& path) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(path, ": no PEM certificate in it"));
  }
  return cert;
}

absl::Time ToTime(const ASN1_TIME* t) {
  struct tm tm {};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromUnixSeconds(timegm(&tm));
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  std::unique_ptr<X509_EXTENSION, Free> ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()));
  if (ext == nullptr || !X509_add_ext(cert, ext.get(), -1)) {
    return SslError(absl::StrCat("certificate extension ", OBJ_nid2sn(nid), " = ", value));
  }
  return absl::OkStatus();
}

// A certificate for `key` named `cn`, signed by `issuer_key` (itself when
// `issuer` is null: a self-signed CA).
absl::StatusOr<Cert> MakeCert(EVP_PKEY* key, const std::string& cn, X509* issuer,
                              EVP_PKEY* issuer_key, absl::Duration validity,
                              const std::vector<std::pair<int, std::string>>& extensions) {
  Cert cert(X509_new());
  if (cert == nullptr) return SslError("X509_new");
  X509_set_version(cert.get(), 2);
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return SslError("a serial number");
  serial[0] &= 0x7f;  // positive
  std::unique_ptr<BIGNUM, void (*)(BIGNUM*)> bn(BN_bin2bn(serial, sizeof(serial), nullptr),
                                                &BN_free);
  if (bn == nullptr || BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert.get())) == nullptr) {
    return SslError("a serial number");
  }
  // An hour back: clients whose clocks run a little behind still accept it.
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), absl::ToInt64Seconds(validity));
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("aidn"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509_set_issuer_name(cert.get(), issuer != nullptr ? X509_get_subject_name(issuer) : name);
  if (!X509_set_pubkey(cert.get(), key)) return SslError("X509_set_pubkey");
  for (const auto& [nid, value] : extensions) {
    AIDN_RETURN_IF_ERROR(
        AddExtension(cert.get(), issuer != nullptr ? issuer : cert.get(), nid, value));
  }
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) == 0) return SslError("signing");
  return cert;
}

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

bool IsIp(const std::string& s) {
  unsigned char addr[16];
  return ::inet_pton(AF_INET, s.c_str(), addr) == 1 || ::inet_pton(AF_INET6, s.c_str(), addr) == 1;
}

}  // namespace

absl::StatusOr<ServerTls> EnsureAutoTls(const AutoTlsOptions& options) {
  std::error_code error;
  std::filesystem::create_directories(options.dir, error);
  if (error) return absl::InternalError(absl::StrCat("mkdir ", options.dir, ": ", error.message()));
  ::chmod(options.dir.c_str(), 0700);
  const std::string ca_file = absl::StrCat(options.dir, "/ca.pem");
  const std::string ca_key_file = absl::StrCat(options.dir, "/ca.key");
  const bool have_cert = std::filesystem::exists(ca_file),
             have_key = std::filesystem::exists(ca_key_file);
  if (have_cert != have_key) {
    return absl::FailedPreconditionError(absl::StrCat(
        options.dir, " holds ", have_cert ? "ca.pem but no ca.key" : "ca.key but no ca.pem",
        ": restore the missing file, or remove both to make a new CA (clients must then get the "
        "new ca.pem)"));
  }
  Cert ca;
  Key ca_key;
  if (!have_cert) {
    AIDN_ASSIGN_OR_RETURN(ca_key, NewKey());
    AIDN_ASSIGN_OR_RETURN(ca, MakeCert(ca_key.get(), "aidn coordinator CA", nullptr, ca_key.get(),
                                       absl::Hours(24 * 365 * 10),
                                       {{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
                                        {NID_key_usage, "critical,keyCertSign,cRLSign"},
                                        {NID_subject_key_identifier, "hash"}}));
    AIDN_ASSIGN_OR_RETURN(const std::string key_pem, KeyPem(ca_key.get()));
    AIDN_ASSIGN_OR_RETURN(const std::string cert_pem, CertPem(ca.get()));
    AIDN_RETURN_IF_ERROR(WriteFile(ca_key_file, key_pem, 0600));
    AIDN_RETURN_IF_ERROR(WriteFile(ca_file, cert_pem, 0644));
  } else {
    AIDN_ASSIGN_OR_RETURN(const std::string cert_pem, ReadFileToString(ca_file));
    AIDN_ASSIGN_OR_RETURN(const std::string key_pem, ReadFileToString(ca_key_file));
    AIDN_ASSIGN_OR_RETURN(ca, ParseCert(cert_pem, ca_file));
    AIDN_ASSIGN_OR_RETURN(ca_key, ParseKey(key_pem, ca_key_file));
    if (X509_check_private_key(ca.get(), ca_key.get()) != 1) {
      ERR_clear_error();
      return absl::FailedPreconditionError(
          absl::StrCat(ca_key_file, " is not the key of ", ca_file));
    }
  }

  std::set<std::string> names = {"localhost", "127.0.0.1", "::1"};
  if (const std::string host = HostName(); !host.empty()) names.insert(host);
  for (const std::string& n : options.names) {
    // Wildcard binds name no host a client dials.
    if (!n.empty() && n != "0.0.0.0" && n != "::") names.insert(n);
  }
  std::vector<std::string> san;
  for (const std::string& n : names) san.push_back(absl::StrCat(IsIp(n) ? "IP:" : "DNS:", n));
  AIDN_ASSIGN_OR_RETURN(Key key, NewKey());
  AIDN_ASSIGN_OR_RETURN(
      Cert cert, MakeCert(key.get(), "aidn coordinator", ca.get(), ca_key.get(), options.validity,
                          {{NID_basic_constraints, "critical,CA:FALSE"},
                           {NID_key_usage, "critical,digitalSignature"},
                           {NID_ext_key_usage, "serverAuth"},
                           {NID_subject_key_identifier, "hash"},
                           {NID_authority_key_identifier, "keyid:always"},
                           {NID_subject_alt_name, absl::StrJoin(san, ",")}}));
  ServerTls tls;
  AIDN_ASSIGN_OR_RETURN(tls.cert_pem, CertPem(cert.get()));
  AIDN_ASSIGN_OR_RETURN(tls.key_pem, KeyPem(key.get()));
  AIDN_RETURN_IF_ERROR(WriteFile(absl::StrCat(options.dir, "/server.key"), tls.key_pem, 0600));
  AIDN_RETURN_IF_ERROR(WriteFile(absl::StrCat(options.dir, "/server.pem"), tls.cert_pem, 0644));
  tls.ca_file = ca_file;
  tls.not_after = ToTime(X509_get0_notAfter(cert.get()));
  return tls;
}

absl::Status IssueClientCertificate(const std::string& ca_dir, const std::string& name,
                                    const std::string& cert_file, const std::string& key_file) {
  const std::string ca_file = absl::StrCat(ca_dir, "/ca.pem");
  const std::string ca_key_file = absl::StrCat(ca_dir, "/ca.key");
  AIDN_ASSIGN_OR_RETURN(const std::string ca_pem, ReadFileToString(ca_file));
  AIDN_ASSIGN_OR_RETURN(const std::string ca_key_pem, ReadFileToString(ca_key_file));
  AIDN_ASSIGN_OR_RETURN(Cert ca, ParseCert(ca_pem, ca_file));
  AIDN_ASSIGN_OR_RETURN(Key ca_key, ParseKey(ca_key_pem, ca_key_file));
  AIDN_ASSIGN_OR_RETURN(Key key, NewKey());
  AIDN_ASSIGN_OR_RETURN(Cert cert,
                        MakeCert(key.get(), name, ca.get(), ca_key.get(), absl::Hours(24 * 365),
                                 {{NID_basic_constraints, "critical,CA:FALSE"},
                                  {NID_key_usage, "critical,digitalSignature"},
                                  {NID_ext_key_usage, "clientAuth"},
                                  {NID_subject_key_identifier, "hash"},
                                  {NID_authority_key_identifier, "keyid:always"}}));
  AIDN_ASSIGN_OR_RETURN(const std::string cert_pem, CertPem(cert.get()));
  AIDN_ASSIGN_OR_RETURN(const std::string key_pem, KeyPem(key.get()));
  AIDN_RETURN_IF_ERROR(WriteFile(key_file, key_pem, 0600));
  return WriteFile(cert_file, cert_pem, 0644);
}

absl::StatusOr<ServerTls> LoadServerTls(const std::string& cert_file, const std::string& key_file) {
  ServerTls tls;
  AIDN_ASSIGN_OR_RETURN(tls.cert_pem, ReadFileToString(cert_file));
  AIDN_ASSIGN_OR_RETURN(tls.key_pem, ReadFileToString(key_file));
  AIDN_ASSIGN_OR_RETURN(Cert cert, ParseCert(tls.cert_pem, cert_file));
  AIDN_ASSIGN_OR_RETURN(Key key, ParseKey(tls.key_pem, key_file));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(key_file, " is not the key of the certificate in ", cert_file));
  }
  tls.not_after = ToTime(X509_get0_notAfter(cert.get()));
  const absl::Time not_before = ToTime(X509_get0_notBefore(cert.get()));
  const absl::Time now = absl::Now();
  if (tls.not_after < now) {
    return absl::InvalidArgumentError(absl::StrCat(
        cert_file, ": the certificate expired on ",
        absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", tls.not_after, absl::UTCTimeZone())));
  }
  if (not_before > now) {
    return absl::InvalidArgumentError(
        absl::StrCat(cert_file, ": the certificate is not valid before ",
                     absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", not_before, absl::UTCTimeZone())));
  }
  return tls;
}

bool IsLoopbackHost(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (h == "localhost" || h == "::1") return true;
  in_addr v4;
  return ::inet_pton(AF_INET, h.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127;
}

namespace {

// A TCP connection to host:port, or -1 (2 s timeouts).
int Dial(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    timeval tv{2, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

std::string Day(const ASN1_TIME* t) {
  return absl::FormatTime("%Y-%m-%d %H:%M UTC", ToTime(t), absl::UTCTimeZone());
}

// The validity of the certificate a handshake refused, as the verify
// callback saw it (the peer certificate is gone once the handshake fails).
thread_local std::string refused_not_before, refused_not_after;

int RememberRefused(int ok, X509_STORE_CTX* store) {
  if (!ok) {
    if (X509* cert = X509_STORE_CTX_get_current_cert(store); cert != nullptr) {
      refused_not_before = Day(X509_get0_notBefore(cert));
      refused_not_after = Day(X509_get0_notAfter(cert));
    }
  }
  return ok;
}

}  // namespace

std::string DiagnoseTls(const std::string& address, const std::string& ca_file, bool insecure) {
  const int fd = Dial(address);
  if (fd < 0) return "";
  std::unique_ptr<SSL_CTX, void (*)(SSL_CTX*)> ctx(SSL_CTX_new(TLS_client_method()), &SSL_CTX_free);
  if (ctx == nullptr) {
    ::close(fd);
    return "";
  }
  // The context first: an SSL takes its settings when it is made.
  if (!insecure) SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, RememberRefused);
  refused_not_before.clear();
  refused_not_after.clear();
  if (!ca_file.empty()) {
    SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr);
  } else {
    SSL_CTX_set_default_verify_paths(ctx.get());
  }
  std::unique_ptr<SSL, void (*)(SSL*)> ssl(SSL_new(ctx.get()), &SSL_free);
  if (ssl == nullptr) {
    ::close(fd);
    return "";
  }
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl.get());
  if (IsIp(host)) {
    X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str());
  } else {
    X509_VERIFY_PARAM_set1_host(param, host.c_str(), 0);
    SSL_set_tlsext_host_name(ssl.get(), host.c_str());
  }
  static const unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_set_alpn_protos(ssl.get(), kAlpn, sizeof(kAlpn));
  SSL_set_fd(ssl.get(), fd);
  const int handshake = SSL_connect(ssl.get());
  std::string why;
  if (handshake != 1) {
    const std::string errors = SslErrors();
    const long verify = SSL_get_verify_result(ssl.get());
    if (insecure) {
      why = "";
    } else if (verify == X509_V_ERR_CERT_HAS_EXPIRED) {
      why = absl::StrCat("its certificate expired on ", refused_not_after);
    } else if (verify == X509_V_ERR_CERT_NOT_YET_VALID) {
      why = absl::StrCat("its certificate is not valid before ", refused_not_before,
                         " (is a clock wrong?)");
    } else if (verify == X509_V_ERR_HOSTNAME_MISMATCH || verify == X509_V_ERR_IP_ADDRESS_MISMATCH) {
      why = absl::StrCat("its certificate does not cover ", host,
                         " (the coordinator's --tls-san adds names to the one it makes)");
    } else if (verify == X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY ||
               verify == X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN ||
               verify == X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT ||
               verify == X509_V_ERR_CERT_SIGNATURE_FAILURE) {
      why = absl::StrCat("its certificate is not signed by ",
                         ca_file.empty() ? "a CA this system trusts" : "the CA in " + ca_file,
                         ": pass the coordinator's <state-dir>/tls/ca.pem (--tls-ca)");
    } else if (verify != X509_V_OK) {
      why = absl::StrCat("its certificate fails verification: ",
                         X509_verify_cert_error_string(verify));
    } else if (errors.find("wrong version number") != std::string::npos ||
               errors.find("packet length too long") != std::string::npos ||
               errors.find("record layer failure") != std::string::npos) {
      why = "it serves plaintext (started with --insecure?): pass --insecure, or give it TLS";
    } else {
      why = absl::StrCat("the TLS handshake failed: ", errors);
    }
  } else if (insecure) {
    why = "it serves TLS: drop --insecure and verify it with its CA file (--tls-ca)";
  }
  ::close(fd);
  return why;
}

absl::StatusOr<std::string> ReadCaFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS CA file ", path, ": ", text.status().message()));
  }
  AIDN_ASSIGN_OR_RETURN(Cert first, ParseCert(*text, absl::StrCat("TLS CA file ", path)));
  return *text;
}

}  // namespace aidn
