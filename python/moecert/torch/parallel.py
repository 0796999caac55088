"""Expert parallelism over torch.distributed: each rank owns a contiguous block
of experts and its own contiguous share of the tokens; (token, slot) rows
travel to their expert's rank and back by all_to_all_single.

Bitwise equal to one process: every expert's rows arrive in global token
order (ranks in order, each rank's rows in token order), each row's GEMM
results do not depend on the other rows of its batch, the experts' gradient
sums run over the same rows in the same order, and the home rank combines y
and dx in slot order from 0 exactly as the one-process op does.
"""
import struct

import torch
import torch.distributed as dist

from ..errors import Error, InvalidArgument
from . import ops, routers
from .functions import EXPERTS
from .ops import BASE_NAMES, LORA_NAMES

ROWS = torch.empty(0, dtype=torch.float32)  # the rows' dx dtype for the backward: fp32, summed at home


def _collective(fn, *args, **kwargs):
    """Runs one torch.distributed collective; its failure (a rank that died, or stalled past the
    process group's timeout) raises moecert.Error naming it, on every rank that was waiting."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise Error("ExpertParallelMoE: {} failed: a rank of the group died, left or stalled past the "
                    "process group's timeout ({})".format(fn.__name__, str(e).splitlines()[0] if str(e) else e)) from e


def _exchange(send, send_counts, recv_counts, group):
    """all_to_all_single of the rows of `send` (bf16 travels as its bytes: gloo has no 16-bit types)."""
    bits = send.dtype == torch.bfloat16
    payload = send.contiguous().view(torch.uint8) if bits else send
    out = payload.new_empty((sum(recv_counts),) + tuple(payload.shape[1:]))
    _collective(dist.all_to_all_single, out, payload.contiguous(), recv_counts, send_counts, group=group)
    return out.view(torch.bfloat16) if bits else out


def _agree(ok, group):
    """Whether every rank's `ok` holds (one all_reduce; every rank learns the same)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    _collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _bits(x):
    """A float's binary64 bits as an int64 (ranks compare floats bitwise)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _disagreement(name, low, high):
    """"name low..high" of a handshake field (floats as their values: alpha, scaling)."""
    if name in ("alpha", "scaling"):
        low, high = (struct.unpack("<d", struct.pack("<q", int(v)))[0] for v in (low, high))
        return "{} {!r}..{!r} (bitwise)".format(name, low, high)
    return "{} {}..{}".format(name, int(low), int(high))


def _extremes(values, group):
    """(the least, the greatest) of each element of `values` (int64) over the group's ranks."""
    low, high = values.clone(), values.clone()
    _collective(dist.all_reduce, low, op=dist.ReduceOp.MIN, group=group)
    _collective(dist.all_reduce, high, op=dist.ReduceOp.MAX, group=group)
    return low, high


def _on_every_rank(step, group, what):
    """Runs step() on this rank, then agrees with the others before any rank goes on to a
    collective: a failure on one rank raises on every rank (the failing rank its own exception,
    the others an Error naming the step) instead of leaving them waiting in an exchange."""
    error = None
    try:
        result = step()
    except Exception as e:  # re-raised below, after the agreement
        error, result = e, None
    if not _agree(error is None, group):
        if error is not None:
            raise error
        raise Error("{}: failed on another rank of the group (its own exception names the clause)".format(what))
    return result


class _Routes:
    """Where this rank's (token, slot) rows go: rows in (destination, token, slot) order."""

    def __init__(self, expert_ids, per_rank, world, group):
        T, K = expert_ids.shape
        flat = expert_ids.reshape(-1).to(torch.int64)
        self.slots = torch.nonzero(flat >= 0).reshape(-1)  # valid (t, j) in token, slot order
        dest = flat[self.slots] // per_rank
        order = torch.sort(dest, stable=True).indices
        self.slots = self.slots[order]
        self.local_ids = (flat[self.slots] - dest[order] * per_rank).to(torch.int32)
        self.tokens = self.slots // K
        self.send_counts = torch.bincount(dest, minlength=world).tolist()
        counts = torch.tensor(self.send_counts, dtype=torch.int64)
        recv = torch.empty_like(counts)
        _collective(dist.all_to_all_single, recv, counts, group=group)
        self.recv_counts = recv.tolist()
        self.T, self.K = T, K

    def there(self, rows, group):
        return _exchange(rows, self.send_counts, self.recv_counts, group)

    def back(self, rows, group):
        return _exchange(rows, self.recv_counts, self.send_counts, group)

    def combine(self, rows, cols):
        """out[t] = sum over t's slots j = 0..K-1 of its rows, fp32 from 0 (the op's own order)."""
        out = torch.zeros(self.T, cols, dtype=torch.float32)
        slot_of = self.slots % self.K
        for j in range(self.K):
            pick = torch.nonzero(slot_of == j).reshape(-1)
            out[self.tokens[pick]] += rows[pick]
        return out


