"""Packed documents (data.reset_attention_mask / reset_position_ids / eod_mask_loss) in one process:
the attention backend and the whole model with documents equal each document run alone; the
backend's block forward/backward (the ring's building block) equals autograd; the loader's rules."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _tol import close
from fivefold.config.schema import DataConfig, ModelConfig
from fivefold.data.documents import DocumentRules, document_positions, document_rules, document_starts, packed_docs
from fivefold.data.loader import IGNORE_INDEX, collate
from fivefold.errors import UserError
from fivefold.model.decoder import Decoder
from fivefold.ops.attention import Documents, attention, block_backward, block_forward

EOD = 0


def _qkv(a=4, g=2, s=24, d=8, dv=8, b=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, w, generator=gen).requires_grad_() for h, w in ((a, d), (g, d), (g, dv))]


def test_documents_attend_only_to_themselves():
    docs = Documents(((0, 5, 13, 24), (0, 24)))  # row 0: three documents; row 1: one
    for dv in (8, 12, 6):  # MLA's dv != d both ways: zero padding must stay exact
        q, k, v = _qkv(dv=dv)
        o = attention(q, k, v, docs=docs)
        do = torch.randn_like(o)
        o.backward(do)
        for b, cuts in enumerate(docs.bounds):
            for s0, s1 in zip(cuts[:-1], cuts[1:]):
                qa, ka, va = (t.detach()[b:b + 1, :, s0:s1].clone().requires_grad_() for t in (q, k, v))
                alone = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True)
                alone.backward(do[b:b + 1, :, s0:s1])
                # same kernel on shorter rows (other tiling) and zero-padded columns: measured worst
                # 1.2e-6 absolute on O(1) values (0.043 of the bound); bound 1.2e-5 + 1.2e-5 |want|
                for got, want in ((o[b:b + 1, :, s0:s1], alone), (q.grad[b:b + 1, :, s0:s1], qa.grad),
                                  (k.grad[b:b + 1, :, s0:s1], ka.grad), (v.grad[b:b + 1, :, s0:s1], va.grad)):
                    close(got, want, rtol=1.2e-5, atol=1.2e-5, site="documents.alone", case=f"dv={dv} row {b} [{s0},{s1})")


def test_block_kernels_equal_autograd_with_documents():
    """block_forward's O and L and block_backward's grads (from the merged O, L) against plain math."""
    q, k, v = _qkv(s=16)
    docs = Documents(((0, 6, 16), (0, 3, 16)))
    pieces = docs.pieces()
    o, lse = block_forward(q.detach(), k.detach(), v.detach(), 8 ** -0.5, True, pieces)
    allowed = torch.zeros(2, 16, 16, dtype=torch.bool)
    for b, q0, q1, k0, k1, _ in pieces:
        allowed[b, q0:q1, k0:k1] = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril()
    scores = torch.einsum("bgmqd,bgkd->bgmqk", q.view(2, 2, 2, 16, 8), k) * 8 ** -0.5
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf")).flatten(1, 2)  # (b, a, s, s)
    want = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)
    # fp32 flash tiles vs one softmax: measured worst 7.2e-7 (O), 2.4e-7 (L); bound 5e-6 + 5e-6 |want| (>= 20x)
    close(o, want, rtol=5e-6, atol=5e-6, site="documents.block_o")
    close(lse, torch.logsumexp(scores, -1), rtol=5e-6, atol=5e-6, site="documents.block_lse")
    do = torch.randn_like(want)
    want.backward(do)
    dq, dk, dv = block_backward(do, q.detach(), k.detach(), v.detach(), o, lse, 8 ** -0.5, True, pieces)
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        close(got, ref, rtol=1e-5, atol=1e-5, site="documents.block_grads")  # measured worst 1.4e-6 (0.05 of the bound)


def test_rules_follow_megatron():
    ids = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, 4]])
    starts = document_starts(ids, EOD)
    assert starts.tolist() == [[True, False, False, True, False, False, False, True]]
    assert document_positions(starts).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    rules = DocumentRules(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert packed_docs(ids, rules).attention.bounds == ((0, 3, 7, 8),)
    mb = collate([np.array([5, 6, EOD, 7, 8, 9, EOD, 4, 3])], rules)
    assert mb.labels.tolist() == [[6, EOD, IGNORE_INDEX, 8, 9, EOD, IGNORE_INDEX, 3]]  # no target at EOD inputs
    assert mb.num_tokens == 6
    assert packed_docs(ids, DocumentRules(EOD, eod_mask_loss=True)) is None  # loss mask only: one sequence


def _tiny(mla: bool = False) -> ModelConfig:
    extra = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8,
                 qk_pos_emb_head_dim=4, v_head_dim=12) if mla else {}
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, vocab_size=64, **extra)


def test_model_with_documents_equals_each_document_alone():
    """reset_attention_mask + reset_position_ids: a packed row's per-token losses are those of each
    document fed alone (positions from 0) — GQA and MLA."""
    gen = torch.Generator().manual_seed(3)
    body = torch.randint(1, 64, (1, 21), generator=gen)
    body[0, 6] = body[0, 13] = EOD
    labels = torch.randint(1, 64, (1, 21), generator=gen)
    rules = DocumentRules(EOD, reset_position_ids=True, reset_attention_mask=True)
    for mla in (False, True):
        model = Decoder(_tiny(mla), seed=1)
        logp = model.logprobs(body, labels, docs=packed_docs(body, rules))
        for s0, s1 in ((0, 7), (7, 14), (14, 21)):
            alone = model.logprobs(body[:, s0:s1], labels[:, s0:s1])
            # same weights, same tokens; kernels see shorter rows: measured worst 4.8e-7 (0.01 of the bound)
            close(logp[:, s0:s1], alone, rtol=1e-5, atol=1e-5, site="documents.model", case=f"mla={mla} [{s0},{s1})")
        plain = model.logprobs(body, labels)
        assert not torch.allclose(plain[:, 7:], logp[:, 7:])  # documents do change the later ones


def test_token_file_without_its_tokenizer_is_refused(tmp_path):
    """A pre-tokenized file read with the byte tokenizer has no known end-of-document id."""
    (tmp_path / "meta.json").write_text(json.dumps({"kind": "tokens", "eod_id": 0}))
    with pytest.raises(UserError, match="set data.tokenizer to that Hugging Face tokenizer"):
        document_rules(DataConfig(path="x.bin", reset_attention_mask=True), tmp_path)
    assert document_rules(DataConfig(path="x.bin"), tmp_path) is None  # flags off: nothing to know
    (tmp_path / "meta.json").write_text(json.dumps({"kind": "text", "eod_id": 0}))
    assert document_rules(DataConfig(eod_mask_loss=True), tmp_path) == DocumentRules(0, eod_mask_loss=True)
