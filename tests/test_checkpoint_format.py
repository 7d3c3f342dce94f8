"""What a save writes on disk stays what earlier versions wrote, so their checkpoints still
load: the file names, the key names, the tensors' shapes and dtypes and the value types of
a one-file checkpoint, a sharded directory (synchronous and asynchronous) and a safetensors
export, compared with a listing taken before the checkpoint code moved into
``roundpipe/checkpoint/`` (``tests/checkpoint_layout.json``).  Only public names and torch
read them.  Regenerate the listing only for a deliberate format change (new format string):
``python tests/test_checkpoint_format.py > tests/checkpoint_layout.json``."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from roundpipe import (GradScaler, RoundPipe, RoundPipeRunConfig, export_weights,  # noqa: E402
                       load_checkpoint, save_checkpoint)

LISTING = pathlib.Path(__file__).with_name("checkpoint_layout.json")


def _shape(value: Any) -> Any:
    """Names and structure, not numbers: strings (key names, formats) as they are."""
    if isinstance(value, dict):
        return {str(k): _shape(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{value.dtype}"
    if isinstance(value, str):
        return value
    return type(value).__name__


def _trained() -> tuple[RoundPipe, torch.optim.Optimizer, GradScaler]:
    model, _, _ = models.gpt(dropout=0.1, layers=1)  # tied head, dropout streams
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32, seed=3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    scaler = GradScaler(pipe, init_scale=2.0**4)
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    pipe.forward_backward(input_args=(idx,), label=idx,
                          loss_fn=lambda o, y: scaler.scale(models.lm_loss(o, y)))
    pipe.step(lambda: scaler.step(opt), is_async=True)  # published/previous weights too
    return pipe, opt, scaler


def _sharded(directory: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(directory).read_metadata()
    return {"files": sorted(os.listdir(directory)),
            "roundpipe.pt": _shape(torch.load(os.path.join(directory, "roundpipe.pt"),
                                              weights_only=True)),
            "tensors": {k: f"tensor{list(v.size)}:{v.properties.dtype}"
                        for k, v in sorted(metadata.state_dict_metadata.items())
                        if hasattr(v, "size")}}


def _safetensors(directory: str) -> dict[str, Any]:
    from safetensors import safe_open
    out: dict[str, Any] = {"files": sorted(os.listdir(directory))}
    for name in out["files"]:
        path = os.path.join(directory, name)
        if name.endswith(".json"):
            out[name] = _shape(json.loads(pathlib.Path(path).read_text()))
        else:
            with safe_open(path, framework="pt") as f:
                out[name] = {"keys": sorted(f.keys()), "metadata": f.metadata()}
    return out


def layout(work: str) -> dict[str, Any]:
    pipe, opt, scaler = _trained()
    one, sharded, background = (os.path.join(work, n) for n in ("one.pt", "sh", "async"))
    save_checkpoint(one, pipe, opt, scaler, extra={"step": 1, "name": "x"})
    save_checkpoint(sharded, pipe, opt, scaler, extra={"step": 1}, sharded=True)
    save_checkpoint(background, pipe, opt, scaler, extra={"step": 1}, sharded=True,
                    asynchronous=True).result()
    pipe.save_pretrained(os.path.join(work, "pretrained"), max_shard_size="8KB")
    export_weights(sharded, os.path.join(work, "export"))
    # What was written loads back (into the same pipe: every key is expected).
    assert load_checkpoint(one, pipe, opt, scaler) == {"step": 1, "name": "x"}
    assert load_checkpoint(sharded, pipe, opt, scaler) == {"step": 1}
    pipe.close()
    return {"one-file": _shape(torch.load(one, weights_only=True)),
            "sharded": _sharded(sharded), "sharded-async": _sharded(background),
            "save_pretrained": _safetensors(os.path.join(work, "pretrained")),
            "export_weights": _safetensors(os.path.join(work, "export"))}


def test_checkpoints_keep_their_on_disk_layout(tmp_path):
    got = layout(str(tmp_path))
    want = json.loads(LISTING.read_text())
    assert got.keys() == want.keys()
    for kind in want:  # one kind at a time: a readable diff
        assert got[kind] == want[kind], kind


def test_the_layout_check_can_fail(tmp_path):
    """The comparison sees a renamed key deep inside (the listing is not compared with
    itself only)."""
    want = json.loads(LISTING.read_text())
    assert want["one-file"]["format"] == "roundpipe-checkpoint-1"
    assert want["sharded"]["roundpipe.pt"]["format"] == "roundpipe-sharded-2"
    renamed = json.loads(LISTING.read_text())
    renamed["sharded"]["roundpipe.pt"]["model_aliases"] = {"head.weight": "wte.weight2"}
    assert renamed["sharded"] != want["sharded"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        print(json.dumps(layout(work), indent=1, sort_keys=True))