def _experts_forward(module, x, expert_ids, weights, tensors):
    """The experts op (its definition) over the group on this rank's tokens: (y [T, H] fp32, what
    _experts_backward needs); tensors: the six LoRA factors and three base weights (None: not
    trained)."""
    g = module.group
    routes = _Routes(expert_ids, module.per_rank, module.world, g)
    x_in = routes.there(x[routes.tokens], g).contiguous()
    w_in = routes.there(weights.reshape(-1)[routes.slots].reshape(-1, 1), g).contiguous()
    ids_in = routes.there(routes.local_ids.reshape(-1, 1), g).contiguous()
    inputs = (x_in, ids_in, w_in) + tuple(tensors) + (module.alpha, module.packed.key, 0, -1, True)
    outputs = _on_every_rank(lambda: EXPERTS.forward(*inputs), g, "experts.forward_train")
    y = routes.combine(routes.back(outputs[0], g), x.shape[1])
    kept, extras = EXPERTS.keep(inputs, outputs)
    wanted = [True, True] + [t is not None for t in tensors]
    return y, (routes, (kept[0], ROWS) + kept[2:], extras, wanted)


def _experts_backward(module, state, dy):
    """(dx [T, H] fp32, dL/dweights [T, K], the local experts' six LoRA and three base-weight
    gradients, Nones where not trained)."""
    routes, kept, extras, wanted = state
    g = module.group
    dy = dy.to(torch.float32).contiguous()
    dy_in = routes.there(dy[routes.tokens], g).contiguous()
    grads = _on_every_rank(lambda: EXPERTS.backward(*kept, dy_in, *extras, wanted), g, "experts.backward")
    dx = routes.combine(routes.back(grads[0], g), dy.shape[1])
    dw_rows = routes.back(grads[1], g).reshape(-1)
    dweights = torch.zeros(routes.T * routes.K, dtype=torch.float32)
    dweights[routes.slots] = dw_rows
    return dx, dweights.reshape(routes.T, routes.K), tuple(t if w else None for t, w in zip(grads[2:], wanted[2:]))


class _ExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down, expert_ids,
                module):
        _on_every_rank(lambda: module.check_inputs(x, expert_ids, weights), module.group, "inputs")
        y, ctx.state = _experts_forward(module, x, expert_ids, weights,
                                        (a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down))
        ctx.module = module
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dweights, expert_grads = _experts_backward(ctx.module, ctx.state, dy)
        return (dx, dweights) + expert_grads + (None, None)


