"""Breadth sweep over Hugging Face families: tiny random float64 models trained one
``forward_backward`` by roundpipe (2 virtual CPU devices, 2 microbatches, both recompute
grains) and compared with the eager per-microbatch loop (loss and every gradient).

    python bench/hf_sweep.py                       # every family below
    python bench/hf_sweep.py --families llama,bert,t5

One row per family: status (ok / refused: first line of the error / error: ...), the
largest relative error over the loss and the gradients (both grains), and seconds.
Nothing is downloaded: models are built from configs with random weights.
"""

from __future__ import annotations

import argparse
import copy
import time
import traceback
from typing import Any

import torch
import transformers
from tqdm import tqdm

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import ModelError
from benchutil import add_smoke_flag, apply_smoke

BATCH, SEQ, VOCAB, NUM_MB = 4, 8, 128, 2
GRAINS = ("stage", "layer")  # the recompute grains each family is checked with

# family -> (model_type, task); the order is the sweep's: decoders, encoders, seq2seq,
# vision, state-space.
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "causal"), "mistral": ("mistral", "causal"),
    "qwen2": ("qwen2", "causal"), "qwen3": ("qwen3", "causal"),
    "gemma": ("gemma", "causal"), "gemma2": ("gemma2", "causal"),
    "gemma3": ("gemma3_text", "causal"), "phi": ("phi", "causal"),
    "phi3": ("phi3", "causal"), "gpt2": ("gpt2", "causal"),
    "gpt_neox": ("gpt_neox", "causal"), "gptj": ("gptj", "causal"),
    "opt": ("opt", "causal"), "bloom": ("bloom", "causal"),
    "falcon": ("falcon", "causal"), "starcoder2": ("starcoder2", "causal"),
    "olmo": ("olmo", "causal"), "olmo2": ("olmo2", "causal"),
    "cohere": ("cohere", "causal"), "stablelm": ("stablelm", "causal"),
    "granite": ("granite", "causal"), "mixtral": ("mixtral", "causal"),
    "qwen2_moe": ("qwen2_moe", "causal"), "qwen3_moe": ("qwen3_moe", "causal"),
    "mpt": ("mpt", "causal"), "codegen": ("codegen", "causal"),
    "biogpt": ("biogpt", "causal"),
    "bert": ("bert", "masked"), "roberta": ("roberta", "masked"),
    "distilbert": ("distilbert", "masked"), "albert": ("albert", "masked"),
    "electra": ("electra", "masked"), "deberta_v2": ("deberta-v2", "masked"),
    "modernbert": ("modernbert", "masked"),
    "t5": ("t5", "seq2seq"), "bart": ("bart", "seq2seq"), "mbart": ("mbart", "seq2seq"),
    "pegasus": ("pegasus", "seq2seq"), "marian": ("marian", "seq2seq"),
    "fsmt": ("fsmt", "seq2seq"),
    "vit": ("vit", "image"), "swin": ("swin", "image"), "convnext": ("convnext", "image"),
    "resnet": ("resnet", "image"),
    "mamba": ("mamba", "causal"), "rwkv": ("rwkv", "causal"), "jamba": ("jamba", "causal"),
    # the rest of docs/models.md's two sweeps that take the generic sizes
    "deepseek_v3": ("deepseek_v3", "causal"), "xglm": ("xglm", "causal"),
    "mamba2": ("mamba2", "causal"), "falcon_mamba": ("falcon_mamba", "causal"),
    "zamba": ("zamba", "causal"), "zamba2": ("zamba2", "causal"),
    "bamba": ("bamba", "causal"), "granitemoehybrid": ("granitemoehybrid", "causal"),
    "lfm2": ("lfm2", "causal"), "olmoe": ("olmoe", "causal"),
    "granitemoe": ("granitemoe", "causal"), "jetmoe": ("jetmoe", "causal"),
    "dbrx": ("dbrx", "causal"), "minimax": ("minimax", "causal"),
    "gpt_oss": ("gpt_oss", "causal"), "llama4": ("llama4_text", "causal"),
    "nemotron": ("nemotron", "causal"), "persimmon": ("persimmon", "causal"),
    "glm": ("glm", "causal"), "glm4": ("glm4", "causal"), "exaone4": ("exaone4", "causal"),
    "helium": ("helium", "causal"), "ernie4_5": ("ernie4_5", "causal"),
    "smollm3": ("smollm3", "causal"), "arcee": ("arcee", "causal"),
    "apertus": ("apertus", "causal"), "seed_oss": ("seed_oss", "causal"),
    "hunyuan": ("hunyuan_v1_dense", "causal"),
    "funnel": ("funnel", "masked"), "mpnet": ("mpnet", "masked"), "fnet": ("fnet", "masked"),
    "squeezebert": ("squeezebert", "masked"), "esm": ("esm", "masked"),
    "big_bird": ("big_bird", "masked"),
    "blenderbot": ("blenderbot", "seq2seq"), "m2m_100": ("m2m_100", "seq2seq"),
    "mt5": ("mt5", "seq2seq"), "umt5": ("umt5", "seq2seq"), "longt5": ("longt5", "seq2seq"),
}

