#!/usr/bin/env python3
"""Mooncake Store put/get timing for bench/peers.sh (one peer of kvd's same-node goals).

Zero-copy client API: register_buffer, put_from, get_into, against a mooncake_master on
127.0.0.1 (HTTP metadata served by the master). Two modes:
  inproc   the client process also holds the store's memory segment (Mooncake's in-process
           client: the bytes move between the caller's buffer and its own segment);
  remote   a second process holds the segment (started by this script, global segment
           --segment bytes) and the measuring process contributes none: the bytes cross
           processes through Mooncake's transfer engine (--protocol, default tcp).
--clients threads each put then get their share of --count values of --size bytes. Prints one
JSON object shaped like kvd-bench --json: {"put": {...}, "get": {...}} with gbps, p50_us,
p99_us; "ok": false and "error" when the store cannot be set up or an operation fails.
"""
import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time


def percentile(values, p):
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]


def new_store(args, segment):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", args.metadata, segment, args.local_buffer,
                     args.protocol, "", args.master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def address(buf):
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def holder(args):
    """The second process of --mode remote: holds the segment until stdin closes."""
    store = new_store(args, args.segment)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def phase(name, clients, work):
    lat = [[] for _ in range(clients)]
    busy = [0.0] * clients
    errors = []

    def run(t):
        start = time.perf_counter()
        try:
            work(t, lat[t])
        except Exception as e:  # noqa: BLE001 - reported as the phase's error
            errors.append(f"{name}: {e}")
        busy[t] = time.perf_counter() - start

    threads = [threading.Thread(target=run, args=(t,)) for t in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    all_lat = [x for l in lat for x in l]
    return all_lat, max(busy), errors


def measure(args):
    out = {"peer": "mooncake", "mode": args.mode, "chunk_bytes": args.size,
           "count": args.count, "concurrency": args.clients, "protocol": args.protocol,
           "ok": False}
    helper = None
    try:
        if args.mode == "remote":
            helper = subprocess.Popen(
                [sys.executable, __file__, "--holder"] + sys.argv[1:],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            line = helper.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError("the segment-holding process did not start")
            store = new_store(args, 0)
        else:
            store = new_store(args, args.segment)
        per = [list(range(t, args.count, args.clients)) for t in range(args.clients)]
        bufs = []
        for t in range(args.clients):
            src, dst = mmap.mmap(-1, args.size), mmap.mmap(-1, args.size)
            src.write((os.urandom(1 << 16) * (args.size // (1 << 16) + 1))[:args.size])
            dst.write(bytes(args.size))  # touched, as the other peers' buffers are
            for b in (src, dst):
                rc = store.register_buffer(address(b), args.size)
                if rc != 0:
                    raise RuntimeError(f"register_buffer returned {rc}")
            bufs.append((src, dst))
        run_id = f"{os.getpid()}-{time.time_ns()}"

        def timed(op, buf, expect):
            """A phase body: `op` (put_from / get_into) on each key of thread t, timed."""
            def work(t, lat):
                ptr = address(bufs[t][buf])
                for i in per[t]:
                    t0 = time.perf_counter()
                    rc = op(f"{run_id}-{i}", ptr, args.size)
                    lat.append((time.perf_counter() - t0) * 1e6)
                    if rc != expect:
                        raise RuntimeError(f"{op.__name__} returned {rc}, expected {expect}")
            return work

        put, get = timed(store.put_from, 0, 0), timed(store.get_into, 1, args.size)

        errors = []
        for name, work in (("put", put), ("get", get)):
            lat, secs, errs = phase(name, args.clients, work)
            errors += errs
            n = len(lat)
            out[name] = {"ops": n, "bytes": n * args.size, "seconds": secs,
                         "gbps": n * args.size / secs / 1e9 if secs > 0 else 0,
                         "p50_us": percentile(lat, 0.5), "p99_us": percentile(lat, 0.99)}
            if errs:
                break
        for i in range(args.count):
            store.remove(f"{run_id}-{i}", True)
        for src, dst in bufs:
            store.unregister_buffer(address(src))
            store.unregister_buffer(address(dst))
        store.close()
        out["ok"] = not errors
        if errors:
            out["error"] = errors[0]
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        out["error"] = str(e)
    finally:
        if helper is not None:
            helper.stdin.close()
            try:
                helper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                helper.kill()
    print(json.dumps(out))
    return 0 if out["ok"] else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--master", required=True, help="mooncake_master RPC address host:port")
    p.add_argument("--metadata", required=True, help="metadata server URL")
    p.add_argument("--size", type=int, required=True, help="bytes per value")
    p.add_argument("--count", type=int, required=True, help="values put then got")
    p.add_argument("--clients", type=int, default=1, help="client threads")
    p.add_argument("--mode", choices=("inproc", "remote"), default="inproc")
    p.add_argument("--segment", type=int, default=256 << 20, help="global segment bytes")
    p.add_argument("--local-buffer", type=int, default=16 << 20, help="local buffer bytes")
    p.add_argument("--protocol", default="tcp", help="transfer engine protocol")
    p.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.holder:
        holder(args)
        return 0
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
