"""Tiny Hugging Face models built from configs (random weights, nothing downloaded), their
batches and losses, for the tests of ``roundpipe`` on real model code."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers", reason='Hugging Face tests need the test extra: pip install -e ".[test]"')

VOCAB = 96
LAYERS = 2

# Causal LMs share one batch layout; BERT is a masked LM.
CAUSAL = ["llama", "qwen3", "gpt2", "qwen3_moe"]
ALL = CAUSAL + ["bert"]


def config(name: str, **overrides: Any) -> Any:
    """A tiny config of model family ``name`` (hidden 32, 2 layers, vocab 96)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                  num_attention_heads=4)
    if name == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common)
    elif name == "qwen3":
        cfg = transformers.Qwen3Config(intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                       **common)
    elif name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                          num_experts=4, num_experts_per_tok=2,
                                          num_key_value_heads=2, head_dim=8, **common)
    elif name == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, num_key_value_heads=2, **common)
    elif name == "phimoe":  # a custom autograd.Function in its router; random routing
        cfg = transformers.PhimoeConfig(intermediate_size=64, num_local_experts=4,
                                        num_experts_per_tok=2, num_key_value_heads=2, **common)
    elif name == "recurrent_gemma":  # a custom autograd.Function in its recurrent block
        cfg = transformers.RecurrentGemmaConfig(
            intermediate_size=64, num_key_value_heads=2, head_dim=8, lru_width=32,
            attention_window_size=8, block_types=["recurrent", "attention"], **common)
    elif name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
    elif name == "bert":
        cfg = transformers.BertConfig(intermediate_size=64, max_position_embeddings=64,
                                      **common)
    else:
        raise KeyError(name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
          **overrides: Any) -> torch.nn.Module:
    """The model (in training mode, dropout off so eager and pipe draw nothing)."""
    cfg = config(name, **overrides)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
                "attention_probs_dropout_prob", "attention_dropout"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    torch.manual_seed(seed)
    auto = (transformers.AutoModelForMaskedLM if name == "bert"
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(cfg).to(dtype)
    model.train()
    return model


def batch(name: str, batch_size: int = 6, seq: int = 10, seed: int = 1
          ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(inputs, labels)``: token ids with left padding in two rows, and the labels the
    model's own loss expects (-100 where no loss is taken)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[batch_size - 2, :5] = 0
    if name == "bert":
        labels = torch.full_like(ids, -100)
        picked = torch.rand(ids.shape, generator=g) < 0.3
        picked[:, 0] = True  # every row has a target
        labels[picked] = ids[picked]
        ids = ids.masked_fill(picked, 3)  # the "[MASK]" token
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def inner_loss(out: Any, _: Any) -> torch.Tensor:
    """The loss computed inside the model (``labels=`` passed as an input)."""
    return out.loss


def outer_loss(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A user loss on the logits, equal in meaning to the model's own."""
    def causal(out: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               labels[:, 1:].reshape(-1), ignore_index=-100)

    def masked(out: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = out.logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100)

    return masked if name == "bert" else causal


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (0 for two zero tensors)."""
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() / scale


def decoder_layers(model: torch.nn.Module) -> list[str]:
    """Paths of the repeated decoder/encoder layers, found without model-specific names:
    children of the ModuleList holding ``num_hidden_layers`` modules."""
    n = model.config.num_hidden_layers
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return [f"{path}.{i}" for i in range(n)]
    raise AssertionError("no ModuleList of num_hidden_layers modules")
