"""Per-step metrics: model FLOPs, peak memory, OUT/metrics.jsonl, TensorBoard, the loss-curve PNG.

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; as Megatron's MFU):
  6 N + 12 L a d s
N = parameters in matrix multiplies (all but the input embedding; the output layer counts),
L layers, a query heads, d head dim, s sequence length. 6N = forward 2N + backward 4N; 12 L a d s is
the attention score and value matmuls (QK^T and AV) forward and backward, counted over the full
s x s square as PaLM does. TFLOP/s per rank = FLOPs per token x tokens per step / step time / ranks.

metrics.jsonl is strict JSON: a NaN or infinite value (a run driven to NaN with the non-finite check
off) is written as null, never as the `NaN` that JSON does not have.
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
from pathlib import Path

import torch

from fivefold.config.schema import ModelConfig
from fivefold.data.sources import json_lines
from fivefold.errors import UserError, write_failed, writing_file


def matmul_params(model: ModelConfig, tp: int = 1) -> int:
    """N: weights of the decoder's matrix multiplies plus the output layer (dense model)."""
    h, d, a, kv = model.hidden_size, model.head_dim, model.num_attention_heads, model.kv_heads
    attn = h * a * d + 2 * h * kv * d + a * d * h
    mlp = model.mlp_matrices * h * model.ffn_size
    return model.num_layers * (attn + mlp) + model.padded_vocab_size(tp) * h


def flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Training model FLOPs per token, as the planner counts them (fivefold.planner.time.flops: the matmuls a
    token passes through, top-k routed experts, MLA, MTP, causal attention; Megatron-Core's count)."""
    from fivefold.planner.time.flops import model_flops_per_token
    return model_flops_per_token(model, seq_length)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak bytes allocated by tensors. CPU: the process's peak resident memory (VmHWM), which
    includes the Python interpreter and torch's libraries (~0.3-0.5 GB) besides tensors."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLog:
    """Rank 0's sink: one JSON object per line in OUT/metrics.jsonl, and TensorBoard when installed."""

    def __init__(self, out_dir: str | Path, tensorboard: bool, resume_from: int = 0, *,
                 tensorboard_dir: str | None = None, wandb_project: str | None = None, wandb_exp_name: str | None = None):
        """Starts a new file, or on resume keeps the rows of steps before `resume_from`. TensorBoard
        logs go to `tensorboard_dir` (default OUT/tensorboard); with `wandb_project`, W&B offline too."""
        self.path = Path(out_dir) / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r["step"] < resume_from] \
            if resume_from and self.path.is_file() else []
        try:
            self.file = open(self.path, "w")
            for r in kept:
                self.file.write(json.dumps(r) + "\n")
        except OSError as e:
            raise write_failed(self.path, e, "the run's metrics") from None
        self.tb = None
        self.wandb_dir = Path(out_dir) / "wandb"
        self.wandb = None
        if wandb_project:
            with _writing(self.wandb_dir, WANDB_WHAT):
                self.wandb = open_wandb(out_dir, wandb_project, wandb_exp_name)
        self.tb_dir = Path(tensorboard_dir) if tensorboard_dir else Path(out_dir) / "tensorboard"
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # said once, not skipped silently: `make setup` installs tensorboard
                print("note: logging.tensorboard is on but the tensorboard package is not importable, so no "
                      f"TensorBoard logs are written to {self.tb_dir} (fix: pip install "
                      "tensorboard, or logging.tensorboard=false); metrics.jsonl is written", file=sys.stderr, flush=True)
            else:
                quiet_tensorboard_writer_threads()
                with _writing(self.tb_dir, TENSORBOARD_WHAT):
                    self.tb = SummaryWriter(str(self.tb_dir))

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl; to TensorBoard / W&B the numbers, a {layer: number} field as one
        scalar per layer (`moe_aux_loss_per_layer/layer_3`), and to TensorBoard a {layer: [count per
        expert]} field as a histogram over the expert index (`moe_tokens_per_expert/layer_3`)."""
        try:
            self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:
            raise write_failed(self.path, e, "the run's metrics; the lines before this step are in it") from None
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        per_layer = {k: v for k, v in record.items() if isinstance(v, dict)}
        scalars.update({f"{k}/layer_{layer}": x for k, v in per_layer.items() for layer, x in v.items()
                        if isinstance(x, (int, float))})
        if self.tb is not None:
            with _writing(self.tb_dir, TENSORBOARD_WHAT):
                for k, v in scalars.items():
                    self.tb.add_scalar(k, v, record["step"])
                for k, v in per_layer.items():
                    for layer, counts in v.items():
                        if isinstance(counts, list):
                            _add_counts(self.tb, f"{k}/layer_{layer}", counts, record["step"])
                self.tb.flush()  # its thread writes the events: a full disk is raised here, at this step's line
        if self.wandb is not None:
            with _writing(self.wandb_dir, WANDB_WHAT):
                self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            with _writing(self.tb_dir, TENSORBOARD_WHAT):
                self.tb.flush()  # (its close does not say whether its thread's last writes failed)
                self.tb.close()
        if self.wandb is not None:
            with _writing(self.wandb_dir, WANDB_WHAT):
                self.wandb.finish()


TENSORBOARD_WHAT = "the TensorBoard logs; metrics.jsonl has every step's numbers"
WANDB_WHAT = "the W&B offline run; metrics.jsonl has every step's numbers"


def _writing(folder: Path, what: str):
    """An OSError from a writer of `folder` (a full disk, a read-only folder) as `write_failed`, naming its file."""
    return writing_file(folder, what, partial=False)


def quiet_tensorboard_writer_threads() -> None:
    """TensorBoard writes its events in a thread; an OSError there (a full disk) printed that thread's
    traceback, and the writer raises it again on the next call from the main thread (`MetricsLog`
    names it there). The thread's traceback is left out; any other thread's exception is printed as before."""
    if getattr(threading.excepthook, "quiets_tensorboard", False):
        return
    before = threading.excepthook

    def hook(args):
        if isinstance(args.exc_value, OSError) and \
                type(args.thread).__module__.startswith("tensorboard.summary.writer"):
            return
        before(args)
    hook.quiets_tensorboard = True
    threading.excepthook = hook


def _add_counts(tb, tag: str, counts: list[int], step: int) -> None:
    """counts[i] items at index i as a TensorBoard histogram: one bucket per index (bucket i ends at i + 0.5)."""
    total = sum(counts)
    if total == 0:
        return
    tb.add_histogram_raw(tag, min=0, max=len(counts) - 1, num=total, sum=sum(i * c for i, c in enumerate(counts)),
                         sum_squares=sum(i * i * c for i, c in enumerate(counts)),
                         bucket_limits=[i + 0.5 for i in range(len(counts))], bucket_counts=counts, global_step=step)


def check_wandb(project: str | None) -> None:
    """Refuse a W&B project when the wandb package is missing (before any rank starts)."""
    if project is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError(f"logging.wandb_project={project!r} (--wandb-project) needs the wandb package, which is not "
                        "installed (fix: pip install wandb, or drop the W&B project; metrics.jsonl and TensorBoard "
                        "are written either way)") from None


def open_wandb(out_dir: str | Path, project: str, name: str | None):
    """A W&B run in offline mode: it writes under OUT/wandb and never reaches the network
    (`wandb sync OUT/wandb/offline-run-*` uploads it later)."""
    check_wandb(project)
    import wandb

    return wandb.init(project=project, name=name, dir=str(out_dir), mode="offline")


def json_safe(value):
    """`value` with every non-finite float (nested in dicts and lists too) replaced by None (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _nan_for_null(v) -> float:
    return math.nan if v is None else v


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, less a last line cut off by a run stopped while writing it
    (`json_lines`); another line that is not JSON is refused naming the file and line."""
    return [row for _, row in json_lines(Path(path), cut_off_last=True)]


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Training loss per step (and eval loss where measured) as a PNG (matplotlib, Agg backend)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    # null (a non-finite value) is drawn as a gap
    ax.plot([r["step"] for r in rows], [_nan_for_null(r["loss"]) for r in rows], label="train")
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [_nan_for_null(r["eval_loss"]) for r in ev], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, png_path, "the loss curve; metrics.jsonl holds the numbers", dpi=100)
    return Path(png_path)


def save_figure(fig, path: str | Path, what: str, **kw) -> None:
    """fig.savefig(path), closed; a full disk or read-only folder named (`what`), the partial file removed."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, **kw)
    except OSError as e:
        Path(path).unlink(missing_ok=True)
        raise write_failed(path, e, what) from None
    finally:
        plt.close(fig)
