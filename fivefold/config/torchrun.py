"""torchrun / `python -m torch.distributed.run` options, every one classified: a launcher in front of
a config's words is read, not skipped.

OPTIONS is the whole option list of torch/distributed/run.py (torch 2.13's `get_args_parser`;
tests/test_torchrun_options.py reads the installed torch's parser source and checks the table is it,
less the options of later releases, `SINCE`). Each option is

  taken     it says the job's size: --nproc-per-node (cluster.gpus_per_node; `gpu`, `auto`, `cpu`,
            `xpu` mean "this node's devices", the config's own value), --nnodes (cluster.num_nodes;
            an elastic range MIN:MAX plans the full job of MAX nodes), --standalone (one node);
            -m / --no-python / --run-path say what the script word is;
  no effect where and how the launcher starts, watches and restarts processes (rendezvous, ports,
            logs, restarts): the same job is trained; `validate` lists each;
  unknown   refused with the closest options.
None changes what is trained and is not built, so nothing is refused as "not implemented yet".
"""
from __future__ import annotations

from pathlib import Path

from fivefold.config.fields import did_you_mean
from fivefold.errors import UserError

SWITCH, VALUE = "switch", "value"
_PLACE = "where or how torchrun starts processes (the same job is trained)"
_WATCH = "how torchrun watches, logs and restarts processes (the same job is trained)"

OPTIONS: dict[tuple[str, ...], tuple[str, str | None, str]] = {
    # option strings: (kind, canonical field or None, why it changes nothing, for the None ones)
    ("--nnodes",): (VALUE, "cluster.num_nodes", ""),
    ("--nproc-per-node", "--nproc_per_node"): (VALUE, "cluster.gpus_per_node", ""),
    ("--standalone",): (SWITCH, "cluster.num_nodes", ""),
    ("-m", "--module"): (SWITCH, None, "the script word is a Python module"),
    ("--no-python", "--no_python"): (SWITCH, None, "the script word is an executable"),
    ("--run-path", "--run_path"): (SWITCH, None, "the script word is a file path"),
    ("--rdzv-backend", "--rdzv_backend"): (VALUE, None, _PLACE),
    ("--rdzv-endpoint", "--rdzv_endpoint"): (VALUE, None, _PLACE),
    ("--rdzv-id", "--rdzv_id"): (VALUE, None, _PLACE),
    ("--rdzv-conf", "--rdzv_conf"): (VALUE, None, _PLACE),
    ("--node-rank", "--node_rank"): (VALUE, None, _PLACE),
    ("--master-addr", "--master_addr"): (VALUE, None, _PLACE),
    ("--master-port", "--master_port"): (VALUE, None, _PLACE),
    ("--local-addr", "--local_addr"): (VALUE, None, _PLACE),
    ("--start-method", "--start_method"): (VALUE, None, _PLACE),
    ("--numa-binding", "--numa_binding"): (VALUE, None, _PLACE),
    ("--virtual-local-rank", "--virtual_local_rank"): (SWITCH, None, _PLACE),
    ("--role",): (VALUE, None, _PLACE),
    ("--max-restarts", "--max_restarts"): (VALUE, None, _WATCH),
    ("--monitor-interval", "--monitor_interval"): (VALUE, None, _WATCH),
    ("--event-log-handler", "--event_log_handler"): (VALUE, None, _WATCH),
    ("--log-dir", "--log_dir"): (VALUE, None, _WATCH),
    ("-r", "--redirects"): (VALUE, None, _WATCH),
    ("-t", "--tee"): (VALUE, None, _WATCH),
    ("--local-ranks-filter", "--local_ranks_filter"): (VALUE, None, _WATCH),
    ("--duplicate-stdout-filters", "--duplicate_stdout_filters"): (VALUE, None, _WATCH),
    ("--duplicate-stderr-filters", "--duplicate_stderr_filters"): (VALUE, None, _WATCH),
    ("--logs-specs", "--logs_specs"): (VALUE, None, _WATCH),
    ("--signals-to-handle", "--signals_to_handle"): (VALUE, None, _WATCH),
    ("--shutdown-timeout", "--shutdown_timeout"): (VALUE, None, _WATCH),
}
BY_NAME = {name: spec for names, spec in OPTIONS.items() for name in names}
SINCE = {"--shutdown-timeout": (2, 12), "--shutdown_timeout": (2, 12)}
"""Options the oldest torch we run on (2.11) lacks -> the torch release that added them; a launcher
line of a newer torch is read the same on an older one (they change nothing that is trained)."""
LAUNCHERS = ("torchrun", "torch.distributed.run")


def launcher_value(name: str, value: str) -> str | None:
    """An option's text as the config value, or None (keep the config's): `gpu` / `auto` / `cpu` /
    `xpu` processes per node mean this node's devices; an elastic node range MIN:MAX plans MAX nodes
    (a run on fewer then stops at the world-size check, naming the sizes)."""
    if name.startswith("--nproc") and value in ("gpu", "auto", "cpu", "xpu"):
        return None
    if name == "--nnodes" and ":" in value:
        return value.partition(":")[2]
    return value


def strip_launcher(words: list[str]) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """`torchrun [options] script [subcommand words]` (or `python -m torch.distributed.run ...`) ->
    (the script's own words, [(canonical field, value)] the options set, notes on options without
    effect). Words with no launcher in front come back as they are; an unknown option is refused."""
    if len(words) > 2 and Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "torch.distributed.run"]:
        words = words[2:]
    if not words or Path(words[0]).name not in LAUNCHERS:
        return words, [], []
    settings, notes, module, i = [], [], False, 1
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if name not in BY_NAME:
            raise UserError(f"unknown torchrun option {name}{did_you_mean(name, BY_NAME)} (torchrun's options "
                            "come before the script; the script's own flags after it)")
        kind, field, why = BY_NAME[name]
        if kind == VALUE and not eq:
            if i + 1 >= len(words):
                raise UserError(f"torchrun option {name} needs a value")
            value, i = words[i + 1], i + 1
        i += 1
        if name == "--standalone":
            settings.append((field, "1"))
        elif field and launcher_value(name, value) is not None:
            settings.append((field, launcher_value(name, value)))
        elif field is None:
            notes.append(f"{name}{' ' + value if kind == VALUE else ''}: {why}")
        module |= name in ("-m", "--module")
    i += 1  # the script (or module)
    if module:  # `-m fivefold train`: the module's own subcommand words are not config
        while i < len(words) and not words[i].startswith("-") and "=" not in words[i]:
            i += 1
    return words[i:], settings, notes
