"""Expert parallelism on one host: the layer (ExpertParallelMoELayer) on P gloo
processes with the threads split among them, against P = 1 with all of them.

    python3 -m moecert.bench_parallel [--ranks 1 2 4] [--threads 16] [--tokens 4096] [--reps 5]
                                      [--shape paper|tiny] [--json FILE]

Each configuration runs T tokens per step in all (T/P per rank), forward and
backward with LoRA trained, --threads / P threads per rank (torch's and
moecert's). Per step: the slowest rank's time (ranks start together after a
barrier), and within it the time the ranks spend in torch.distributed
collectives (exchange) and outside them (compute); medians over --reps steps
after two warm-up steps. Memory per rank: the packed experts and the peak
resident set.
"""
import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"paper": dict(experts=64, hidden=2048, inter=1408, topk=6, rank=8),
          "tiny": dict(experts=8, hidden=128, inter=256, topk=2, rank=4)}


def _rank(rank, world, port, args, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    threads = max(1, args.threads // world)
    torch.set_num_threads(threads)
    import moecert
    from moecert.torch import ops, parallel
    moecert.set_num_threads(threads)
    shape = SHAPES[args.shape]
    E, H, I, K, r = (shape[k] for k in ("experts", "hidden", "inter", "topk", "rank"))
    T = args.tokens // world
    cfg = ops.LayerConfig(E, H, I, K, r, 2.0 * r, max_tokens=T)
    g = torch.Generator().manual_seed(5)  # the same weights on every rank; each keeps its block
    n = lambda *s, sd: (torch.randn(*s, generator=g) * sd)
    base = [n(E, I, H, sd=H ** -0.5).bfloat16(), n(E, I, H, sd=H ** -0.5).bfloat16(), n(E, H, I, sd=I ** -0.5).bfloat16()]
    per = E // world
    module = parallel.ExpertParallelMoELayer(cfg, *(b[rank * per:(rank + 1) * per].contiguous() for b in base),
                                             n(E, H, sd=H ** -0.5), torch.zeros(E))
    with torch.no_grad():
        for name in ("b_gate", "b_up", "b_down"):
            getattr(module.experts, name).normal_(0, r ** -0.5)
    x = n(args.tokens, H, sd=1.0).bfloat16()[rank * T:(rank + 1) * T].contiguous()
    dy = n(args.tokens, H, sd=1.0)[rank * T:(rank + 1) * T].contiguous()
    spent = [0.0]
    real = parallel._collective

    def timed(fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(fn, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t0

    parallel._collective = timed
    steps, exchange = [], []
    for i in range(args.reps + 2):
        module.zero_grad(set_to_none=True)
        dist.barrier()
        spent[0] = 0.0
        t0 = time.perf_counter()
        module(x).backward(dy)
        both = torch.tensor([time.perf_counter() - t0, spent[0]], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if i >= 2:
            steps.append(float(both[0]) * 1e3)
            exchange.append(float(both[1]) * 1e3)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        step, ex = statistics.median(steps), statistics.median(exchange)
        with open(out, "w") as f:
            json.dump({"ranks": world, "threads_per_rank": threads, "tokens_per_rank": T, "step_ms": step,
                       "exchange_ms": ex, "compute_ms": step - ex, "steps_ms": steps, "exchange_steps_ms": exchange,
                       "packed_bytes_per_rank": module.experts.packed.nbytes(), "peak_rss_gib_max_rank": float(rss)},
                      f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m moecert.bench_parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--threads", type=int, default=16, help="threads in all, split among the ranks")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step in all")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="paper")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = []
    print("{:>5} {:>8} {:>8} {:>10} {:>12} {:>11} {:>12} {:>10}".format(
        "ranks", "threads", "tokens", "step ms", "exchange ms", "compute ms", "packed MiB", "peak GiB"))
    with tempfile.TemporaryDirectory() as d:
        for world in args.ranks:
            out = os.path.join(d, "{}.json".format(world))
            mp.start_processes(_rank, args=(world, _free_port(), args, out), nprocs=world, start_method="spawn")
            with open(out) as f:
                r = json.load(f)
            rows.append(r)
            print("{:>5} {:>8} {:>8} {:>10.1f} {:>12.1f} {:>11.1f} {:>12.1f} {:>10.2f}".format(
                world, r["threads_per_rank"], r["tokens_per_rank"], r["step_ms"], r["exchange_ms"], r["compute_ms"],
                r["packed_bytes_per_rank"] / 2 ** 20, r["peak_rss_gib_max_rank"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "moecert-parallel-bench/1", "python": sys.version.split()[0], "torch": torch.__version__,
                       "shape": SHAPES[args.shape], "tokens": args.tokens, "threads": args.threads, "results": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
