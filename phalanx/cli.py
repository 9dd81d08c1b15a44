"""The ``phalanx`` command: serve, launch, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("PHALANX_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="phalanx", description="phalanx LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    from phalanx.serve.cli import DefaultsHelp, add_serve_args
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=DefaultsHelp)
    add_serve_args(serve)
    launch = sub.add_parser("launch", help="under mpirun: run a command whose LLM uses this MPI job")
    launch.add_argument("cmd", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("kind", choices=["throughput", "decode", "serve", "prefix", "kv", "overhead", "adp"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from phalanx.serve.cli import serve as run_serve
        return run_serve(args)
    if args.command == "launch":
        from phalanx.pyexecutor.launch import launch as run_launch
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return run_launch(cmd)
    if args.command == "bench":
        from phalanx.bench.cli import run_bench
        return run_bench(args.kind, args.rest)
    return 1


if __name__ == "__main__":
    sys.exit(main())
