"""How a request tells a prefill instance where to send its KV: vLLM's per-request
``kv_transfer_params`` carry ``{"lmcache": {"pd_receiver": "host:port"}}`` (the proxy adds it; the
address is the decoder's `pd_peer_host:pd_peer_init_port`). The connector reads it with
`receiver_of`.
"""

from __future__ import annotations

from typing import Any

PARAMS_KEY = "lmcache"
RECEIVER_FIELD = "pd_receiver"


def with_receiver(params: Any, receiver: str) -> dict[str, Any]:
    """`params` (a request's ``kv_transfer_params``, or None) naming `receiver`."""
    out = dict(params) if isinstance(params, dict) else {}
    ours = out.get(PARAMS_KEY)
    out[PARAMS_KEY] = {**(ours if isinstance(ours, dict) else {}), RECEIVER_FIELD: receiver}
    return out


def receiver_of(params: Any) -> str | None:
    """The receiver a request's ``kv_transfer_params`` name, or None (none, or malformed:
    ValueError, with what is wrong)."""
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(ours, dict) or RECEIVER_FIELD not in ours:
        return None
    value = ours[RECEIVER_FIELD]
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"kv_transfer_params {PARAMS_KEY}.{RECEIVER_FIELD}={value!r}: expected 'host:port'")
    return value