# Tiny sizes, passed to a config only where its defaults have the attribute.
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, head_dim=8, max_position_embeddings=64,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64, n_ctx=64,
    d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, n_heads=4, n_layers=2,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    embedding_size=32, ffn_dim=64, dim=32, hidden_dim=64, max_seq_len=64,
    rotary_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_local_experts=4, num_experts=4, num_experts_per_tok=2, state_size=8,
    attention_hidden_size=32, context_length=64, global_attn_every_n_layers=1,
    src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, decoder_vocab_size=VOCAB,
    use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    decoder_start_token_id=1,
)
DROPOUTS = ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout",
            "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
            "embd_pdrop", "attn_pdrop", "dropout_rate", "classifier_dropout",
            "attention_dropout_prob", "hidden_act_dropout", "mlp_dropout",
            "embedding_dropout", "attn_dropout", "resid_dropout", "emb_pdrop",
            "drop_path_rate", "summary_first_dropout", "qa_dropout", "seq_classif_dropout",
            "ffn_dropout")
# Families whose sizes are not the generic ones (lists per stage, image sizes).
SPECIFIC: dict[str, dict[str, Any]] = {
    "vit": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, image_size=32, patch_size=8),
    "swin": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], image_size=32,
                 patch_size=4, window_size=4),
    "convnext": dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32),
    "resnet": dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                   layer_type="basic"),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64),
    "deberta-v2": dict(position_buckets=8, max_relative_positions=16),
    "deepseek_v3": dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        kv_lora_rank=16, q_lora_rank=16, n_routed_experts=4,
                        first_k_dense_replace=1, n_group=1, topk_group=1,
                        num_key_value_heads=4),
    "zamba": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=2, mamba_d_state=8,
                  mamba_dt_rank=4, attention_head_dim=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=8, mamba_headdim=8,
                   mamba_d_state=8, attention_head_dim=8, num_mem_blocks=1),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
                  attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8,
                             mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8),
    "mamba2": dict(num_heads=8, head_dim=8, n_groups=1, expand=2),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, ffn_config=dict(
        ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2), attn_config=dict(kv_n_heads=2)),
}
FAMILY_TASKS = dict(FAMILIES.values())
# FSMT's causal mask (fill_with_neg_inf) overflows in float64 in eager PyTorch itself.
FLOAT32 = {"fsmt"}
# XGLM builds its mask in the default dtype: float64 needs it as the default (eager too).
DEFAULT_FLOAT64 = {"xglm"}
AUTO = {"causal": transformers.AutoModelForCausalLM,
        "masked": transformers.AutoModelForMaskedLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
        "image": transformers.AutoModelForImageClassification}


def tiny_config(model_type: str) -> Any:
    defaults = transformers.AutoConfig.for_model(model_type)
    settable = lambda k: hasattr(defaults, k) and not (  # noqa: E731
        isinstance(getattr(type(defaults), k, None), property)
        and getattr(type(defaults), k).fset is None)
    kwargs = {k: v for k, v in TINY.items() if settable(k)}
    kwargs.update({k: 0.0 for k, v in defaults.to_dict().items()  # no random draws
                   if ("drop" in k or k in DROPOUTS) and isinstance(v, float)})
    if FAMILY_TASKS.get(model_type) == "image":  # their sizes are per stage: no generic ones
        kwargs = {k: v for k, v in kwargs.items() if k in DROPOUTS or k == "use_cache"}
    kwargs.update(SPECIFIC.get(model_type, {}))
    if "num_labels" in dir(defaults) and model_type in ("vit", "swin", "convnext", "resnet"):
        kwargs["num_labels"] = 3
    if FAMILY_TASKS.get(model_type) == "seq2seq":
        kwargs.setdefault("decoder_start_token_id", TINY["decoder_start_token_id"])
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    if any(hasattr(cfg, k) for k in ("num_local_experts", "num_experts")):
        # grouped_mm experts have no float64 kernel on the CPU (eager fails too)
        cfg._experts_implementation = "eager"
    return cfg


