"""Masked attention on CUDA runs FlexAttention (llmtrain.models.attention_masks): with document
masking, sliding windows and soft-capped scores its logits and gradients equal the dense-mask
path, uncompiled (the shared compiled FlexAttention) and with the blocks compiled under bf16
autocast, and the mask adds no (T, T) memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB, T, B = 512, 1024, 2


def _model(compile_blocks: bool = False, max_seq_len: int = T, **options):
    from llmtrain.models.presets import preset_config
    from llmtrain.models.transformer import build_model

    cfg = preset_config(
        "tiny", vocab_size=VOCAB, d_model=256, n_heads=4, n_kv_heads=2, n_layers=2,
        max_seq_len=max_seq_len, doc_masking=True, init_std=0.05, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg)
    model.init_weights(torch.Generator(device="cuda").manual_seed(0))
    if compile_blocks:
        for block in model.blocks.values():
            block.compile()
    return model


def _batch(seq: int = T):
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, seq), device="cuda", generator=g)
    # documents of every size, a boundary on a 128-token tile edge, one of a single token
    starts = torch.rand(B, seq, device="cuda", generator=g) < 1 / 90
    starts[0, 128] = starts[0, 300] = starts[0, 301] = starts[1, 1] = True
    return tokens, starts


def _dense_inputs(starts):
    from llmtrain.models.attention_masks import document_ids, positions_in_document

    doc = document_ids(starts)
    seq = starts.size(1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & causal
    return dict(positions=positions_in_document(starts), attention_mask=mask)


def _logits_and_grads(model, tokens, inputs, bf16: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
        logits = model(tokens, **inputs)
    logits.float().square().mean().backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_blocks_bf16"])
def test_flex_document_masking_equals_the_dense_mask_on_cuda(compiled):
    model = _model(compile_blocks=compiled)
    tokens, starts = _batch()
    masks = model._positions_and_masks(tokens, starts, None, 0, None, None, None)[1]
    assert all(m.block_mask is not None for m in masks)  # FlexAttention, not the dense fallback
    got, got_grads = _logits_and_grads(model, tokens, dict(doc_starts=starts), bf16=compiled)
    want, want_grads = _logits_and_grads(model, tokens, _dense_inputs(starts), bf16=compiled)
    # float32: the kernels differ in summation order only; bf16: both round their inputs
    atol, rtol = (5e-2, 5e-2) if compiled else (2e-4, 1e-3)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for name, grad in want_grads.items():
        scale = grad.abs().max().item() or 1.0
        torch.testing.assert_close(
            got_grads[name] / scale, grad / scale, atol=atol, rtol=rtol, msg=name
        )


def test_document_mask_memory_is_flat_in_t():
    """At 8192 tokens a dense mask is B x 64 MiB and SDPA with it falls back to kernels that hold
    more; with FlexAttention the masked step's peak stays within a few MiB of the causal one."""
    seq = 8192
    model = _model(max_seq_len=seq)
    tokens, starts = _batch(seq)
    peaks = {}
    for name, inputs in (("causal", {}), ("documents", dict(doc_starts=starts))):
        for _ in range(2):  # the first call compiles FlexAttention
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", torch.bfloat16):
                model(tokens, **inputs).float().mean().backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
    dense_mask_bytes = B * seq * seq
    assert peaks["documents"] - peaks["causal"] < dense_mask_bytes / 8, peaks


@pytest.mark.parametrize("softcap", [None, 20.0], ids=["window", "window_softcap"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_blocks_bf16"])
def test_flex_windows_equal_the_dense_mask_on_cuda(compiled, softcap, monkeypatch):
    """A local block (window 200, crossing tile edges) beside a global one, with documents and
    soft-capped scores: FlexAttention's BlockMasks and score_mod against the dense masks the
    same functions give, logits and gradients."""
    from llmtrain.models import attention_masks

    attention = dict(window=200, pattern=["local", "global"], softcap=softcap)
    model = _model(compile_blocks=compiled, attention=attention)
    tokens, starts = _batch()
    masks = model._positions_and_masks(tokens, starts, None, 0, None, None, None)[1]
    assert len({id(m) for m in masks}) == 2 and all(m.block_mask is not None for m in masks)
    got, got_grads = _logits_and_grads(model, tokens, dict(doc_starts=starts), bf16=compiled)
    monkeypatch.setattr(attention_masks, "flex_runs_here", lambda x: False)
    want, want_grads = _logits_and_grads(model, tokens, dict(doc_starts=starts), bf16=compiled)
    atol, rtol = (5e-2, 5e-2) if compiled else (2e-4, 1e-3)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for name, grad in want_grads.items():
        scale = grad.abs().max().item() or 1.0
        torch.testing.assert_close(
            got_grads[name] / scale, grad / scale, atol=atol, rtol=rtol, msg=name
        )