class ExpertParallelMoE(torch.nn.Module):
    """The experts op on the caller's routing, its experts spread over a torch.distributed group.

    num_experts E (divisible by the group's size P): rank r owns experts [r E/P, (r+1) E/P) with
    their base weights w_gate, w_up [E/P, I, H], w_down [E/P, H, I] bf16 (packed once) and,
    with rank > 0, LoRA factors of its experts as fp32 parameters (b_* from 0). forward(x [T, H]
    bf16, expert_ids [T, K] global ids, weights [T, K] fp32) -> y [T, H] fp32 for this rank's
    tokens; autograd gives dx, dL/dweights and the local experts' LoRA gradients, and with
    train_base the base weights' (then parameters of this module, packed again from their
    current values at every forward). Without train_base the pack is the base weights' only
    storage. Every rank calls forward and backward together (collectives)."""

    def __init__(self, num_experts, w_gate, w_up, w_down, rank=0, alpha=None, group=None, train_base=False):
        super().__init__()
        self.train_base = bool(train_base)
        self.group = group
        self.world, self.rank_id = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.world:
            raise InvalidArgument("num_experts {}: not divisible by the group's {} ranks".format(
                num_experts, self.world))
        self.num_experts, self.per_rank = num_experts, num_experts // self.world
        if w_gate.shape[0] != self.per_rank:
            raise InvalidArgument("w_gate: {} experts, this rank owns {}".format(w_gate.shape[0], self.per_rank))
        self.first = self.rank_id * self.per_rank
        if self.train_base:
            w_gate, w_up, w_down = (torch.nn.Parameter(w.detach().clone()) for w in (w_gate, w_up, w_down))
            self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.packed = ops.PackedExperts(w_gate, w_up, w_down)
        E, I, H = w_gate.shape
        self.hidden, self.alpha = H, float(alpha if alpha is not None else 2 * rank)
        if rank:
            for name, shape in ops._lora_shapes(E, H, I, rank).items():
                init = torch.zeros(shape) if name.startswith("b_") else (torch.rand(shape) * 2 - 1) / shape[2] ** 0.5
                setattr(self, name, torch.nn.Parameter(init))
        self.lora_rank = rank
        self._handshake(I)

    def _handshake(self, inter):
        """Every rank holds the same shape of the layer (E, H, I, r, alpha, group size) and
        its own block of experts, or every rank raises the same error before any exchange."""
        mine = torch.tensor([self.num_experts, self.hidden, inter, self.lora_rank, _bits(self.alpha),
                             self.world], dtype=torch.int64)
        low, high = _extremes(mine, self.group)
        if not torch.equal(low, high):
            names = ("num_experts", "hidden", "inter", "rank", "alpha", "group size")
            diff = [_disagreement(n, a, b) for n, a, b in zip(names, low, high) if a != b]
            raise InvalidArgument("ExpertParallelMoE: the ranks disagree on " + ", ".join(diff))

    def check_inputs(self, x, expert_ids, weights):
        """This rank's inputs, checked before any exchange: shapes, dtypes, ids in range."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != torch.bfloat16:
            raise InvalidArgument("x: expected a [T, {}] bfloat16 tensor".format(self.hidden))
        if expert_ids.shape != weights.shape or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
            raise InvalidArgument("expert_ids {} and weights {}: expected [T, K] each, T = {}".format(
                list(expert_ids.shape), list(weights.shape), x.shape[0]))
        bad = (expert_ids < -1) | (expert_ids >= self.num_experts)
        if bool(bad.any()):
            t, j = (int(v) for v in torch.nonzero(bad)[0])
            raise InvalidArgument("expert_ids[{}, {}] = {}: expected -1 <= id < {}".format(
                t, j, int(expert_ids[t, j]), self.num_experts))

    def factors(self):
        """The LoRA factors and the trained base weights as autograd inputs (None: absent); with
        train_base, the base weights' current values packed."""
        lora = tuple(getattr(self, n) for n in LORA_NAMES) if self.lora_rank else (None,) * 6
        base = tuple(getattr(self, n) for n in BASE_NAMES) if self.train_base else (None,) * 3
        if self.train_base:
            with torch.no_grad():
                packed = ops.PackedExperts(*(t.detach().to(torch.bfloat16).contiguous() for t in base))
            packed.adopt_pools(self.packed)
            self.packed = packed
        return lora + base

    def forward(self, x, expert_ids, weights):
        return _ExpertParallel.apply(x, weights, *self.factors(), expert_ids, self)


def _sum_over_ranks(t, group, world):
    """The sum of every rank's t, added in rank order (rank 0's, then + rank 1's, ...): the same
    bits on every rank, in every run (an all_reduce leaves the order to the backend)."""
    flat = t.reshape(-1)
    parts = torch.empty(world * flat.numel(), dtype=flat.dtype)
    _collective(dist.all_to_all_single, parts, flat.repeat(world), group=group)
    parts = parts.view(world, -1)
    total = parts[0].clone()
    for p in range(1, world):
        total += parts[p]
    return total.view(t.shape)


class _ExpertParallelLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, router_w, router_b, a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down,
                module):
        cfg, g = module.config, module.group
        z = _on_every_rank(lambda: module.logits(x, router_w, router_b), g, "layer.router_linear")
        (idx, w), ctx.route = _on_every_rank(lambda: routers.layer_route(cfg, z, module.router_bias), g, "router")
        tensors = (a_gate, b_gate, a_up, b_up, a_down, b_down, w_gate, w_up, w_down)
        y, ctx.state = _experts_forward(module.experts, x, idx, w, tensors)
        ctx.module = module
        ctx.save_for_backward(x, router_w)
        return y

    @staticmethod
    def backward(ctx, dy):
        m = ctx.module
        x, router_w = ctx.saved_tensors
        dx, dweights, expert_grads = _experts_backward(m.experts, ctx.state, dy)
        dz = _on_every_rank(lambda: routers.layer_route_backward(m.config, ctx.route, dweights), m.group,
                            "router backward")
        grads = _on_every_rank(lambda: ops.router_linear_backward(x, router_w, dz, dx=dx), m.group,
                               "layer.router_linear backward")
        R, H = router_w.shape
        both = _sum_over_ranks(torch.cat([grads["router_w"].reshape(-1), grads["router_b"]]), m.group, m.world)
        return (dx, both[:R * H].view(R, H), both[R * H:]) + expert_grads + (None,)


