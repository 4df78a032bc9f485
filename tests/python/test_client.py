"""The kvd Python package against a real kvd: connect, hash, lookup, put, get, release, stats,
zero-copy buffers (buffer protocol and DLPack), and errors carrying the status code."""

import os
import re

import numpy as np
import pytest

import kvd

CHUNK_BYTES = 256 * 5 * 2 * 4 * 8 * 4  # stories260k: tokens x layers x (K,V) x heads x dim x f32


def engine(daemon, **kw):
    return kvd.connect(daemon.address, model="stories260k", ucx_tls="sm,tcp", net_devices="lo",
                       **kw)


def random_chunk(seed):
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)


def test_version_is_the_projects():
    # kvd.__version__ comes from the build, which takes it from project(kvd VERSION ...).
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        version = re.search(r"project\(kvd VERSION (\d+\.\d+\.\d+)", f.read()).group(1)
    assert kvd.__version__ == version


def test_connect_takes_the_registered_layout(daemon):
    with engine(daemon) as c:
        assert c.layout["num_layers"] == 5 and c.layout["dtype"] == "float32"
        assert c.layout["rope_pairing"] == "interleaved"
        assert c.chunk_bytes == CHUNK_BYTES and c.chunk_tokens == 256
        assert c.node_name == "pytest" and c.connected


def test_hash_accepts_numpy_and_lists(daemon):
    with engine(daemon) as c:
        tokens = np.arange(600, dtype=np.int32)
        chain = c.hash(tokens)
        assert len(chain) == 3  # 256 + 256 + 88
        assert chain == c.hash(list(range(600)))
        assert c.hash(tokens, include_partial_chunk=False) == chain[:2]
        assert len(chain[0].hex()) == 32 and kvd.Hash128.from_hex(chain[0].hex()) == chain[0]
        # A different prefix changes every later key (the chain).
        other = tokens.copy()
        other[0] = 99
        assert all(a != b for a, b in zip(c.hash(other), chain))


def test_put_lookup_get_release_round_trip(daemon):
    with engine(daemon) as c:
        tokens = np.arange(1000, 1512, dtype=np.int32)
        chain = c.hash(tokens)
        chunks = [random_chunk(1), random_chunk(2)]
        for h, data in zip(chain, chunks):
            r = c.put(h, 256, data)
            assert r.bytes == CHUNK_BYTES and not r.already_stored
        assert c.put(chain[0], 256, chunks[0]).already_stored
        hit = c.lookup(chain)
        assert hit.matched_chunks == 2 and hit.matched_tokens == 512 and hit.lease_id != 0
        # get writes straight into a slice of a bigger array: no copy, no new object.
        big = np.zeros(2 * CHUNK_BYTES + 64, np.uint8)
        for i in range(2):
            view = big[64 + i * CHUNK_BYTES:64 + (i + 1) * CHUNK_BYTES]
            g = c.get(hit.lease_id, i, view)
            assert g.bytes == CHUNK_BYTES and g.tokens == 256
            np.testing.assert_array_equal(view, chunks[i])
        assert not big[:64].any()
        c.release(hit.lease_id)
        # A prompt that diverges in its second chunk matches only the first.
        tokens[300] += 1
        miss = c.lookup(c.hash(tokens))
        assert miss.matched_chunks == 1
        c.release(miss.lease_id)


def test_other_buffer_kinds(daemon):
    with engine(daemon) as c:
        chain = c.hash(np.arange(5000, 5256, dtype=np.int32))
        data = bytes(random_chunk(3))
        c.put(chain[0], 256, data)  # bytes (read-only is fine for put)
        hit = c.lookup(chain)
        out = bytearray(CHUNK_BYTES)
        c.get(hit.lease_id, 0, out)
        assert bytes(out) == data
        mv = memoryview(bytearray(CHUNK_BYTES))
        c.get(hit.lease_id, 0, mv)
        assert mv.tobytes() == data
        c.release(hit.lease_id)


def test_put_layers_get_layers(daemon):
    with engine(daemon) as c:
        chain = c.hash(np.arange(9000, 9100, dtype=np.int32))  # one partial chunk, 100 tokens
        rng = np.random.default_rng(5)
        k = [rng.standard_normal((100, 4, 8), dtype=np.float32) for _ in range(5)]
        v = [rng.standard_normal((100, 4, 8), dtype=np.float32) for _ in range(5)]
        c.put_layers(chain[0], 100, k, v)
        hit = c.lookup(chain)
        assert hit.matched_tokens == 100
        k2 = [np.zeros((128, 4, 8), np.float32) for _ in range(5)]  # room for more tokens
        v2 = [np.zeros((128, 4, 8), np.float32) for _ in range(5)]
        g = c.get_layers(hit.lease_id, 0, k2, v2, 128)
        assert g.tokens == 100
        for i in range(5):
            np.testing.assert_array_equal(k2[i][:100], k[i])
            np.testing.assert_array_equal(v2[i][:100], v[i])
            assert not k2[i][100:].any()
        c.release(hit.lease_id)


def test_stats_and_health(daemon):
    with engine(daemon) as c:
        before = c.stats()
        chain = c.hash(np.arange(11000, 11256, dtype=np.int32))
        c.put(chain[0], 256, random_chunk(6))
        after = c.stats()
        host = lambda s: next(t for t in s["tiers"] if t["name"] == "host")  # noqa: E731
        assert host(after)["chunks"] == host(before)["chunks"] + 1
        assert after["node"] == "pytest"
    with kvd.connect(daemon.address, admin=True) as admin:
        h = admin.health()
        assert h["ok"] is True
        assert any(m["name"] == "stories260k" for m in admin.stats()["registered_models"])


