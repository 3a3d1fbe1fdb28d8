"""CUDA memory from Python (ferry/cuda.py, docs/GPU.md): cuda_info, ferry.DeviceArray, mem_copy
round trips, device tensors as arguments (the pointer and desc handed to C, contiguity, the
producer's stream synchronized first), device= on the calls that make tensors, and the jobs with
device memory on both sides.

Runs against the in-tree stand-in driver (libferry_cudastub.so: FERRY_CUDASTUB, else found under
the build folder), or the real driver when FERRY_TEST_CUDA=driver (scripts/gpu-check.sh); skips
with "no CUDA driver" when neither loads. The stand-in maps device memory PROT_NONE in this
process, so any CPU access to device bytes crashes here as it would on a GPU, and it defers
asynchronous copies until their stream is synchronized, so a missing synchronization reads stale
bytes. Device memory is filled and checked only through ferry_mem_copy.
"""
import ctypes
import glob
import mmap
import os

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
REAL = os.environ.get("FERRY_TEST_CUDA") == "driver"


def _stand_in():
    env = os.environ.get("FERRY_CUDASTUB")
    if env:
        return env
    # the one built with the library under test (a sanitizer build's would not load here)
    lib = os.environ.get("FERRY_LIB")
    beside = os.path.join(os.path.dirname(lib), "tests", "libferry_cudastub.so") if lib else ""
    if beside and os.path.exists(beside):
        return beside
    found = (glob.glob(os.path.join(_REPO, "build", "tests", "libferry_cudastub.so")) +
             sorted(glob.glob(os.path.join(_REPO, "build*", "**", "libferry_cudastub.so"),
                              recursive=True)))
    return found[0] if found else None


# Before ferry loads a driver (it does so once per process, at the first call that needs one).
if not REAL:
    _stub = _stand_in()
    if _stub is None:
        pytest.skip("no CUDA driver: the stand-in libferry_cudastub.so is not built (set "
                    "FERRY_CUDASTUB)", allow_module_level=True)
    os.environ["FERRY_CUDA_LIB"] = _stub

import ferry  # noqa: E402
from ferry import cuda  # noqa: E402
from ferry.tensors import as_buffer  # noqa: E402

INFO = ferry.cuda_info()
if not INFO["found"] or not INFO["devices"]:
    pytest.skip("no CUDA driver: %s" % (INFO["detail"] or "no device"), allow_module_level=True)
LAST = len(INFO["devices"]) - 1  # another device than 0 where there is one

try:
    import torch
    TORCH_CUDA = torch.cuda.is_available()
except ImportError:
    torch, TORCH_CUDA = None, False


def on_device(arr, device=0):
    """A DeviceArray holding a copy of host array arr."""
    return ferry.DeviceArray(arr.shape, arr.dtype, device).copy_from_host(arr)


class CAI:
    """A foreign device array: only __cuda_array_interface__ (as CuPy, Numba), over memory that
    `owner` keeps."""

    def __init__(self, owner, **over):
        self.owner = owner
        self.iface = dict(owner.__cuda_array_interface__, **over)

    @property
    def __cuda_array_interface__(self):
        return self.iface


# -- the driver as Python sees it ------------------------------------------------------------
def test_cuda_info_lists_the_devices():
    assert INFO["driver_version"] > 0 and INFO["detail"] == ""
    assert INFO["library"]
    for i, d in enumerate(INFO["devices"]):
        assert d["index"] == i and d["name"] and d["total_bytes"] > 0


def test_device_ordinal_names():
    assert cuda.device_ordinal(None) is None and cuda.device_ordinal("cpu") is None
    assert cuda.device_ordinal("cuda:1") == 1 and cuda.device_ordinal(3) == 3
    for bad in ("gpu", "cuda:", "cuda:x", -1, True, 1.5):
        with pytest.raises(ValueError):
            cuda.device_ordinal(bad)


