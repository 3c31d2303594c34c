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
from fivefold.errors import NotImplementedYet, UserError
from fivefold.config.batch_sizes import BatchSizes
from fivefold.train.loop import train
from fivefold.config.supported import check_supported
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


# examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh with USE_MEGATRON_FSDP=1 (its default), PROFILE=0 and
# WANDB=0 (its default 1 adds --wandb-project, which needs the wandb package: without it `fivefold train`
# refuses before any rank starts, tests/test_logging.py)
DSV3 = """--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 2
 --expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
 --overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear
 --micro-batch-size 1 --global-batch-size 8 --train-samples 24 --exit-duration-in-mins 220
 --no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective
 --recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 32
 --data-cache-path {out}/cache --tokenizer-type NullTokenizer --vocab-size 255 --mock-data
 --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
 --num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --kv-channels 16
 --max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000
 --make-vocab-size-divisible-by 32 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
 --untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0
 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 20 --lr-warmup-samples 8
 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
 --num-experts 8 --moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-token-dispatcher-type flex
 --moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
 --moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5
 --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
 --moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing
 --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
 --eval-iters 32 --eval-interval 100 --auto-detect-ckpt-format --load {out}/checkpoints --save {out}/checkpoints
 --save-interval 100 --dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard
 --log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard
 --log-throughput --log-interval 1 --logging-level 40 --tensorboard-dir {out}/tensorboard --bf16
 --enable-experimental
 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
 --use-distributed-optimizer --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor
 --fsdp-double-buffer --use-nccl-ub --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16"""

# examples/rl/model_configs/qwen3_30b_a3b_moe.sh: common.sh's COMMON_OPTIONS, then ENV_DEPENDENT and MODEL_OPTIONS
QWEN3 = """--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --use-mcore-models
 --transformer-impl transformer_engine --bf16 --te-rng-tracker --inference-dynamic-batching-buffer-size-gb 20
 --data-parallel-random-init --attention-backend flash --timing-log-level 1 --log-timers-to-tensorboard
 --save-retain-interval 160 --inference-dynamic-batching-num-cuda-graphs 1
 --inference-dynamic-batching-unified-memory-level 1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
 --cuda-graph-impl=local --rl-persist-cuda-graphs
 --micro-batch-size 1 --global-batch-size 8 --grpo-group-size 16 --grpo-prompts-per-step 64 --grpo-iterations 1
 --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.2 --grpo-kl-beta 0.0 --langrl-env-config {out}/env.yaml
 --seq-length 32 --inference-max-seq-length 32 --inference-max-requests 32 --pretrained-checkpoint {out}/ckpt
 --no-use-tokenizer-model-from-checkpoint-args --bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
 --expert-model-parallel-size 2 --attention-backend flash --transformer-impl transformer_engine --te-rng-tracker
 --tokenizer-type NullTokenizer --vocab-size 255 --mock-data --tokenizer-hf-include-special-tokens
 --untie-embeddings-and-output-weights --num-layers 2 --hidden-size 64 --ffn-hidden-size 192
 --num-attention-heads 4 --kv-channels 16 --max-position-embeddings 32 --group-query-attention --num-query-groups 2
 --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope --rotary-percent 1.0
 --rotary-base 1000000 --use-rotary-position-embeddings --swiglu --disable-bias-linear --num-experts 8
 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 0.001 --moe-router-load-balancing-type aux_loss
 --attention-dropout 0.0 --hidden-dropout 0.0 --no-masked-softmax-fusion --attention-softmax-in-fp32
 --vocab-size 255 --make-vocab-size-divisible-by 128 --dist-ckpt-strictness log_unexpected --qk-layernorm
 --moe-token-dispatcher-type alltoall --moe-layer-freq 1 --optimizer adam --adam-beta1 0.9 --adam-beta2 0.999
 --adam-eps 1e-8 --lr 1e-6 --min-lr 1e-7 --lr-warmup-samples 0 --clip-grad 1.0 --weight-decay 0.01
 --no-load-optim --ckpt-format torch_dist --train-iters 2"""


DSV3_REFUSED = ["--rotary-scaling-factor", "--mscale", "--mscale-all-dim", "--enable-experimental", "--init-model-with-meta-device",
                "--fsdp-double-buffer", "--use-nccl-ub", "--megatron-fsdp-grad-comm-dtype",
                "--megatron-fsdp-main-grads-dtype"]
"""YaRN RoPE scaling and Megatron-FSDP's buffer / dtype switches (DeepSeek-V3's routing — group-limited,
expert bias, top-k scaling, router dtype, forced balance — and MTP are built)."""
DSV3_NOT_TRAINED = ["--recompute-modules"]
"""Parsed (the planner models every module) but refused by `fivefold train` before any rank starts: the
runtime recomputes the attention core only (fivefold/config/supported.py)."""
QWEN3_UNKNOWN = ["--tokenizer-hf-include-special-tokens"]
"""Not a flag of Megatron-LM at the pinned commit either (it has only --tokenizer-hf-no-include-special-tokens,
and its parser does not abbreviate): Megatron refuses this script's line too."""
QWEN3_REFUSED = ["--te-rng-tracker", "--inference-dynamic-batching-buffer-size-gb", "--data-parallel-random-init",
                 "--save-retain-interval", "--inference-dynamic-batching-unified-memory-level", "--grpo-group-size",
                 "--grpo-prompts-per-step", "--grpo-iterations", "--grpo-clamp-eps-lower", "--grpo-clamp-eps-upper",
                 "--grpo-kl-beta", "--langrl-env-config", "--inference-max-seq-length", "--inference-max-requests",
                 "--pretrained-checkpoint", "--no-use-tokenizer-model-from-checkpoint-args",
                 "--attention-softmax-in-fp32"]
