"""The zero-copy calls of the kvd Python package against a real kvd on its shared-memory path:
read_in_place (a read-only view of a pinned chunk where it lies in kvd's arena), reserve_put /
commit (a writable slot of the arena the caller fills itself), flush_releases; the buffer
protocol without copies, read-only views, the lifetime rules, and the errors without shared
memory."""

import ctypes
import gc
import io
import itertools
import time

import numpy as np
import pytest

import kvd
from kvd_daemon import KvdDaemon

MODEL = "stories260k"
CHUNK_BYTES = 256 * 5 * 2 * 4 * 8 * 4  # tokens x layers x (K,V) x heads x dim x f32
CAPACITY = 32 << 20

_seeds = itertools.count(1)


@pytest.fixture(scope="module")
def shm_daemon():
    # 32 MiB arena in 8 MiB segments: below the capacity, so kvd serves it as shared memory.
    d = KvdDaemon(node="pytest-shm", capacity="32MiB", segment="8MiB", unix=True)
    yield d
    d.stop()


def engine(address, **kw):
    return kvd.connect(address, model=MODEL, ucx_tls="sm,tcp", net_devices="lo", **kw)


@pytest.fixture
def client(shm_daemon):
    with engine(shm_daemon.unix_address) as c:
        assert c.shared_memory, "kvd did not grant the shared-memory path:\n" + shm_daemon.log()
        yield c


@pytest.fixture
def admin(shm_daemon):
    with kvd.connect(shm_daemon.address, admin=True) as a:
        yield a


def fresh_chain(c, chunks=1):
    """Keys of chunks no other test has put (the daemon is shared by the module)."""
    tokens = np.random.default_rng(next(_seeds)).integers(0, 1 << 30, 256 * chunks,
                                                          dtype=np.int32)
    return c.hash(tokens)


def get_writable_buffer(obj):
    """PyObject_GetBuffer(obj, PyBUF_WRITABLE) as a C consumer calls it (the exporter's own error
    propagates; a buffer it grants is released again)."""
    view = ctypes.create_string_buffer(256)  # a Py_buffer is 80 bytes on 64-bit CPython
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
    get.restype = ctypes.c_int
    get(obj, ctypes.addressof(view), 0x0001)  # PyBUF_WRITABLE
    ctypes.pythonapi.PyBuffer_Release.argtypes = [ctypes.c_void_p]
    ctypes.pythonapi.PyBuffer_Release(ctypes.addressof(view))


def random_chunk(seed):
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)


def stored_chunk(c, seed):
    """A fresh chunk put through the copying path: (its key, its bytes, a lease on it)."""
    (h,) = fresh_chain(c)
    data = random_chunk(seed)
    c.put(h, 256, data)
    hit = c.lookup([h])
    assert hit.matched_chunks == 1
    return h, data, hit


def host_tier(admin):
    return next(t for t in admin.stats()["tiers"] if t["name"] == "host")


def counter(admin, name):
    return admin.stats()["counters"][name]


def nothing_open(admin):
    """Waits (up to 10 s) until kvd holds no read, lease or reservation of any session: the
    earlier tests' clients are gone, and their connections' ends may still be in kvd's queue."""
    deadline = time.monotonic() + 10
    while True:
        open_now = (counter(admin, "host_reads_open"), counter(admin, "host_leases_open"),
                    host_tier(admin)["reserved_bytes"])
        if open_now == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"reads, leases, reserved bytes open: {open_now}"
        time.sleep(0.05)


def test_read_in_place_is_byte_exact_with_the_chunks_metadata(client):
    h, data, hit = stored_chunk(client, 1)
    with client.read_in_place(hit.lease_id, 0) as view:
        assert isinstance(view, kvd.ChunkView)
        assert view.verified and not view.released
        assert len(view) == view.bytes == CHUNK_BYTES
        assert view.tokens == 256 and view.form == "raw" and view.codec_id == 0
        copied = np.empty(CHUNK_BYTES, np.uint8)
        assert view.checksum == client.get(hit.lease_id, 0, copied).checksum
        assert bytes(view) == data.tobytes()
        assert memoryview(view).readonly and memoryview(view).nbytes == CHUNK_BYTES
    assert view.released
    # Unverified: the same bytes, and verify() checks them later.
    unverified = client.read_in_place(hit.lease_id, 0, verify_checksum=False)
    assert not unverified.verified
    unverified.verify()
    assert unverified.verified
    np.testing.assert_array_equal(np.frombuffer(unverified, np.uint8), data)
    unverified.release()
    client.release(hit.lease_id)


