"""The kvd package's cluster calls: placement for prefill (Client.place, Client.connect_placed) and
cluster-scope lookups (Client.lookup(chain, cluster=True): LookupResult.holders, .fetched_chunks)
against a real etcd-server and two real kvds on 127.0.0.2 and 127.0.0.3 (skipped when etcd is not
installed), and their refusal by a kvd in no cluster."""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import pytest

import kvd
from kvd_daemon import KvdDaemon, stop_process

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import tied_popen  # noqa: E402  (etcd dies with the test process, however it ends)

from test_client import CHUNK_BYTES, engine, random_chunk  # noqa: E402

ETCD = os.environ.get("KVD_ETCD_BINARY") or "/usr/bin/etcd"
TOKEN = "pytest-cluster-token"


def free_port(ip):
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class EtcdServer:
    """A one-member etcd-server on 127.0.0.1 in a temp dir, answering within 10 s."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-pytest-etcd-")
        client_url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        peer_url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self._log = open(os.path.join(self.dir, "etcd.log"), "w")
        self.proc = tied_popen.popen(
            [ETCD, "--name=kvd-pytest", f"--data-dir={self.dir}/data",
             f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
             f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
             f"--initial-cluster=kvd-pytest={peer_url}", "--log-level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.endpoint = client_url[len("http://"):]  # "ip:port", as cluster.etcd takes it
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(client_url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("etcd did not start")
            time.sleep(0.05)

    def stop(self):
        stop_process(self.proc, self._log, self.dir)


def cluster_yaml(etcd, node):
    return (f"cluster:\n  etcd: [{etcd.endpoint}]\n  name: pytest\n  node: {node}\n"
            f"  lease_ttl_s: 3\n  token: {TOKEN}\n  peer_timeout_ms: 1000\n")


@pytest.fixture(scope="module")
def cluster():
    """kvd a on 127.0.0.2 and kvd b on 127.0.0.3, members of one cluster on a real etcd."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip("etcd is not installed (etcd-server)")
    etcd = EtcdServer()
    kvds = []
    try:
        for node, ip in (("a", "127.0.0.2"), ("b", "127.0.0.3")):
            kvds.append(KvdDaemon(node=node, listen=f"{ip}:0", extra=cluster_yaml(etcd, node)))
        yield kvds
    finally:
        for d in kvds:
            d.stop()
        etcd.stop()


def place_when_seen(c, chain, node, timeout_s=10):
    """c.place(chain, node=node) once c's kvd lists that member (NOT_FOUND until then; UNAVAILABLE
    before its first member list)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.place(chain, node=node)
        except (kvd.NotFoundError, kvd.UnavailableError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_put_placed_on_b_then_a_cluster_lookup_from_a_fetches_it_byte_exact(cluster):
    a, b = cluster
    with engine(a) as prefill:
        chain = prefill.hash(np.arange(5000, 5000 + 3 * 256, dtype=np.int32))
        assert len(chain) == 3
        placed = place_when_seen(prefill, chain, "b")
        assert isinstance(placed, kvd.PlacementResult) and placed.membership_current
        assert placed.membership_age_ms == 0
        assert len(placed.targets) == 1
        target = placed.targets[0]
        assert isinstance(target, kvd.PlacementTarget)
        assert target.node == "b" and target.control_address == b.address and not target.local
        chunks = [random_chunk(40 + i) for i in range(3)]
        with prefill.connect_placed(target) as to_b:
            assert to_b.node_name == "b"
            for h, data in zip(chain, chunks):
                assert not to_b.put(h, 256, data).already_stored

        local = prefill.lookup(chain)  # a itself holds none of them
        assert local.matched_chunks == 0 and local.holders == [] and local.fetched_chunks == 0
        assert local.membership_current is False and local.membership_age_ms == 0  # local scope

        hit = prefill.lookup(chain, cluster=True)
        assert hit.matched_chunks == 3 and hit.fetched_chunks == 3
        assert hit.membership_current is True and hit.membership_age_ms == 0
        assert [h.node for h in hit.holders] == ["a", "b"]
        held = hit.holders[1]
        assert isinstance(held, kvd.PrefixHolder)
        assert held.matched_chunks == 3 and held.error == "" and held.found_in == {"host": 3}
        assert hit.holders[0].matched_chunks == 3  # a's own prefix, the fetched chunks included
        for i, data in enumerate(chunks):
            out = np.empty(CHUNK_BYTES, np.uint8)
            prefill.get(hit.lease_id, i, out)
            assert np.array_equal(out, data), f"chunk {i} differs"
        prefill.release(hit.lease_id)

        # The placement rule ranks both members; a member that is not up is named.
        ranked = prefill.place(chain)
        assert sorted(t.node for t in ranked.targets) == ["a", "b"]
        assert [t.local for t in ranked.targets if t.node == "a"] == [True]
        with pytest.raises(kvd.NotFoundError, match="zz"):
            prefill.place(chain, node="zz")


def test_a_kvd_in_no_cluster_refuses_cluster_calls_naming_why(daemon):
    with engine(daemon) as c:
        chain = c.hash(np.arange(256, dtype=np.int32))
        with pytest.raises(kvd.FailedPreconditionError, match="not a cluster member") as e:
            c.lookup(chain, cluster=True)
        assert e.value.code_name == "FAILED_PRECONDITION"
        with pytest.raises(kvd.FailedPreconditionError, match="not a cluster member"):
            c.place(chain)
        with pytest.raises(TypeError):
            c.lookup(chain, True)  # cluster is keyword-only
        hit = c.lookup(chain)
        assert hit.holders == [] and hit.fetched_chunks == 0