"""Megatron's RL loop (GRPO, its inference engine), its TE RNG tracker, a random init per DP rank and
fp32 softmax for bf16 attention (the CPU kernels already compute softmax in fp32, but a GPU run would not)."""


def _without(words: list[str], flags: list[str]) -> list[str]:
    """`words` less `flags` and their values."""
    out, i = [], 0
    while i < len(words):
        name = words[i].split("=")[0]
        i += 1
        if name in flags:
            while "=" not in words[i - 1] and i < len(words) and not words[i].startswith("--"):
                i += 1
        else:
            out.append(words[i - 1])
    return out


def _refused(words: list[str]) -> tuple[list[str], list[str]]:
    """(unknown flags, flags not built) named in the refusal of `words`."""
    with pytest.raises(UserError) as e:
        load_config(None, words)
    text = str(e.value)
    unknown = [part.split()[0] for part in text.split(" | ")[0].removeprefix("unknown flags ")
               .removeprefix("unknown flag ").split("; ")] if text.startswith("unknown") else []
    built = text.split("Megatron-LM flag")[1].split(" (they change")[0].lstrip("s ").split(", ")
    return unknown, built


@pytest.mark.parametrize("name", ["dsv3", "qwen3"])
def test_script_refuses_what_is_not_built_and_trains_without_it(name, tmp_path, workers):
    """The refusal names every flag not built in one message (DeepSeek-V3's list, Qwen3-30B-A3B's
    unknown flag and its list); without those flags the line validates and trains 3 / 2 steps on 4
    ranks (DeepSeek-V3: MLA with its latent norms, first layer dense, sigmoid group-limited routing with
    expert bias, top-k scaling and forced balance, EP2 under Megatron-FSDP ZeRO-3; Qwen3: q/k norms,
    GQA, TP2+SP x EP2)."""
    text, unknown, refused = {"dsv3": (DSV3, [], DSV3_REFUSED), "qwen3": (QWEN3, QWEN3_UNKNOWN, QWEN3_REFUSED)}[name]
    words = _words(text, out=tmp_path)
    assert _refused(words) == (unknown, refused)
    if name == "dsv3":
        parsed = load_config(None, _without(words, unknown + refused), world_size=4).config
        assert parsed.training.recompute_modules == ["mlp", "moe", "mla_up_proj", "layernorm"]
        with pytest.raises(NotImplementedYet, match="recompute_modules"):
            check_supported(parsed)
        refused = refused + DSV3_NOT_TRAINED
    loaded = load_config(None, _without(words, unknown + refused), world_size=4)
    validate(loaded.config, loaded.dialect)
    cfg = loaded.config
    if name == "dsv3":
        m = cfg.model
        assert (m.multi_latent_attention, m.qk_layernorm, m.moe_first_k_dense_layers, m.moe_router_score_function,
                cfg.training.data_parallel_sharding_strategy, cfg.training.train_iters) == \
            (True, True, 1, "sigmoid", "optim_grads_params", 3)
        # its --moe-router-pre-softmax is dropped: Megatron renormalises sigmoid top-k weights whatever it says
        assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor,
                m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate, m.moe_router_dtype,
                m.moe_router_force_load_balancing, m.moe_router_pre_softmax) == \
            (4, 2, 2.5, True, 1e-3, "fp32", True, False)
    data_dir = prepare(cfg, tmp_path / "run")
    losses = _run(cfg, tmp_path / "run", data_dir, workers)
    assert len(losses) == cfg.training.train_iters and all(np.isfinite(losses))


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


def test_preprocess_writes_the_bpe_ids_of_the_vocab_and_merges(gpt2_corpus):
    """`preprocess --vocab-file --merge-file` tokenizes with that GPT-2 BPE (it wrote byte ids once:
    the tokenizer type was overwritten by the input's format), read against Hugging Face tokenizers'
    own byte-level BPE on the same files, each document followed by its end-of-document id."""
    from tokenizers import ByteLevelBPETokenizer

    from fivefold.data.indexed import open_corpus

    bpe = ByteLevelBPETokenizer(gpt2_corpus["vocab"], gpt2_corpus["merges"])
    eod = bpe.token_to_id("<|endoftext|>")
    corpus = open_corpus(gpt2_corpus["data"])
    texts = [json.loads(line)["text"] for line in (Path(gpt2_corpus["vocab"]).parent / "docs.jsonl").open()]
    assert len(corpus.starts) - 1 == len(texts)
    for i in (0, 1, len(texts) - 1):
        got = corpus.tokens[corpus.starts[i]:corpus.starts[i + 1]].tolist()
        assert got == bpe.encode(texts[i]).ids + [eod], i


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
