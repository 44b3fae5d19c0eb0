#!/usr/bin/env bash
# Writes the Secrets the manifests mount, as one YAML file for
# `kubectl apply -f`: a CA and the coordinator's server certificate
# (aidn-tls: ca.crt, tls.crt, tls.key), the coordinator's tokens
# (aidn-tokens: an admin token and the worker join token) and the worker
# join token alone for the workers (aidn-worker-token).
#
#   deploy/kubernetes/make-secrets.sh OUT_DIR [EXTRA_DNS_NAME...]
#
# OUT_DIR receives secrets.yaml, ca.crt (for aidnctl: AIDN_TLS_CA) and
# admin.token (AIDN_TOKEN); keep the last two, and secrets.yaml, private.
# Needs openssl only; nothing is sent anywhere.
set -euo pipefail
out=${1:?usage: make-secrets.sh OUT_DIR [EXTRA_DNS_NAME...]}
shift
namespace=${AIDN_NAMESPACE:-aidn}
umask 077
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

sans="DNS:aidn-coordinator,DNS:aidn-coordinator.$namespace,DNS:aidn-coordinator.$namespace.svc"
sans+=",DNS:aidn-coordinator.$namespace.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:::1"
for name in "$@"; do sans+=",DNS:$name"; done

openssl ecparam -name prime256v1 -genkey -noout -out "$tmp/ca.key" 2>/dev/null
openssl req -x509 -new -key "$tmp/ca.key" -sha256 -days 3650 -subj "/CN=aidn CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$out/ca.crt" 2>/dev/null
openssl ecparam -name prime256v1 -genkey -noout -out "$tmp/tls.key" 2>/dev/null
openssl req -new -key "$tmp/tls.key" -subj "/CN=aidn-coordinator" -out "$tmp/tls.csr" 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n' \
  "$sans" >"$tmp/ext"
openssl x509 -req -in "$tmp/tls.csr" -CA "$out/ca.crt" -CAkey "$tmp/ca.key" -CAserial "$tmp/ca.srl" -CAcreateserial \
  -days 825 -sha256 -extfile "$tmp/ext" -out "$tmp/tls.crt" 2>/dev/null

admin=$(openssl rand -hex 32)
worker=$(openssl rand -hex 32)
printf '%s\n' "$admin" >"$out/admin.token"

b64() { base64 -w0 "$@"; }
{
  cat <<YAML
apiVersion: v1
kind: Secret
metadata:
  name: aidn-tls
  namespace: $namespace
type: kubernetes.io/tls
data:
  ca.crt: $(b64 "$out/ca.crt")
  tls.crt: $(b64 "$tmp/tls.crt")
  tls.key: $(b64 "$tmp/tls.key")
---
apiVersion: v1
kind: Secret
metadata:
  name: aidn-tokens
  namespace: $namespace
type: Opaque
data:
  tokens: $(printf '%s admin admin\n%s worker\n' "$admin" "$worker" | b64)
---
apiVersion: v1
kind: Secret
metadata:
  name: aidn-worker-token
  namespace: $namespace
type: Opaque
data:
  token: $(printf '%s\n' "$worker" | b64)
YAML
} >"$out/secrets.yaml"
echo "make-secrets.sh: wrote $out/secrets.yaml, $out/ca.crt and $out/admin.token"
