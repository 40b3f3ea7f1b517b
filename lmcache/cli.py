"""The `lmcache` command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import signal
import sys

from lmcache.process_exit import skip_final_collection


def _prepare_model(args: argparse.Namespace) -> int:
    from lmcache.integration.local_model import local_model_path

    print(local_model_path(args.dtype))
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from lmcache.storage_backend.serde.seal import write_key_file

    try:
        kid = write_key_file(args.path)
    except FileExistsError:
        raise SystemExit(f"{args.path} exists: refusing to overwrite a key file") from None
    print(f"wrote KV key {kid} to {args.path} (mode 0600); set kv_encryption_key: {args.path}")
    return 0


def _log_to_stderr() -> None:
    """A serving command's logging, to stderr; ``kill -USR1 PID`` writes every thread's stack there
    too (where a server that will not stop is stuck)."""
    logging.basicConfig(level=os.environ.get("LMCACHE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError):  # stderr is not a file (captured, in a test)
        pass


def _server(args: argparse.Namespace) -> int:
    from lmcache.server.server import LMCacheServer, serve

    _log_to_stderr()
    if args.max_size_gb <= 0 or args.max_frame_mb <= 0 or args.frame_timeout <= 0:
        raise SystemExit("--max-size-gb, --max-frame-mb and --frame-timeout must be > 0")
    token = args.auth_token or os.environ.get("LMCACHE_AUTH_TOKEN") or None
    server = LMCacheServer(int(args.max_size_gb * (1 << 30)), auth_token=token,
                           max_value_bytes=int(args.max_frame_mb * (1 << 20)),
                           frame_timeout=args.frame_timeout)
    asyncio.run(serve(args.host, args.port, server))
    return 0


def _cache_server(args: argparse.Namespace) -> int:
    from lmcache.cache_server.ops import OpsEndpoint
    from lmcache.cache_server.server import CacheServer
    from lmcache.config import LMCacheEngineConfig

    _log_to_stderr()
    if args.size_gb <= 0 or args.heartbeat <= 0:
        raise SystemExit("lmcache cache-server: --size-gb and --heartbeat must be > 0")
    try:
        config = LMCacheEngineConfig.from_file(args.config) if args.config else LMCacheEngineConfig()
        if args.kv_events is not None:
            config = dataclasses.replace(config, kv_events_endpoint=args.kv_events)
        server = CacheServer(args.url, int(args.size_gb * (1 << 30)), config, heartbeat=args.heartbeat)
    except (ValueError, OSError) as e:
        raise SystemExit(f"lmcache cache-server: {e}") from None
    try:
        ops = OpsEndpoint(server, args.http_host, args.http_port)
    except OSError as e:
        server.close()
        where = f"{args.http_host}:{args.http_port}"
        raise SystemExit(f"lmcache cache-server: cannot serve HTTP on {where}: {e}") from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    print(f"lmcache cache-server: serving {server.url} (L1 {args.size_gb:g} GB, session {server.session}); "
          f"operations on http://{args.http_host}:{ops.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        ops.close()
        server.close()
    return 0


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())


def _router(args: argparse.Namespace) -> int:
    """`lmcache router`; with ``--policy pd`` (and as `lmcache proxy`) the prefill/decode front."""
    if args.policy == "pd":
        from lmcache.pd.proxy import ProxyConfig
        from lmcache.pd.proxy import run as run_pd

        if not (args.prefiller and args.decoder) or args.instance:
            raise SystemExit(f"lmcache {args.command}: --policy pd takes --prefiller and --decoder, "
                             "not --instance")
        try:
            pd = ProxyConfig.parse(args.prefiller, args.decoder, args.decoder_kv or "", args.kv_protocol,
                                   args.host, args.port, args.prefill_timeout, args.prefill_policy,
                                   args.prefiller_kv_events or "", args.model, args.shared_kv_events,
                                   args.stall_timeout)
        except ValueError as e:
            raise SystemExit(f"lmcache {args.command}: {e}") from None
        _log_to_stderr()
        run_pd(pd)
        return 0
    from lmcache.router.index import TIER_WEIGHTS
    from lmcache.router.server import RouterConfig, run

    if not args.instance or args.prefiller or args.decoder:
        raise SystemExit(f"lmcache router: --policy {args.policy} takes --instance, "
                         "not --prefiller/--decoder")
    try:
        weights = {k: float(v) for k, _, v in (w.partition("=") for w in _split(args.tier_weights))}
        config = RouterConfig(_split(args.instance), args.policy, _split(args.kv_events), args.model,
                              args.host, args.port, args.request_cost, args.max_blocks,
                              {**TIER_WEIGHTS, **weights}, shared_kv_events=_split(args.shared_kv_events),
                              stall_timeout=args.stall_timeout)
    except ValueError as e:
        raise SystemExit(f"lmcache router: {e}") from None
    _log_to_stderr()
    run(config)
    return 0


def _add_pd_arguments(x: argparse.ArgumentParser, required: bool) -> None:
    x.add_argument("--prefiller", required=required, help="prefill vLLM URL(s), comma-separated")
    x.add_argument("--decoder", required=required, help="decode vLLM URL(s), comma-separated")
    x.add_argument("--decoder-kv", default=None,
                   help="each decoder's KV receiver HOST:PORT (pd_peer_host:pd_peer_init_port), same order "
                        "(the lmcache hand-off)")
    x.add_argument("--kv-protocol", default=None,
                   help="how the KV goes from prefiller to decoder: lmcache (the default: LMCache's "
                        "connector with enable_pd pushes it) or nixl (vLLM's NixlConnector: the decoder "
                        "pulls it)")
    x.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    x.add_argument("--port", type=int, default=8000, help="TCP port")
    x.add_argument("--stall-timeout", type=float, default=10.0,
                   help="seconds a request may wait with nothing from its instance (no answer, or no "
                        "next chunk of a stream) before the instance's /health is probed; one whose "
                        "/health does not answer is a failed instance (default %(default)s)")
    x.add_argument("--prefill-timeout", type=float, default=600.0,
                   help="seconds to wait for a prefiller before the decoder answers alone")
    x.add_argument("--prefill-policy", default="round-robin", choices=("round-robin", "session", "kv-aware"),
                   help="how the prefiller is picked (kv-aware: by the prefix each holds and its load; needs "
                        "--prefiller-kv-events and --model)")
    x.add_argument("--prefiller-kv-events", default=None,
                   help="each prefiller's KV events endpoint (vLLM's --kv-events-config), same order")
    x.add_argument("--model", help="the model's folder, for its tokenizer (kv-aware; for the router's other "
                   "policies it lets /stats compare predicted and served hits)")
    x.add_argument("--shared-kv-events", default="", metavar="ENDPOINTS",
                   help="kv-aware: the KV events endpoints of cache servers every instance (with --policy "
                        "pd, every prefiller) is attached to (lmcache cache-server --kv-events), "
                        "comma-separated: their chunks count as cached on each")


def _controller_call(args: argparse.Namespace) -> int:
    """One request to an engine's controller or a cache server's operations endpoint; prints the
    JSON answer (exit 1 on an error)."""
    import http.client
    import json
    import urllib.error
    import urllib.request

    url = args.url or os.environ.get("LMCACHE_CONTROLLER_URL")
    if not url:
        raise SystemExit("give --url HOST:PORT (or set LMCACHE_CONTROLLER_URL): the engine's controller_url "
                         "or the cache server's --http-port")
    base = url if "://" in url else f"http://{url}"
    body = _request_body(args)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base.rstrip('/')}/{args.command}", data=data,
                                     method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            answer = response.read()
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except http.client.InvalidURL as e:
        print(f"bad --url {base}: {e}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        print(f"cannot reach {base}: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(json.loads(answer), indent=2))
    except ValueError:
        print(f"{base} did not answer JSON: {answer[:200].decode(errors='replace')!r}", file=sys.stderr)
        return 1
    return 0


def _request_body(args: argparse.Namespace) -> dict | None:
    if args.command in ("health", "stats"):
        return None
    if args.command == "clear":
        return {"tier": args.tier}
    if args.command == "unpin" and args.lease:
        return {"lease": args.lease}
    body: dict = {}
    if args.text is not None:
        body["text"] = args.text
    if args.tokens is not None:
        body["tokens"] = args.tokens
    if args.extra_key is not None:
        body["extra_key"] = args.extra_key
    if getattr(args, "ttl", None) is not None:
        body["ttl"] = args.ttl
    return body


def _verify(args: argparse.Namespace) -> int:
    from lmcache.verify.run import main as verify

    return verify(args)


def _token_ids(value: str) -> list[int]:
    try:
        return [int(t) for t in value.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a list of comma-separated token ids") from None


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value!r}")
    return seconds


def _add_controller_commands(sub: argparse._SubParsersAction) -> None:
    def command(name: str, summary: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary)
        p.add_argument("--url", help="the engine's controller or a cache server's operations endpoint, "
                                     "HOST:PORT (default: $LMCACHE_CONTROLLER_URL)")
        p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for the answer")
        p.set_defaults(func=_controller_call)
        return p

    def prompt(p: argparse.ArgumentParser, required: bool = True) -> None:
        which = p.add_mutually_exclusive_group(required=required)
        which.add_argument("--text", help="the prompt as text (tokenized by the engine's tokenizer)")
        which.add_argument("--tokens", type=_token_ids, help="the prompt as comma-separated token ids")
        p.add_argument("--extra-key", help="the request's extra key (e.g. vLLM's cache_salt)")

    command("health", "is the engine's cache working (per tier)")
    command("stats", "the engine's and tiers' counters")
    prompt(command("lookup", "how much of a prompt is cached, in which tier and on which peers"))
    clear = command("clear", "empty a local tier")
    clear.add_argument("--tier", required=True, choices=("hot", "disk", "all"))
    pin = command("pin", "keep a prompt's cached prefix cached (until unpinned or --ttl)")
    prompt(pin)
    pin.add_argument("--ttl", type=_seconds, help="seconds the pin lasts (default 3600)")
    unpin = command("unpin", "end a pin (by prompt or by --lease)")
    prompt(unpin, required=False)
    unpin.add_argument("--lease", help="the lease id `lmcache pin` printed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache", description="LMCache command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-model", help="convert the bundled SmolLM2-135M GGUF into a local HF folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.set_defaults(func=_prepare_model)
    s = sub.add_parser("server", help="run the lm:// cache server (shared KV store for remote_url=lm://...)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=65432, help="TCP port (0 = any free port)")
    s.add_argument("--max-size-gb", type=float, default=4.0, help="capacity; LRU eviction beyond it")
    s.add_argument("--max-frame-mb", type=float, default=512.0, help="largest value accepted in one PUT")
    s.add_argument("--frame-timeout", type=float, default=30.0,
                   help="seconds a started frame may take to arrive before the connection is dropped")
    s.add_argument("--auth-token", default=None,
                   help="shared secret clients must present (default: $LMCACHE_AUTH_TOKEN, else none)")
    s.set_defaults(func=_server)
    c = sub.add_parser("cache-server", help="run the cache server engines on this host share (shared-memory "
                       "L1, the tiers behind it; engines set cache_server_url)")
    c.add_argument("--url", default="ipc:///tmp/lmcache-cache-server.sock",
                   help="control socket: ipc:///path (default /tmp/lmcache-cache-server.sock) or tcp://host:port")
    c.add_argument("--size-gb", type=float, default=4.0,
                   help="L1: the shared-memory arena (memory is used as it fills; LRU beyond it)")
    c.add_argument("--config", default=None,
                   help="LMCache YAML config of the tiers behind L1 (local_disk, remote_url, ...)")
    c.add_argument("--heartbeat", type=float, default=1.0,
                   help="seconds between engines' heartbeats (an engine whose process the server cannot "
                        "watch is reaped after 2 missed ones)")
    c.add_argument("--http-host", default="127.0.0.1", help="address of the operations endpoint (/health, "
                   "/stats, /metrics, /lookup, /clear, /pin, /unpin)")
    c.add_argument("--http-port", type=int, default=0, help="port of the operations endpoint (0 = any)")
    c.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the tiers' KV events in vLLM's format on this ZMQ endpoint (tcp://*:PORT "
                        "binds, tcp://HOST:PORT connects); overrides the config's kv_events_endpoint")
    c.set_defaults(func=_cache_server)
    x = sub.add_parser("proxy", help="the OpenAI-compatible front of prefill/decode disaggregation (xPyD); "
                       "the same as `lmcache router --policy pd`")
    _add_pd_arguments(x, required=True)
    x.set_defaults(func=_router, policy="pd", instance=None)
    r = sub.add_parser("router", help="an OpenAI-compatible front for several vLLM instances (round-robin, "
                       "session affinity, KV-aware, or prefill/decode)")
    r.add_argument("--policy", default="round-robin", choices=("round-robin", "session", "kv-aware", "pd"))
    r.add_argument("--instance", help="the vLLM instances' URLs, comma-separated (all but --policy pd)")
    r.add_argument("--kv-events", help="each instance's KV events endpoint (vLLM's --kv-events-config "
                   "endpoint, e.g. tcp://HOST:5557), same order (kv-aware)")
    from lmcache.router.policies import REQUEST_COST

    r.add_argument("--request-cost", type=int, default=REQUEST_COST,
                   help="kv-aware: prompt tokens a request in flight counts for besides its uncached prompt "
                        "(default %(default)s)")
    r.add_argument("--max-blocks", type=int, default=200_000, help="kv-aware: blocks indexed per instance")
    from lmcache.router.index import TIER_WEIGHTS

    defaults = ",".join(f"{medium}={weight:g}" for medium, weight in TIER_WEIGHTS.items())
    r.add_argument("--tier-weights", default="",
                   help=f"kv-aware: MEDIUM=WEIGHT,... (default {defaults}; GPU is vLLM's own prefix cache)")
    _add_pd_arguments(r, required=False)
    r.set_defaults(func=_router)
    k = sub.add_parser("keygen", help="write a new AES-256 KV sealing key file (mode 0600) for "
                       "kv_encryption_key; refuses to overwrite")
    k.add_argument("path", help="the key file to create")
    k.set_defaults(func=_keygen)
    _add_controller_commands(sub)
    from lmcache.verify.run import add_arguments as verify_arguments

    v = sub.add_parser("verify", help="canary: does a running OpenAI server answer prompts served from its "
                       "cache as it computes them fresh (a random cache_salt)")
    verify_arguments(v)
    v.set_defaults(func=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `lmcache` program (`argv` None: this process's command line; a program exits
    without the interpreter's last garbage collection, see `lmcache.process_exit`)."""
    if argv is None:
        skip_final_collection()
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
