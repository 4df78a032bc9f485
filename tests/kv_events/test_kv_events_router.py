"""A KV-aware router over three kvds: one index per node built only from each kvd's KV events
(vLLM's KVEventBatch decoder), through 10,000 random chunk puts with LRU and admin evictions.
At the end the index of every node equals `kvdctl ls` of that node, and the router's longest
prefix per node equals what that kvd's own lookup answers, for every document."""

import json
import os
import random
import subprocess
import sys
import time

import msgspec
import numpy as np
import zmq
from vllm.distributed.kv_events import KVEventBatch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import kvd  # noqa: E402
from kvd_daemon import KvdDaemon  # noqa: E402
from test_kv_events import END_SEQ, apply_events, free_port  # noqa: E402

KVDCTL = os.environ.get("KVDCTL_BINARY", "kvdctl")
CHUNK_TOKENS = 16        # stories260k: 20,480 bytes a chunk
CAPACITY = "1MiB"        # about 50 chunks a node: LRU evicts all along
PUTS = int(os.environ.get("KVD_ROUTER_PUTS", "10000"))
DOCUMENTS = 300          # shared prefixes: documents of up to 6 chunks
NODES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


class NodeFeed:
    """A router's view of one kvd: a SUB socket, sequence tracking, replay for gaps."""

    def __init__(self, ctx, daemon):
        self.ctx, self.daemon = ctx, daemon
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(daemon.pub_endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.index = set()
        self.next_seq = None  # the next batch number expected
        self.batches = self.gaps = 0

    def apply(self, seq, payload):
        if self.next_seq is not None and seq < self.next_seq:
            return  # already applied (a replayed batch)
        if self.next_seq is not None and seq > self.next_seq:
            self.gaps += 1
            self.replay(self.next_seq, seq)
        apply_events(self.index, self.decoder.decode(payload))
        self.batches += 1
        self.next_seq = seq + 1

    def replay(self, start, upto):
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.daemon.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert dealer.poll(10000), "the replay endpoint did not answer"
            _, _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_SEQ:
                break
            if seq < upto:
                self.apply(seq, payload)
        dealer.close(linger=0)

    def drain(self):
        while self.sub.poll(0):
            _, seq, payload = self.sub.recv_multipart()
            self.apply(int.from_bytes(seq, "big"), payload)

    def first_batch(self):
        """Batch 0 (the start's resync) came before this subscriber: take it from the replay."""
        self.next_seq = 0
        self.replay(0, 1)


def listed(daemon):
    out = subprocess.run([KVDCTL, "--addr", daemon.address, "--json", "ls", "--limit", "0"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return {int(c["hash"][16:], 16) for c in json.loads(out)["chunks"]}


def block(h):
    return int(h.hex()[16:], 16)


def test_router_index_stays_exact_over_three_nodes():
    rng = random.Random(20261206)
    daemons = []
    ctx = zmq.Context()
    try:
        for i, host in enumerate(NODES):
            pub, replay = free_port(), free_port()
            d = KvdDaemon(node=f"n{i}", capacity=CAPACITY, chunk_tokens=CHUNK_TOKENS,
                          listen=f"{host}:0", extra=(
                              f"kv_events: {{endpoint: 'tcp://{host}:{pub}', "
                              f"replay_endpoint: 'tcp://{host}:{replay}'}}"))
            d.pub_endpoint, d.replay_endpoint = f"tcp://{host}:{pub}", f"tcp://{host}:{replay}"
            daemons.append(d)
        feeds = [NodeFeed(ctx, d) for d in daemons]
        time.sleep(0.5)  # the subscriptions reach the publishers
        for f in feeds:
            f.first_batch()
        clients = [kvd.connect(d.address, model="stories260k", chunk_tokens=CHUNK_TOKENS,
                               ucx_tls="sm,tcp",
                               net_devices="lo") for d in daemons]
        docs = [clients[0].hash(np.arange(d * 1000, d * 1000 + 6 * CHUNK_TOKENS,
                                          dtype=np.int32)) for d in range(DOCUMENTS)]
        payload = np.random.default_rng(1).integers(0, 255, clients[0].chunk_bytes, np.uint8)
        evicts = 0
        for i in range(PUTS):
            n = rng.randrange(len(daemons))
            chain = docs[rng.randrange(DOCUMENTS)]
            # A prompt extends what the node holds of its document by one chunk (prefix order).
            hit = clients[n].lookup(chain)
            if hit.lease_id:
                clients[n].release(hit.lease_id)
            k = min(hit.matched_chunks, len(chain) - 1)
            clients[n].put(chain[k], CHUNK_TOKENS, payload)
            if rng.random() < 0.002:  # now and then an operator empties a node
                subprocess.run([KVDCTL, "--addr", daemons[n].address, "evict", "--all"],
                               check=True, capture_output=True, timeout=30)
                evicts += 1
            if i % 250 == 0:
                for f in feeds:
                    f.drain()
        assert evicts > 0

        truth = [listed(d) for d in daemons]
        deadline = time.monotonic() + 30
        while any(f.index != t for f, t in zip(feeds, truth)):
            assert time.monotonic() < deadline, [
                (len(f.index), len(t), len(f.index ^ t)) for f, t in zip(feeds, truth)]
            for f in feeds:
                f.drain()
            time.sleep(0.05)
        # The router's answer (longest prefix each node holds) is each kvd's own answer.
        for chain in docs:
            for f, c in zip(feeds, clients):
                held = 0
                while held < len(chain) and block(chain[held]) in f.index:
                    held += 1
                hit = c.lookup(chain)
                if hit.lease_id:
                    c.release(hit.lease_id)
                assert hit.matched_chunks == held
        stats = [(len(t), f.batches, f.gaps) for f, t in zip(feeds, truth)]
        print(f"router: {PUTS} puts, {evicts} admin evictions; per node (chunks held, batches, "
              f"gaps replayed): {stats}")
        assert all(len(t) > 0 for t in truth)
        for c in clients:
            c.close()
    finally:
        ctx.destroy(linger=0)
        for d in daemons:
            d.stop()
