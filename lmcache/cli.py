"""The `lmcache` command line."""

from __future__ import annotations

import argparse
import sys


def _prepare_model(args: argparse.Namespace) -> int:
    from lmcache.integration.local_model import local_model_path

    print(local_model_path(args.dtype))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcache", description="LMCache command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-model", help="convert the bundled SmolLM2-135M GGUF into a local HF folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.set_defaults(func=_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
