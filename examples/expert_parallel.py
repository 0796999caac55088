"""moecert's MoE layer over 2 processes (gloo on CPU): each rank owns half the
experts and its own tokens; a few LoRA training steps.

    /usr/bin/python3 examples/expert_parallel.py
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

E, H, I, K, RANK, T = 8, 64, 128, 2, 4, 32


def train(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from moecert.torch import ops
    from moecert.torch.parallel import ExpertParallelMoELayer
    g = torch.Generator().manual_seed(0)  # the same full weights everywhere; each rank keeps its block
    w_gate, w_up = (torch.randn(E, I, H, generator=g) * H ** -0.5).bfloat16(), (torch.randn(E, I, H, generator=g) * H ** -0.5).bfloat16()
    w_down = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    mine = slice(rank * E // world, (rank + 1) * E // world)
    cfg = ops.LayerConfig(E, H, I, K, RANK, 8.0, max_tokens=T)
    layer = ExpertParallelMoELayer(cfg, w_gate[mine].contiguous(), w_up[mine].contiguous(), w_down[mine].contiguous(),
                                   torch.randn(E, H, generator=g) * H ** -0.5, torch.zeros(E))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)  # router (data-parallel) + this rank's LoRA factors
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1 + rank)).bfloat16()  # this rank's tokens
    for step in range(3):
        opt.zero_grad()
        loss = layer(x).pow(2).mean()
        loss.backward()
        opt.step()
        if rank == 0:
            print("step {} loss on rank 0: {:.4f}".format(step, loss.item()))
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port on this host for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(s.getsockname()[1])
    mp.spawn(train, args=(2,), nprocs=2)
