"""ckptio's Python DDP demo: a data-parallel trainer (torch.distributed with
Gloo, DistributedDataParallel, CPU) that checkpoints through ckptio. Run it
with ckptio-launch (Debian 12's torchrun is broken under Python 3.11; the
launcher sets the same variables):

    ckptio-launch -n 4 -- python3 tools/ddp_demo.py --store ./demo-store --steps 60 --every 10

The data of step s on rank r is a pure function of (s, r), every op runs on
one thread, gradients are averaged in rank order (rank_ordered_mean) and
the optimizer's state is checkpointed, so a run that is killed and resumed
ends with exactly the parameters of one that never stopped: rank 0 prints
their SHA-256 so anyone can compare.

--kill-rank0-during-save=STEP SIGKILLs rank 0 in the middle of writing
STEP's checkpoint: a thread watches the step's folder, and kills the
process as soon as the save's first file appears there, before anything is
committed (on an object store, s3://, as soon as its first object is
committed: the step's manifest comes after all of them). The waiting ranks
report the dead writer; the relaunch resumes from the newest step that
verifies.
"""
import argparse
import hashlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ckptio


def batch(step, rank, width):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, width, generator=g)
    return x, x.roll(1, dims=1) * 0.5


def model_of(width, depth):
    torch.manual_seed(42)  # the same initial model on every rank
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def param_hash(model):
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_ordered_mean(world):
    """A DDP communication hook: the mean of a gradient bucket over the
    ranks, summed in rank order. Gloo's all-reduce sums each element in an
    order that depends on its place in the bucket, and DDP lays its buckets
    out anew after the first step of every launch: with it, a resumed run
    differs from an uninterrupted one in the last bits. Gathered and summed
    in rank order, every element's sum is the same whatever the layout."""
    def hook(_state, bucket):
        buf = bucket.buffer()
        parts = [torch.empty_like(buf) for _ in range(world)]
        gathered = dist.all_gather(parts, buf, async_op=True).get_future()

        def mean(_fut):
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            return total.div_(world)

        return gathered.then(mean)
    return hook


def kill_when_the_step_begins(store, step):
    """SIGKILLs this process as soon as the step's folder holds something
    (the save is writing it, nothing is committed yet). On a store that is
    not a local folder (s3://, nfs://), as soon as the step's first object
    is committed: its manifest comes after its other objects."""
    local = store[len("file://"):] if store.startswith("file://") else store
    folder = os.path.join(local, f"step-{step:012d}")
    if "://" in local:
        from ckptio import _ckptio
        keys = _ckptio.Store(store).keys
        begun = lambda: bool(keys(f"step-{step:012d}/"))  # noqa: E731
    else:
        begun = lambda: os.path.isdir(folder) and os.listdir(folder)  # noqa: E731

    def watch():
        while not begun():
            time.sleep(0.0005)
        print(f"rank 0: --kill-rank0-during-save: SIGKILL while writing step {step}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--wait", default="file-lock", choices=["file-lock", "manifest", "store"])
    ap.add_argument("--kill-rank0-during-save", type=int, default=None, metavar="STEP")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("USE_LIBUV", "0")  # PyTorch >= 2.4: Debian's has no libuv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = model_of(args.width, args.depth)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, rank_ordered_mean(world))
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = {"model": model, "optim": optim, "step": 0}
    ckpt = ckptio.Checkpointer(args.store, wait=args.wait, keep_last=3, timeout=120)

    # A store that is damaged or unreachable stops the job: it never
    # restarts from scratch over checkpoints it could not read.
    got = ckpt.load(state)
    start = 1 if got is None else got + 1
    if rank == 0:
        print("no checkpoint yet: starting at step 1" if got is None else
              f"resumed from step {got} (loaded on every rank, verified)", flush=True)
    if rank == 0 and args.kill_rank0_during_save is not None:
        kill_when_the_step_begins(args.store, args.kill_rank0_during_save)

    for step in range(start, args.steps + 1):
        x, y = batch(step, rank, args.width)
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP averages the gradients over the ranks
        optim.step()
        if step % args.every == 0 or step == args.steps:
            state["step"] = step
            try:
                ckpt.save(step, state)
            except ckptio.WriterDiedError as e:
                print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
                return 3
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f}, checkpoint committed", flush=True)
    if rank == 0:
        print(f"final parameter hash: {param_hash(model)}", flush=True)
    dist.barrier()  # no rank leaves while others still need the store
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
