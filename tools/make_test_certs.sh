#!/usr/bin/env bash
# Writes the TLS test fixtures under tests/fixtures/tls (docs/security.md): a test CA, the
# cluster's certificate signed by it (what the router and the workers present; also the router's
# HTTPS / gRPC TLS certificate in the tests), and a rogue CA with a certificate of its own (a
# caller that has *a* certificate, but not the cluster's). Every certificate names 127.0.0.1,
# ::1 and localhost, and is valid for 100 years, so the fixtures do not expire under the tests.
# Test material only: never deploy these keys.
#
# Usage: tools/make_test_certs.sh [OUT_DIR]   (default tests/fixtures/tls; needs openssl)
set -euo pipefail
out=${1:-tests/fixtures/tls}
mkdir -p "$out"
days=36500
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cat >"$work/leaf.ext" <<'EXT'
basicConstraints = CA:FALSE
keyUsage = digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, IP:::1, DNS:localhost
EXT

# make_ca NAME: a self-signed CA key + certificate.
make_ca() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
    -subj "/CN=pdserve test $1" -keyout "$out/$1.key" -out "$out/$1.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign" 2>/dev/null
}
# make_leaf NAME CA: a key + certificate for NAME signed by CA.
make_leaf() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=pdserve test $1" -keyout "$out/$1.key" -out "$work/$1.csr" 2>/dev/null
  openssl x509 -req -in "$work/$1.csr" -CA "$out/$2.pem" -CAkey "$out/$2.key" -CAcreateserial \
    -CAserial "$work/$2.srl" -days "$days" -extfile "$work/leaf.ext" -out "$out/$1.pem" 2>/dev/null
}

make_ca ca
make_leaf cluster ca
make_ca rogue-ca
make_leaf rogue rogue-ca
echo "wrote $out: ca, cluster (signed by ca), rogue-ca, rogue (signed by rogue-ca)"
