"""A loopback TCP proxy that limits bandwidth: a token bucket per direction, shared by all
connections (one simulated link).

    python benchmarks/rate_limited_proxy.py --target 127.0.0.1:65432 --gbps 1.0 [--port 0]

Prints ``listening on 127.0.0.1:PORT`` once ready, then forwards every accepted connection to
`--target`, each direction through its bucket: bytes are forwarded in pieces of at most 64 KiB,
and a piece leaves only when the bucket holds its size (refill at the rate, burst of 1 ms of
traffic or one piece, whichever is larger). Runs until killed; binds loopback only.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

PIECE = 64 * 1024


class TokenBucket:
    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.burst = max(PIECE, bytes_per_s * 1e-3)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until `n` bytes may pass."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
            self.stamp = now
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def pipe(src: socket.socket, dst: socket.socket, bucket: TokenBucket) -> None:
    buf = bytearray(PIECE)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if n == 0:
                break
            bucket.take(n)
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(port: int, target: tuple[str, int], gbps: float) -> None:
    up, down = TokenBucket(gbps * 1e9 / 8), TokenBucket(gbps * 1e9 / 8)
    listener = socket.create_server(("127.0.0.1", port))
    print(f"listening on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        server = socket.create_connection(target)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pipe, args=(client, server, up), daemon=True).start()
        threading.Thread(target=pipe, args=(server, client, down), daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="host:port to forward to")
    ap.add_argument("--gbps", type=float, required=True, help="link rate in Gbit/s, each direction")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    host, port = args.target.rsplit(":", 1)
    serve(args.port, (host, int(port)), args.gbps)


if __name__ == "__main__":
    main()
