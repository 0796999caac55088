"""A LoRA training step through moecert's MoE layer in PyTorch (README)."""
import torch
import moecert
import moecert.torch as mt

torch.manual_seed(0)
layer = mt.MoELayer(experts=8, hidden=256, inter=512, topk=2, rank=8, max_tokens=64)
opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=1e-2)  # router + LoRA
x, target = torch.randn(64, 256), torch.randn(64, 256)  # x rounded to bf16 inside; y in x's dtype
moecert.set_contract_level("check")  # a NaN or a bad index raises moecert.ContractViolation
losses = []
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(layer(x), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("loss per step:", " ".join("{:.4f}".format(v) for v in losses))
assert losses[-1] < losses[0], losses
