#!/bin/sh
# ferry.pc for a static link: install the build into a scratch prefix, keep only libferry.a,
# and build a program that opens a context with nothing but `pkg-config --static --cflags
# --libs ferry` (issue 35: ucx was missing from Requires.private, so the link failed with
# undefined ucp_* symbols). The program must run and must not load a libferry.so.
# Usage: run.sh BUILD_DIR WORK_DIR
set -eu
build=$1
work=$2/pkgconfig
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
find "$work/prefix" -name 'libferry.so*' -exec rm -f {} +
pc=$(find "$work/prefix" -name ferry.pc)
[ -n "$pc" ] || { echo "pkgconfig: no ferry.pc installed"; exit 1; }
# the prefix the build was configured with, made the scratch one (in ferry.pc only: the
# libraries it requires keep theirs)
sed -i "s#^prefix=.*#prefix=$work/prefix#" "$pc"
flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --static --cflags --libs ferry)
echo "pkgconfig: cc prog.c $flags"
cat >"$work/prog.c" <<'C'
#include <ferry.h>
#include <stdio.h>

int main(void) {
  ferry_ctx_opts opts = {.size = sizeof opts, .name = "pc-static"};
  ferry_ctx *ctx;
  int rc = ferry_ctx_open(&opts, &ctx);
  if (rc != 0) {
    fprintf(stderr, "ferry_ctx_open: %s\n", ferry_last_error());
    return 1;
  }
  printf("ferry %s: %s\n", ferry_version(), ferry_ctx_address(ctx));
  ferry_ctx_close(ctx);
  return 0;
}
C
# shellcheck disable=SC2086
cc -o "$work/prog" "$work/prog.c" $flags
"$work/prog"
if ldd "$work/prog" | grep -q libferry; then
  echo "pkgconfig: the program loads a libferry.so; it should hold libferry.a"
  exit 1
fi
rm -rf "$work"
