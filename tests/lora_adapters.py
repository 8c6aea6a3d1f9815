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


def write_random_adapter(folder, arch, rank: int, seed: int = 0) -> str:
    """A random LoRA adapter in PEFT's file format on q_proj and v_proj, written without peft or a
    transformers model (for tests where the adapter's weights are not the point); returns its path."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from kvharbor.engine.lora.adapter import sub_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = sub_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, shapes[module].d_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(shapes[module].d_out, rank, generator=gen) * 0.05
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)
