"""What ``load_checkpoint`` says when the checkpoint is not this model's, or not there."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from roundpipe import RoundPipe, load_checkpoint, save_checkpoint
from roundpipe.checkpoint import CheckpointError


def _pipe(widths):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    pipe = RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32)
    return pipe, torch.optim.AdamW(pipe.optim_parameters())


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_another_models_checkpoint_names_the_models_tensors_first(tmp_path, sharded,
                                                                  with_optimizer):
    saved, saved_opt = _pipe([4, 4, 4])
    path = str(tmp_path / ("ck" if sharded else "ck.pt"))
    save_checkpoint(path, saved, saved_opt, sharded=sharded)
    pipe, opt = _pipe([4, 8, 4, 2])  # other keys and shapes, and other optimizer groups
    before = [p.detach().clone() for p in pipe.model.parameters()]
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, pipe, opt if with_optimizer else None)
    message = str(error.value)
    assert "holds another model's state than Sequential's" in message
    assert "missing keys: 2 of the model's tensors are not in it ('2.weight', '2.bias')" \
        in message
    assert "'0.weight' saved [4, 4], the model's [8, 4]" in message
    assert "parameter group" not in message  # not the optimizer's groups
    assert "Nothing was loaded" in message
    assert all(torch.equal(a, b) for a, b in zip(pipe.model.parameters(), before))
    saved.close()
    pipe.close()


def test_unexpected_keys_are_named():
    saved, _ = _pipe([4, 4, 4, 4])
    pipe, _ = _pipe([4, 4, 4])
    with pytest.raises(CheckpointError, match=r"unexpected keys: 2 of its tensors are not "
                                              r"the model's \('2.weight', '2.bias'\)"):
        from roundpipe.checkpoint.save_load import check_model_state
        check_model_state(saved.state_dict(), pipe, "x.pt")
    saved.close()
    pipe.close()


def test_a_missing_file_says_no_such_file(tmp_path):
    pipe, opt = _pipe([4, 4])
    path = os.path.join(str(tmp_path), "nope.pt")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, pipe, opt)
    assert str(error.value).startswith(f"no such file: {path!r}")
    assert "weights_only" not in str(error.value)
    pipe.close()
