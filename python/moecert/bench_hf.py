"""Whole-model LoRA fine-tuning with moecert.hf against transformers + PEFT, in one process.

    python3 -m moecert.bench_hf [--families qwen3_moe deepseek_v3 ...] [--steps 20]
                                [--tokens 48 1024] [--reps 5] [--json FILE] [--skip-speed]

Needs transformers 5 and peft (target_parameters). Models are built from configurations with
random weights (no download), their weights rounded to bf16 values so that every run starts
from the same base; the LoRA adapter (rank 8 on gate_up_proj and down_proj, alpha 16) starts as
moecert.hf initialises it (A uniform, B = 0), A rounded to bf16 values, and reaches the other
runs through PEFT's adapter format (save_adapter -> PeftModel.from_pretrained).

accuracy  per family, a small model fine-tuned for --steps AdamW steps (lr 1e-3, batch 4 x 32
          tokens, the same batches) three ways: the model in float64 with PEFT (the reference),
          the model in bf16 with moecert.hf, the model in bf16 with PEFT. Reported: each step's
          loss difference from the float64 run, and the final adapters' relative Frobenius error
          against the float64 run's (per factor tensor; the largest and the median).
speed     per family at E64 H1024 I384 K8 (2 decoder layers), the time of a training step
          (forward, backward, AdamW step on the LoRA factors) at T tokens: moecert.hf,
          transformers' eager experts + PEFT, and its grouped_mm experts + PEFT, in alternation
          (moecert, eager, grouped, moecert, ...), each timed after 20 ms of untimed steps of the
          same side; medians, tokens/s and the medians of the paired ratios.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

import moecert
import moecert.hf as hf
from moecert.bench import settled

RANK, ALPHA, LR = 8, 16, 1e-3
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
LARGE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=128)
# multi-head latent attention: as many key/value heads as heads; the rotary part is head_dim wide
MLA = {False: dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
       True: dict(kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128)}
FAMILIES = {  # (config, model, {size: experts' configuration})
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  lambda e, i: dict(num_experts=e, num_experts_per_tok=8 if e > 8 else 2, moe_intermediate_size=i,
                                    norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  lambda e, i: dict(num_experts=e, num_experts_per_tok=8 if e > 8 else 2, moe_intermediate_size=i,
                                    shared_expert_intermediate_size=2 * i, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                lambda e, i: dict(num_local_experts=e, num_experts_per_tok=8 if e > 8 else 2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", lambda e, i: dict(num_experts=e, num_experts_per_tok=8 if e > 8 else 2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    lambda e, i: dict(n_routed_experts=e, num_experts_per_tok=8 if e > 8 else 2, moe_intermediate_size=i,
                                      n_group=4 if e > 8 else 2, topk_group=2 if e > 8 else 1, first_k_dense_replace=0,
                                      n_shared_experts=1)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    lambda e, i: dict(n_routed_experts=e, num_experts_per_tok=8 if e > 8 else 2,
                                      moe_intermediate_size=i, first_k_dense_replace=0, n_shared_experts=1)),
}


def build(family, large, seed=0):
    """A fp32 model of the family with random weights rounded to bf16 values."""
    import transformers
    cfg_name, model_name, experts = FAMILIES[family]
    dims = dict(LARGE if large else SMALL, **experts(64 if large else 8, 384 if large else 32))
    if family.startswith("deepseek"):
        dims.update(MLA[large], num_key_value_heads=dims["num_attention_heads"],
                    head_dim=MLA[large]["qk_rope_head_dim"])
    if family == "mixtral" and large:
        dims["intermediate_size"] = 384
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**dims))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model.train()


def initial_adapter(family, large, directory):
    """moecert.hf's initial adapter of the family's model (A rounded to bf16 values), saved in
    PEFT's format."""
    model = build(family, large)
    torch.manual_seed(1)
    hf.patch(model, rank=RANK, alpha=ALPHA)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(p.bfloat16().float())
    hf.save_adapter(model, directory)


def with_moecert(family, large, adapter):
    model = build(family, large).to(torch.bfloat16)
    hf.patch(model)
    hf.load_adapter(model, adapter)
    return model


def with_peft(family, large, adapter, dtype, experts="eager"):
    import peft
    model = build(family, large).to(dtype)
    model.set_experts_implementation(experts)  # transformers' ExpertsInterface (its default may be grouped_mm)
    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def batches(steps, vocab, batch=4, seq=32, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def train(model, data):
    """Losses of AdamW steps on `data` (the labels are the inputs)."""
    opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=0.0)
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def adapters_of(model, directory):
    """The PEFT-format adapter tensors of a trained model (moecert.hf's or PEFT's), as float64."""
    import safetensors.torch
    if isinstance(model, torch.nn.Module) and any(isinstance(m, hf.Experts) for m in model.modules()):
        hf.save_adapter(model, directory)
    else:
        model.save_pretrained(directory)
    return {k: v.double() for k, v in safetensors.torch.load_file(os.path.join(directory, hf.adapters.WEIGHTS)).items()}


