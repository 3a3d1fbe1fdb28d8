#!/bin/sh
# Test certificates for the rediss:// tests (tests/redisutil.h): a CA, a server certificate it
# signs for localhost and 127.0.0.1, a client certificate it signs (mutual TLS), and a second CA
# that signed nothing (a client given it must refuse the server). All with the openssl CLI
# (Debian package openssl, scripts/deps.sh test), into DIR. Usage: certs.sh DIR
set -eu
dir=${1:?usage: certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
days=2
ca() { # NAME: NAME.key, NAME.crt (self-signed, a CA)
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.crt" -days $days \
    -subj "/CN=ferry test $1" -addext basicConstraints=critical,CA:TRUE \
    -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
}
leaf() { # NAME CN EXT: NAME.key, NAME.crt signed by ca
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" \
    -days $days -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca ca
ca other-ca
leaf server localhost "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
leaf client ferry-client "extendedKeyUsage=clientAuth"
chmod 600 ./*.key
