"""kvd's KV events in vLLM's KVEvents wire format, decoded by vLLM's own classes
(vllm.distributed.kv_events.KVEventBatch via msgspec) from a real kvd: puts and evictions give
BlockStored / BlockRemoved batches numbered 0, 1, 2, ...; the index they build equals
`kvdctl ls`; a subscriber that missed batches gets them from the replay endpoint; batch 0 is
AllBlocksCleared and the chunks a restarted kvd restored from its disk tier."""

import json
import os
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVEventBatch)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from kvd_daemon import KvdDaemon  # noqa: E402

KVDCTL = os.environ.get("KVDCTL_BINARY", "kvdctl")
ROUNDTRIP = os.environ.get("KVD_ROUNDTRIP_BINARY", "kvd-roundtrip")
TOPIC = b"kvd-events"
CHUNK_TOKENS = 256
END_SEQ = -1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kvd(tiers_extra=""):
    """kvd publishing KV events; `tiers_extra`: more lines of its `tiers:` map."""
    pub, replay = free_port(), free_port()
    # stories260k: 327,680 bytes per chunk of 256 tokens; 1 MiB holds three.
    d = KvdDaemon(capacity="1MiB", chunk_tokens=CHUNK_TOKENS, extra=tiers_extra + (
        f"kv_events: {{endpoint: 'tcp://127.0.0.1:{pub}', "
        f"replay_endpoint: 'tcp://127.0.0.1:{replay}', topic: {TOPIC.decode()}}}"))
    d.pub_endpoint = f"tcp://127.0.0.1:{pub}"
    d.replay_endpoint = f"tcp://127.0.0.1:{replay}"
    return d


@pytest.fixture
def kvd():
    d = start_kvd()
    yield d
    d.stop()


def roundtrip(kvd, tokens=512):
    """Puts a random prompt of `tokens` (2 chunks at 512) into kvd, looks it up and gets it."""
    subprocess.run([ROUNDTRIP, "--addr", kvd.address, "--model", "stories260k", "--tokens",
                    str(tokens), "--ucx-tls", "sm,tcp", "--net-devices", "lo"], check=True,
                   capture_output=True, timeout=30)


