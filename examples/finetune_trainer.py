"""Fine-tune a Hugging Face causal LM with ``transformers.Trainer`` on roundpipe.

    python examples/finetune_trainer.py                 # a tiny random Llama, toy sums
    python examples/finetune_trainer.py --devices 3     # three virtual CPU devices
    python examples/finetune_trainer.py --lora --async-step  # adapters only, async steps

The only change from a plain Trainer script is the class, ``RoundPipeTrainer``, and its
``pipe_options``: the model stays in host memory and every device is a stateless worker
(on CUDA machines, every visible GPU).  The data is made on the spot: short sentences
such as "12 plus 7 is 19.", as bytes, so nothing is downloaded.  Trainer draws its own
progress bar, logs the loss, evaluates on held-out sentences and saves with ``--save``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from finetune_hf import ByteTokenizer, tiny_llama
from train_gpt import parse_devices
from transformers import TrainingArguments

from roundpipe.hf import RoundPipeTrainer


def sums(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{a} plus {b} is {a + b}." for a, b in
            ((rng.randrange(50), rng.randrange(50)) for _ in range(count))]


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row (lengths vary from batch to batch); no loss on
    padding."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--devices", default=None,
                        help="number of virtual CPU devices, or a list like cuda:0,cuda:1 "
                             "(default: every CUDA device, else one CPU device)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--num-microbatch", type=int, default=4,
                        help="microbatches per batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters only")
    parser.add_argument("--async-step", action="store_true",
                        help="asynchronous steps with predicted weights (default: exact)")
    parser.add_argument("--save", default=None, help="directory to save the model to")
    parser.add_argument("--output-dir", default="trainer_output",
                        help="Trainer's output directory (checkpoints are off)")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    model = tiny_llama(tokenizer.vocab_size)
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules="all-linear"))
    train = [{"input_ids": tokenizer.encode(s)} for s in sums(2000, seed=0)]
    held_out = [{"input_ids": tokenizer.encode(s)} for s in sums(64, seed=1)]

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=16,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=10,
        weight_decay=0.0, logging_steps=max(1, args.steps // 10), save_strategy="no",
        report_to=[], remove_unused_columns=False, seed=0)
    trainer = RoundPipeTrainer(
        model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
        data_collator=collate, async_step=args.async_step,
        pipe_options=dict(devices=parse_devices(args.devices), optim_dtype=torch.float32,
                          num_microbatch=args.num_microbatch))
    pipe = trainer.pipe
    print(f"{type(model).__name__} on {', '.join(d.name for d in pipe.devices)}, "
          f"{'asynchronous' if args.async_step else 'exact'} steps")

    started = time.perf_counter()
    result = trainer.train()
    print(pipe.plan)  # how the model was cut (compiled at the first step)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"train loss: first log {losses[0]:.3f} -> last {losses[-1]:.3f}, "
          f"mean {result.training_loss:.3f}, {time.perf_counter() - started:.1f} s")
    print(f"held-out loss: {trainer.evaluate()['eval_loss']:.3f}")
    if args.save:
        trainer.save_model(args.save)
        print(f"saved the model to {args.save}")
    pipe.close()


if __name__ == "__main__":
    main()