def test_small_puts_go_in_one_exchange_unless_turned_off(daemon):
    token_bytes = CHUNK_BYTES // 256  # 1280 bytes of KV per token
    with engine(daemon) as c, engine(daemon, inline_put_bytes=0) as three_steps:
        chain = c.hash(np.arange(12000, 12256, dtype=np.int32))
        inline = lambda: c.stats()["counters"]["puts_inline"]  # noqa: E731
        before = inline()
        small = np.random.default_rng(7).integers(0, 256, 16 * token_bytes, dtype=np.uint8)
        assert c.put(chain[0], 16, small).bytes == small.size
        assert inline() == before + 1
        assert three_steps.put(kvd.Hash128(0x51, 1), 16, small).bytes == small.size
        assert inline() == before + 1  # inline_put_bytes=0: reserve, send, commit
        assert c.put(chain[0], 16, small).already_stored
        hit = c.lookup(chain[:1])
        out = np.zeros(small.size, np.uint8)
        assert c.get(hit.lease_id, 0, out).bytes == small.size
        np.testing.assert_array_equal(out, small)
        c.release(hit.lease_id)
    with pytest.raises(kvd.InvalidArgumentError, match="inline_put_bytes must be <= 1048576"):
        engine(daemon, inline_put_bytes=2 << 20)


def test_events_stream_stored_chunks_to_a_subscriber(daemon):
    with kvd.connect(daemon.address, admin=True) as admin, engine(daemon) as c:
        sub = admin.subscribe_events(queue_limit=64)
        assert sub == {"queue_limit": 64, "namespace": ""}
        assert admin.poll_events(0) == []
        chain = c.hash(np.arange(21000, 21512, dtype=np.int32))
        for i, h in enumerate(chain):
            c.put(h, 256, random_chunk(40 + i))
        events = []
        for _ in range(50):
            events += admin.poll_events(200)
            if len(events) >= 2:
                break
        assert [e["seq"] for e in events] == [1, 2]
        assert [e["event"] for e in events] == ["stored", "stored"]
        assert [e["hash"] for e in events] == [h.hex() for h in chain]
        assert all(e["tier"] == "host" and e["bytes"] == CHUNK_BYTES for e in events)
        with pytest.raises(kvd.FailedPreconditionError, match="already subscribed"):
            admin.subscribe_events()


def test_errors_carry_the_status_code(daemon):
    with engine(daemon) as c:
        chain = c.hash(np.arange(256, dtype=np.int32))
        with pytest.raises(kvd.InvalidArgumentError) as e:
            c.put(chain[0], 256, np.zeros(100, np.uint8))
        assert e.value.code == 1 and e.value.code_name == "INVALID_ARGUMENT"
        assert "100" in e.value.message and str(CHUNK_BYTES) in e.value.message
        with pytest.raises(kvd.InvalidArgumentError, match="C-contiguous"):
            c.put(chain[0], 256, np.zeros((CHUNK_BYTES, 2), np.uint8)[:, 0])
        with pytest.raises(kvd.InvalidArgumentError, match="writable"):
            c.get(1, 0, bytes(CHUNK_BYTES))
        with pytest.raises(kvd.InvalidArgumentError, match="got int"):
            c.put(chain[0], 256, 42)
        with pytest.raises(kvd.Error) as e:
            c.get(123456789, 0, np.zeros(CHUNK_BYTES, np.uint8))
        assert e.value.code == 2 and isinstance(e.value, kvd.NotFoundError)
        assert "123456789" in e.value.message
        # The connection survives every refusal above.
        assert c.connected
    with pytest.raises(kvd.NotFoundError, match="no-such-model"):
        kvd.connect(daemon.address, model="no-such-model")
    with pytest.raises(kvd.InvalidArgumentError, match="model"):
        kvd.connect(daemon.address)
    c = engine(daemon)
    c.close()
    with pytest.raises(kvd.FailedPreconditionError, match="closed"):
        c.lookup([])


def test_nccl_without_a_gpu_is_unavailable_with_the_reason(daemon):
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is present: NCCL may start here")
    except OSError:
        pass
    with pytest.raises(kvd.UnavailableError) as e:
        engine(daemon, nccl=True)
    assert e.value.code == 8 and "NCCL" in e.value.message
    assert "no CUDA device" in e.value.message or "built without NCCL" in e.value.message
    with engine(daemon) as c:  # the same daemon serves a client without the option
        assert c.connected


def test_unreachable_daemon_is_unavailable():
    with pytest.raises(kvd.UnavailableError) as e:
        kvd.connect("127.0.0.1:1", admin=True, timeout_ms=2000)
    assert e.value.code == 8 and "127.0.0.1:1" in e.value.message


def test_a_read_only_session_reads_and_never_puts(daemon):
    with engine(daemon) as writer, engine(daemon, read_only=True) as reader:
        chain = writer.hash(np.arange(13000, 13256, dtype=np.int32))
        data = random_chunk(13)
        writer.put(chain[0], 256, data)
        with pytest.raises(kvd.PermissionDeniedError, match="readOnly"):
            reader.put(kvd.Hash128(0x4ead, 1), 256, random_chunk(14))
        hit = reader.lookup(chain[:1])
        assert hit.matched_chunks == 1
        out = np.zeros(CHUNK_BYTES, np.uint8)
        assert reader.get(hit.lease_id, 0, out).bytes == CHUNK_BYTES
        np.testing.assert_array_equal(out, data)
        reader.release(hit.lease_id)
