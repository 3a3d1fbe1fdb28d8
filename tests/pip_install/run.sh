#!/bin/sh
# `pip install ./python` as the README gives it, from a clean copy of the checkout (the files git
# does not ignore, as the other stages build them: nothing of build/ comes along), offline, with FERRY_LIB and PYTHONPATH unset: the
# install builds libferry.so (python/build_backend/ferry_build.py) and `import ferry` must load
# that copy, inside the venv. `pip install -e` imports the checkout's package. Then `pip wheel
# --no-deps ./python`, the checkout removed, and the wheel installed into a second venv, where it
# must work the same. Each install must expose the vLLM plugin entry point (vllm.general_plugins).
# The venvs see Debian's NumPy (--system-site-packages); the index is an address nothing listens
# on, so a step that wanted the network fails at once instead of passing on a networked machine.
# Usage: run.sh SOURCE_DIR WORK_DIR
set -eu
src=$1
work=$2/pip_install
rm -rf "$work" && mkdir -p "$work/checkout"
unset FERRY_LIB PYTHONPATH PIP_FIND_LINKS PIP_NO_INDEX
export PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_CONFIG_FILE=/dev/null PIP_RETRIES=0 \
  PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$src" ls-files -z --cached --others --exclude-standard |
    (cd "$src" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$work/checkout"
else # an unpacked tarball: all of it but the build folders
  (cd "$src" && tar --exclude='./build*' --exclude=./python/build -cf - .) | tar -xf - -C "$work/checkout"
fi
[ -f "$work/checkout/python/pyproject.toml" ] || { echo "no clean copy of $src"; exit 1; }
[ ! -e "$work/checkout/build" ] || { echo "the copy has build/"; exit 1; }

# the installed distribution exposes the vLLM plugin entry point (pyproject.toml); loading it
# imports ferry.integrations.vllm, which imports no vLLM
check_plugin() { # venv
  (cd "$work" && "$1/bin/python" <<'PY'
from importlib.metadata import entry_points
import ferry.integrations.vllm as fv
eps = [e for e in entry_points(group="vllm.general_plugins") if e.dist.name == "ferry"]
assert [(e.name, e.value) for e in eps] == [("ferry", "ferry.integrations.vllm:register")], eps
assert eps[0].load() is fv.register
print("pip_install: entry point vllm.general_plugins: ferry = %s: ok" % eps[0].value)
PY
  )
}

# import ferry from outside the checkout; the library must be the one inside the venv
check() { # venv
  (cd "$work" && "$1/bin/python" - "$1" <<'PY'
import os, sys
import numpy as np
import ferry
venv = os.path.realpath(sys.argv[1])
lib = os.path.realpath(ferry._lib.path)
assert lib.startswith(venv + os.sep), "libferry.so from %s, not from the venv %s" % (lib, venv)
assert os.path.realpath(ferry.__file__).startswith(venv + os.sep), ferry.__file__
with ferry.Store(host_directory=True) as s:
    s.put("k", np.arange(1000, dtype=np.int32))
    assert (s.get("k") == np.arange(1000, dtype=np.int32)).all()
print("pip_install: ferry from %s, libferry.so from %s: ok" % (ferry.__file__, lib))
PY
  )
}

/usr/bin/python3 -m venv --system-site-packages "$work/v1"
"$work/v1/bin/pip" install "$work/checkout/python"
check "$work/v1"
check_plugin "$work/v1"

# editable: nothing built; the package is the checkout's own (here with v1's library)
/usr/bin/python3 -m venv --system-site-packages "$work/v3"
"$work/v3/bin/pip" install -e "$work/checkout/python"
lib=$(ls "$work"/v1/lib/python3*/site-packages/ferry/libferry.so)
(cd "$work" && FERRY_LIB=$lib "$work/v3/bin/python" -c "
import os, ferry
want = os.path.realpath('$work/checkout/python/ferry/__init__.py')
assert os.path.realpath(ferry.__file__) == want, ferry.__file__
print('pip_install: editable: ferry from', ferry.__file__)")
FERRY_LIB=$lib check_plugin "$work/v3"

"$work/v1/bin/pip" wheel --no-deps -w "$work/wheels" "$work/checkout/python"
rm -rf "$work/checkout"
/usr/bin/python3 -m venv --system-site-packages "$work/v2"
"$work/v2/bin/pip" install "$work"/wheels/ferry-*.whl
check "$work/v2"
check_plugin "$work/v2"
rm -rf "$work"