# -- DeviceArray and mem_copy ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32, np.float64])
def test_device_array_round_trip(dtype):
    host = (np.arange(3 * 5 * 7) % 251).astype(dtype).reshape(3, 5, 7)
    a = on_device(host, LAST)
    assert cuda.mem_where(a.ptr) == ("cuda", LAST)
    back = a.to_host()
    assert back.dtype == host.dtype and back.shape == host.shape and np.array_equal(back, host)
    iface = a.__cuda_array_interface__
    assert iface["shape"] == (3, 5, 7) and iface["data"] == (a.ptr, False)
    assert np.dtype(iface["typestr"]) == host.dtype and iface["version"] == 3
    assert iface["strides"] is None and iface["stream"] is None
    a.close()
    a.close()  # twice is fine
    with pytest.raises(ValueError):
        a.ptr


def test_device_array_bfloat16_is_its_bits():
    a = ferry.DeviceArray((4, 2), "bfloat16")
    assert a.dtype_name == "bfloat16" and a.dtype == np.uint16 and a.nbytes == 16
    desc, buf = as_buffer(a)
    assert desc.dtype == 11  # bfloat16 survives, where the interface only says <u2


def test_device_array_refuses_bad_arguments():
    a = ferry.DeviceArray(8, np.int64)
    with pytest.raises(ValueError, match="bytes"):
        a.copy_from_host(np.zeros(7, np.int64))
    with pytest.raises(ValueError, match="device memory"):
        a.copy_from_host(ferry.DeviceArray(8, np.int64))
    with pytest.raises(ValueError):
        ferry.DeviceArray(8, np.int64, device="cpu")
    with pytest.raises(ferry.Error):  # no such device: the C library's error, nothing allocated
        ferry.DeviceArray(8, np.int64, device=len(INFO["devices"]) + 5)


def test_mem_copy_device_to_device_and_back():
    host = np.random.default_rng(1).integers(0, 1 << 30, 4096, dtype=np.int64)
    a = on_device(host, 0)
    b = ferry.DeviceArray(host.shape, host.dtype, LAST)
    cuda.mem_copy(b.ptr, a.ptr, host.nbytes)
    assert np.array_equal(b.to_host(), host)
    cuda.mem_copy(b.ptr + 8, a.ptr, 8)  # interior addresses of an allocation work too
    want = host.copy()
    want[1] = host[0]
    assert np.array_equal(b.to_host(), want)


def test_empty_device_array():
    a = ferry.DeviceArray((0, 3), np.float32)
    assert a.to_host().shape == (0, 3)
    a.copy_from_host(np.zeros((0, 3), np.float32))


# -- device tensors as arguments -------------------------------------------------------------
def test_argument_gives_the_device_pointer_and_desc():
    a = on_device(np.arange(24, dtype=np.int32).reshape(2, 3, 4), LAST)
    for obj in (a, CAI(a), CAI(a, strides=(48, 16, 4))):  # explicit C strides are contiguous
        desc, buf = as_buffer(obj, writable=True)
        assert isinstance(buf, cuda.DeviceBytes)
        assert buf.ctypes.data == a.ptr and buf.nbytes == 96 and buf.device == LAST
        assert desc.dtype == 8 and desc.ndim == 3
        assert tuple(desc.shape[i] for i in range(3)) == (2, 3, 4)


