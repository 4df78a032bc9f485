"""Zero-copy buffers of the kvd Python package against a real kvd: numpy arrays through the buffer
protocol and through DLPack, torch tensors (skipped without torch), device tensors refused with
the status code where this client cannot serve them, get writing into the caller's memory."""

import re

import numpy as np
import pytest

import kvd
from test_client import CHUNK_BYTES, engine, random_chunk


class DLPackOnly:
    """Exposes an array through __dlpack__ / __dlpack_device__ alone (as torch tensors do), not
    the buffer protocol; counts the exports."""

    def __init__(self, array):
        self.array = array
        self.exports = 0

    def __dlpack__(self, stream=None):
        self.exports += 1
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class DLPackNoDevice:
    """An older DLPack producer: __dlpack__ without __dlpack_device__."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()


class DeviceTensor:
    """A device tensor as DLPack announces it: __dlpack_device__() = (kDLCUDA, 1) by default. Its
    __dlpack__ must never be called here (no device: the refusal comes first)."""

    def __init__(self, device=(2, 1)):
        self.device = device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        raise AssertionError("__dlpack__ of a device tensor was called")


def put_and_lookup(c, first_token, data):
    chain = c.hash(np.arange(first_token, first_token + 256, dtype=np.int32))
    c.put(chain[0], 256, data)
    return c.lookup(chain)


def test_numpy_dlpack_put_and_get_in_place(daemon):
    with engine(daemon) as c:
        src = random_chunk(11).view(np.float32).reshape(5, 2, 256, 4, 8)
        exporter = DLPackOnly(src)
        hit = put_and_lookup(c, 11000, exporter)
        assert exporter.exports == 1
        dst = np.zeros_like(src)
        before = dst.__array_interface__["data"][0]
        res = c.get(hit.lease_id, 0, DLPackOnly(dst))
        # Written into the caller's array itself (no copy handed back).
        assert dst.__array_interface__["data"][0] == before
        assert res.bytes == CHUNK_BYTES
        np.testing.assert_array_equal(dst, src)
        # A producer without __dlpack_device__ (older DLPack) works the same.
        dst2 = np.zeros(CHUNK_BYTES, np.uint8)
        c.get(hit.lease_id, 0, DLPackNoDevice(dst2))
        np.testing.assert_array_equal(dst2, src.reshape(-1).view(np.uint8))
        c.release(hit.lease_id)


def test_dlpack_of_any_dtype_counts_bytes(daemon):
    with engine(daemon) as c:
        src = random_chunk(12).view(np.float16)  # 2-byte elements: size from bits x lanes
        hit = put_and_lookup(c, 12000, DLPackOnly(src))
        dst = np.zeros(CHUNK_BYTES // 8, np.float64)
        c.get(hit.lease_id, 0, DLPackOnly(dst))
        assert dst.tobytes() == src.tobytes()
        c.release(hit.lease_id)


def test_dlpack_refusals_name_the_argument(daemon):
    with engine(daemon) as c:
        chain = c.hash(np.arange(13000, 13256, dtype=np.int32))
        wide = np.zeros((CHUNK_BYTES, 2), np.uint8)
        with pytest.raises(kvd.InvalidArgumentError, match=r"data: a C-contiguous tensor") as e:
            c.put(chain[0], 256, DLPackOnly(wide[:, 0]))
        assert e.value.code == 1
        # numpy cannot export a read-only array through DLPack: said, not a Python BufferError.
        ro = np.zeros(CHUNK_BYTES, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(kvd.InvalidArgumentError, match="out: cannot export it through DLPack"):
            c.get(1, 0, DLPackOnly(ro))
        # A wrong size through DLPack is the client's size check, as for any buffer.
        with pytest.raises(kvd.InvalidArgumentError, match=str(CHUNK_BYTES)):
            c.put(chain[0], 256, DLPackOnly(np.zeros(100, np.float32)))
        assert c.connected


def test_device_tensors_are_refused_with_the_status_code(daemon):
    # CUDA tensors go to libkvd_client as plain pointers; it can serve them only in a CUDA build
    # with a device. Here (no device) it says why: UNIMPLEMENTED "built without CUDA" in a build
    # without CUDA, UNAVAILABLE "no CUDA device" in a CUDA build. Either way before the
    # tensor's __dlpack__ runs (DeviceTensor asserts it never does) and before anything is stored.
    refused = (kvd.UnimplementedError, kvd.UnavailableError)
    reason = r"(built without CUDA|no CUDA device)"
    with engine(daemon) as c:
        chain = c.hash(np.arange(14000, 14256, dtype=np.int32))
        with pytest.raises(refused) as e:
            c.put(chain[0], 256, DeviceTensor())
        assert (e.value.code, e.value.code_name) in ((10, "UNIMPLEMENTED"), (8, "UNAVAILABLE"))
        assert e.value.message.startswith("data: a CUDA tensor (device 1): ")
        assert re.search(reason, e.value.message)
        with pytest.raises(refused, match=r"^(UNIMPLEMENTED|UNAVAILABLE): out: a CUDA tensor"):
            c.get(1, 0, DeviceTensor())
        k = [np.zeros((256, 4, 8), np.float32) for _ in range(5)]
        v = [np.zeros((256, 4, 8), np.float32) for _ in range(4)] + [DeviceTensor()]
        with pytest.raises(refused, match=r"v\[4\]: a CUDA tensor"):
            c.put_layers(chain[0], 256, k, v)
        # A device kind libkvd_client never takes (ROCm) is UNIMPLEMENTED in every build.
        with pytest.raises(kvd.UnimplementedError, match=r"data: a ROCm tensor \(device 0\)"):
            c.put(chain[0], 256, DeviceTensor(device=(10, 0)))
        # Nothing was stored, the connection serves on.
        assert c.lookup(chain).matched_chunks == 0
        assert c.connected


def test_torch_cpu_tensors_put_and_get_in_place(daemon):
    torch = pytest.importorskip("torch")
    with engine(daemon) as c:
        src = torch.from_numpy(random_chunk(15).copy()).view(torch.bfloat16).reshape(-1, 64)
        hit = put_and_lookup(c, 15000, src)
        dst = torch.zeros_like(src)
        ptr = dst.data_ptr()
        c.get(hit.lease_id, 0, dst)
        assert dst.data_ptr() == ptr
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
        # Per-layer tensors (put_layers / get_layers) work the same.
        k = [torch.randn(256, 4, 8) for _ in range(5)]
        v = [torch.randn(256, 4, 8) for _ in range(5)]
        chain = c.hash(np.arange(15300, 15556, dtype=np.int32))
        c.put_layers(chain[0], 256, k, v)
        hit2 = c.lookup(chain)
        k2 = [torch.zeros(256, 4, 8) for _ in range(5)]
        v2 = [torch.zeros(256, 4, 8) for _ in range(5)]
        c.get_layers(hit2.lease_id, 0, k2, v2, 256)
        assert all(torch.equal(a, b) for a, b in zip(k + v, k2 + v2))
        c.release(hit.lease_id)
        c.release(hit2.lease_id)


def test_torch_refusals(daemon):
    torch = pytest.importorskip("torch")
    with engine(daemon) as c:
        chain = c.hash(np.arange(16000, 16256, dtype=np.int32))
        t = torch.zeros(CHUNK_BYTES // 4, requires_grad=True)
        with pytest.raises(kvd.InvalidArgumentError, match="data: cannot export it through DLPack"):
            c.put(chain[0], 256, t)
        with pytest.raises(kvd.InvalidArgumentError, match="C-contiguous"):
            c.put(chain[0], 256, torch.zeros(CHUNK_BYTES // 2, 2).t())
        if torch.cuda.is_available():
            # A CUDA build with a device serves it (the device script's tests check the bytes);
            # otherwise the refusal above.
            try:
                c.put(chain[0], 256, torch.zeros(CHUNK_BYTES, dtype=torch.uint8, device="cuda"))
            except (kvd.UnimplementedError, kvd.UnavailableError) as e:
                assert e.message.startswith("data: a CUDA tensor")
