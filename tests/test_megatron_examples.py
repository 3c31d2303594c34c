"""Megatron-LM's own example scripts (pinned commit d98e8a64dd), each written as its command line from
the script's flag list — torchrun launcher included — scaled to 4 local ranks and a tiny model: sizes
(layers, hidden, heads, experts, sequence, batch, iterations) and the parallel sizes shrink; every other
flag stays as the script has it. What the script takes as arguments (its checkpoint folder, tokenizer,
data) is made here: Mixtral's Llama-2 tokenizer model and corpus become --tokenizer-type NullTokenizer
with --mock-data; GPT-3's GPT-2 vocab.json / merges.txt and corpus are a small byte-level BPE and a
corpus `fivefold preprocess` writes with it.

Megatron itself refuses train_gpt3_175b_distributed.sh as written (--step-batch-size-schedule with
--global-batch-size: megatron/training/arguments.py); so do we, with the fix, and the fixed line trains.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from _tol import close
from _train_util import one_process_context
from fivefold.cli import main
from fivefold.cli.train import prepare
from fivefold.config.load import load_config
from fivefold.config.schema import config_from_dict, to_dict
from fivefold.config.validate import validate
from fivefold.errors import UserError
from fivefold.train.batch_sizes import BatchSizes
from fivefold.train.loop import train
import test_zero

MIXTRAL = """torchrun --nproc_per_node 4 --nnodes 1 --node_rank 0 --master_addr localhost --master_port 29500
 pretrain_gpt.py --use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 256
 --num-layers 4 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --init-method-std 0.01
 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
 --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
 --no-position-embedding --rotary-base 1000000
 --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
 --tokenizer-type NullTokenizer --vocab-size 255 --mock-data --split 99990,8,2
 --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters {iters} --lr-decay-iters 320000
 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
 --use-distributed-optimizer --sequence-parallel
 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {ckpt} --load {ckpt}
 --tensorboard-dir {ckpt}/tensorboard --no-load-optim --no-load-rng"""

GPT3 = """torchrun --nproc_per_node 4 --nnodes 1 --master_addr localhost --master_port 29500 pretrain_gpt.py
 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
 --attention-backend auto --micro-batch-size 1 --global-batch-size 4 --step-batch-size-schedule "0:2 64:4"
 --train-iters 3 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
 --data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
 --log-interval 100 --save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt} --eval-iters 10
 --tensorboard-dir {tb}"""


def _words(text: str, **paths) -> list[str]:
    return shlex.split(text.replace("\n", " ").format(**paths))


def _run(cfg, out: Path, data_dir: Path, workers) -> list[float]:
    """The run's loss at each step (its --log-interval may print fewer)."""
    results = workers(4).run(test_zero._train_rank, to_dict(cfg), str(out), str(data_dir))
    return [loss for _, loss in sorted(results[0]["losses"].items())]


def test_mixtral_8x7b_script_trains_and_resumes_from_its_save_folder(tmp_path, workers):
    """No flag refused; Megatron's meaning kept (rope despite the deprecated --no-position-embedding,
    GQA by --group-query-attention, SP dropped at TP=1); --load of the still-empty --save folder starts
    fresh, and the same line with more iterations resumes there with a fresh optimizer (--no-load-optim)."""
    ckpt = tmp_path / "ckpt"
    loaded = load_config(None, _words(MIXTRAL, iters=2, ckpt=ckpt))
    validate(loaded.config, loaded.dialect)
    cfg = loaded.config
    m, p = cfg.model, cfg.parallel
    assert (m.position_embedding_type, m.num_query_groups, m.num_experts, m.activation, m.tie_word_embeddings) == \
        ("rope", 2, 4, "swiglu", False)
    assert (cfg.cluster.resolved_world_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
            p.sequence_parallel, cfg.training.precision) == (4, 2, 2, False, "bf16")
    data_dir = prepare(cfg, tmp_path / "first")
    assert cfg.model.vocab_size == 256  # NullTokenizer: 255 ids + end of document
    first = _run(cfg, tmp_path / "first", data_dir, workers)
    assert len(first) == 2 and all(np.isfinite(first)) and (ckpt / "step_00000002").is_dir()
    assert any((ckpt / "tensorboard").iterdir())
    loaded = load_config(None, _words(MIXTRAL, iters=3, ckpt=ckpt))
    validate(loaded.config, loaded.dialect)
    again = loaded.config
    prepare(again, tmp_path / "again")
    resumed = _run(again, tmp_path / "again", data_dir, workers)
    assert len(resumed) == 1 and (ckpt / "step_00000003").is_dir()  # step 2 only: 0 and 1 came back


