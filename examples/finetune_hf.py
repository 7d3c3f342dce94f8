"""Fine-tune a Hugging Face causal language model with roundpipe.

    python examples/finetune_hf.py                  # a tiny random Llama on the toy text
    python examples/finetune_hf.py --devices 3      # three virtual CPU devices (no GPU needed)
    python examples/finetune_hf.py --lora           # train LoRA adapters only (needs peft)

By default the model is a tiny Llama built from a config (random weights) with a byte-level
tokenizer, trained on the handful of sentences below, so nothing is downloaded.  On CUDA
machines every visible GPU is used (bfloat16 compute, fp32 master weights on the host).

Real weights: point --model at a local directory holding a Hugging Face checkpoint and its
tokenizer, for example one written by ``save_pretrained`` or fetched beforehand with
``huggingface-cli download meta-llama/Llama-3.2-1B --local-dir ./llama-3.2-1b``:

    python examples/finetune_hf.py --model ./llama-3.2-1b --lora --steps 200 --save ./out

It is loaded with ``from_pretrained(path, local_files_only=True)``; replace TEXT (or
``batches()``) with your data.  The model stays in host memory; the GPUs only ever hold the
stage being computed and the next one.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Iterator

import torch
from progress import Progress
from train_gpt import parse_devices

import roundpipe
from roundpipe import RoundPipeRunConfig

TEXT = """\
A pipeline moves work from one stage to the next.
Each stage holds a few layers of the model.
The host keeps every weight; the devices only borrow them.
Weights stream to a device just before its stage runs.
Microbatches follow one another through the stages.
The optimizer runs on the host while the next step begins.
Small models learn short sentences quickly.
Long sentences need more steps, and more patience.
Gradients flow back from the last stage to the first.
Every device is a worker that keeps no state of its own.
The loss falls as the model learns which byte comes next.
Adapters train while the base weights stay frozen.
"""


class ByteTokenizer:
    """UTF-8 bytes as tokens, after three specials (pad, bos, eos): 259 ids in all."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + [b + 3 for b in text.encode("utf-8")] + [self.eos_token_id]


def tiny_llama(vocab_size: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    return AutoModelForCausalLM.from_config(config)


def load(path: str | None, on_gpu: bool) -> tuple[torch.nn.Module, object]:
    """The model (on the CPU) and a tokenizer with ``encode`` and ``pad_token_id``."""
    if path is None:
        tokenizer = ByteTokenizer()
        return tiny_llama(tokenizer.vocab_size), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model, tokenizer


def batches(tokenizer: object, batch_size: int, seed: int
            ) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """Endless shuffled batches of whole sentences, right-padded to the longest one (so
    the sequence length changes from batch to batch); labels are -100 on padding."""
    sentences = [tokenizer.encode(line) for line in TEXT.splitlines() if line.strip()]
    rng = random.Random(seed)
    while True:
        picked = [rng.choice(sentences) for _ in range(batch_size)]
        length = max(len(s) for s in picked)
        ids = torch.full((batch_size, length), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(batch_size, length, dtype=torch.long)
        for row, tokens in enumerate(picked):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}, int(mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="local directory of a Hugging Face checkpoint (default: a tiny "
                             "random Llama built from a config)")
    parser.add_argument("--devices", default=None,
                        help="number of virtual CPU devices, or a list like cuda:0,cuda:1 "
                             "(default: every CUDA device, else one CPU device)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters only")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--num-microbatch", type=int, default=None,
                        help="microbatches per batch (None: devices + 1)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default 3e-3, or 1e-4 for --model)")
    parser.add_argument("--save", default=None, help="directory to save the result to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and weights")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    devices = parse_devices(args.devices)
    on_gpu = torch.cuda.is_available() and (devices is None or any("cuda" in d for d in devices))
    model, tokenizer = load(args.model, on_gpu)
    if on_gpu and args.model is None:
        model = model.to(torch.bfloat16)
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    lr = args.lr or (3e-3 if args.model is None else 1e-4)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    data = batches(tokenizer, args.batch_size, args.seed)
    example, _ = next(data)
    # Labels go in as an input: the model computes its own (shifted) loss on the device.
    pipe = roundpipe.compile(model, (), example, devices=devices, optim_dtype=torch.float32,
                             model_run_config=RoundPipeRunConfig(
                                 num_microbatch=args.num_microbatch))
    print(f"{type(model).__name__}: {total / 1e6:.3f} M parameters, of which "
          f"{trainable / 1e6:.3f} M trained, on {', '.join(d.name for d in pipe.devices)}")
    print(pipe.plan)

    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=lr, weight_decay=0.0)
    num_mb = pipe.model_run_config.resolve(len(pipe.devices)).num_microbatch
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    bar = Progress(range(args.steps), args.steps, "fine-tune")
    for _ in bar:
        inputs, count = next(data)
        loss = pipe.forward_backward(input_kwargs=inputs, loss_fn=lambda out, _: out.loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item() / num_mb)  # the sum over microbatches; report the mean
        tokens += count
        bar.show(loss=f"{losses[-1]:.3f}",
                 tok_s=f"{tokens / (time.perf_counter() - started):,.0f}")
    pipe.synchronize()
    bar.close()
    k = max(1, min(10, len(losses) // 2))
    print(f"loss: first {k} steps {sum(losses[:k]) / k:.3f} -> last {k} steps "
          f"{sum(losses[-k:]) / k:.3f} ({len(pipe.plans)} compiled program(s) for "
          f"{args.steps} batches of varying length)")
    if args.save:
        pipe.save_pretrained(args.save)  # the model's own method, after the last step
        print(f"saved the model to {os.path.abspath(args.save)}")
    pipe.close()


if __name__ == "__main__":
    main()