class ExpertParallelMoELayer(torch.nn.Module):
    """moecert's MoE layer (MoELayer's maths and bits: router linear, router, SwiGLU experts with
    LoRA) with its experts spread over a torch.distributed group as ExpertParallelMoE spreads them.

    config: ops.LayerConfig (E divisible by the group's size). Rank r holds experts
    [r E/P, (r+1) E/P): w_gate, w_up [E/P, I, H], w_down [E/P, H, I] bf16, and their LoRA factors
    (`self.experts.a_gate` ..., fp32, b_* from 0). The router parameters router_w [R, H], router_b
    [R] fp32 (and router_bias [E] for sigmoid_topk) are data-parallel: every rank holds the same
    (checked at construction) and routes its own tokens; their gradients are the sum over the
    ranks' tokens, added in rank order, the same bits on every rank. train_base: the base weights
    are trained too (`self.experts.w_gate` ..., packed at every forward). forward(x
    [T, H] bf16) -> y [T, H] fp32 for this rank's tokens; every rank calls forward and backward
    together."""

    def __init__(self, config, w_gate, w_up, w_down, router_w, router_b, router_bias=None, group=None,
                 train_base=False):
        super().__init__()
        config.struct()  # validates
        self.config, self.group = config, group
        self.experts = ExpertParallelMoE(config.experts, w_gate, w_up, w_down, rank=config.lora_rank,
                                         alpha=config.lora_alpha, group=group, train_base=train_base)
        self.world = self.experts.world
        R, H = config.router_outputs(), config.hidden
        ops.check(router_w, "router_w", ops.F32, (R, H))
        ops.check(router_b, "router_b", ops.F32, (R,))
        self.router_w = torch.nn.Parameter(router_w.detach().clone())
        self.router_b = torch.nn.Parameter(router_b.detach().clone())
        if config.router == "sigmoid_topk":
            ops.check(router_bias, "router_bias", ops.F32, (config.experts,))
            router_bias = router_bias.detach().clone()
        else:
            router_bias = None
        self.register_buffer("router_bias", router_bias)
        self._handshake()

    def _handshake(self):
        """Every rank holds the same router (kind, K, its parameters bit for bit), or every rank
        raises the same error before any exchange."""
        # Fixed-length fields first (the same tensor length on every rank whatever they hold),
        # then, where they agree, the parameters' bits (whose length they fix): any
        # disagreement is the same error on every rank, never a collective of mismatched sizes.
        c = self.config
        params = [self.router_w, self.router_b] + ([self.router_bias] if self.router_bias is not None else [])
        fields = torch.tensor([ops.ROUTERS.index(c.router), c.topk, int(c.renormalize), c.groups, c.topk_group,
                               _bits(c.scaling), sum(p.numel() for p in params)], dtype=torch.int64)
        low, high = _extremes(fields, self.group)
        names = ("router", "topk", "renormalize", "groups", "topk_group", "scaling", "router parameter count")
        diff = [_disagreement(n, a, b) for n, a, b in zip(names, low, high) if a != b]
        if not diff:
            bits = torch.cat([p.detach().reshape(-1).view(torch.int32).to(torch.int64) for p in params])
            low, high = _extremes(bits, self.group)
            if not torch.equal(low, high):
                diff.append("the router parameters (router_w, router_b, router_bias) differ")
        if diff:
            raise InvalidArgument("ExpertParallelMoELayer: the ranks disagree on " + ", ".join(diff))

    def logits(self, x, router_w, router_b):
        """This rank's router logits z [T, R] (x checked first)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.config.hidden or \
                x.dtype != torch.bfloat16:
            raise InvalidArgument("x: expected a [T, {}] bfloat16 tensor".format(self.config.hidden))
        return ops.router_linear_forward(x, router_w.detach(), router_b.detach())

    def forward(self, x):
        return _ExpertParallelLayer.apply(x, self.router_w, self.router_b, *self.experts.factors(), self)
