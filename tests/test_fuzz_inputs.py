"""No input ends in a traceback: random flags, YAML and allocation strings through validate and layout.

Each case runs a command's `main(argv)` in this process (output captured) and asserts what a user
may rely on: exit 0 or 2, a message, no traceback, and a peak of traced Python memory under 200 MiB
whatever world size the input names (a report must cost what it prints, never a per-rank table).
Cases are drawn by hypothesis with `derandomize=True`: the same cases on every run. A handful of
cases go through the real `python -m fivefold` as well.
"""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tracemalloc

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fivefold.cli import main
from fivefold.config.fields import ALIASES, TYPES
from fivefold.config.megatron import FLAGS

PEAK_LIMIT = 200 * 2**20
CASES = {"flags": 850, "yaml": 650, "allocation": 550}  # >= 2,000 in all

def fuzz(n: int) -> settings:
    return settings(max_examples=n, derandomize=True, deadline=None, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))

# ---- values and words ----

sizes = st.one_of(st.integers(-3, 17), st.sampled_from([0, 1, 2, 3, 4, 8, 64, 4096, 2**31, 10**12, 10**40]),
                  st.integers(-(10**30), 10**30))
texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)
values = st.one_of(sizes.map(str), st.sampled_from(["true", "false", "none", "", "1.5", "nan", "inf", "-0",
                                                    "1e400", "[2,2]", "p2p", "a2a+p2p", "interleaved",
                                                    "9" * 5000, "\u00e9\u00e8", "tp-cp-ep-dp-pp"]), texts)
keys = st.one_of(st.sampled_from(sorted(TYPES) + sorted(ALIASES)),
                 st.sampled_from(sorted(TYPES)).map(lambda k: "actor.model." + k.split(".")[1]),
                 st.sampled_from(sorted(TYPES)).map(lambda k: "trainer.policy.megatron_config." + k.split(".")[1]),
                 st.sampled_from(sorted(TYPES)).map(lambda k: "cfg.model." + k.split(".")[1]), texts)
megatron = st.sampled_from(sorted(FLAGS))
option = st.sampled_from(["--world-size", "--nodes", "--gpus-per-node"])
word_lists = st.lists(st.one_of(
    st.tuples(megatron, values).map(list),                  # --flag value
    megatron.map(lambda f: [f]),                            # a switch (or a flag missing its value)
    st.tuples(keys, values).map(lambda kv: [f"{kv[0]}={kv[1]}"]),
    st.tuples(option, sizes).map(lambda ov: [ov[0], str(ov[1])]),
    st.just(["--all-ranks"]), texts.map(lambda t: [t])), max_size=8).map(lambda ws: [w for g in ws for w in g])
grid_words = st.lists(st.one_of(
    st.tuples(st.sampled_from(["--tp", "--pp", "--cp", "--ep", "--etp", "--dp", "--world-size", "--rank"]),
              sizes).map(lambda ov: [ov[0], str(ov[1])]),
    st.tuples(st.just("--order"), st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "pp-dp-ep-cp-tp", "tp-tp",
                                                   "tp-cp-dp-pp", "x"])).map(list),
    st.just(["--all-ranks"])), max_size=6).map(lambda ws: [w for g in ws for w in g])

# ---- YAML documents ----

yaml_keys = st.one_of(st.sampled_from(["cluster", "parallel", "model", "training", "actor", "models",
                                       "allocation_mode", "world_size", "num_nodes", "gpus"]),
                      st.sampled_from(sorted(TYPES)).map(lambda k: k.split(".")[1]), texts)
leaves = st.one_of(st.none(), st.booleans(), sizes, st.floats(allow_nan=True), texts,
                   st.sampled_from(["0-3", "0,2", "d2t2", "sglang.d2t2p1+d1t4p1", "-1", "0-99999999999"]))
trees = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(yaml_keys, inner, max_size=5)), max_leaves=20)


def _dump(tree) -> bytes:
    return yaml.safe_dump(tree, allow_unicode=True, sort_keys=False).encode()


