"""LoRA fine-tuning of a PEFT-wrapped Llama, and the Hugging Face methods reached through
the pipe (``pipe.config``, ``pipe.save_pretrained``)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_models as hf
import reference
from roundpipe import RoundPipe, RoundPipeRunConfig

peft = pytest.importorskip("peft", reason='LoRA tests need the test extra: '
                                          'pip install -e ".[test]"')

NUM_MB = 3


def _lora_llama() -> torch.nn.Module:
    base = hf.build("llama")
    torch.manual_seed(2)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    # LoRA's B starts at zero; perturb it so the adapters shape the loss from step one.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_lora_trains_only_the_adapters() -> None:
    model = _lora_llama()
    eager = copy.deepcopy(model)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if not p.requires_grad}
    pipe = RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
    inputs, labels = hf.batch("llama")
    inputs = {**inputs, "labels": labels}

    loss = pipe.forward_backward(input_kwargs=inputs, loss_fn=hf.inner_loss)
    ref = reference.eager_forward_backward(eager, (), inputs, None, hf.inner_loss, NUM_MB)
    assert hf.rel_err(loss, ref) <= 1e-5
    # Masters, gradients and (below) optimizer state exist for the adapters only.
    named = dict(pipe.optim_named_parameters())
    assert list(named) == adapters
    ref_params = dict(eager.named_parameters())
    for name, master in named.items():
        assert master is not dict(model.named_parameters())[name]  # a separate fp32 master
        assert hf.rel_err(master.grad, ref_params[name].grad) <= 1e-5, name
    assert set(pipe._state.masters()) == set(adapters)
    # stats(): gradients came back for the adapters alone, each once (one reader unit).
    stats = pipe.stats()
    assert set(stats.grad_bytes) == set(adapters)
    assert stats.grad_bytes_downloaded == sum(4 * named[n].numel() for n in adapters)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)

    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in named.items()}
    for step in range(2):
        if step:
            pipe.forward_backward(input_kwargs=inputs, loss_fn=hf.inner_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    assert len(opt.state) == len(adapters)
    params = dict(model.named_parameters())
    for name, value in frozen.items():
        assert torch.equal(params[name], value), name  # base weights bit-identical
    for name in adapters:
        assert not torch.equal(params[name], before[name]), name  # adapters moved
        assert torch.equal(params[name], named[name].detach())  # and were published
    pipe.close()


def test_config_and_save_pretrained_are_forwarded(tmp_path) -> None:
    """``pipe.config`` is the model's; ``pipe.save_pretrained`` first waits for the pending
    asynchronous step, so the saved model is the trained one and reloads to the same
    outputs as the pipe."""
    model = hf.build("llama")
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert pipe.config is model.config and pipe.config.num_hidden_layers == hf.LAYERS
    assert pipe.get_input_embeddings() is model.get_input_embeddings()
    inputs, labels = hf.batch("llama", batch_size=4)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.5)
    pipe.forward_backward(input_kwargs={**inputs, "labels": labels}, loss_fn=hf.inner_loss)
    pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)  # weights not yet written
    pipe.save_pretrained(tmp_path)
    masters = dict(pipe.optim_named_parameters())
    reloaded = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, masters[name]), name
    reloaded.eval()
    pipe.eval()
    with torch.no_grad():
        got = pipe(**inputs).logits
        want = reloaded(**inputs).logits
    assert hf.rel_err(got, want) <= 1e-6
    pipe.close()