def test_argument_refusals():
    a = on_device(np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    with pytest.raises(ValueError, match="not contiguous"):
        as_buffer(CAI(a, shape=(3, 2, 4), strides=(16, 48, 4)))
    with pytest.raises(TypeError, match="not supported"):
        as_buffer(CAI(a, typestr="<c8"))
    with pytest.raises(TypeError, match="not supported"):
        as_buffer(CAI(a, typestr=">i4"))
    with pytest.raises(ValueError, match="stream 0"):
        as_buffer(CAI(a, stream=0))
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(CAI(a, data=(a.ptr, True)), writable=True)  # a destination
    as_buffer(CAI(a, data=(a.ptr, True)))  # a source may be read-only
    host = np.zeros(24, np.int32)
    with pytest.raises(ferry.NotSupported, match="not CUDA memory"):
        as_buffer(CAI(a, data=(host.ctypes.data, False)))


class _Streams:
    """The driver entry points to make an asynchronous copy on a stream of the test's own."""

    def __init__(self):
        d = ctypes.CDLL(INFO["library"])
        self.d = d
        for f in ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                  "cuStreamCreate", "cuMemcpyAsync", "cuStreamSynchronize", "cuStreamDestroy_v2",
                  "cuMemHostRegister_v2", "cuMemHostUnregister"):
            getattr(d, f).restype = ctypes.c_int
        d.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                    ctypes.c_void_p]
        d.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        d.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        d.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        d.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        dev, self.ctx, old = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        assert d.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert d.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev) == 0
        assert d.cuCtxGetCurrent(ctypes.byref(old)) == 0
        self.old = old

    def __enter__(self):
        assert self.d.cuCtxSetCurrent(self.ctx) == 0
        return self

    def __exit__(self, *exc):
        self.d.cuCtxSetCurrent(self.old)

    def stream(self):
        s = ctypes.c_void_p()
        assert self.d.cuStreamCreate(ctypes.byref(s), 1) == 0  # CU_STREAM_NON_BLOCKING
        return s.value


def _write_async(st, s, dst, host):
    """Queues host -> dst on stream s (pinned source: the copy is really asynchronous)."""
    assert st.d.cuMemHostRegister_v2(host.ctypes.data, host.nbytes, 1) == 0
    assert st.d.cuMemcpyAsync(dst.ptr, host.ctypes.data, host.nbytes, s) == 0


def _page_aligned(n, value):
    """n bytes of value in their own pages (what cuMemHostRegister pins)."""
    buf = np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)
    buf[:] = value
    return buf


def test_argument_stream_is_synchronized_before_ferry_reads():
    st = _Streams()
    old = np.zeros(1 << 16, np.uint8)
    new = _page_aligned(1 << 16, 7)
    a = on_device(old)
    with st:
        s = st.stream()
        _write_async(st, s, a, new)
    desc, buf = as_buffer(CAI(a, stream=s))  # waits for s
    host = np.empty_like(new)
    cuda.mem_copy(host.ctypes.data, buf.ctypes.data, buf.nbytes)
    assert np.array_equal(host, new)
    with st:
        st.d.cuMemHostUnregister(new.ctypes.data)
        st.d.cuStreamDestroy_v2(s)


@pytest.mark.skipif(REAL, reason="the stand-in defers asynchronous copies; a GPU may have "
                    "finished one by the time it is read")
def test_without_the_stream_ferry_would_read_stale_bytes():
    # the control of the test above: without the interface's stream nothing waits, and the
    # stand-in still holds the copy back, so the test above fails if ferry did not synchronize
    st = _Streams()
    old = np.zeros(1 << 16, np.uint8)
    new = _page_aligned(1 << 16, 7)
    a = on_device(old)
    with st:
        s = st.stream()
        _write_async(st, s, a, new)
    desc, buf = as_buffer(CAI(a))
    host = np.empty_like(new)
    cuda.mem_copy(host.ctypes.data, buf.ctypes.data, buf.nbytes)
    assert np.array_equal(host, old)
    with st:
        assert st.d.cuStreamSynchronize(s) == 0
        st.d.cuMemHostUnregister(new.ctypes.data)
        st.d.cuStreamDestroy_v2(s)


def test_refit_sender_waits_on_each_stream_once():
    a = on_device(np.zeros(4, np.int32))
    calls = []
    bufs = []
    for key in (("cai", 0, 5), ("cai", 0, 5), ("cai", 0, 6), None):
        _, b = as_buffer(a)
        b.stream, b.sync = key, (lambda k=key: calls.append(k))
        bufs.append(b)
    cuda.sync_all(bufs)
    assert calls == [("cai", 0, 5), ("cai", 0, 6)]