documents = st.one_of(
    st.dictionaries(yaml_keys, trees, max_size=6).map(_dump),
    trees.map(_dump),
    st.binary(max_size=64),                                                    # binary / non-UTF-8
    st.integers(1, 20_000).map(lambda n: ("[" * n + "]" * n).encode()),        # deep nesting
    st.integers(1, 6000).map(lambda n: f"tp: {'7' * n}\n".encode()),           # huge integers
    st.lists(st.tuples(yaml_keys, st.one_of(st.none(), sizes)), max_size=6).map(  # indentation lost
        lambda kv: "".join(f"{k}:{'' if v is None else ' ' + str(v)}\n" for k, v in kv).encode()),
)

# ---- allocation strings ----

dims = st.lists(st.tuples(st.sampled_from("dtpcexz"), st.one_of(sizes, st.integers(0, 9))), max_size=4).map(
    lambda ds: "".join(f"{k}{v}" for k, v in ds))
backend = st.sampled_from(["sglang", "vllm", "megatron", "fsdp", "train", "foo", ""])
component = st.one_of(st.tuples(backend, st.sampled_from([":", "."]), dims).map("".join),
                      st.tuples(dims, dims).map(lambda ad: f"megatron:(attn:{ad[0]}|ffn:{ad[1]})"), dims)
allocations = st.one_of(st.lists(component, min_size=1, max_size=3).flatmap(
    lambda cs: st.sampled_from(["+", "|"]).map(lambda sep: sep.join(cs))),
    st.text(alphabet="dtpce0123456789:.+|()sglangmetrai ", max_size=30))


# ---- the check ----

def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    tracemalloc.start()  # around the command only: hypothesis's own drawing is not traced (nor slowed)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse: usage error (2) or -h (0)
                code = e.code if isinstance(e.code, int) else 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = out.getvalue() + err.getvalue()
    assert code in (0, 2), f"exit {code} for {argv!r}:\n{text[-2000:]}"
    assert text.strip(), f"no message for {argv!r}"
    assert "Traceback" not in text, f"traceback for {argv!r}:\n{text[-2000:]}"
    assert peak < PEAK_LIMIT, f"peak {peak / 2**20:.0f} MiB for {argv!r}"
    return code, text


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@fuzz(CASES["flags"])
@given(argv=st.one_of(word_lists.map(lambda ws: ["validate", *ws]), grid_words.map(lambda ws: ["layout", *ws])))
def test_random_words(argv):
    _run(argv)


@fuzz(CASES["yaml"])
@given(doc=documents, suffix=st.sampled_from([".yaml", ".yaml", ".txt"]), words=word_lists,
       command=st.sampled_from(["validate", "validate", "layout"]))
def test_random_files(config_dir, doc, suffix, words, command):
    path = config_dir / f"config{suffix}"
    path.write_bytes(doc)
    _run([command, str(path), *(words if command == "validate" else [])])


@fuzz(CASES["allocation"])
@given(mode=allocations, command=st.sampled_from(["layout", "validate"]),
       rank=st.one_of(st.none(), st.integers(-2, 40)))
def test_random_allocations(mode, command, rank):
    if command == "layout":
        _run(["layout", mode, *([] if rank is None else ["--rank", str(rank)])])
    else:
        _run(["validate", f"allocation_mode={mode}"])


def test_known_bad_inputs_refused_with_a_message(config_dir):
    """The inputs of issue 19, each refused (exit 2) with what is wrong and the fix."""
    seed = config_dir / "seed000.yaml"  # seed 000's sizing example, indentation lost in copying
    seed.write_text("cluster:\nnum_nodes: 16\nactor:\nmodel:\ntensor_model_parallel_size: 2\n")
    binary = config_dir / "binary.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    rlinf = config_dir / "rlinf.yaml"
    rlinf.write_text("cluster:\n  num_nodes: 16\n")
    for argv, needle in [
        (["validate", str(seed)], "indentation was probably lost"),
        (["validate", str(binary)], "is not a text file"),
        (["validate", str(rlinf), "--world-size", "4"], "give one: world_size=128"),
        (["layout", "--tp", "0"], "--tp 0: must be >= 1"),
        (["layout", "--world-size", "10000000000", "--all-ranks"], "more than the 65536 it prints"),
        (["validate", "pp=4", "num_layers=8", "decoder_first_pipeline_num_layers=8", "--world-size", "8"],
         "at least one layer each"),
    ]:
        code, text = _run(argv)
        assert code == 2 and needle in text, (argv, text)


