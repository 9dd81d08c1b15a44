"""``phalanx bench <kind> ...`` dispatch."""

from __future__ import annotations


def run_bench(kind: str, argv: list[str]) -> int:
    if kind == "throughput":
        from phalanx.bench.throughput import main
    elif kind == "decode":
        from phalanx.bench.decode import main
    elif kind == "adp":
        from phalanx.bench.adp_routing import main
    elif kind == "overhead":
        from phalanx.bench.overhead import main
    elif kind == "kv":
        from phalanx.bench.kv_match import main
    elif kind == "serve":
        from phalanx.bench.serve import main
    elif kind == "prefix":
        from phalanx.bench.prefix import main
    else:
        raise SystemExit(f"unknown benchmark {kind!r}")
    return main(argv)
