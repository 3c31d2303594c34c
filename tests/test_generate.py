"""Generation with a key/value cache (fivefold.model.generate): each step equals running the whole
sequence again without a cache, under TP each rank holds its heads' cache and all ranks sample the
same tokens as one process; what it does not run is refused."""
from __future__ import annotations

import pytest
import torch

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.errors import NotImplementedYet
from fivefold.model.decoder import Decoder
from fivefold.model.generate import generate
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=256)
GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, activation="gelu",
                  normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute",
                  max_position_embeddings=64, tie_word_embeddings=True)
PROMPTS = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
# Cached and uncached logits differ by fp32 summation order only (attention over the same keys in
# one call or two; TP: sharded sums): measured worst 4.8e-7 absolute on log-probs ~ -5; bound 1e-5 (21x).
ATOL = 1e-5


@pytest.mark.parametrize("cfg", [CFG, GPT], ids=["rope-gqa", "gpt-learned-positions"])
def test_cached_greedy_decoding_equals_recomputing_the_sequence(cfg):
    model = Decoder(cfg, seed=3).eval()
    out = generate(model, PROMPTS, 6, temperature=0)
    seq = PROMPTS
    with torch.no_grad():
        for step in range(6):
            logp = torch.log_softmax(model(seq)[:, -1, : cfg.vocab_size].float(), -1)
            assert torch.equal(logp.argmax(-1), out.tokens[:, step])
            close(out.logprobs[:, step], logp.gather(-1, out.tokens[:, step, None]).squeeze(-1), rtol=0, atol=ATOL,
                  site="generate.cache", case=f"{cfg.activation} step {step}")
            seq = torch.cat([seq, out.tokens[:, step, None]], 1)
    assert out.cache.length == 7 + 5 and out.cache.layers[0][0].shape[2] == 12


def test_sampling_is_seeded():
    model = Decoder(CFG, seed=3)
    a, b, c = (generate(model, PROMPTS, 8, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert model.training  # restored


def _tp_generate(rank: int, world: int, temperature: float) -> dict:
    model = Decoder(CFG, mesh=Mesh.build(Layout(tp=world)), seed=3)
    out = generate(model, PROMPTS, 6, temperature=temperature, seed=5)
    return {"tokens": out.tokens, "logprobs": out.logprobs}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tensor_parallel_generation_equals_one_process(workers, temperature):
    one = generate(Decoder(CFG, seed=3), PROMPTS, 6, temperature=temperature, seed=5)
    for rank, got in enumerate(workers(2).run(_tp_generate, temperature)):
        assert torch.equal(got["tokens"], one.tokens), rank
        close(got["logprobs"], one.logprobs, rtol=0, atol=ATOL, site="generate.tp", case=f"rank {rank} t={temperature}")


def test_what_generation_does_not_run_is_refused():
    mla = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=256, multi_latent_attention=True,
                      kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)
    with pytest.raises(NotImplementedYet, match="multi-latent attention"):
        generate(Decoder(mla), PROMPTS, 2)
