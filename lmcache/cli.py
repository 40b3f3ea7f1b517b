"""The `lmcache` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def _prepare_model(args: argparse.Namespace) -> int:
    from lmcache.integration.local_model import local_model_path

    print(local_model_path(args.dtype))
    return 0


def _server(args: argparse.Namespace) -> int:
    from lmcache.server.server import LMCacheServer, serve

    logging.basicConfig(level=os.environ.get("LMCACHE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_size_gb <= 0 or args.max_frame_mb <= 0 or args.frame_timeout <= 0:
        raise SystemExit("--max-size-gb, --max-frame-mb and --frame-timeout must be > 0")
    token = args.auth_token or os.environ.get("LMCACHE_AUTH_TOKEN") or None
    server = LMCacheServer(int(args.max_size_gb * (1 << 30)), auth_token=token,
                           max_value_bytes=int(args.max_frame_mb * (1 << 20)),
                           frame_timeout=args.frame_timeout)
    asyncio.run(serve(args.host, args.port, server))
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