# -- device= on the calls that make tensors ------------------------------------------------------
@pytest.fixture
def mq_pair():
    pub = ferry.MQ(host_directory=True, name="py-cuda-pub")
    sub = ferry.MQ(pub.directory, name="py-cuda-sub")
    yield pub, sub
    sub.close()
    pub.close()


def test_recv_onto_a_device(mq_pair):
    pub, sub = mq_pair
    sub.subscribe("d")
    pub.wait_subscribers("d", 1, timeout=10)
    x = np.arange(6 * 7, dtype=np.float32).reshape(6, 7)
    bits = np.arange(5, dtype=np.uint16)
    pub.publish("d", x)
    pub.publish("d", b"raw bytes")
    pub.publish("d", x[::2])  # a strided host array is published as a copy
    topic, publisher, y = sub.recv(timeout=10, device="cuda:%d" % LAST)
    want_type = torch.Tensor if TORCH_CUDA else ferry.DeviceArray
    assert (topic, publisher) == ("d", "py-cuda-pub") and isinstance(y, want_type)
    host = y.cpu().numpy() if TORCH_CUDA else y.to_host()
    assert host.shape == x.shape and np.array_equal(host, x)
    _, _, raw = sub.recv(timeout=10, device=LAST, copy=True)
    raw_host = raw.cpu().numpy() if TORCH_CUDA else raw.to_host()
    assert raw_host.tobytes() == b"raw bytes"
    _, _, z = sub.recv(timeout=10, device=LAST)
    assert np.array_equal(z.cpu().numpy() if TORCH_CUDA else z.to_host(), x[::2])
    with pytest.raises(ValueError):
        sub.recv(timeout=0, device="gpu:0")
    del bits


def test_new_on_device_types():
    a = cuda.new_on_device((2, 3), 11, LAST, "numpy")
    if TORCH_CUDA:
        assert a.device.type == "cuda" and a.dtype == torch.bfloat16
    else:
        assert isinstance(a, ferry.DeviceArray) and a.dtype_name == "bfloat16"
    with pytest.raises(ValueError, match="like=bytes"):
        cuda.new_on_device((2,), 2, 0, bytes)
    if torch is not None and not TORCH_CUDA:
        with pytest.raises(ferry.NotSupported, match="torch with CUDA"):
            cuda.new_on_device((2,), 2, 0, "torch")


def test_torch_cpu_tensors_unchanged():
    if torch is None:
        pytest.skip("needs torch")
    t = torch.arange(6, dtype=torch.int64)
    desc, arr = as_buffer(t)
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == t.data_ptr()


@pytest.mark.skipif(not TORCH_CUDA, reason="no GPU: needs torch with CUDA (Debian's torch is CPU-only)")
def test_torch_cuda_tensor_argument():
    t = torch.arange(24, dtype=torch.int32, device="cuda:0").reshape(4, 6)
    desc, buf = as_buffer(t)  # synchronizes torch's current stream
    assert buf.ctypes.data == t.data_ptr() and buf.nbytes == 96 and buf.device == 0
    host = np.empty((4, 6), np.int32)
    cuda.mem_copy(host.ctypes.data, buf.ctypes.data, 96)
    assert np.array_equal(host, np.arange(24, dtype=np.int32).reshape(4, 6))
    with pytest.raises(ValueError, match="not contiguous"):
        as_buffer(t.t())
    w = torch.as_tensor(on_device(np.arange(5, dtype=np.int64)), device="cuda:0")
    assert w.cpu().tolist() == [0, 1, 2, 3, 4]  # torch wraps a DeviceArray without a copy


# -- the jobs with device memory (the store's and refit's C paths for CUDA) ---------------------
@pytest.fixture(scope="module")
def stores():
    a = ferry.Store(host_directory=True, name="py-cuda-a", capacity=64 << 20, timeout=5)
    b = ferry.Store(a.directory, name="py-cuda-b", timeout=5)
    yield a, b
    b.close()
    a.close()