def build(family: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A float64 model in training mode and its batch, labels included."""
    model_type, task = FAMILIES[family]
    cfg = tiny_config(model_type)
    torch.manual_seed(0)
    dtype = torch.float32 if family in FLOAT32 else torch.float64
    model = AUTO[task].from_config(cfg).to(dtype).train()
    g = torch.Generator().manual_seed(1)
    if task == "image":
        size = getattr(cfg, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        inputs = dict(pixel_values=torch.randn(BATCH, 3, size, size, generator=g, dtype=dtype),
                      labels=torch.randint(0, 3, (BATCH,), generator=g))
        return model, inputs
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if model_type in ("mamba", "rwkv"):
        del inputs["attention_mask"]
    if task == "causal":
        inputs["labels"] = ids.clone()
    elif task == "masked":
        labels = torch.full_like(ids, -100)
        labels[:, 1::3] = ids[:, 1::3]
        inputs["labels"] = labels
    else:
        inputs["labels"] = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return model, inputs


def split(value: Any, i: int) -> Any:
    """Microbatch ``i`` of ``value``: batch tensors in NUM_MB equal parts, the rest whole."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == BATCH:
        return value.chunk(NUM_MB)[i]
    return value


def eager_loop(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    total = 0.0
    for i in range(NUM_MB):
        loss = model(**{k: split(v, i) for k, v in inputs.items()}).loss
        loss.backward()
        total = total + loss.detach()
    return total


def rel_err(got: torch.Tensor | None, ref: torch.Tensor | None, floor: float = 0.0) -> float:
    """max |got - ref| over max |ref|; ``floor`` keeps gradients that are zero in exact
    arithmetic (an attention key's bias) from dividing rounding noise by rounding noise."""
    if ref is None:
        return 0.0 if got is None or not got.any() else float("inf")
    if got is None:
        return 0.0 if not ref.any() else float("inf")
    scale = max(ref.abs().max().item(), floor)
    diff = (got - ref).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def check(family: str, grain: str) -> float:
    """Max relative error of roundpipe against eager for one recompute grain."""
    model, inputs = build(family)
    eager = copy.deepcopy(model)
    ref = eager_loop(eager, inputs)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB,
                                                         recompute_grain=grain))
    loss = pipe.forward_backward(input_kwargs=inputs, loss_fn=lambda out, _: out.loss)
    errors = [rel_err(loss.detach(), ref)]
    ref_params = dict(eager.named_parameters())
    floor = 1e-9 * max((p.grad.abs().max().item() for p in ref_params.values()
                        if p.grad is not None), default=0.0)
    for name, p in pipe.optim_named_parameters():
        errors.append(rel_err(p.grad, ref_params[name].grad, floor))
    ref_buffers = dict(eager.named_buffers())
    for name, b in model.named_buffers():  # BatchNorm statistics and other written state
        if name in ref_buffers and b.is_floating_point():
            errors.append(rel_err(b, ref_buffers[name]))
    return max(errors)


def run_family(family: str) -> tuple[str, float | None, float]:
    start = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    if family in DEFAULT_FLOAT64:
        torch.set_default_dtype(torch.float64)
    try:
        err = max(check(family, grain) for grain in GRAINS)
        status = "ok" if err <= (1e-5 if family in FLOAT32 else 1e-9) else "WRONG"
    except ModelError as e:
        status, err = "refused: " + (str(e).strip().splitlines() or [""])[0], None
    except Exception as e:  # noqa: BLE001 - a sweep reports every failure and goes on
        first = (str(e).strip().splitlines() or [""])[0]
        status, err = f"error: {type(e).__name__}: {first}"[:200], None
        if ARGS.traceback:
            traceback.print_exc()
    finally:
        torch.set_default_dtype(default_dtype)
    return status, err, time.perf_counter() - start


def main() -> None:
    families = ARGS.families.split(",") if ARGS.families else list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    rows = []
    for family in tqdm(families, desc="families"):
        status, err, secs = run_family(family)
        rows.append((family, status, err, secs))
        tqdm.write(f"{family:12s} {status[:150]:150s} "
                   f"{'-' if err is None else f'{err:.1e}':>8s} {secs:6.1f}s")
    print(f"\n{'family':12s} {'status':60s} {'max err':>8s} {'s':>6s}")
    for family, status, err, secs in rows:
        print(f"{family:12s} {status[:120]:60s} "
              f"{'-' if err is None else f'{err:.1e}':>8s} {secs:6.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated, e.g. llama,bert")
    parser.add_argument("--traceback", action="store_true", help="print errors' tracebacks")
    add_smoke_flag(parser)
    ARGS = apply_smoke(parser.parse_args(), families="llama")
    if ARGS.smoke:  # one grain (2 decoder layers stay: the fewest that make layer units)
        GRAINS = ("stage",)
    main()