def test_a_slot_written_through_numpy_commits_byte_exact(client):
    chain = fresh_chain(client, chunks=3)
    data = [random_chunk(10 + i) for i in range(3)]
    # 1: a writable numpy array over the slot; slot.commit().
    slot = client.reserve_put(chain[0], 256)
    assert isinstance(slot, kvd.PutSlot) and slot.open and not slot.already_stored
    assert len(slot) == slot.bytes == CHUNK_BYTES and slot.tokens == 256 and slot.hash == chain[0]
    arr = np.frombuffer(slot, np.uint8)
    assert arr.flags.writeable and arr.ctypes.data == slot.address
    arr[:] = data[0]
    del arr
    r = slot.commit()
    assert r.bytes == CHUNK_BYTES and not r.already_stored
    assert slot.committed and not slot.open
    # 2: a memoryview in a with block; client.commit_put(slot).
    slot = client.reserve_put(chain[1], 256)
    with memoryview(slot) as m:
        m[:] = data[1].tobytes()
    assert not client.commit_put(slot).already_stored
    # 3: the slot as a context manager, float32 writes.
    with client.reserve_put(chain[2], 256) as slot:
        np.frombuffer(slot, np.float32)[:] = data[2].view(np.float32)
        slot.commit()
    hit = client.lookup(chain)
    assert hit.matched_chunks == 3
    out = np.empty(CHUNK_BYTES, np.uint8)
    for i in range(3):
        client.get(hit.lease_id, i, out)  # the copying get verifies the writer's checksum
        np.testing.assert_array_equal(out, data[i])
    client.release(hit.lease_id)


def test_numpy_sees_the_arena_without_a_copy(client):
    h, data, hit = stored_chunk(client, 20)
    with client.read_in_place(hit.lease_id, 0) as view:
        as_f32 = np.frombuffer(view, np.float32)
        as_u8 = np.asarray(view)
        # Both arrays point at the view's address in kvd's arena: no copy was made.
        assert as_f32.ctypes.data == view.address == as_u8.ctypes.data
        assert np.shares_memory(as_f32, as_u8)
        assert not as_f32.flags.writeable and not as_u8.flags.writeable
        np.testing.assert_array_equal(as_f32, data.view(np.float32))
        # The address lies in kvd's arena: not in any buffer of this process that a copy made.
        assert as_f32.ctypes.data != data.ctypes.data
        del as_f32, as_u8
    client.release(hit.lease_id)


def test_writing_through_a_read_view_raises(client):
    h, data, hit = stored_chunk(client, 30)
    with client.read_in_place(hit.lease_id, 0) as view:
        with pytest.raises(TypeError, match="read-only"):
            memoryview(view)[0] = 1
        arr = np.frombuffer(view, np.uint8)
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1
        with pytest.raises(ValueError):
            arr.setflags(write=True)
        with pytest.raises(TypeError):
            io.BytesIO(b"x" * 8).readinto(view)  # asks for a writable buffer
        # A consumer that asks for a writable buffer is refused by the view itself.
        with pytest.raises(BufferError, match="ChunkView is read-only"):
            get_writable_buffer(view)
        del arr
        assert bytes(view) == data.tobytes()
    client.release(hit.lease_id)


def test_use_after_release_raises_and_exported_buffers_keep_the_chunk_pinned(client, admin):
    nothing_open(admin)
    h, data, hit = stored_chunk(client, 40)
    view = client.read_in_place(hit.lease_id, 0)
    arr = np.frombuffer(view, np.uint8)
    client.release(hit.lease_id)
    client.flush_releases()  # the lease is gone: only the view pins the chunk now
    assert counter(admin, "host_reads_open") == 1
    view.release()  # an exported array is alive: the read stays open until it goes
    assert view.released
    for use in (lambda: memoryview(view), view.verify, lambda: view.address,
                lambda: np.frombuffer(view, np.uint8)):
        with pytest.raises(kvd.FailedPreconditionError, match="ChunkView was released"):
            use()
    assert view.bytes == CHUNK_BYTES and view.tokens == 256  # the metadata stays readable
    client.flush_releases()
    assert counter(admin, "host_reads_open") == 1
    assert host_tier(admin)["pinned_bytes"] >= CHUNK_BYTES
    np.testing.assert_array_equal(arr, data)  # still the chunk's bytes, still mapped
    del arr  # the last export: the read ends (with the next request, here the flush)
    client.flush_releases()
    assert counter(admin, "host_reads_open") == 0
    assert host_tier(admin)["pinned_bytes"] == 0
    view.release()  # twice: nothing more to do

    # A slot: writes after commit or abort are refused; commit with a live export is refused.
    (h2,) = fresh_chain(client)
    slot = client.reserve_put(h2, 256)
    arr = np.frombuffer(slot, np.uint8)
    arr[:] = data
    with pytest.raises(BufferError, match="still alive"):
        slot.commit()
    assert slot.open
    del arr
    slot.commit()
    for use in (lambda: memoryview(slot), slot.commit, lambda: slot.address):
        with pytest.raises(kvd.FailedPreconditionError, match="PutSlot was committed"):
            use()
    with pytest.raises(kvd.FailedPreconditionError, match="committed"):
        slot.abort()
    slot.release()  # a committed slot: nothing to do


