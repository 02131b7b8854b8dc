"""integrations.transformers.apply: tiny, randomly initialised Llama, Mistral, Qwen2, Qwen3,
Gemma 2 and Gemma 3 models (no download) with their RMSNorms, gated MLPs and rotary
embeddings on our kernels give the unpatched model's logits and parameter gradients;
apply is idempotent and logged, undo puts every module back."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import portable_kernels.integrations.transformers as pk_hf  # noqa: E402
from conftest import DEVICE  # noqa: E402
from portable_kernels import ops  # noqa: E402
from portable_kernels.testing import Tolerance, assert_close  # noqa: E402

# fp32 end to end: our kernels compute in fp32 as torch does, in another order; GPUs run
# the models' fp32 matrix products as tf32 either way.
TOL = Tolerance(1e-4, 1e-4) if DEVICE.type == "cpu" else Tolerance(2e-2, 2e-2)
GRAD_TOL = Tolerance(1e-4, 1e-3) if DEVICE.type == "cpu" else Tolerance(2e-2, 2e-2)
VOCAB, SEQ = 96, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              head_dim=16)

# name -> (config class, model class, extra config): every architecture apply() knows.
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # also q_norm, k_norm over heads
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 8}),  # 1 + w, geglu
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
}


def _model(name):
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(DEVICE)
    model.set_attn_implementation("eager")
    # Gemma's norms start at w = 0 (scale 1 + w = 1): move them off it, so that a wrong
    # offset shows.
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ in pk_hf.RMS_NORMS:
                module.weight.add_(0.1 * torch.randn(module.weight.shape).to(DEVICE))
    return model


def _run(model, ids):
    model.zero_grad()
    logits = model(ids, use_cache=False).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def counted(monkeypatch):
    """How many calls reached each kernel's operator."""
    calls = {"rms_norm": 0, "swiglu": 0, "geglu": 0, "rope": 0}
    for name in calls:
        real = getattr(ops, name)

        def counting(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, counting)
    return calls


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_matches_transformers(name, gen, device, counted, caplog):
    model = _model(name)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(device)
    ref_logits, ref_grads = _run(model, ids)

    with caplog.at_level(logging.INFO, logger=pk_hf.logger.name):
        counts = pk_hf.apply(model)
    layers = 2
    norms = 2 * layers + 1 + (2 * layers if name in ("qwen3", "gemma3") else 0) \
        + (2 * layers if name.startswith("gemma") else 0)  # q/k norms; Gemma's pre/post-MLP norms
    assert counts == {"rms_norm": norms, "mlp": layers, "rotary": 1, "loss": 1}
    assert f"runs {norms} RMSNorm and {layers} MLP modules" in caplog.text
    assert model.config._attn_implementation == pk_hf.NAME

    logits, grads = _run(model, ids)
    assert counted["rms_norm"] == norms  # one forward call per module
    assert counted["rope"] == layers and counted["geglu" if name.startswith("gemma") else "swiglu"] == layers
    assert_close(logits, ref_logits, TOL, f"{name} logits")
    for param, ref in ref_grads.items():
        assert_close(grads[param], ref, GRAD_TOL, f"{name} gradient of {param}")

    pk_hf.undo(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert model.config._attn_implementation != pk_hf.NAME
    assert torch.equal(_run(model, ids)[0], ref_logits)


def test_apply_is_idempotent_and_undo_restores_rotary(gen, device, counted):
    import transformers.models.llama.modeling_llama as modeling

    original = modeling.apply_rotary_pos_emb
    first, second = _model("llama"), _model("llama")
    counts = pk_hf.apply(first)
    assert pk_hf.apply(first) == counts
    pk_hf.apply(second)
    assert modeling.apply_rotary_pos_emb is not original
    pk_hf.undo(first)
    assert modeling.apply_rotary_pos_emb is not original  # the second still uses it
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen).to(device)
    with torch.no_grad():
        second(ids, use_cache=False)
    assert counted["rope"] == 2
    pk_hf.undo(second)
    pk_hf.undo(second)  # nothing left to undo
    assert modeling.apply_rotary_pos_emb is original


def test_calls_the_kernels_cannot_take_fall_back(device, caplog):
    """An RMSNorm whose weight and input dtypes differ runs transformers' own forward."""
    model = _model("llama")
    pk_hf.apply(model)
    try:
        norm = model.model.norm
        x = torch.randn(2, 3, 64, device=device, dtype=torch.float16)
        with caplog.at_level(logging.WARNING, logger=pk_hf.logger.name):
            out = norm(x)
        assert "LlamaRMSNorm: input torch.float16 with weight torch.float32" in caplog.text
        assert torch.equal(out, type(norm).forward(norm, x))
    finally:
        pk_hf.undo(model)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_patched_model_traces_without_graph_breaks(gen, device):
    """fullgraph: the patched norms, MLPs and rotary embeddings trace as our operators."""
    torch._dynamo.reset()
    model = _model("qwen3")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(device)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        pk_hf.apply(model)
        try:
            out = torch.compile(lambda i: model(i, use_cache=False).logits, fullgraph=True,
                                backend="aot_eager")(ids)
        finally:
            pk_hf.undo(model)
    assert_close(out, ref, TOL, "compiled logits")


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_patched_loss_is_fused_and_matches_transformers(name, gen, device, monkeypatch):
    """With labels and a gradient, the loss comes from fused_linear_cross_entropy over the
    hidden states (no logits returned): the same loss and parameter gradients as
    transformers' own head and loss (Gemma 2's final-logit softcap included), with
    ignored labels and with num_items_in_batch's sum reduction."""
    model = _model(name)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(device)
    labels = ids.clone()
    labels[0, :3] = -100

    def step(**kwargs):
        model.zero_grad()
        out = model(ids, labels=labels, use_cache=False, **kwargs)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    refs = [step(), step(num_items_in_batch=torch.tensor(17, device=device))]
    pk_hf.apply(model)
    fused = []
    monkeypatch.setattr(ops, "fused_linear_cross_entropy", _counting(
        ops.fused_linear_cross_entropy, fused))
    try:
        outs = [step(), step(num_items_in_batch=torch.tensor(17, device=device))]
    finally:
        pk_hf.undo(model)
    assert len(fused) == 2
    for (out, grads), (ref, ref_grads) in zip(outs, refs):
        assert out.logits is None
        assert_close(out.loss, ref.loss, TOL, f"{name} loss")
        for param, want in ref_grads.items():
            assert_close(grads[param], want, GRAD_TOL, f"{name} gradient of {param}")
    with torch.no_grad():  # no gradient wanted: transformers' own head, logits returned
        assert model(ids, labels=labels, use_cache=False).logits is not None


def _counting(real, calls):
    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    return counting
