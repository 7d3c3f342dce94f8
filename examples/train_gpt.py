"""Train a small GPT with roundpipe: compile, print the stage plan, train, report.

    python examples/train_gpt.py                    # every CUDA device, else one CPU device
    python examples/train_gpt.py --devices 4        # four virtual CPU devices (no GPU needed)
    python examples/train_gpt.py --steps 50 --num-microbatch 6

The text is generated here (sentences of small sums, "seven plus two is nine."), so nothing
is downloaded; a character-level model learns it quickly enough to see the loss fall.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from progress import Progress

import roundpipe
from roundpipe import RoundPipeRunConfig

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
         "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
         "seventeen", "eighteen"]


def make_text(num_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append(f"{WORDS[a]} plus {WORDS[b]} is {WORDS[a + b]}. ")
    return "".join(out)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int = 256, layers: int = 4, heads: int = 4,
                 max_len: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for module in self.modules():  # GPT-2 style init: small weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def parse_devices(spec: str | None) -> list[str] | None:
    if spec is None:
        return None  # every CUDA device, else one CPU device
    if spec.isdigit():
        return ["cpu"] * int(spec)
    return [d.strip() for d in spec.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--devices", default=None,
                        help="number of virtual CPU devices, or a list like cuda:0,cuda:1 "
                             "(None: every CUDA device, else one CPU device)")
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--num-microbatch", type=int, default=None,
                        help="microbatches per batch (None: devices + 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and weights")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    text = make_text(4000, args.seed)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    on_gpu = torch.cuda.is_available() and (args.devices is None or "cuda" in args.devices)
    model = GPT(len(chars))
    if on_gpu:
        model = model.to(torch.bfloat16)  # compute in bf16, fp32 masters on the host
    n_params = sum(p.numel() for p in model.parameters())
    num_mb = args.num_microbatch

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,))
        x = torch.stack([data[s:s + args.seq_len] for s in starts])
        y = torch.stack([data[s + 1:s + args.seq_len + 1] for s in starts])
        return x, y

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    x0, _ = batch()
    pipe = roundpipe.compile(model, (x0,), devices=parse_devices(args.devices),
                             optim_dtype=torch.float32,
                             model_run_config=RoundPipeRunConfig(num_microbatch=num_mb))
    print(f"GPT with {n_params / 1e6:.2f} M parameters on "
          f"{', '.join(d.name for d in pipe.devices)}")
    print(pipe.plan)

    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=args.lr, weight_decay=0.01)
    losses: list[float] = []
    tokens = args.batch_size * args.seq_len
    started = time.perf_counter()
    bar = Progress(range(1, args.steps + 1), args.steps, "train")
    for step in bar:
        x, y = batch()
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        # the loss is a sum over the call's microbatches; report their mean
        losses.append(loss.item() / pipe.plan.num_microbatch)
        if step % 5 == 0 or step == args.steps:
            elapsed = time.perf_counter() - started
            bar.show(loss=f"{losses[-1]:.3f}", tok_s=f"{step * tokens / elapsed:,.0f}")
    pipe.synchronize()
    bar.close()
    k = min(10, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
          f"(uniform guess: {math.log(len(chars)):.3f})")
    pipe.close()


if __name__ == "__main__":
    main()
