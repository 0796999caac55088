"""Expert parallelism on the gloo backend, 2 and 4 processes on 127.0.0.1 started
here with a time limit: y, dx, dL/dweights and every expert's LoRA (and, when
trained, base-weight) gradients bitwise equal to one process, for -1 slots, idle experts, every token routed to
one rank's experts, and uneven token counts per rank; ranks that disagree on
the config, a bad expert id on one rank and a NaN found by an expert's owner
raise on every rank, none waits, and the group works afterwards; a rank that
dies or stalls makes the others raise within the group's timeout. The layer
(router linear and router on each rank's tokens, data-parallel router
parameters) likewise for the three routers: y, dx and the LoRA gradients
bitwise those of one process, the router gradients the same on every rank and
in every run and within the derived bound of the exact value."""
import datetime
import math
import os
import socket
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moecert.torch import ops

E, H, I, K, RANK, T = 8, 32, 48, 2, 4, 13
KINDS = ("normal", "tails", "one_rank")
WIDE_K = (6, 8)
SHARES = {2: [5, 8], 4: [2, 4, 3, 4]}  # tokens per rank, uneven


def problem(kind, world, k=K):
    g = torch.Generator().manual_seed(11)
    n = lambda *s, sd=1.0: torch.randn(*s, generator=g) * sd
    base = [n(E, I, H, sd=H ** -0.5).bfloat16(), n(E, I, H, sd=H ** -0.5).bfloat16(), n(E, H, I, sd=I ** -0.5).bfloat16()]
    shapes = ops._lora_shapes(E, H, I, RANK)
    lora = ops.Lora(*(n(*shapes[k], sd=0.3) for k in ops.LORA_NAMES), alpha=8.0)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "one_rank":  # every slot on the last rank's experts
        per = E // world
        ids = torch.stack([torch.randperm(per, generator=g)[:k] for _ in range(T)]) + (world - 1) * per
    w = torch.rand(T, k, generator=g)
    if kind == "tails":
        ids[2, 1] = ids[7, 1] = -1
        ids[9, :] = -1
        w[ids < 0] = 0
    return base, lora, n(T, H).bfloat16(), ids.to(torch.int32), w, n(T, H)


