#!/usr/bin/env bash
# Development TLS certificates and SuperNode authentication keys for a Flower deployment.
#
#   scripts/flower-dev-certs.sh [OUT_DIR] [SUPERNODES] [SERVER_NAMES]
#
# OUT_DIR (default: certificates) receives
#   ca.key, ca.crt            a self-signed certificate authority (give ca.crt to every node)
#   server.key, server.pem    the SuperLink's key and certificate, signed by the CA, valid for
#                             SERVER_NAMES (comma-separated host names and IPs; default
#                             localhost,127.0.0.1,::1)
#   supernode_<i>, .pub       an ECDSA P-384 key pair per SuperNode (OpenSSH format), i = 1..N
# For development only: the CA key lies unencrypted next to what it signs. Existing files are
# never overwritten. Needs openssl and ssh-keygen.
set -euo pipefail

out=${1:-certificates}
n=${2:-3}
names=${3:-localhost,127.0.0.1,::1}
days=365

[[ $n =~ ^[0-9]+$ ]] || { echo "SUPERNODES must be a number, got '$n'" >&2; exit 2; }
for tool in openssl ssh-keygen; do
  command -v "$tool" >/dev/null || { echo "$tool is needed and not installed" >&2; exit 2; }
done
mkdir -p "$out"
for f in ca.key ca.crt server.key server.pem; do
  [[ ! -e $out/$f ]] || { echo "$out/$f exists; not overwriting (pick another OUT_DIR)" >&2; exit 2; }
done

san=""
first=""
IFS=',' read -r -a hosts <<< "$names"
for h in "${hosts[@]}"; do
  [[ -n $first ]] || first=$h
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
done
san=${san%,}

umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

openssl genrsa -out "$out/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha256 -days "$days" \
  -subj "/CN=protofl development CA" -out "$out/ca.crt"
openssl genrsa -out "$out/server.key" 4096 2>/dev/null
openssl req -new -key "$out/server.key" -subj "/CN=$first" -out "$work/server.csr"
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$san" > "$work/ext.cnf"
openssl x509 -req -in "$work/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -CAserial "$work/ca.srl" -days "$days" -sha256 -extfile "$work/ext.cnf" \
  -out "$out/server.pem" 2>/dev/null
chmod 644 "$out/ca.crt" "$out/server.pem"

for i in $(seq 1 "$n"); do
  key=$out/supernode_$i
  [[ -e $key ]] && { echo "$key exists; kept" >&2; continue; }
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "protofl-supernode-$i" -f "$key"
done

cat <<USAGE
wrote $out/: ca.crt, server.pem/.key (for $names) and $n SuperNode key pair(s)
SuperLink:  flower-superlink --ssl-ca-certfile $out/ca.crt --ssl-certfile $out/server.pem \\
              --ssl-keyfile $out/server.key --enable-supernode-auth
register:   flwr supernode register $out/supernode_1.pub <superlink connection>   (each node)
SuperNode:  flower-supernode --superlink $first:9092 --root-certificates $out/ca.crt \\
              --auth-supernode-private-key $out/supernode_1 --node-config 'data-root="..."'
flwr CLI:   root-certificates = "$out/ca.crt" in the SuperLink connection (~/.flwr/config.toml)
USAGE
