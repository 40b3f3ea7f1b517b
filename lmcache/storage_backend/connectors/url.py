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

`RemoteURL.url` is the URL as given with its secrets masked (the password as ``***``, the
``auth_token`` option left out): every message and log line names the store by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

COMMON_OPTIONS = frozenset({"namespace", "backoff", "max_backoff"})


@dataclass(frozen=True)
class RemoteURL:
    url: str  # redacted: safe to log (see the module doc)
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
    parts = _split(url)
    if parts is None:
        raise ValueError("remote_url must look like scheme://host:port (it has no '://')")
    shown = parts.redacted()
    if not url.partition("://")[2].partition("?")[0]:  # nothing between :// and the options
        raise ValueError(f"remote_url {shown!r} must look like scheme://host:port")
    hosts = [_host_port(shown, hp) for hp in parts.netloc.split(",")]
    options = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    password = unquote(parts.password) if parts.password is not None else None
    return RemoteURL(shown, parts.scheme, hosts, [p for p in parts.path.split("/") if p],
                     unquote(parts.user) or None, password, options)


def redact_url(url: str) -> str:
    """`url` as messages and logs show it: the password as ``***``, without the ``auth_token``
    option; "" for a string without ``://`` (where its secrets would be is unclear)."""
    parts = _split(url)
    return parts.redacted() if parts is not None else ""


@dataclass(frozen=True)
class _Parts:
    scheme: str
    user: str
    password: str | None  # None: no ``:`` in the user info
    at: str  # "@" if the URL has user info
    netloc: str  # host:port[,host:port...]
    path: str
    query: str

    def redacted(self) -> str:
        kept = "&".join(p for p in self.query.split("&") if p and p.partition("=")[0] != "auth_token")
        return (f"{self.scheme}://{self.user}{':***' if self.password is not None else ''}{self.at}"
                f"{self.netloc}" + (f"/{self.path}" if self.path else "") + (f"?{kept}" if kept else ""))


def _split(url: str) -> _Parts | None:
    """The parts of ``scheme://[user[:password]@]netloc[/path][?query]`` (None without ``://``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, netloc = netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return _Parts(scheme, user, password if colon else None, at, netloc, path, query)


def _host_port(url: str, hp: str) -> tuple[str, int]:
    host, colon, port = hp.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"remote_url {url!r}: {hp!r} must be host:port")
    return host.strip("[]"), int(port)
