"""`RemoteURL`: a parsed `remote_url`.

    lm://HOST:PORT[?auth_token=T]
    redis://[[USER]:PASSWORD@]HOST:PORT[/DB]        valkey://... (the same)
    rediss://... valkeys://...                      (TLS; see the ssl_* options)
    redis-sentinel://[[USER]:PASSWORD@]H1:P1,H2:P2/SERVICE[/DB]
    redis-cluster://[[USER]:PASSWORD@]H1:P1,H2:P2,...

Options common to every scheme, as query parameters:
    namespace=NS     keys are stored as "NS:<key>" (several deployments in one store)
    backoff=S        seconds before retrying a failed store (doubles per failure; default 0.5)
    max_backoff=S    upper bound of that delay (default 30)
Redis-family options: ttl=SECONDS (expiry of every stored chunk), max_connections=N (pool size),
ssl_ca_certs=PATH, ssl_certfile=PATH, ssl_keyfile=PATH, ssl_cert_reqs=required|optional|none,
ssl_check_hostname=true|false. Unknown options are errors, not silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

COMMON_OPTIONS = frozenset({"namespace", "backoff", "max_backoff"})


@dataclass(frozen=True)
class RemoteURL:
    url: str
    scheme: str
    hosts: list[tuple[str, int]]
    path: list[str]
    username: str | None = None
    password: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        return self.options.get("namespace", "")

    def float_option(self, name: str, default: float) -> float:
        raw = self.options.get(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"remote_url {self.url!r}: option {name}={raw!r} must be a number") from None
        if value <= 0:
            raise ValueError(f"remote_url {self.url!r}: option {name}={raw!r} must be > 0")
        return value

    def check_options(self, allowed: frozenset[str]) -> None:
        unknown = set(self.options) - allowed - COMMON_OPTIONS
        if unknown:
            raise ValueError(f"remote_url {self.url!r}: unknown option(s) {sorted(unknown)}; "
                             f"{self.scheme}:// accepts {sorted(allowed | COMMON_OPTIONS)}")


def parse_remote_url(url: str) -> RemoteURL:
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"remote_url {url!r} must look like scheme://host:port")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    hosts = [_host_port(url, hp) for hp in netloc.split(",")]
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    return RemoteURL(url, scheme, hosts, [p for p in path.split("/") if p], username, password, options)


def _host_port(url: str, hp: str) -> tuple[str, int]:
    host, colon, port = hp.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"remote_url {url!r}: {hp!r} must be host:port")
    return host.strip("[]"), int(port)
