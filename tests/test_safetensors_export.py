"""pipe.save_pretrained and roundpipe.export_weights: sharded safetensors with an index, as
transformers writes and reads them."""

from __future__ import annotations

import builtins
import json
import os

import pytest
import torch

import models
import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, export_weights, save_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")


def _trained(devices: int = 2) -> tuple[RoundPipe, torch.optim.Optimizer]:
    model, _, _ = models.gpt(layers=3)  # tied embeddings: written once
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    pipe.forward_backward(input_args=(idx,), label=idx, loss_fn=models.lm_loss)
    pipe.step(lambda: (opt.step(), opt.zero_grad()))  # pending: save_pretrained waits
    return pipe, opt


def _read(out_dir) -> dict[str, torch.Tensor]:
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        part = safetensors_torch.load_file(str(out_dir / f))
        assert all(index["weight_map"][k] == f for k in part)
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    return tensors


def test_save_pretrained_of_a_plain_module_writes_indexed_shards(tmp_path):
    pipe, _ = _trained()
    files = pipe.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(files) > 3 and files[-1].endswith("index.json")
    tensors = _read(tmp_path)
    want = pipe.model.state_dict()  # after the step: save_pretrained synchronised
    assert set(want) - set(tensors) == {"head.weight"}  # tied to the embedding
    for name, t in tensors.items():
        assert torch.equal(t, want[name]), name
    # A fresh model loads them (re-tying the head), strict but for the tied name.
    fresh, _, _ = models.gpt(layers=3)
    missing, unexpected = fresh.load_state_dict(tensors, strict=False)
    assert missing == ["head.weight"] and not unexpected
    # One shard: a single model.safetensors, and the old shards and index are gone.
    pipe.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    pipe.close()


def test_a_checkpoints_weights_export_without_its_optimizer_state(tmp_path, monkeypatch):
    pipe, opt = _trained()
    save_checkpoint(tmp_path / "ck.pt", pipe, opt)
    save_checkpoint(tmp_path / "ck", pipe, opt, sharded=True)
    masters = dict(pipe.optim_named_parameters())
    pipe.close()
    from roundpipe.checkpoint import sharded as checkpoint_sharded
    real = checkpoint_sharded.read_tensors

    def model_only(path, keys):
        assert not any(k.startswith("optimizer.") for k in keys)
        return real(path, keys)
    monkeypatch.setattr(checkpoint_sharded, "read_tensors", model_only)
    for source in ("ck.pt", "ck"):
        out = tmp_path / f"export-{source}"
        export_weights(tmp_path / source, out, max_shard_size="20KB", dtype=torch.bfloat16)
        tensors = _read(out)
        for name, master in masters.items():
            if name in tensors:
                assert torch.equal(tensors[name], master.to(torch.bfloat16)), name


def test_a_missing_safetensors_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_safetensors(name, *args, **kwargs):
        if name.startswith("safetensors"):
            raise ImportError("No module named 'safetensors'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_safetensors)
    with pytest.raises(roundpipe.RoundPipeError, match=r"pip install 'roundpipe\[hf\]'"):
        export_weights(tmp_path / "none", tmp_path / "out")


def test_transformers_loads_an_exported_checkpoint_and_pipe_save_pretrained(tmp_path):
    pytest.importorskip("transformers")
    import hf_models as hf
    from transformers import AutoModelForCausalLM
    model = hf.build("llama")
    pipe = RoundPipe(model, devices=["cpu"])
    save_checkpoint(tmp_path / "ck", pipe, sharded=True)
    export_weights(tmp_path / "ck", tmp_path / "out", max_shard_size="50KB")
    model.config.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    want = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, want[name]), name
    # An HF model's own save_pretrained (sharded by transformers) through the pipe.
    pipe.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    pipe.close()


def test_an_export_interrupted_while_writing_leaves_the_earlier_one_whole(tmp_path,
                                                                          monkeypatch):
    """A re-export that fails at its last shard (a full disk, Ctrl-C) leaves every earlier
    shard and the index as they were: never new shards beside old ones."""
    pipe, opt = _trained()
    pipe.save_pretrained(tmp_path, max_shard_size="20KB")
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    pipe.forward_backward(input_args=(torch.randint(0, 64, (4, 8)),),
                          label=torch.randint(0, 64, (4, 8)), loss_fn=models.lm_loss)
    pipe.step(lambda: (opt.step(), opt.zero_grad()))  # new weights: every shard differs
    real, calls = safetensors_torch.save_file, []

    def fail_last(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == len(before) - 1:  # the last shard (the index is not a shard)
            raise KeyboardInterrupt
        real(tensors, path, metadata=metadata)
    monkeypatch.setattr(safetensors_torch, "save_file", fail_last)
    with pytest.raises(KeyboardInterrupt):
        pipe.save_pretrained(tmp_path, max_shard_size="20KB")
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before
    pipe.close()
