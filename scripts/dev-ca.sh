#!/usr/bin/env bash
# A development CA and one certificate per service, for adaserve's optional mutual TLS.
#
#   scripts/dev-ca.sh OUT_DIR [NAME ...]
#
# Writes OUT_DIR/ca.crt and ca.key, then NAME.crt and NAME.key for each NAME (default:
# scheduler drafter verifier gateway). Each certificate is valid for TLS servers and
# clients alike (every service is both), for the DNS names NAME, adaserve-NAME and
# localhost and the address 127.0.0.1; add names with DEV_CA_SANS="DNS:x,DNS:y".
# An existing CA in OUT_DIR is reused, so more services can be added later.
#
# For development and tests only: the keys are unencrypted and the CA lives 30 days.
# In production, issue certificates from your own CA (e.g. cert-manager) and see
# docs/SECURITY.md for the settings and the Kubernetes Secret.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(scheduler drafter verifier gateway)
command -v openssl >/dev/null || { echo "dev-ca.sh: openssl not found" >&2; exit 1; }
mkdir -p "$out"
umask 077  # private keys readable by their owner only

if [[ ! -f "$out/ca.key" || ! -f "$out/ca.crt" ]]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -sha256 \
    -subj "/CN=adaserve development CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
fi

for name in "${names[@]}"; do
  [[ "$name" =~ ^[A-Za-z0-9.-]+$ ]] || { echo "dev-ca.sh: bad name '$name'" >&2; exit 2; }
  sans="DNS:$name,DNS:adaserve-$name,DNS:localhost,IP:127.0.0.1${DEV_CA_SANS:+,$DEV_CA_SANS}"
  ext=$(mktemp)
  trap 'rm -f "$ext" "$out/$name.csr"' EXIT
  printf '%s\n' \
    "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" \
    "subjectAltName=$sans" >"$ext"
  openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=$name" \
    -keyout "$out/$name.key" -out "$out/$name.csr" 2>/dev/null
  openssl x509 -req -in "$out/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -days 30 -sha256 -extfile "$ext" -out "$out/$name.crt" 2>/dev/null
  rm -f "$ext" "$out/$name.csr"
  trap - EXIT
  echo "$out/$name.crt ($sans)"
done
chmod 644 "$out"/*.crt
