"""Peak live bytes per local logit of an eager cross entropy on fp32-cast logits, forward + backward:
F.cross_entropy on one rank's logits, and torch's DTensor loss_parallel on vocab-sharded ones
(tests/test_calibration.py::test_loss_parallel_holds_16_bytes_a_local_logit_eagerly; run by torchrun
on 2 gloo ranks). Prints "plain B" and "loss_parallel B" on rank 0."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn) -> int:
    """The most bytes live at once among those `fn` allocates (the profiler's memory events in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in p.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tokens, local_vocab = 1024, 2048
    torch.manual_seed(0)
    labels = torch.randint(0, local_vocab * world, (tokens,))
    logits = torch.randn(tokens, local_vocab, dtype=torch.bfloat16, requires_grad=True)  # (T, V/world)

    def plain():
        F.cross_entropy(logits.float(), labels % local_vocab).backward()

    def sharded():
        with loss_parallel():
            F.cross_entropy(DTensor.from_local(logits, mesh, [Shard(1)]).float(), labels).backward()

    for name, fn in (("plain", plain), ("loss_parallel", sharded)):
        per_logit = peak_bytes(fn) / (tokens * local_vocab)
        if dist.get_rank() == 0:
            print(name, per_logit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
