"""The ferry package's own PEP 517 build backend: `pip install ./python` and `pip wheel ./python`
build libferry.so with the project's CMake and put it in the wheel, beside the package.

Why its own backend: it needs nothing to be installed first (`requires = []` in pyproject.toml),
so pip's isolated build works offline, with no package index and no --no-build-isolation; and
the wheel it makes carries the library, so `import ferry` needs no FERRY_LIB.

The wheel:
- ferry/ (every .py and py.typed under python/ferry, subpackages included) and ferry/libferry.so;
- tagged py3-none-<platform> (a ctypes binding: any Python 3, but this machine's libferry.so);
- metadata from pyproject.toml's [project] table and README.md, and its entry points
  ([project.entry-points.*], scripts, gui-scripts) in the dist-info's entry_points.txt.

Where libferry.so comes from, first match:
1. `--config-settings=ferry-lib=PATH` (pip 22.1+): that file, bundled as it is;
2. python/ferry/libferry.so, a copy placed there before the install: bundled as it is;
3. otherwise built: CMake configures the project (the checkout's root, python/.., or native/ in
   an sdist) into python/build/cmake (ignored by git; a temporary folder when python/ is not
   writable), with the tests off and warnings not fatal, and builds the `ferry` target only
   (about 15 s on 2 cores; a second build from the same tree, `pip wheel` after `pip install`,
   rebuilds only what changed). Nothing from the checkout's build/ is used. Needs cmake, a C
   compiler and the libraries of scripts/deps.sh build.

An editable install (`pip install -e ./python`) links the checkout's python/ into the
environment and builds nothing: the package then finds the checkout's build/libferry.so (`make`).
"""
import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
SDIST_NATIVE = "native"  # where an sdist keeps the C project
# What the C project's CMake needs to build the library (CMakeLists.txt adds bench/ always).
NATIVE_PARTS = ["CMakeLists.txt", "ferry.pc.in", "include", "src", "bench"]


def _project():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise RuntimeError("ferry's build needs Python 3.11+, or tomli (Debian python3-tomli)")
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _dist_name(project):
    return re.sub(r"[-_.]+", "_", project["name"]).lower()


def _metadata(project):
    lines = ["Metadata-Version: 2.1", "Name: " + project["name"], "Version: " + project["version"]]
    if "description" in project:
        lines.append("Summary: " + project["description"])
    if "requires-python" in project:
        lines.append("Requires-Python: " + project["requires-python"])
    lines += ["Classifier: " + c for c in project.get("classifiers", [])]
    lines += ["Requires-Dist: " + d for d in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (d, extra) for d in deps]
    body = ""
    readme = project.get("readme")
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(HERE, readme), encoding="utf-8") as f:
            body = "\n" + f.read()
    return ("\n".join(lines) + "\n" + body).encode("utf-8")


def _entry_points(project):
    """entry_points.txt: each group of [project.entry-points] (scripts and gui-scripts as
    console_scripts and gui_scripts), one `name = object reference` a line; None when none."""
    groups = dict(project.get("entry-points", {}))
    for key, group in (("scripts", "console_scripts"), ("gui-scripts", "gui_scripts")):
        if project.get(key):
            groups[group] = project[key]
    text = "".join("[%s]\n%s\n" % (group, "".join("%s = %s\n" % kv for kv in eps.items()))
                   for group, eps in groups.items() if eps)
    return text.encode() if text else None


def _add_dist_info(wheel, dist_info, project, tag):
    wheel.add(dist_info + "/METADATA", _metadata(project))
    wheel.add(dist_info + "/WHEEL", _wheel_file(tag))
    entry_points = _entry_points(project)
    if entry_points:
        wheel.add(dist_info + "/entry_points.txt", entry_points)


def _tag():
    return "py3-none-" + re.sub(r"[-.]", "_", sysconfig.get_platform())


def _wheel_file(tag):
    return ("Wheel-Version: 1.0\nGenerator: ferry_build\nRoot-Is-Purelib: false\nTag: %s\n"
            % tag).encode()


class _Wheel:
    """A .whl being written: each file's bytes, with the RECORD line that lists its hash."""

    def __init__(self, path, dist_info):
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.dist_info = dist_info
        self.records = []

    def add(self, arcname, data, mode=0o644):
        info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))

    def close(self):
        record = self.dist_info + "/RECORD"
        self.records.append(record + ",,")
        self.zip.writestr(zipfile.ZipInfo(record, date_time=(2020, 1, 1, 0, 0, 0)),
                          "\n".join(self.records) + "\n")
        self.zip.close()


def _package_files():
    """(path in the wheel, path on disk) of every .py and py.typed of the package."""
    root = os.path.join(HERE, "ferry")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py") or name == "py.typed":
                full = os.path.join(dirpath, name)
                out.append(("ferry/" + os.path.relpath(full, root).replace(os.sep, "/"), full))
    return out


def _native_source():
    for cand in (os.path.join(HERE, SDIST_NATIVE), os.path.dirname(HERE)):
        if os.path.isfile(os.path.join(cand, "CMakeLists.txt")) and \
                os.path.isfile(os.path.join(cand, "include", "ferry.h")):
            return cand
    raise RuntimeError("ferry's build: no C project beside python/ (want ../CMakeLists.txt and "
                       "../include/ferry.h): install from a checkout of the whole repository")


def _build_dir(workdir):
    """python/build/cmake (git ignores it): a second build from the same tree (pip wheel after
    pip install) rebuilds only what changed. A tree it cannot write to builds under workdir."""
    build = os.path.join(HERE, "build", "cmake")
    try:
        os.makedirs(build, exist_ok=True)
        if os.access(build, os.W_OK):
            return build
    except OSError:
        pass
    return os.path.join(workdir, "cmake-build")


