"""Random PEFT LoRA adapters for tests, made with peft itself (so the files are PEFT's own format)."""

from __future__ import annotations

import copy

import torch


def make_adapter(base: torch.nn.Module, folder, rank: int, alpha: int, targets: list[str], *, rslora: bool = False,
                 seed: int = 0, scale: float = 1.0):  # fmt: skip
    """A random adapter for `base` saved to `folder`; returns the peft model (the reference).
    `scale` shrinks lora_B: peft's random init moves a real model's logits far enough that its
    greedy text is noise, and near-ties make noise a poor exactness check."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                             use_rslora=rslora, lora_dropout=0.0)  # fmt: skip
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.save_pretrained(folder)
    return model