def worker(rank, world, port, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    from moecert.torch.parallel import ExpertParallelMoE
    per, off = E // world, sum(SHARES[world][:rank])
    rows = slice(off, off + SHARES[world][rank])
    results = {}

    def one_step(problem_args):
        """This rank's outputs and gradients of one forward and backward on a problem."""
        base, lora, x, ids, w, dy = problem(*problem_args)
        mine = slice(rank * per, (rank + 1) * per)
        module = ExpertParallelMoE(E, *(b[mine].contiguous() for b in base), rank=RANK, alpha=8.0)
        with torch.no_grad():
            for k in ops.LORA_NAMES:
                getattr(module, k).copy_(getattr(lora, k)[mine])
        xs, ws = x[rows].clone().requires_grad_(), w[rows].clone().requires_grad_()
        y = module(xs, ids[rows].contiguous(), ws)
        y.backward(dy[rows])
        return {"y": y.detach(), "dx": xs.grad, "dweights": ws.grad,
                **{k: getattr(module, k).grad for k in ops.LORA_NAMES}}

    for kind in KINDS:
        results[kind] = one_step((kind, world))
    for k in WIDE_K:  # real models' K: a token's slots on several ranks, combined in slot order
        results["K", k] = one_step(("normal", world, k))
    base, lora, x, ids, w, dy = problem("tails", world)  # base weights trained as well
    mine = slice(rank * per, (rank + 1) * per)
    module = ExpertParallelMoE(E, *(b[mine].contiguous() for b in base), rank=RANK, alpha=8.0, train_base=True)
    with torch.no_grad():
        for k in ops.LORA_NAMES:
            getattr(module, k).copy_(getattr(lora, k)[mine])
    module(x[rows], ids[rows].contiguous(), w[rows]).backward(dy[rows])
    results["base"] = {k: getattr(module, k).grad for k in ops.BASE_NAMES + ops.LORA_NAMES}
    results["faults"] = faults(rank, world, per, rows)
    torch.save(results, os.path.join(out_dir, "{}.pt".format(rank)))
    dist.destroy_process_group()


def faults(rank, world, per, rows):
    """Bad input on one rank: every rank raises (no rank waits in a collective), the group stays
    usable. Returns (scenario, exception type, clause or message) per scenario."""
    import moecert
    from moecert.torch.parallel import ExpertParallelMoE
    base, lora, x, ids, w, dy = problem("normal", world)
    mine = slice(rank * per, (rank + 1) * per)
    out = []

    def attempt(name, fn):
        try:
            fn()
            out.append((name, "none", ""))
        except moecert.ContractViolation as e:
            out.append((name, "ContractViolation", e.clause))
        except moecert.Error as e:
            out.append((name, type(e).__name__, str(e)))

    # The ranks disagree on alpha: the same error on every rank, before any exchange.
    attempt("config", lambda: ExpertParallelMoE(E, *(b[mine].contiguous() for b in base), rank=RANK,
                                                alpha=8.0 if rank else 16.0))
    # One ulp apart: compared bitwise.
    attempt("alpha ulp", lambda: ExpertParallelMoE(E, *(b[mine].contiguous() for b in base), rank=RANK,
                                                   alpha=8.0 if rank else math.nextafter(8.0, 9.0)))
    module = ExpertParallelMoE(E, *(b[mine].contiguous() for b in base), rank=RANK, alpha=8.0)
    bad_ids = ids[rows].clone()
    if rank == world - 1:
        bad_ids[0, 0] = E  # out of range on one rank
    attempt("expert id", lambda: module(x[rows], bad_ids, w[rows]))
    bad_x = x[rows].clone()
    if rank == 0:
        bad_x[0, 3] = float("nan")  # found by the experts' owner, after the exchange
    with moecert.contracts("check"):
        attempt("nan", lambda: module(bad_x, ids[rows].contiguous(), w[rows]))
    attempt("after", lambda: module(x[rows], ids[rows].contiguous(), w[rows]))  # the group still works
    return out


LAYER_CASES = [(router, one_rank) for router in ("softmax_topk", "sigmoid_topk", "product_key")
               for one_rank in (False, True)]


def layer_problem(router, one_rank=False):
    """A layer config and its parameters (fp32 LoRA factors, B nonzero), x and dy; one_rank: the
    router bias sends every token to the last experts (the last rank's for 2 and 4 ranks), the
    others idle."""
    if router == "product_key":
        cfg = ops.LayerConfig(16, H, I, K, RANK, 8.0, router, max_tokens=T)
    elif router == "sigmoid_topk":
        cfg = ops.LayerConfig(E, H, I, K, RANK, 8.0, router, groups=4, topk_group=2, scaling=1.5, max_tokens=T)
    else:
        cfg = ops.LayerConfig(E, H, I, K, RANK, 8.0, router, max_tokens=T)
    g = torch.Generator().manual_seed(23)
    n = lambda *s, sd=1.0: torch.randn(*s, generator=g) * sd
    Ex, R_ = cfg.experts, cfg.router_outputs()
    p = {"w_gate": n(Ex, I, H, sd=H ** -0.5).bfloat16(), "w_up": n(Ex, I, H, sd=H ** -0.5).bfloat16(),
         "w_down": n(Ex, H, I, sd=I ** -0.5).bfloat16(), "router_w": n(R_, H, sd=H ** -0.5), "router_b": n(R_, sd=0.1),
         "router_bias": n(Ex, sd=0.05) if router == "sigmoid_topk" else None}
    shapes = ops._lora_shapes(Ex, H, I, RANK)
    p.update({k: n(*shapes[k], sd=0.3) for k in ops.LORA_NAMES})
    if one_rank:  # experts 6, 7 of 8; product key: ix = 3 of 4, experts 12..15 of 16
        p["router_b"][[3] if router == "product_key" else [6, 7]] += 8.0
    return cfg, p, n(T, H).bfloat16(), n(T, H)


def layer_worker(rank, world, port, out_dir):
    """ExpertParallelMoELayer on this rank's tokens, for each router, twice; and router parameters
    that differ on one rank."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    import moecert
    from moecert.torch.parallel import ExpertParallelMoELayer
    moecert.set_num_threads(rank + 1)  # the ranks' thread counts differ
    off = sum(SHARES[world][:rank])
    rows = slice(off, off + SHARES[world][rank])
    results = {}
    for router, one_rank in LAYER_CASES:
        cfg, p, x, dy = layer_problem(router, one_rank)
        per = cfg.experts // world
        mine = slice(rank * per, (rank + 1) * per)
        module = ExpertParallelMoELayer(cfg, *(p[k][mine].contiguous() for k in ops.BASE_NAMES), p["router_w"],
                                        p["router_b"], p["router_bias"], train_base=True)
        with torch.no_grad():
            for k in ops.LORA_NAMES:
                getattr(module.experts, k).copy_(p[k][mine])
        runs = []
        for _ in range(2):
            module.zero_grad(set_to_none=True)
            xs = x[rows].clone().requires_grad_()
            y = module(xs)
            y.backward(dy[rows])
            runs.append({"y": y.detach(), "dx": xs.grad, "router_w": module.router_w.grad,
                         "router_b": module.router_b.grad,
                         **{k: getattr(module.experts, k).grad for k in ops.LORA_NAMES + ops.BASE_NAMES}})
        results[router, one_rank] = runs
        # An optimizer step on every parameter (the base weights packed again by the forward), then a second step.
        torch.optim.SGD(module.parameters(), lr=0.05).step()
        module.zero_grad(set_to_none=True)
        module(x[rows]).backward(dy[rows])
        results[router, one_rank, "stepped"] = {"router_w": module.router_w.detach().clone(),
                                                "grad": module.router_w.grad}
    bad_x = x[rows].clone()
    if rank == world - 1:
        bad_x[1, 2] = float("nan")
    try:
        with moecert.contracts("check"):
            module(bad_x)
        results["nan"] = ("none", "")
    except moecert.ContractViolation as e:
        results["nan"] = ("ContractViolation", e.clause)
    except moecert.Error as e:
        results["nan"] = (type(e).__name__, str(e))
    cfg, p, x, dy = layer_problem("softmax_topk")
    per = cfg.experts // world
    router_b = p["router_b"].clone()
    if rank == 0:
        router_b[1] += 2 ** -20  # one bit apart on one rank
    try:
        ExpertParallelMoELayer(cfg, *(p[k][rank * per:(rank + 1) * per].contiguous() for k in ops.BASE_NAMES),
                               p["router_w"], router_b)
        results["mismatch"] = ("none", "")
    except moecert.Error as e:
        results["mismatch"] = (type(e).__name__, str(e))
    # The ranks disagree on the router kind (router parameters of other sizes): the same error
    # on every rank, no collective of mismatched sizes.
    cfg, p, x, dy = layer_problem("sigmoid_topk" if rank == 0 else "softmax_topk")
    try:
        ExpertParallelMoELayer(cfg, *(p[k][rank * per:(rank + 1) * per].contiguous() for k in ops.BASE_NAMES),
                               p["router_w"], p["router_b"], p["router_bias"])
        results["kind"] = ("none", "")
    except moecert.Error as e:
        results["kind"] = (type(e).__name__, str(e))
    torch.save(results, os.path.join(out_dir, "{}.pt".format(rank)))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOST_TIMEOUT_S = 5


def lost_rank_worker(rank, world, port, out_dir, how):
    """The last rank dies (exits) or stalls (sleeps past the timeout) after the module was built;
    the others run a forward and record what it raised and when."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=LOST_TIMEOUT_S))
    import moecert
    from moecert.torch.parallel import ExpertParallelMoE
    base, lora, x, ids, w, dy = problem("normal", world)
    per = E // world
    module = ExpertParallelMoE(E, *(b[rank * per:(rank + 1) * per].contiguous() for b in base), rank=RANK)
    if rank == world - 1:
        if how == "stalls":
            time.sleep(4 * LOST_TIMEOUT_S)
        os._exit(0)  # no goodbye to the group
    t0 = time.monotonic()
    try:
        module(x, ids, w)
        outcome = ("none", "")
    except moecert.Error as e:
        outcome = (type(e).__name__, str(e))
    torch.save({"outcome": outcome, "seconds": time.monotonic() - t0}, os.path.join(out_dir, "{}.pt".format(rank)))
    os._exit(0)  # the group is broken: leave without its teardown


def run_world(world, out_dir, limit_s=180, target=worker, extra=()):
    ctx = mp.start_processes(target, args=(world, free_port(), out_dir) + extra, nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("{} ranks did not finish within {} s".format(world, limit_s))


@pytest.mark.parametrize("world", [2, 4])
def test_bitwise_equal_to_one_process(world):
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(world, out_dir)
        ranks = [torch.load(os.path.join(out_dir, "{}.pt".format(r))) for r in range(world)]
    def same_as_one_process(key, problem_args):
        base, lora, x, ids, w, dy = problem(*problem_args)
        y, saved = ops.experts_forward_train(ops.PackedExperts(*base), x, ids, w, lora)
        g = ops.experts_backward(saved, dy, ("dx", "dweights") + ops.LORA_NAMES)
        cat = lambda name: torch.cat([r[key][name] for r in ranks])
        assert torch.equal(cat("y"), y), key
        assert torch.equal(cat("dx"), g["dx"].bfloat16()), key  # autograd stores dx as x's dtype
        assert torch.equal(cat("dweights"), g["dweights"]), key
        for k in ops.LORA_NAMES:
            assert torch.equal(cat(k), g[k]), (key, k)

    for kind in KINDS:
        same_as_one_process(kind, (kind, world))
        if kind == "one_rank":  # the other ranks' experts are idle: their gradients exactly 0
            assert all(torch.all(ranks[r][kind][k] == 0) for r in range(world - 1) for k in ops.LORA_NAMES)
        assert sum(len(r[kind]["y"]) for r in ranks) == T
    base, lora, x, ids, w, dy = problem("tails", world)
    packed = ops.PackedExperts(*base)
    _, saved = ops.experts_forward_train(packed, x, ids, w, lora)
    g = ops.experts_backward(saved, dy, ops.BASE_NAMES + ops.LORA_NAMES)
    for k in ops.BASE_NAMES + ops.LORA_NAMES:  # autograd stores a base weight's gradient in its dtype, bf16
        assert torch.equal(torch.cat([r["base"][k] for r in ranks]), g[k].to(base[0].dtype if k in ops.BASE_NAMES
                                                                                   else g[k].dtype)), k
    faults = [dict((name, (kind, what)) for name, kind, what in r["faults"]) for r in ranks]
    assert len({f["config"] for f in faults}) == 1  # the same error on every rank
    assert faults[0]["config"][0] == "InvalidArgument" and "alpha" in faults[0]["config"][1]
    assert len({f["alpha ulp"] for f in faults}) == 1
    assert faults[0]["alpha ulp"][0] == "InvalidArgument" and "alpha 8.0..8.000000000000002" in faults[0]["alpha ulp"][1]
    for k in WIDE_K:
        same_as_one_process(("K", k), ("normal", world, k))
    assert faults[-1]["expert id"][0] == "InvalidArgument" and "expert_ids[0, 0] = 8" in faults[-1]["expert id"][1]
    assert all(f["expert id"][0] == "Error" and "another rank" in f["expert id"][1] for f in faults[:-1])
    assert any(f["nan"] == ("ContractViolation", "experts.forward_train.x_finite") for f in faults)
    assert all(f["nan"][0] in ("ContractViolation", "Error") for f in faults)
    assert all(f["after"] == ("none", "") for f in faults)


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_lost_rank_makes_the_others_raise(how):
    world = 2
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(world, out_dir, limit_s=120, target=lost_rank_worker, extra=(how,))
        seen = [torch.load(os.path.join(out_dir, "{}.pt".format(r))) for r in range(world - 1)]
    for r in seen:
        kind, message = r["outcome"]
        assert kind == "Error" and "a rank of the group died, left or stalled" in message, r
        assert r["seconds"] < 3 * LOST_TIMEOUT_S, r  # within the timeout (and the spawn's slack), no hang


@pytest.mark.parametrize("world", [2, 4])
def test_layer_bitwise_equal_to_one_process_router_grads_within_bound(world):
    from test_layer import layer64  # the layer in float64 torch autograd
    from conftest import within
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(world, out_dir, target=layer_worker)
        ranks = [torch.load(os.path.join(out_dir, "{}.pt".format(r))) for r in range(world)]
    for router, one_rank in LAYER_CASES:
        cfg, p, x, dy = layer_problem(router, one_rank)
        packed = ops.PackedExperts(*(p[k] for k in ops.BASE_NAMES))
        lora = ops.Lora(*(p[k] for k in ops.LORA_NAMES), alpha=cfg.lora_alpha)
        y, saved = ops.layer_forward(cfg, packed, p["router_w"], p["router_b"], x, p["router_bias"], lora)
        want = ("dx", "router_w", "router_b") + ops.LORA_NAMES + ops.BASE_NAMES
        g = ops.layer_backward(saved, dy, want, dx_dtype=torch.bfloat16)
        bounds = ops.layer_bounds(saved, dy, ("router_w", "router_b"))
        idx, _ = ops.layer_routing(saved)
        kernel = {k: v.bfloat16() if k in ops.LORA_NAMES else v  # the factors as the kernel reads them
                  for k, v in p.items() if v is not None}
        _, _, g64, _ = layer64(cfg, kernel, x, dy, idx)
        case = (router, one_rank)
        if one_rank:  # the other ranks' experts idle: exactly 0
            assert all(torch.all(r[case][0][k] == 0) for r in ranks[:-1] for k in ops.LORA_NAMES + ops.BASE_NAMES), case
        for run in range(2):
            cat = lambda name: torch.cat([r[case][run][name] for r in ranks])
            assert torch.equal(cat("y"), y), case
            assert torch.equal(cat("dx"), g["dx"]), case
            for k in ops.LORA_NAMES + ops.BASE_NAMES:  # base: autograd keeps the weights' dtype, bf16
                assert torch.equal(cat(k), g[k].to(cat(k).dtype)), (case, k)
            for k in ("router_w", "router_b"):
                first = ranks[0][case][0][k]
                assert bool(first.abs().sum() > 0), (case, k)
                assert all(torch.equal(r[case][run][k], first) for r in ranks), (case, k, "ranks or runs differ")
                within("{} {} over {} ranks".format(case, k, world), first, g64[k], bounds[k])
        stepped = [r[router, one_rank, "stepped"] for r in ranks]  # the replicas stay equal
        assert all(torch.equal(t["router_w"], stepped[0]["router_w"]) and torch.equal(t["grad"], stepped[0]["grad"])
                   for t in stepped), case
    assert ranks[-1]["nan"] == ("ContractViolation", "layer.router_linear.finite"), ranks[-1]["nan"]
    assert all(r["nan"][0] == "Error" and "another rank" in r["nan"][1] for r in ranks[:-1])
    mismatch = [r["mismatch"] for r in ranks]
    assert len(set(mismatch)) == 1 and mismatch[0][0] == "InvalidArgument", mismatch
    assert "router parameters" in mismatch[0][1]
    kind = [r["kind"] for r in ranks]
    assert len(set(kind)) == 1 and kind[0][0] == "InvalidArgument", kind
    assert "router 0..1" in kind[0][1] and "router parameter count" in kind[0][1], kind
