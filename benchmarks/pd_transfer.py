"""Prefill->decode KV transfer speed: a prompt's KV sent by a prefill engine's `PDSender` to a
decode engine's receiver (NIXL and TCP channels), vs the raw transfer of the same bytes between
the same two processes.

The sender (this process) is an engine that stored a 4,096-token prompt of SmolLM2-shaped KV (30
layers, 3 KV heads x 64, bf16: 16 chunks of 5.9 MB, 94 MB) from a vLLM-style paged cache
(`tier_throughput.Setup`). Two receivers run in their own processes (this script with
``--receive``): decode engines with ``pd_role: receiver``, one over NIXL (UCX), one over TCP, each
with a raw TCP sink beside it. Timed, alternating, `--reps` times each after a warm-up, with the
receivers' buffers emptied before every call (untimed):

- engine over NIXL: ``PDSender.send`` (offer, NIXL writes from the registered arena, commit);
- raw NIXL: one NIXL write of the same chunk objects into the receiver's buffer, through the
  same agents, no offer or commit; the receiving process waits for its notification (driving
  NIXL's progress, as the engine's receiver does: neither side runs NIXL's progress thread) and
  acknowledges it;
- engine over TCP: ``PDSender.send`` to the TCP receiver (the bytes inline on its connection);
- raw TCP: ``sendall`` of the same bytes to the sink in the TCP receiver's process, which reads
  them into a buffer and acknowledges.

The received KV is checked bit-identical to what was sent, once per channel.

    python benchmarks/pd_transfer.py [--reps 9] [--tokens 4096]

Goal (issue 24): engine >= 0.7x raw on each channel (ratio of medians). Writes
benchmarks/out/pd_transfer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from machine import cpu_info, cpu_line
from tier_throughput import CHUNK_BYTES, OUT, Setup, medians

from lmcache.memory_management import TensorMemoryAllocator
from lmcache.pd.sender import PDSender
from lmcache.pd.wire import byte_view
from tests.helpers.servers import free_port

_LEN = struct.Struct("<Q")


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(1))


def sink(server: socket.socket, nbytes: int) -> None:
    """Raw TCP: read each announced payload into one buffer, acknowledge it."""
    buf = memoryview(bytearray(nbytes))
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while head := conn.recv(_LEN.size, socket.MSG_WAITALL):
                (n,) = _LEN.unpack(head)
                view = buf[:n]
                while view:
                    got = conn.recv_into(view)
                    if not got:
                        return
                    view = view[got:]
                conn.sendall(b"k")


def receive(channel: str, n_tokens: int) -> None:
    """A decode engine receiving KV on `channel`, and a raw sink; commands on stdin."""
    port = free_port()
    rx = Setup(prompt(n_tokens), store=False, enable_pd=True, pd_role="receiver", pd_peer_init_port=port,
               transfer_channel=channel, pd_buffer_size=2 * n_tokens * CHUNK_BYTES // 256, local_cpu=False)
    tier = rx.engine.storage_manager.backends["PDBackend"]
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=sink, args=(raw, n_tokens * CHUNK_BYTES // 256 + (1 << 20)), daemon=True).start()
    print("ready", port, raw.getsockname()[1], flush=True)
    for line in sys.stdin:
        if line.strip() == "clear":
            tier.clear()
        elif line.strip() == "check":  # retrieve what arrived; compare with the KV the sender stored
            rx.retrieve()
            rx.check()
        elif line.strip() == "notified":  # a raw NIXL write is landing: progress until it has
            assert tier.server.agent is not None and tier.server.agent.wait_notif(b"raw", 30.0)
        print("ok", flush=True)
    rx.close()


class Receiver:
    def __init__(self, channel: str, n_tokens: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                            str(Path(__file__).resolve().parents[1])])}
        args = [sys.executable, __file__, "--receive", channel, "--tokens", str(n_tokens)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["ready"]:
            raise SystemExit(f"the {channel} receiver did not start: {line}")
        self.address = f"127.0.0.1:{line[1]}"
        self.raw = socket.create_connection(("127.0.0.1", int(line[2])))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def command(self, what: str) -> None:
        self.ask(what)
        self.done(what)

    def ask(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()

    def done(self, what: str) -> None:
        assert self.proc.stdout is not None
        answer = self.proc.stdout.readline().strip()
        if answer != "ok":
            raise SystemExit(f"receiver: {what} -> {answer!r}")

    def close(self) -> None:
        self.raw.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--receive", choices=("nixl", "tcp"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.receive:
        receive(args.receive, args.tokens)
        return
    tx = Setup(prompt(args.tokens), transfer_channel="nixl")
    sender = PDSender(tx.engine, tx.engine.config, rank=0)
    if sender.agent is None:
        raise SystemExit("NIXL is not installed here: pip install nixl-cu12")
    rx = {ch: Receiver(ch, args.tokens) for ch in ("nixl", "tcp")}
    try:
        held = tx.engine.held_prefix(tx.tokens)
        nbytes = sum(o.tensor.numel() * o.tensor.element_size() for _, o in held)  # type: ignore[union-attr]
        for ch in rx:  # correctness first: what arrives is what was stored
            result = sender.send(rx[ch].address, tx.tokens)
            assert result.sent == nbytes and (result.nixl == nbytes) == (ch == "nixl"), result
            rx[ch].command("check")
            rx[ch].command("clear")
        link = sender._links[rx["nixl"].address]
        assert link.nixl_peer is not None and sender.agent is not None
        ranges, offset = [], 0
        for _, obj in held:
            t = obj.tensor
            assert t is not None
            n = t.numel() * t.element_size()
            ranges.append((t.data_ptr(), link.remote_base + offset, n))
            offset += TensorMemoryAllocator.aligned_size(n)
        views = [byte_view(o.tensor) for _, o in held]  # type: ignore[arg-type]

        def engine(ch: str):
            def run() -> None:
                assert sender.send(rx[ch].address, tx.tokens).sent == nbytes
            return run

        def raw_nixl() -> None:
            rx["nixl"].ask("notified")
            sender.agent.write(link.nixl_peer, ranges, b"raw", 30.0)  # type: ignore[union-attr,arg-type]
            rx["nixl"].done("notified")

        def raw_tcp() -> None:
            sock = rx["tcp"].raw
            sock.sendall(_LEN.pack(nbytes))
            for view in views:
                sock.sendall(view)
            assert sock.recv(1) == b"k"

        def clear() -> None:
            for r in rx.values():
                r.command("clear")

        t = medians([engine("nixl"), raw_nixl, engine("tcp"), raw_tcp], args.reps, clear)
        row = {"tokens": args.tokens, "MB": nbytes / 1e6, "chunks": len(held),
               "engine_nixl_s": t[0], "raw_nixl_s": t[1], "engine_tcp_s": t[2], "raw_tcp_s": t[3],
               "nixl_ratio": t[1] / t[0], "tcp_ratio": t[3] / t[2]}
        for _, obj in held:
            obj.ref_count_down()
        print(f"CPU: {cpu_line()}; {args.tokens} tokens of SmolLM2-shaped bf16 KV ({nbytes / 1e6:.0f} MB, "
              f"{len(held)} chunks), medians of {args.reps}")
        for ch in ("nixl", "tcp"):
            e, r = row[f"engine_{ch}_s"], row[f"raw_{ch}_s"]
            print(f"  {ch:4}: engine send {e * 1e3:7.1f} ms ({nbytes / e / 1e9:5.2f} GB/s)   raw "
                  f"{r * 1e3:7.1f} ms ({nbytes / r / 1e9:5.2f} GB/s)   ratio {r / e:.2f} (goal >= 0.7)")
        OUT.mkdir(exist_ok=True)
        (OUT / "pd_transfer.json").write_text(json.dumps(
            {"date": time.strftime("%Y-%m-%d"), **cpu_info(), "reps": args.reps, **row}, indent=2))
    finally:
        sender.close()
        for r in rx.values():
            r.close()
        tx.close()


if __name__ == "__main__":
    main()
