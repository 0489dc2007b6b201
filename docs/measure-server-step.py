"""A server's CPU per BSP training step, in one process (issue 39; docs/benchmarks.md's bench vw
row): the requests of ``hpcps bench vw``'s job in its later epochs, made up and handed to the
server one after the other, without MPI and without the worker:

    .venv/bin/python docs/measure-server-step.py [--rounds 8] [--steps 40]

A shard of 620 k keys below 2**24 (the 3-epoch job's table), FTRL, dim 1, a bias key with a given
initial value; Zipf batches of about 12.5 k distinct keys (39 k nonzeros, as a 1,000-row batch of 39
fields) and the bias. Each step is the worker's push-pull: the gradients of the batch the step
before pulled, its keys marked where the next pull reads them (``protocol.IN_PULL``), and the next
batch's pull, so the server updates the pulled part, answers, then updates the rest. Replies are
dropped. Prints the server's CPU per step (``time.process_time``), the median and the minimum of
the rounds. Run it alternately against another checkout for a ratio (``PYTHONPATH`` to its
``hpcps`` and ``hpcps_kernels``, from a directory outside both).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import hpcps
from hpcps.ps import protocol

BIAS = 1 << 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    ctx = hpcps.init(servers=1, staleness=0)
    table = ctx.sparse_table("w", dim=1, optimizer="ftrl", params={"alpha": 0.1}, key_bits=24,
                             init_keys=((BIAS, (0.3,)),))
    rng = np.random.default_rng(0)
    stored = np.unique(rng.permutation(1 << 24)[:620_000].astype(np.uint64))
    for lo in range(0, stored.size, 60_000):
        keys = stored[lo:lo + 60_000]
        table.wait(table.push(keys, rng.normal(size=(keys.size, 1)).astype(np.float32) * 0.01))
    server = ctx.server
    server.replies.post = lambda *a, **k: None  # (no worker reads them)
    order = rng.permutation(stored.size)
    batches = [np.append(np.unique(stored[order[rng.zipf(1.15, 39_000) % stored.size]]), np.uint64(BIAS))
               for _ in range(args.steps + 1)]
    source, clock, times = server.worker_rank0, 1000, []
    for r in range(args.rounds + 2):  # (the first two: warming up)
        server.handle(source, protocol.Pull(table.id, 1, clock, 0, batches[0]).pack())  # (the slots the first push takes)
        requests = []
        for i in range(args.steps):
            grads = rng.normal(size=(batches[i].size, 1)).astype(np.float32) * 0.01
            requests.append(protocol.PushPull(table.id, 1, clock, 0, batches[i], grads, batches[i + 1],
                                              in_pull=np.isin(batches[i], batches[i + 1])).pack())
            clock += 1
        start = time.process_time()
        for request in requests:
            server.handle(source, request)
        if r >= 2:
            times.append((time.process_time() - start) / args.steps)
    print(f"{np.mean([b.size for b in batches]):.0f} keys a step; the server's CPU per step: median "
          f"{np.median(times) * 1e6:.1f} us, minimum {min(times) * 1e6:.1f} us ({args.rounds} rounds of {args.steps})")


if __name__ == "__main__":
    main()