def test_job_store_put_from_and_get_into_device(stores):
    a, b = stores
    routing = np.random.default_rng(2).integers(0, 64, (4, 33, 8), dtype=np.int32)
    src = on_device(routing, 0)
    a.put("routing", src)
    assert np.array_equal(b.get("routing"), routing)  # a host get of device-put bytes
    out = ferry.DeviceArray(routing.shape, routing.dtype, LAST)
    assert b.get("routing", out=out) is out
    assert np.array_equal(out.to_host(), routing)
    got = b.get("routing", device="cuda:%d" % LAST)
    assert np.array_equal(got.cpu().numpy() if TORCH_CUDA else got.to_host(), routing)
    batch = b.get_batch(["routing", "no-such-key"], device=LAST)
    assert batch[1] is None
    assert np.array_equal(batch[0].cpu().numpy() if TORCH_CUDA else batch[0].to_host(), routing)
    small = ferry.DeviceArray((4, 33), np.int32)
    with pytest.raises(ferry.ShapeError):
        b.get("routing", out=small)
    with pytest.raises(ferry.NotFound):
        b.get("no-such-key", device=0)
    with pytest.raises(ValueError):
        b.get("routing", out=out, device=0)


def _copy_counts():
    """The stand-in's copies so far (host to device, device to host, device to device, through
    IPC), or None on the real driver."""
    if REAL:
        return None
    import ctypes
    counts = (ctypes.c_ulonglong * 4)()
    ctypes.CDLL(os.environ["FERRY_CUDA_LIB"]).cuStubCopyCounts(counts)
    return list(counts)


def test_job_store_device_pool():
    """Store(device_pool_bytes=): a put from device memory stays on the device (no device-to-host
    copy), and gets of it into device and host memory, here and from another node of this
    process (staged by its owner), return its bytes; a re-put replaces them."""
    a = ferry.Store(host_directory=True, name="py-cuda-dp", device_pool_bytes=1 << 20, timeout=5)
    b = ferry.Store(a.directory, name="py-cuda-dp-b", timeout=5)
    try:
        x = np.arange(4096, dtype=np.int64)
        src = on_device(x, 0)
        before = _copy_counts()
        a.put("dp", src)
        after = _copy_counts()
        if before is not None:  # device to device into the pool, nothing device to host
            assert after[1] == before[1] and after[2] > before[2]
        for s in (a, b):
            assert np.array_equal(s.get("dp"), x)
            out = ferry.DeviceArray(x.shape, x.dtype, LAST)
            assert np.array_equal(s.get("dp", out=out).to_host(), x)
        a.put("dp", on_device(x * 3, 0))
        assert np.array_equal(b.get("dp"), x * 3)
    finally:
        b.close()
        a.close()


def test_job_mq_publish_from_device(mq_pair):
    pub, sub = mq_pair
    sub.subscribe("dev")
    pub.wait_subscribers("dev", 1, timeout=10)
    x = np.arange(1000, dtype=np.int64)
    pub.publish("dev", on_device(x, LAST))
    _, _, y = sub.recv(timeout=10)
    assert np.array_equal(y, x)