def test_absurd_world_size_prints_only_what_is_asked():
    code, text = _run(["validate", "tp=2", "--world-size", str(10**15)])
    assert code == 0 and f"world={10**15}" in text and "... (500000000000000 groups)" in text
    assert len(text) < 20_000


@pytest.mark.parametrize("argv", [
    ["validate", "tp=2", "--world-size", str(10**12)],
    ["validate", "--tensor-model-parallel-size", "0", "--world-size", "8"],
    ["layout", "sglang:d4t2+megatron:(attn:d1p2t4|ffn:d1p2e4)", "--rank", "99"],
    ["validate", "/dev/null/missing.yaml"],
    ["layout", "--tp", "3", "--world-size", "8"],
])
def test_through_the_real_cli(argv):
    r = subprocess.run([sys.executable, "-m", "fivefold", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 2) and (r.stdout + r.stderr).strip(), r
    assert "Traceback" not in r.stderr, r.stderr


def test_output_into_head_ends_quietly():
    """`fivefold layout ... | head -1`: the reader stops early; no BrokenPipeError, exit 141 as Unix tools."""
    r = subprocess.run(f"{sys.executable} -m fivefold layout --world-size 60000 --all-ranks | head -1; "
                       "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.startswith("TP=1 CP=1 PP=1 DP=60000") and r.stderr == "", r.stderr
    assert r.returncode == 141


# ---- the planner's commands ----

planner_words = st.lists(st.one_of(
    st.tuples(st.sampled_from(["--gpus", "--gpus-per-node", "--gpu", "--gpu-memory-gib", "--bf16-tflops",
                               "--network-gbs", "--gemm-efficiency", "--allocator-overhead", "--matmul-ceiling"]),
              st.one_of(sizes.map(str), st.sampled_from(["h100-sxm", "b200", "x", "nan", "-inf", "0.5"]))).map(list),
), max_size=3).map(lambda ws: [w for g in ws for w in g])


@fuzz(300)
@given(model=st.sampled_from(["llama3-8b", "mixtral-8x7b", "deepseek-v3", "nope"]), words=planner_words,
       more=word_lists)
def test_random_estimates(model, words, more):
    """`estimate` of one layout (milliseconds each): random hardware options and config words."""
    _run(["estimate", "--model", model, *words, *more])


@pytest.mark.parametrize("words", [
    ["--gpus", str(10**12)], ["--gpus", "0"], ["--gpus", "16", "--gpus-per-node", "-8"], ["--gpus", "16", "--top", "-3"],
    ["--gpus", "16", "--micro-batch", "0"], ["--gpus", "16", "--seq-len", "0"], ["--gpus", "16", "--global-batch", "-4"],
    ["--gpus", "16", "--gpu-memory-gib", "-1"], ["--gpus", "16", "--network-gbs", "nan"],
    ["--gpus", "16", "--allocator-overhead", "-5"], ["--gpus", "16", "--schedules", "fast"],
    ["--gpus", "16", "--dp-modes", "zero4"], ["--gpus", "16", "--matmul-ceiling", "1.5"],
    ["--gpus", "16", "--matmul-ceiling", "nan"],
])
def test_plan_refuses_bad_sizes_before_searching(words):
    """Each used to search (a 10^12-GPU cluster for minutes), print nonsense (--top -3 printed every row
    but three, a negative allocator overhead negative memory) or end in a ZeroDivisionError."""
    code, text = _run(["plan", "--model", "llama3-8b", *words])
    assert code == 2 and ("must be" in text or "up to" in text or "unknown" in text or "expected" in text), text