def listed(kvd):
    """The block hashes kvd holds, as the events name them (the chain hash's low 64 bits)."""
    out = subprocess.run([KVDCTL, "--addr", kvd.address, "--json", "ls", "--limit", "0"],
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return {int(c["hash"][16:], 16): c for c in json.loads(out)["chunks"]}


def apply_events(index, batch):
    """A router's index of block hashes, updated by one KVEventBatch."""
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            index.clear()
        elif isinstance(e, BlockStored):
            index.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.difference_update(e.block_hashes)


class Subscriber:
    """A router's side: a SUB socket decoding with vLLM's KVEventBatch, an index of the blocks."""

    def __init__(self, ctx, endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches = []  # (seq, KVEventBatch)
        self.index = set()

    def take(self, seq, payload):
        batch = self.decoder.decode(payload)
        self.batches.append((seq, batch))
        self.apply(batch)

    def apply(self, batch):
        apply_events(self.index, batch)

    def reorder(self):
        """Sorts the batches by sequence number and rebuilds the index in that order."""
        self.batches.sort(key=lambda sb: sb[0])
        self.index = set()
        for _, batch in self.batches:
            self.apply(batch)

    def drain(self, until, timeout=10.0):
        """Receives until `until(self)` holds (or fails after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while not until(self):
            left = deadline - time.monotonic()
            assert left > 0, f"no matching events within {timeout} s: {self.batches}"
            if self.sub.poll(int(left * 1000) + 1):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == TOPIC
                self.take(int.from_bytes(seq, "big", signed=True), payload)


def events(sub, kind):
    return [e for _, b in sub.batches for e in b.events if isinstance(e, kind)]


def connect_and_settle(ctx, endpoint):
    sub = Subscriber(ctx, endpoint)
    time.sleep(0.5)  # PUB/SUB: a subscription takes a moment to reach the publisher
    return sub


def test_puts_then_evictions_decode_with_vllm(kvd):
    ctx = zmq.Context()
    try:
        sub = connect_and_settle(ctx, kvd.pub_endpoint)
        roundtrip(kvd)
        first = listed(kvd)
        assert len(first) == 2
        sub.drain(lambda s: s.index == set(first))
        stored = events(sub, BlockStored)
        assert {h for e in stored for h in e.block_hashes} == set(first)
        for e in stored:
            assert e.block_size == CHUNK_TOKENS and e.medium == "CPU"
            assert e.token_ids == [] and e.parent_block_hash is None

        # A second prompt does not fit beside the first: LRU evicts, the router sees removals.
        roundtrip(kvd)
        now = listed(kvd)
        sub.drain(lambda s: s.index == set(now) and events(s, BlockRemoved))
        removed = {h for e in events(sub, BlockRemoved) for h in e.block_hashes}
        assert removed and removed <= set(first)
        assert all(e.medium == "CPU" for e in events(sub, BlockRemoved))

        # More prompts through the 3-chunk tier: the index keeps up with kvd's contents.
        for _ in range(8):
            roundtrip(kvd)
        now = listed(kvd)
        sub.drain(lambda s: s.index == set(now))

        # An admin evict of everything: every block is removed.
        subprocess.run([KVDCTL, "--addr", kvd.address, "evict", "--all"], check=True,
                       capture_output=True, timeout=30)
        assert listed(kvd) == {}
        sub.drain(lambda s: not s.index)

        # Consecutive numbers (batch 0, the start's resync, came before this subscriber).
        seqs = [seq for seq, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        assert all(b.data_parallel_rank == 0 and b.ts > 0 for _, b in sub.batches)
    finally:
        ctx.destroy(linger=0)


def test_missed_batches_come_back_through_replay(kvd):
    ctx = zmq.Context()
    try:
        early = connect_and_settle(ctx, kvd.pub_endpoint)
        roundtrip(kvd)
        early.drain(lambda s: s.index == set(listed(kvd)))
        # A late subscriber missed all of that; it sees the next batch's number and asks the
        # replay endpoint for everything from 0.
        late = connect_and_settle(ctx, kvd.pub_endpoint)
        roundtrip(kvd)
        late.drain(lambda s: s.batches)
        assert late.batches[0][0] > 0
        missed_upto = late.batches[0][0]
        replay = ctx.socket(zmq.DEALER)
        replay.connect(kvd.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(10000), "the replay endpoint did not answer"
            empty, topic, seq, payload = replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert empty == b"" and topic == TOPIC
            replayed.append(seq)
            if seq < missed_upto:
                late.take(seq, payload)
        assert replayed == list(range(len(replayed))) and replayed[-1] >= missed_upto
        late.reorder()
        early.drain(lambda s: s.index == set(listed(kvd)))
        late.drain(lambda s: s.index == set(listed(kvd)))
        # Both saw every batch after the start's resync (batch 0, which only the replay gave).
        assert [s for s, _ in late.batches if s > 0] == [s for s, _ in early.batches if s > 0]
        assert late.batches[0][0] == 0 and isinstance(late.batches[0][1].events[0],
                                                      AllBlocksCleared)
    finally:
        ctx.destroy(linger=0)


def test_invalid_section_exits_2_naming_the_key(tmp_path):
    import kvd_daemon
    config = tmp_path / "topology.yaml"
    config.write_text(kvd_daemon.TOPOLOGY.format(
        node="t", chunk_tokens=CHUNK_TOKENS, capacity="1MiB", host_extra="", extra_models="",
        smollm_compression="off", extra="kv_events: {endpoint: '127.0.0.1:5557'}"))
    r = subprocess.run([os.environ.get("KVD_BINARY", "kvd"), "--config", str(config), "--listen",
                        "127.0.0.1:0", "--unix", "none"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "kv_events.endpoint" in r.stdout + r.stderr


def replay_all(ctx, endpoint):
    """Every batch kvd keeps, from the replay endpoint: [(seq, KVEventBatch)]."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    out = []
    while True:
        assert dealer.poll(10000), "the replay endpoint did not answer"
        _, _, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == END_SEQ:
            return out
        out.append((seq, decoder.decode(payload)))


def test_restart_announces_cleared_then_what_the_disk_restored(tmp_path):
    """A router that indexed a kvd before it restarted: batch 0 of the new kvd clears the node's
    blocks and names every chunk restored from the disk tier (STORAGE), so the index equals
    `kvdctl ls` without a token of the old run."""
    disk = f"  disk: {{path: '{tmp_path / 'disk'}', capacity: 64MiB}}\n"
    d = start_kvd(disk)
    try:
        for _ in range(3):
            roundtrip(d)
        before = listed(d)
    finally:
        d.stop()
    d = start_kvd(disk)
    ctx = zmq.Context()
    try:
        now = listed(d)
        assert now and set(now) <= set(before)
        assert all(c["tier"] == "disk" for c in now.values())
        batches = replay_all(ctx, d.replay_endpoint)
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        first = batches[0][1].events
        assert isinstance(first[0], AllBlocksCleared)
        assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in first[1:])
        index = set(before) | {"stale"}  # what a router held of the old run
        for _, batch in batches:
            apply_events(index, batch)
        assert index == set(now)
    finally:
        ctx.destroy(linger=0)
        d.stop()


def medium_index(sub, medium):
    """The blocks `sub`'s events say `medium` holds (events applied in sequence order)."""
    index = set()
    for _, batch in sorted(sub.batches, key=lambda sb: sb[0]):
        for e in batch.events:
            if e.medium != medium:
                continue
            if isinstance(e, BlockStored):
                index.update(e.block_hashes)
            else:
                index.difference_update(e.block_hashes)
    return index


def test_disk_tier_blocks_are_storage_medium(tmp_path):
    d = start_kvd(f"  disk: {{path: '{tmp_path / 'disk'}', capacity: 64MiB}}\n")
    ctx = zmq.Context()
    try:
        sub = connect_and_settle(ctx, d.pub_endpoint)
        for _ in range(3):
            roundtrip(d)
        now = listed(d)
        in_host = {h for h, c in now.items() if c["tier"] == "host"}
        only_on_disk = {h for h, c in now.items() if c["tier"] == "disk"}
        assert only_on_disk, now  # 6 chunks, the host tier holds 3
        # The host tier's blocks are CPU; those evicted from it and kept on disk are STORAGE.
        sub.drain(lambda s: medium_index(s, "CPU") == in_host
                  and medium_index(s, "STORAGE") >= only_on_disk)
    finally:
        ctx.destroy(linger=0)
        d.stop()


def test_without_replay_endpoint_events_still_flow():
    """No replay socket: the publisher's thread waits on the event hub alone."""
    pub = free_port()
    d = KvdDaemon(capacity="1MiB", chunk_tokens=CHUNK_TOKENS,
                  extra=f"kv_events: {{endpoint: 'tcp://127.0.0.1:{pub}', topic: {TOPIC.decode()}}}")
    ctx = zmq.Context()
    try:
        sub = connect_and_settle(ctx, f"tcp://127.0.0.1:{pub}")
        roundtrip(d)
        first = listed(d)
        sub.drain(lambda s: s.index == set(first))
        roundtrip(d)  # an idle stretch between batches, then more: the thread wakes again
        now = listed(d)
        sub.drain(lambda s: s.index == set(now) and events(s, BlockRemoved))
    finally:
        ctx.destroy(linger=0)
        d.stop()