def test_job_refit_device_tensors_both_sides():
    rng = np.random.default_rng(3)
    host = {"w": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.integers(0, 1 << 15, 100).astype(np.uint16),
            "cpu": np.arange(10, dtype=np.int64)}  # host and device tensors in one plan
    sd = {"w": on_device(host["w"]), "b": on_device(host["b"], LAST), "cpu": host["cpu"]}
    name = "pycuda-%d" % os.getpid()
    tx = ferry.RefitSender(name, sd, buffer_bytes=4096)
    rx = ferry.RefitReceiver(name, timeout=5)
    try:
        dst = {"w": ferry.DeviceArray((64, 32), np.float32, LAST),
               "b": ferry.DeviceArray(100, np.uint16, 0), "cpu": np.zeros(10, np.int64)}
        rx.bind(dst)
        for v in (1, 2):
            host["w"] += 1
            sd["w"].copy_from_host(host["w"])
            tx.push(v)
            assert rx.wait(v, timeout=10) == v
            assert np.array_equal(dst["w"].to_host(), host["w"])
            assert np.array_equal(dst["b"].to_host(), host["b"])
            assert np.array_equal(dst["cpu"], host["cpu"])
    finally:
        rx.close()
        tx.close()


def test_without_a_driver_device_tensors_are_refused_before_c():
    # FERRY_CUDA=off in a child: the pointer (not device memory this process could ever read)
    # must not reach the C library, which would take it for host memory
    import subprocess
    import sys
    code = (
        "import ferry\n"
        "class Foreign:\n"
        "    __cuda_array_interface__ = {'shape': (4,), 'typestr': '<i4', 'data': (4096, False),\n"
        "                                'version': 3}\n"
        "try:\n"
        "    ferry.Store(host_directory=True, name='py-cuda-off').put('k', Foreign())\n"
        "except ferry.NotSupported as e:\n"
        "    print('refused:', e)\n")
    env = dict(os.environ, FERRY_CUDA="off")
    if os.environ.get("FERRY_TEST_INSTALLED") != "1":  # else the installed package, as here
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(_HERE),
                                                          os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "no CUDA driver" in out.stdout
    assert "FERRY_CUDA=off" in out.stdout


def test_job_refit_alias_views_the_senders_device_buffer():
    # alias mode over CUDA IPC: the sender (another process: a process cannot map its own IPC
    # handles) keeps every tensor on one device, uncast, so its whole buffer is device memory;
    # this receiver's views point into it, and nothing is copied here
    import subprocess
    import sys
    name = "pycuda-alias-%d" % os.getpid()
    code = (
        "import sys, numpy as np, ferry\n"
        "w = np.arange(600, dtype=np.float32).reshape(20, 30)\n"
        "b = np.arange(50, dtype=np.int64)\n"
        "sd = {'w': ferry.DeviceArray(w.shape, np.float32, 0).copy_from_host(w),\n"
        "      'b': ferry.DeviceArray(b.shape, np.int64, 0).copy_from_host(b)}\n"
        "tx = ferry.RefitSender(%r, sd, buffer_bytes=4096, alias=True)\n"
        "print('ready', flush=True)\n"
        "for line in sys.stdin:\n"
        "    v = int(line)\n"
        "    sd['w'].copy_from_host(w + v)\n"
        "    sd['b'].copy_from_host(b * v)\n"
        "    tx.push(v)\n"
        "    print('pushed', v, flush=True)\n"
        "tx.close()\n" % name)
    env = dict(os.environ)
    if os.environ.get("FERRY_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(_HERE),
                                                          os.environ.get("PYTHONPATH")]))
    tx = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env)
    rx = None
    try:
        assert tx.stdout.readline().strip() == "ready"
        rx = ferry.RefitReceiver(name, timeout=10)
        views = rx.bind_alias()
        for v in (1, 2):
            tx.stdin.write("%d\n" % v)
            tx.stdin.flush()
            assert tx.stdout.readline().split() == ["pushed", str(v)]
            assert rx.wait(v, timeout=10) == v
            for k in ("w", "b"):
                assert cuda.mem_where(views[k].__cuda_array_interface__["data"][0])[0] == "cuda"
            w = np.arange(600, dtype=np.float32).reshape(20, 30) + v
            assert np.array_equal(views["w"].to_host(), w)
            assert np.array_equal(views["b"].to_host(), np.arange(50, dtype=np.int64) * v)
    finally:
        if rx is not None:
            rx.close()
        tx.stdin.close()
        assert tx.wait(timeout=30) == 0
