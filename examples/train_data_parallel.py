"""Train the small GPT of train_gpt.py on several machines: one roundpipe process per
machine, each a data-parallel replica using every local device.

    python examples/train_data_parallel.py --devices 2          # one replica, no launcher
    torchrun --standalone --nproc_per_node 2 examples/train_data_parallel.py --devices 2
    torchrun --nnodes 4 --nproc_per_node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/train_data_parallel.py     # four machines

Every replica draws the same global batch and trains on its own rows of it (with a real
data set, use torch.utils.data.DistributedSampler).  Gradients are averaged across the
replicas; with ``--zero`` the AdamW state is sharded across them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roundpipe  # noqa: E402
import roundpipe.distributed as rd  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from progress import Progress  # noqa: E402
from train_gpt import GPT, make_text, parse_devices  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--devices", default=None,
                        help="virtual CPU devices per replica, or a list like cuda:0,cuda:1 "
                             "(None: every CUDA device, else one CPU device)")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--global-batch", type=int, default=16,
                        help="sequences per step, over all replicas")
    parser.add_argument("--num-microbatch", type=int, default=None,
                        help="microbatches per replica's batch (None: devices + 1)")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--zero", action="store_true", help="shard the optimizer state")
    parser.add_argument("--checkpoint", default=None,
                        help="file to save the final state to (None: not saved)")
    args = parser.parse_args()

    rank, world = rd.init_distributed()  # (0, 1) under plain python
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must divide among {world} "
                         "replicas")
    local_batch = args.global_batch // world

    torch.manual_seed(0)  # the same text, model and batches on every replica
    text = make_text(4000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    model = GPT(len(chars), d=128)
    pipe = roundpipe.RoundPipe(model, devices=parse_devices(args.devices),
                               optim_dtype=torch.float32,
                               model_run_config=RoundPipeRunConfig(
                                   num_microbatch=args.num_microbatch))
    opt = (rd.zero_optimizer(pipe, torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
           if args.zero else torch.optim.AdamW(pipe.optim_parameters(), lr=args.lr,
                                               weight_decay=0.01))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    sampler = torch.Generator().manual_seed(1)
    losses: list[float] = []
    started = time.perf_counter()
    bar = Progress(range(1, args.steps + 1), args.steps, f"replica {rank}")
    for step in bar:
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.global_batch,),
                               generator=sampler)
        mine = starts[rank * local_batch:(rank + 1) * local_batch]  # this replica's rows
        x = torch.stack([data[s:s + args.seq_len] for s in mine])
        y = torch.stack([data[s + 1:s + args.seq_len + 1] for s in mine])
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        # the loss of the committed gradient: averaged over replicas, summed over
        # microbatches; report the mean per microbatch
        losses.append(loss.item() / pipe.resolve_run_config().num_microbatch)
        bar.show(loss=f"{losses[-1]:.3f}")
    pipe.synchronize()
    bar.close()
    elapsed = time.perf_counter() - started
    if pipe.data_parallel is not None:
        rd.check_replicas(pipe)  # every replica holds the same weights
    if args.checkpoint:
        if args.zero and pipe.data_parallel is not None:
            opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # every replica
        if rank == 0:
            roundpipe.save_checkpoint(args.checkpoint, pipe, opt)
            print(f"saved the model and optimizer state to "
                  f"{os.path.abspath(args.checkpoint)}")
    if rank == 0:
        k = min(10, len(losses))
        print(f"{world} replica(s) x {len(pipe.devices)} device(s): {args.steps} steps in "
              f"{elapsed:.1f} s; loss: first {k} steps {sum(losses[:k]) / k:.3f} -> last "
              f"{k} steps {sum(losses[-k:]) / k:.3f} (uniform guess: "
              f"{math.log(len(chars)):.3f})")
    pipe.close()


if __name__ == "__main__":
    main()
