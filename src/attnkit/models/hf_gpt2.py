"""Weights between :class:`attnkit.models.GPT` and Hugging Face's ``GPT2LMHeadModel``.

Only state dicts cross this boundary: nothing here imports ``transformers`` except
:func:`config_from_hf` (which reads an object's attributes). Differences handled:

- HF GPT-2 uses ``Conv1D`` layers whose weights are ``(in, out)``: transposed vs ``nn.Linear``.
- ``attn.c_attn`` packs W_query, W_key, W_value side by side: ``(d, 3d)``.
- ``lm_head`` is tied to ``wte`` in HF; attnkit keeps a separate ``out_head`` (copied).
- HF's ``gelu_new`` is the tanh GELU attnkit's :class:`~attnkit.models.gpt.FeedForward` uses.
"""

from __future__ import annotations

from typing import Any

import torch

from attnkit.models.gpt import GPT, GPTConfig

__all__ = ["config_from_hf", "export_hf_gpt2_state_dict", "load_hf_gpt2_state_dict"]


def config_from_hf(hf_config: Any) -> GPTConfig:
    """Return the :class:`GPTConfig` matching a ``transformers.GPT2Config``."""
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        context_length=hf_config.n_positions,
        emb_dim=hf_config.n_embd,
        n_layers=hf_config.n_layer,
        n_heads=hf_config.n_head,
        drop_rate=0.0,
        qkv_bias=True,
    )


def _check_compatible(cfg: GPTConfig) -> None:
    windows = cfg.windows()
    if (
        cfg.rope
        or any(w is not None for w in windows)
        or cfg.n_kv_heads not in (None, cfg.n_heads)
        or cfg.attn_sinks
        or cfg.mla_kv_rank is not None
    ):
        raise ValueError(
            "GPT-2 has learned positions, full attention in every layer, no GQA, sinks or "
            f"MLA: got rope={cfg.rope}, windows={windows}, n_kv_heads={cfg.n_kv_heads}, "
            f"attn_sinks={cfg.attn_sinks}, mla_kv_rank={cfg.mla_kv_rank}"
        )
    if not cfg.qkv_bias:
        raise ValueError("GPT-2 has qkv biases: build the GPT with qkv_bias=True")


def load_hf_gpt2_state_dict(model: GPT, hf_state_dict: dict[str, torch.Tensor]) -> GPT:
    """Copy a ``GPT2LMHeadModel`` state dict into ``model`` (in place) and return it.

    Raises:
        ValueError: a model GPT-2 cannot describe, or missing / mis-shaped tensors.
    """
    _check_compatible(model.cfg)
    sd = {k.removeprefix("transformer."): v for k, v in hf_state_dict.items()}
    d = model.cfg.emb_dim

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise ValueError(f"HF GPT-2 state dict lacks {name!r}")
        return sd[name]

    ours: dict[str, torch.Tensor] = {
        "tok_emb.weight": get("wte.weight"),
        "pos_emb.weight": get("wpe.weight"),
        "final_norm.weight": get("ln_f.weight"),
        "final_norm.bias": get("ln_f.bias"),
        "out_head.weight": sd.get("lm_head.weight", get("wte.weight")),
    }
    for i in range(model.cfg.n_layers):
        h, o = f"h.{i}.", f"trf_blocks.{i}."
        q_w, k_w, v_w = get(h + "attn.c_attn.weight").split(d, dim=1)  # 3 x (d, d), Conv1D
        q_b, k_b, v_b = get(h + "attn.c_attn.bias").split(d)
        for name, w, b in (("W_query", q_w, q_b), ("W_key", k_w, k_b), ("W_value", v_w, v_b)):
            ours[o + f"att.{name}.weight"] = w.t()
            ours[o + f"att.{name}.bias"] = b
        ours[o + "att.out_proj.weight"] = get(h + "attn.c_proj.weight").t()
        ours[o + "att.out_proj.bias"] = get(h + "attn.c_proj.bias")
        ours[o + "ff.layers.0.weight"] = get(h + "mlp.c_fc.weight").t()
        ours[o + "ff.layers.0.bias"] = get(h + "mlp.c_fc.bias")
        ours[o + "ff.layers.2.weight"] = get(h + "mlp.c_proj.weight").t()
        ours[o + "ff.layers.2.bias"] = get(h + "mlp.c_proj.bias")
        for n in ("1", "2"):
            ours[o + f"norm{n}.weight"] = get(h + f"ln_{n}.weight")
            ours[o + f"norm{n}.bias"] = get(h + f"ln_{n}.bias")
    target = model.state_dict()
    for name, tensor in ours.items():
        if target[name].shape != tensor.shape:
            raise ValueError(
                f"{name}: HF tensor has shape {tuple(tensor.shape)}, model expects "
                f"{tuple(target[name].shape)}"
            )
    model.load_state_dict({k: v.contiguous() for k, v in ours.items()}, strict=True)
    return model


def export_hf_gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Return ``model``'s weights as a ``GPT2LMHeadModel`` state dict (``lm_head`` included)."""
    _check_compatible(model.cfg)
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["final_norm.weight"],
        "transformer.ln_f.bias": sd["final_norm.bias"],
        "lm_head.weight": sd["out_head.weight"],
    }
    for i in range(model.cfg.n_layers):
        h, o = f"transformer.h.{i}.", f"trf_blocks.{i}."
        att = o + "att."
        out[h + "attn.c_attn.weight"] = torch.cat(
            [sd[att + f"{n}.weight"] for n in ("W_query", "W_key", "W_value")]
        ).t()  # (d, 3d)
        out[h + "attn.c_attn.bias"] = torch.cat(
            [sd[att + f"{n}.bias"] for n in ("W_query", "W_key", "W_value")]
        )
        out[h + "attn.c_proj.weight"] = sd[att + "out_proj.weight"].t()
        out[h + "attn.c_proj.bias"] = sd[att + "out_proj.bias"]
        out[h + "mlp.c_fc.weight"] = sd[o + "ff.layers.0.weight"].t()
        out[h + "mlp.c_fc.bias"] = sd[o + "ff.layers.0.bias"]
        out[h + "mlp.c_proj.weight"] = sd[o + "ff.layers.2.weight"].t()
        out[h + "mlp.c_proj.bias"] = sd[o + "ff.layers.2.bias"]
        for n in ("1", "2"):
            out[h + f"ln_{n}.weight"] = sd[o + f"norm{n}.weight"]
            out[h + f"ln_{n}.bias"] = sd[o + f"norm{n}.bias"]
    return {k: v.contiguous() for k, v in out.items()}
