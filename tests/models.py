"""Small models covering what the compiler must handle.  Each factory returns
``(model, example_args, example_kwargs)``; models are built in float32 on the CPU."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


# --- GPT: tied embeddings, kwargs (attention mask), dict output, dropout ----------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 4, heads: int = 2,
                 max_len: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(d, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
        for block in self.h:
            x = block(x, mask)
        return {"logits": self.head(self.ln_f(x)), "hidden": x}


def gpt(dropout: float = 0.0, layers: int = 4, batch: int = 4, seq: int = 8):
    torch.manual_seed(0)
    model = GPT(layers=layers, dropout=dropout)
    idx = torch.randint(0, 64, (batch, seq))
    mask = torch.ones(batch, seq)
    mask[0, -2:] = 0
    return model, (idx,), {"attention_mask": mask}


# --- MLP ------------------------------------------------------------------------------

def mlp(batch: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(batch, 16),), {}


# --- small conv net -------------------------------------------------------------------

class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x)) + x
        return self.fc(self.pool(x).flatten(1))


def convnet(batch: int = 4):
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(batch, 3, 16, 16),), {}


# --- blocks nested two levels deep: stages[i].blocks[j] ---------------------------------

class ResBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class NestedStage(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class Nested(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.encoder = nn.Module()
        self.encoder.stages = nn.ModuleList([NestedStage(d, 3), NestedStage(d, 2)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for stage in self.encoder.stages:
            x = stage(x)
        return self.out(x)


def nested(batch: int = 6):
    torch.manual_seed(0)
    return Nested(), (torch.randn(batch, 8),), {}


# --- buffers: BatchNorm ---------------------------------------------------------------

class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12),
                                                    nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        return self.head(self.layers(x))


def bnnet(batch: int = 8):
    torch.manual_seed(0)
    return BNNet(), (torch.randn(batch, 12),), {}


# --- a shape-dependent Python branch ----------------------------------------------------

class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(8) for _ in range(3)])
        self.short = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        if x.shape[-1] == 8:  # specialised by tracing: always true for this model
            x = self.short(x)
        for b in self.blocks:
            x = b(x)
        if x.shape[0] > 1000:
            x = x * 0
        return self.head(x)


def branchy(batch: int = 4):
    torch.manual_seed(0)
    return Branchy(), (torch.randn(batch, 8),), {}


# --- a dataclass output and a tuple output ----------------------------------------------

@dataclasses.dataclass
class RegOut:
    pred: torch.Tensor
    features: torch.Tensor


class DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(8) for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x, *, scale: float = 1.0):
        for b in self.blocks:
            x = b(x)
        return RegOut(self.head(x) * scale, x)


def dataclass_net(batch: int = 4):
    torch.manual_seed(0)
    return DataclassNet(), (torch.randn(batch, 8),), {"scale": 2.0}


# --- data-dependent control flow: export fails, torch.fx with leaf blocks works ----------

class Gate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: export cannot trace this
            return torch.relu(self.fc(x))
        return self.fc(x)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Gate(8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def data_dependent(batch: int = 4):
    torch.manual_seed(0)
    return DataDependent(), (torch.randn(batch, 8),), {}


class Untraceable(nn.Module):
    """Data-dependent control flow in the top-level forward: no tracer can handle it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y * 2
        return y


def untraceable():
    torch.manual_seed(0)
    return Untraceable(), (torch.randn(3, 4),), {}


# --- export fails inside a block, torch.fx at the top: leaf modules -----------------------

class Router(nn.Module):
    """Sends each row to one of two experts: a Python loop over data-dependent indices."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 2)
        self.experts = nn.Parameter(torch.randn(2, d, d) / d ** 0.5)  # stacked, as in HF

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in choice.unique():  # data-dependent: export cannot trace this loop
            rows = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, x[rows] @ self.experts[e])
        return x + out


class Routed(nn.Module):
    """Export fails inside ``Router``; torch.fx fails on the shape test in ``forward``."""

    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Router(d) for _ in range(layers)])
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        if x.shape[-1] > 4:  # a shape test: export specialises it, torch.fx cannot
            x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def routed(batch: int = 6):
    torch.manual_seed(0)
    return Routed(), (torch.randn(batch, 8),), {}


class ListMoE(nn.Module):
    """Top-1 mixture of experts kept in an ``nn.ModuleList`` (the experts hold most of the
    layer's parameters), looping over the experts that received rows."""

    def __init__(self, d: int, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(-1)
            if rows.numel() == 0:  # data-dependent
                continue
            out = out.index_add(0, rows, expert(x[rows]))
        return out


class MoELayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = ListMoE(d)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MoENet(nn.Module):
    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MoELayer(d) for _ in range(layers)])
        self.head = nn.Linear(d, 2)

    def forward(self, x, *, scale: float = 1.0):  # keyword-only: no torch.fx fallback
        for layer in self.layers:
            x = layer(x)
        return self.head(x * scale)


def moenet(batch: int = 6):
    torch.manual_seed(0)
    return MoENet(), (torch.randn(batch, 8),), {}


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class SoftMoELayer(nn.Module):
    """Top-2 mixture of experts that runs every expert (no data-dependent control flow):
    experts in a ModuleList that all read the same input, not a chain of layers."""

    def __init__(self, d: int, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList([Expert(d) for _ in range(experts)])

    def forward(self, x):
        h = self.norm(x)
        w = self.router(h).softmax(-1)
        top, idx = w.topk(2, dim=-1)
        gate = torch.zeros_like(w).scatter(-1, idx, top)
        return x + sum(gate[..., i:i + 1] * e(h) for i, e in enumerate(self.experts))


class SoftMoE(nn.Module):
    def __init__(self, d: int = 8, layers: int = 4, in_features: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, d)
        self.layers = nn.ModuleList([SoftMoELayer(d) for _ in range(layers)])
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class VarArgs(nn.Module):
    """``forward(*args, **kwargs)``, the signature of wrappers such as PEFT's PeftModel."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def varargs(batch: int = 4, seq: int = 8):
    model, args, kwargs = gpt(layers=2, batch=batch, seq=seq)
    return VarArgs(model), args, kwargs


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


ALL = {
    "gpt": gpt,
    "mlp": mlp,
    "convnet": convnet,
    "nested": nested,
    "bnnet": bnnet,
    "branchy": branchy,
    "dataclass_net": dataclass_net,
    "data_dependent": data_dependent,
}


def to_dtype(model: nn.Module, args, kwargs, dtype: torch.dtype):
    """Cast a model and the floating example inputs to ``dtype``."""
    model = model.to(dtype)
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return model, tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def lm_loss(out, labels):
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