def test_a_view_held_across_many_puts_stays_valid(client, admin):
    h, data, hit = stored_chunk(client, 50)
    view = client.read_in_place(hit.lease_id, 0)
    arr = np.frombuffer(view, np.float32)
    client.release(hit.lease_id)
    # Twice the arena's worth of other chunks: capacity pressure evicts everything it may.
    fillers = fresh_chain(client, chunks=2 * CAPACITY // CHUNK_BYTES)
    evictions = host_tier(admin)["evictions"]
    for i, f in enumerate(fillers):
        client.put(f, 256, random_chunk(1000 + i % 7))
    assert host_tier(admin)["evictions"] > evictions
    assert client.lookup(fillers[:1]).matched_chunks == 0  # the first filler was evicted
    np.testing.assert_array_equal(arr, data.view(np.float32))
    view.verify()
    again = client.lookup([h])
    assert again.matched_chunks == 1  # the pinned chunk was never evicted
    client.release(again.lease_id)
    del arr
    view.release()


def test_a_slot_dropped_without_commit_leaves_no_chunk(client, admin):
    nothing_open(admin)
    chain = fresh_chain(client, chunks=3)
    data = random_chunk(60)
    # Dropped (garbage collected) after a write.
    slot = client.reserve_put(chain[0], 256)
    np.frombuffer(slot, np.uint8)[:] = data
    del slot
    gc.collect()
    # Left by a with block without commit().
    with client.reserve_put(chain[1], 256) as slot:
        memoryview(slot)[:] = data.tobytes()
    assert not slot.open and not slot.committed
    # Released while an array is exported: the reservation lives until the array goes.
    slot = client.reserve_put(chain[2], 256)
    arr = np.frombuffer(slot, np.uint8)
    slot.release()
    with pytest.raises(kvd.FailedPreconditionError, match="released without a commit"):
        slot.commit()
    assert host_tier(admin)["reserved_bytes"] >= CHUNK_BYTES
    arr[:] = data  # still this process's reserved slot: nobody else's chunk
    del arr, slot
    gc.collect()
    assert host_tier(admin)["reserved_bytes"] == 0
    for h in chain:
        assert client.lookup([h]).matched_chunks == 0
    # Nothing was left reserved: the same chunks can be put.
    for h in chain:
        assert not client.put(h, 256, data).already_stored


def test_a_chunk_already_stored_gives_a_slot_with_nothing_to_write(client):
    (h,) = fresh_chain(client)
    client.put(h, 256, random_chunk(70))
    slot = client.reserve_put(h, 256)
    assert slot.already_stored
    with pytest.raises(kvd.FailedPreconditionError, match="already holds this chunk"):
        memoryview(slot)
    assert slot.commit().already_stored


def test_views_and_slots_outlive_their_client(shm_daemon):
    c = engine(shm_daemon.unix_address)
    (h, h2) = fresh_chain(c, chunks=2)
    data = random_chunk(80)
    c.put(h, 256, data)
    view = c.read_in_place(c.lookup([h]).lease_id, 0)
    slot = c.reserve_put(h2, 256)
    c.close()
    np.testing.assert_array_equal(np.frombuffer(view, np.uint8), data)  # still mapped
    view.release()
    with pytest.raises(kvd.FailedPreconditionError, match="closed"):
        slot.commit()
    slot.release()  # the closed connection had kvd reclaim the reservation
    with engine(shm_daemon.unix_address) as again:
        assert again.lookup([h2]).matched_chunks == 0
        assert not again.put(h2, 256, data).already_stored


def test_flush_releases_ends_released_views_in_one_call(client, admin):
    nothing_open(admin)
    chain = fresh_chain(client, chunks=3)
    for i, h in enumerate(chain):
        client.put(h, 256, random_chunk(90 + i))
    hit = client.lookup(chain)
    views = [client.read_in_place(hit.lease_id, i) for i in range(3)]
    client.release(hit.lease_id)
    for v in views:
        v.release()
    # The releases ride on the next request: kvd has not heard of them yet.
    assert counter(admin, "host_reads_open") == 3
    assert counter(admin, "host_leases_open") == 1
    client.flush_releases()
    assert counter(admin, "host_reads_open") == 0
    assert counter(admin, "host_leases_open") == 0
    client.flush_releases()  # nothing pending: OK


def test_zero_copy_calls_need_the_shared_memory_path(shm_daemon):
    def refused(c, where):
        (h,) = fresh_chain(c)
        with pytest.raises(kvd.FailedPreconditionError, match=where + ".*use Put"):
            c.reserve_put(h, 256)
        c.put(h, 256, random_chunk(100))
        hit = c.lookup([h])
        with pytest.raises(kvd.FailedPreconditionError, match=where + ".*use Get"):
            c.read_in_place(hit.lease_id, 0)
        c.release(hit.lease_id)

    with engine(shm_daemon.address) as tcp:
        assert not tcp.shared_memory
        refused(tcp, "over TCP")
    with engine(shm_daemon.unix_address, shared_memory=False) as off:
        assert not off.shared_memory
        refused(off, "shared_memory is false")
    no_shm = KvdDaemon(node="pytest-noshm", capacity="32MiB", segment="8MiB",
                       shared_memory=False, unix=True)
    try:
        with engine(no_shm.unix_address) as c:
            assert not c.shared_memory
            refused(c, "kvd did not grant it")
    finally:
        no_shm.stop()
    with engine(shm_daemon.unix_address) as c:
        with pytest.raises(kvd.InvalidArgumentError, match="tokens must be > 0"):
            c.reserve_put(fresh_chain(c)[0], 0)
