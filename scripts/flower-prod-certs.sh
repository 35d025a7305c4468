#!/usr/bin/env bash
# Production credentials for a Flower deployment (docs/flower.md, "Certificates for
# production"). Each step runs where its secret lives; no private key is ever copied.
#
#   scripts/flower-prod-certs.sh ca       OUT_DIR PASS_FILE
#       (only if the organisation has no CA) a CA whose key is encrypted (AES-256) with the
#       passphrase in PASS_FILE: OUT_DIR/ca.key (encrypted), OUT_DIR/ca.crt
#   scripts/flower-prod-certs.sh csr      OUT_DIR SERVER_NAMES
#       on the SuperLink host: OUT_DIR/server.key (stays there) and OUT_DIR/server.csr for
#       SERVER_NAMES (comma-separated host names and IPs)
#   scripts/flower-prod-certs.sh sign     CA_CRT CA_KEY PASS_FILE CSR OUT_PEM [DAYS]
#       at the CA: the SuperLink certificate OUT_PEM (serverAuth, the CSR's names), signed
#       with the passphrase-protected CA key (the passphrase is read from PASS_FILE, never
#       from the command line)
#   scripts/flower-prod-certs.sh site-key KEY_PATH [COMMENT]
#       on a site: a new SuperNode authentication key pair KEY_PATH, KEY_PATH.pub (ECDSA
#       P-384); for a rotation, register the new .pub, restart the SuperNode with the new
#       key, then unregister the old node (flwr supernode unregister NODE_ID)
#
# Existing files are never overwritten; a wrong passphrase or a bad CSR stops with one line
# and exit code 2. Needs openssl (and ssh-keygen for site-key).
set -euo pipefail
umask 077

die() { echo "$*" >&2; exit 2; }
fresh() { for f in "$@"; do [[ ! -e $f ]] || die "$f exists; not overwriting"; done; }
need() { command -v "$1" >/dev/null || die "$1 is needed and not installed"; }
readable() { [[ -r $1 ]] || die "$1: no such file (or not readable)"; }

san_of() {  # host names and IPs -> an openssl subjectAltName value
  local san="" h
  IFS=',' read -r -a hosts <<< "$1"
  for h in "${hosts[@]}"; do
    if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
  done
  echo "${san%,}"
}

need openssl
cmd=${1:-}
shift || true
case $cmd in
  ca)
    [[ $# -eq 2 ]] || die "usage: $0 ca OUT_DIR PASS_FILE"
    out=$1; pass=$2
    readable "$pass"
    mkdir -p "$out"
    fresh "$out/ca.key" "$out/ca.crt"
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:4096 -aes256 \
      -pass "file:$pass" -out "$out/ca.key" 2>/dev/null
    openssl req -x509 -new -key "$out/ca.key" -passin "file:$pass" -sha256 -days 1825 \
      -subj "/CN=protofl federation CA" -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$out/ca.crt"
    chmod 644 "$out/ca.crt"
    echo "wrote $out/ca.key (AES-256, passphrase in $pass) and $out/ca.crt"
    ;;
  csr)
    [[ $# -eq 2 ]] || die "usage: $0 csr OUT_DIR SERVER_NAMES"
    out=$1; names=$2
    [[ -n $names ]] || die "SERVER_NAMES is empty"
    mkdir -p "$out"
    fresh "$out/server.key" "$out/server.csr"
    first=${names%%,*}
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:4096 -out "$out/server.key" 2>/dev/null
    openssl req -new -key "$out/server.key" -subj "/CN=$first" \
      -addext "subjectAltName=$(san_of "$names")" -out "$out/server.csr"
    chmod 644 "$out/server.csr"
    echo "wrote $out/server.key (keep it on this host) and $out/server.csr (send it to the CA)"
    ;;
  sign)
    [[ $# -ge 5 && $# -le 6 ]] || die "usage: $0 sign CA_CRT CA_KEY PASS_FILE CSR OUT_PEM [DAYS]"
    ca_crt=$1; ca_key=$2; pass=$3; csr=$4; pem=$5; days=${6:-397}
    for f in "$ca_crt" "$ca_key" "$pass" "$csr"; do readable "$f"; done
    fresh "$pem"
    openssl req -in "$csr" -noout -verify 2>/dev/null || die "$csr is not a valid signed CSR"
    san=$(openssl req -in "$csr" -noout -text | grep -A1 "Subject Alternative Name" | tail -1 \
          | sed 's/ //g; s/IPAddress:/IP:/g') || true
    [[ -n $san && $san != *"SubjectAlternativeName"* ]] || die "$csr names no host (subjectAltName)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
      "$san" > "$work/ext.cnf"
    openssl x509 -req -in "$csr" -CA "$ca_crt" -CAkey "$ca_key" -passin "file:$pass" \
      -CAcreateserial -CAserial "$work/ca.srl" -days "$days" -sha256 \
      -extfile "$work/ext.cnf" -out "$work/server.pem" 2>"$work/err" \
      || die "cannot sign $csr with $ca_key (wrong passphrase, or the key does not match $ca_crt)"
    openssl verify -CAfile "$ca_crt" "$work/server.pem" >/dev/null \
      || die "the signed certificate does not verify against $ca_crt"
    cp "$work/server.pem" "$pem"
    chmod 644 "$pem"
    echo "wrote $pem for $san (valid $days days)"
    ;;
  site-key)
    [[ $# -ge 1 && $# -le 2 ]] || die "usage: $0 site-key KEY_PATH [COMMENT]"
    need ssh-keygen
    key=$1
    fresh "$key" "$key.pub"
    mkdir -p "$(dirname "$key")"
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "${2:-protofl-supernode}" -f "$key"
    echo "wrote $key (keep it on this site) and $key.pub (register it: flwr supernode register)"
    ;;
  *)
    die "usage: $0 ca|csr|sign|site-key ... (see the header of $0)"
    ;;
esac