def relative_errors(ours, reference):
    return sorted(float((ours[k] - v).norm() / v.norm()) for k, v in reference.items())


def accuracy(family, steps):
    with tempfile.TemporaryDirectory() as tmp:
        start = os.path.join(tmp, "start")
        initial_adapter(family, False, start)
        data = batches(steps, SMALL["vocab_size"])
        runs = {"float64": with_peft(family, False, start, torch.float64),
                "moecert_bf16": with_moecert(family, False, start),
                "peft_bf16": with_peft(family, False, start, torch.bfloat16)}
        losses = {name: train(model, data) for name, model in runs.items()}
        final = {name: adapters_of(model, os.path.join(tmp, name)) for name, model in runs.items()}
    out = {"family": family, "steps": steps, "losses": losses}
    for name in ("moecert_bf16", "peft_bf16"):
        diffs = [abs(a - b) for a, b in zip(losses[name], losses["float64"])]
        errs = relative_errors(final[name], final["float64"])
        out[name] = {"loss_diff_max": max(diffs), "loss_diff_last": diffs[-1], "adapter_rel_err_max": errs[-1],
                     "adapter_rel_err_median": statistics.median(errs)}
    return out


def stepper(model, ids):
    opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=0.0)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def speed(family, tokens, reps):
    with tempfile.TemporaryDirectory() as tmp:
        start = os.path.join(tmp, "start")
        initial_adapter(family, True, start)
        sides = {"moecert": with_moecert(family, True, start),
                 "eager": with_peft(family, True, start, torch.bfloat16)}
        try:
            sides["grouped_mm"] = with_peft(family, True, start, torch.bfloat16, "grouped_mm")
        except Exception as e:  # an older transformers or torch without grouped_mm
            print("# {}: grouped_mm experts unavailable: {}".format(family, e), file=sys.stderr)
    out = []
    for T in tokens:
        batch = 1 if T < 256 else T // 256
        ids = torch.randint(0, LARGE["vocab_size"], (batch, T // batch), generator=torch.Generator().manual_seed(3))
        steps = {name: stepper(model, ids) for name, model in sides.items()}
        times = {name: [] for name in steps}
        for _ in range(reps):
            for name, step in steps.items():
                times[name].append(settled(step))
        row = {"family": family, "tokens": T, "median_ms": {n: statistics.median(t) for n, t in times.items()},
               "runs_ms": times}
        row["tokens_per_s"] = {n: T * 1e3 / ms for n, ms in row["median_ms"].items()}
        row["paired_speedup"] = {n: statistics.median([b / a for a, b in zip(times["moecert"], t)])
                                 for n, t in times.items() if n != "moecert"}
        out.append(row)
        print("{:<12} T={:<5} ".format(family, T) + "  ".join(
            "{} {:.1f} ms ({:.0f} tok/s)".format(n, ms, row["tokens_per_s"][n]) for n, ms in row["median_ms"].items())
            + "  moecert paired speedup: " + ", ".join("{:.2f}x vs {}".format(v, n)
                                                       for n, v in row["paired_speedup"].items()), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m moecert.bench_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    ap.add_argument("--speed-families", nargs="+", choices=sorted(FAMILIES), default=["deepseek_v3", "qwen3_moe"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="+", default=[48, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import peft
    import transformers
    env = {"moecert": moecert.build_info(), "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__, "python": sys.version.split()[0], "torch_threads": torch.get_num_threads(),
           "moecert_threads": moecert.num_threads(), "isa": moecert.default_isa(),
           "contract_level": moecert.contract_level(), "rank": RANK, "alpha": ALPHA,
           "reps": args.reps}
    print("# " + " ".join("{}={}".format(k, v) for k, v in env.items()), flush=True)
    results = {"accuracy": [], "speed": []}
    for family in args.families:
        r = accuracy(family, args.steps)
        results["accuracy"].append(r)
        print("{:<12} {} steps vs float64: ".format(family, args.steps) + "; ".join(
            "{}: loss diff max {:.2e} last {:.2e}, adapters rel err max {:.2e} median {:.2e}".format(
                n, r[n]["loss_diff_max"], r[n]["loss_diff_last"], r[n]["adapter_rel_err_max"],
                r[n]["adapter_rel_err_median"]) for n in ("moecert_bf16", "peft_bf16")), flush=True)
    if not args.skip_speed:
        for family in args.speed_families:
            results["speed"] += speed(family, args.tokens, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "moecert-hf-bench/1", "environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