@pytest.fixture(scope="module")
def gpt2_corpus(tmp_path_factory) -> dict[str, str]:
    """A byte-level BPE written as GPT-2's vocab.json / merges.txt, and a corpus tokenized with it."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("gpt2")
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 5) for i in range(80)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    paths = {"vocab": str(root / "vocab.json"), "merges": str(root / "merges.txt")}
    assert main(["preprocess", "--input", str(root / "docs.jsonl"), "--output-prefix", str(root / "corpus"),
                 "--vocab-file", paths["vocab"], "--merge-file", paths["merges"], "--append-eod"]) == 0
    return paths | {"data": str(root / "corpus_text_document")}


def test_gpt3_175b_script_is_refused_as_megatron_refuses_it(gpt2_corpus, tmp_path):
    with pytest.raises(UserError, match="drop --global-batch-size"):
        load_config(None, _words(GPT3, ckpt=tmp_path, tb=tmp_path, **gpt2_corpus))


def test_gpt3_175b_script_without_global_batch_trains_its_batch_schedule(gpt2_corpus, tmp_path, workers):
    """The fixed line: GPT-2 BPE through --vocab-file / --merge-file (the model sized by it), the indexed
    corpus through --data-path, fp16 with loss scaling, TP2 x PP2, and the batch growing from 2 to 4
    samples (the pipeline runs 2, then 4 microbatches). The same line in fp32 equals one process step
    for step (worst measured 8.4e-8 relative; bound 2e-6, 24x)."""
    words = [w for w in _words(GPT3, ckpt=tmp_path / "ckpt", tb=tmp_path / "tb", **gpt2_corpus)]
    i = words.index("--global-batch-size")
    del words[i:i + 2]
    loaded = load_config(None, words)
    validate(loaded.config, loaded.dialect)
    cfg = loaded.config
    assert (cfg.data.tokenizer_type, cfg.training.precision, cfg.training.global_batch_size) == (None, "fp16", 1)
    data_dir = prepare(cfg, tmp_path / "fp16")
    assert cfg.model.vocab_size == 300  # the BPE's, as Megatron sizes the model by its tokenizer
    sizes = BatchSizes.of(cfg.training)
    assert [sizes.size(s) for s in range(3)] == [2, 4, 4]  # 64 tokens = 2 samples consumed after step 0
    fp16 = _run(cfg, tmp_path / "fp16", data_dir, workers)
    assert len(fp16) == 3 and all(np.isfinite(fp16))
    ref = config_from_dict(to_dict(cfg))
    ref.training.precision = "fp32"
    ref.checkpoint.save = ref.checkpoint.load = None
    layout = _run(ref, tmp_path / "fp32", data_dir, workers)
    one = config_from_dict(to_dict(ref))
    one.parallel.tensor_model_parallel_size = one.parallel.pipeline_model_parallel_size = 1
    one.cluster.world_size = one.cluster.gpus_per_node = 1
    (tmp_path / "one").mkdir()
    single = train(one, one_process_context(tmp_path / "one"), data_dir, progress=False)
    for step, loss in enumerate(layout):
        close(loss, single.losses[step], rtol=2e-6, site="megatron_examples.gpt3", case=f"step {step}")
