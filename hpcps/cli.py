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


def _cmd_bench_ps(args) -> int:
    from hpcps import bench_ps

    sizes = [int(x) for x in args.sizes.split(",")]
    rows = bench_ps.run(sizes, args.repeat, args.dim, args.optimizer)
    if rows is not None:
        if args.json:
            for r in rows:
                print(json.dumps(r))
        else:
            print(bench_ps.format_rows(rows, args.optimizer))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcps", description="MPI parameter server for huge sparse models")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks (run under mpiexec)")
    bsub = bench.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("mpi", help="raw MPI point-to-point bandwidth between ranks 0 and 1")
    b.add_argument("--json", action="store_true", help="one JSON object per line")
    b.set_defaults(func=_cmd_bench_mpi)
    b = bsub.add_parser("ps", help="push/pull throughput per server beside raw MPI bandwidth (1 server + 1 worker)")
    b.add_argument("--sizes", default="1000,10000,100000,1000000", help="batch sizes in keys, comma-separated")
    b.add_argument("--repeat", type=int, default=5)
    b.add_argument("--dim", type=int, default=1)
    b.add_argument("--optimizer", default="ftrl", choices=["sgd", "adagrad", "ftrl", "adam"])
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_bench_ps)
    d = sub.add_parser("demo", help="the main job of `make demo`")
    d.set_defaults(func=_cmd_bench_mpi, json=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