def _forget_other_source(build, src):
    """Empties build when its CMake cache belongs to another source tree (a moved checkout)."""
    try:
        with open(os.path.join(build, "CMakeCache.txt"), encoding="utf-8") as f:
            home = next((line.split("=", 1)[1].strip() for line in f
                         if line.startswith("CMAKE_HOME_DIRECTORY:")), None)
    except OSError:
        return
    if home is None or os.path.realpath(home) != os.path.realpath(src):
        shutil.rmtree(build)
        os.makedirs(build)


def _build_library(workdir):
    """libferry.so built by the project's CMake (python/build/cmake, else under workdir); its
    path."""
    cmake = shutil.which("cmake")
    if not cmake:
        raise RuntimeError("ferry's build needs cmake, a C compiler and the libraries that "
                           "scripts/deps.sh build installs (Debian: cmake gcc pkg-config ...)")
    src, build = _native_source(), _build_dir(workdir)
    _forget_other_source(build, src)
    jobs = str(os.cpu_count() or 1)
    for cmd in ([cmake, "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                 "-DFERRY_TESTS=OFF", "-DFERRY_WERROR=OFF"],
                [cmake, "--build", build, "-j", jobs, "--target", "ferry"]):
        print("ferry_build: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return os.path.join(build, "libferry.so")


def _library(config_settings, workdir):
    given = (config_settings or {}).get("ferry-lib")
    copied = os.path.join(HERE, "ferry", "libferry.so")
    if given:
        path = os.path.abspath(given)
    elif os.path.exists(copied):
        path = copied
    else:
        return _build_library(workdir)
    if not os.path.isfile(path):
        raise RuntimeError("ferry's build: ferry-lib=%s: no such file" % given)
    print("ferry_build: bundling %s (no build)" % path, flush=True)
    return path


def _write_dist_info(directory, project, tag):
    dist_info = "%s-%s.dist-info" % (_dist_name(project), project["version"])
    path = os.path.join(directory, dist_info)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "METADATA"), "wb") as f:
        f.write(_metadata(project))
    with open(os.path.join(path, "WHEEL"), "wb") as f:
        f.write(_wheel_file(tag))
    entry_points = _entry_points(project)
    if entry_points:
        with open(os.path.join(path, "entry_points.txt"), "wb") as f:
            f.write(entry_points)
    return dist_info


# PEP 517 / PEP 660 hooks.

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _write_dist_info(metadata_directory, _project(), _tag())


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _write_dist_info(metadata_directory, _project(), "py3-none-any")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project, tag = _project(), _tag()
    name = "%s-%s-%s.whl" % (_dist_name(project), project["version"], tag)
    dist_info = "%s-%s.dist-info" % (_dist_name(project), project["version"])
    with tempfile.TemporaryDirectory(prefix="ferry-build-") as workdir:
        library = _library(config_settings, workdir)
        wheel = _Wheel(os.path.join(wheel_directory, name), dist_info)
        for arcname, full in _package_files():
            with open(full, "rb") as f:
                wheel.add(arcname, f.read())
        with open(library, "rb") as f:  # the real file (libferry.so is a link to it)
            wheel.add("ferry/libferry.so", f.read(), 0o755)
        _add_dist_info(wheel, dist_info, project, tag)
        wheel.close()
    return name


# An editable install's finder: `ferry` (and its subpackages) from the checkout's python/ferry,
# nothing else of python/ (its tests/ and build_backend/ stay off sys.path).
_EDITABLE_FINDER = '''"""ferry, installed editable: imported from %(pkg)s (pip install -e)."""
import importlib.abc
import importlib.util
import sys

PKG = %(pkg)r


class _FerryFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "ferry":
            return None
        return importlib.util.spec_from_file_location(
            name, PKG + "/__init__.py", submodule_search_locations=[PKG])


if not any(isinstance(f, _FerryFinder) for f in sys.meta_path):
    sys.meta_path.append(_FerryFinder())
'''


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    name = "%s-%s-py3-none-any.whl" % (_dist_name(project), project["version"])
    dist_info = "%s-%s.dist-info" % (_dist_name(project), project["version"])
    wheel = _Wheel(os.path.join(wheel_directory, name), dist_info)
    pkg = os.path.join(HERE, "ferry")
    wheel.add("_ferry_editable.py", (_EDITABLE_FINDER % {"pkg": pkg}).encode())
    wheel.add("_ferry_editable.pth", b"import _ferry_editable\n")
    _add_dist_info(wheel, dist_info, project, "py3-none-any")
    wheel.close()
    return name


def build_sdist(sdist_directory, config_settings=None):
    """python/ at the archive's root, the C project the library is built from under native/."""
    project = _project()
    base = "%s-%s" % (_dist_name(project), project["version"])
    skip = re.compile(r"(^|/)(__pycache__|build|[^/]*\.egg-info)(/|$)|\.pyc$|libferry\.so")

    def keep(info):
        return None if skip.search(info.name[len(base) + 1:]) else info

    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(HERE)):
            if entry != SDIST_NATIVE:
                tar.add(os.path.join(HERE, entry), base + "/" + entry, filter=keep)
        src = _native_source()
        for part in NATIVE_PARTS:
            tar.add(os.path.join(src, part), "%s/%s/%s" % (base, SDIST_NATIVE, part), filter=keep)
        pkg_info = io.BytesIO(_metadata(project))
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(pkg_info.getvalue())
        tar.addfile(info, pkg_info)
    return os.path.basename(path)
