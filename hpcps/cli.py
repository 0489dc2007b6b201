"""The ``hpcps`` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_bench_mpi(args) -> int:
    from hpcps import bench_mpi, transport

    transport.install_abort_handler()
    comm = transport.world().Dup()
    rows = bench_mpi.run(comm)
    if comm.Get_rank() == 0:
        if args.json:
            for r in rows:
                print(json.dumps(r))
        else:
            print(f"{'bytes':>10} {'one-way':>12} {'GB/s':>8}")
            for r in rows:
                print(f"{r['bytes']:>10} {r['one_way_s'] * 1e6:>10.1f}us {r['gb_per_s']:>8.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcps", description="MPI parameter server for huge sparse models")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks (run under mpiexec)")
    bsub = bench.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("mpi", help="raw MPI point-to-point bandwidth between ranks 0 and 1")
    b.add_argument("--json", action="store_true", help="one JSON object per line")
    b.set_defaults(func=_cmd_bench_mpi)
    d = sub.add_parser("demo", help="the main job of `make demo`")
    d.set_defaults(func=_cmd_bench_mpi, json=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
