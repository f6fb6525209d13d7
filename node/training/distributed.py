"""One node as N torch.distributed ranks: an 8-GPU machine is one peer (FSDP2 inside).

    locoswarm node join --ranks 2 ...          # this process is rank 0 and starts ranks 1..N-1
    torchrun --nproc-per-node 8 -m node.cli node join ...   # every rank from torchrun's environment

Rank 0 runs the whole Node (coordinator, DHT, streams) exactly as a 1-rank node does, with a
training object of the `Training` protocol (node/training/base.py): `RankedTraining`, its outer
step `RankedOuter`. Ranks 1..N-1 run `follow()`: they wait for the small commands rank 0
broadcasts (train round r, encode, prepare these payloads, commit, gather, load, evaluate, stop)
and run the same collective step; `execute` is that step, the same code on every rank.

- Inner loop: the model wrapped with `fully_shard` per block and at the root (FSDP2), gloo on CPU
  (NCCL for CUDA tensors), each rank a disjoint slice of the node's batch, so the global batch is
  the run's and the gradients are its mean.
- Outer step: node/training/sharded_outer.py, on each rank's rows (`DTensor.to_local()`): the
  packet is byte-identical to a 1-rank node's, and so are the parameters after the outer step.
- Rank 0 keeps the global model that starts the round as one whole fp32 copy in host memory
  (`RankedTraining.model`, an unsharded module): after every outer step it is refreshed from the
  ranks tensor by tensor (`gather`), and what the node writes into it (a loaded snapshot or
  checkpoint) goes back to the ranks (`load`). The node's digest, snapshots, amendments and
  checkpoints read it as they read a 1-rank node's round start, so they are unchanged. That copy
  is the price of keeping the round loop unchanged: host memory, never device memory.
- Checkpoints: rank 0 writes the global model only (no inner optimizer state, no error buffer);
  a resumed multi-rank node starts them afresh, as a peer that loaded a snapshot does.
- Processes: every follower exits when rank 0 stops it, when rank 0's connection breaks (a
  collective fails), or when the process that started it is gone (a watchdog on its parent).

Commands travel as msgpack maps broadcast from rank 0 (length, then bytes); nothing is pickled.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from node.training.base import ApplyResult, Prepared
from node.training.inner import InnerResult, make_inner_optimizer, run_inner_steps
from node.training.params import flat_named_params
from protocol.errors import ProtocolError

log = logging.getLogger("locoswarm.node")

COLLECTIVE_TIMEOUT = timedelta(hours=6)  # a follower idles while rank 0 waits for the swarm
PARENT_POLL_S = 1.0  # how often a spawned follower checks that rank 0's process is alive
KEPT_PREPARED = 4  # aggregates kept for a later commit (an amended round recomputes the one before)


@dataclass(slots=True)
class RankGroup:
    """This process's place among the node's ranks; rank 0 also holds the followers it started."""

    rank: int
    world_size: int
    followers: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def spawn(cls, num_ranks: int, device: str, threads: int = 0) -> RankGroup:
        """Rank 0 of `num_ranks`: start ranks 1..N-1 on this machine, then join the group with them."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(num_ranks),
            "LOCOSWARM_PARENT_PID": str(os.getpid()),
            "LOCOSWARM_THREADS": str(threads),
            "LOCOSWARM_DEVICE": device,
        }
        followers = [
            subprocess.Popen(
                [sys.executable, "-m", "node.training.distributed"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            )
            for r in range(1, num_ranks)
        ]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log.info("ranks 1..%d started as processes %s", num_ranks - 1, " ".join(str(f.pid) for f in followers))
        group = cls(0, num_ranks, followers)
        try:
            _init_process_group(0, num_ranks, device)
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def from_env(cls, device: str) -> RankGroup:
        """This rank under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)."""
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init_process_group(rank, world_size, device)
        return cls(rank, world_size)

    def follow(self) -> int:
        """Run as a follower until rank 0 says stop (ranks 1..N-1)."""
        try:
            return follow(self)
        finally:
            self.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the group and stop the followers this process started (by their handles)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + timeout_s
        for follower in self.followers:
            try:
                follower.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.wait()


def start_ranks(num_ranks: int, device: str, threads: int = 0) -> RankGroup | None:
    """This process's rank group: torchrun's (WORLD_SIZE > 1 in the environment), else rank 0 of
    `num_ranks` started here; None for a 1-rank node."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return RankGroup.from_env(device)
    return RankGroup.spawn(num_ranks, device, threads) if num_ranks > 1 else None


def _init_process_group(rank: int, world_size: int, device: str) -> None:
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    )


def broadcast_message(message: Mapping[str, Any] | None) -> dict[str, Any]:
    """Rank 0's `message` on every rank (rank 0 passes it, the others None)."""
    rank = dist.get_rank()
    data = msgpack.packb(message, use_bin_type=True) if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, 0)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buffer, 0)
    return msgpack.unpackb(buffer.numpy().tobytes(), raw=False)


def rank_device(device: str, rank: int) -> torch.device:
    """A rank's device: CUDA rank r uses GPU LOCAL_RANK (r by default); CPU ranks share the CPU."""
    if device.startswith("cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return torch.device(device)


@dataclass(slots=True)
class RankState:
    """What every rank holds: its FSDP2 model, AdamW over its shards, its rows of the outer state."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    outer: Any  # node.training.sharded_outer.ShardedSparseLoCo
    shard: Any  # node.training.data.TokenDataset: the node's part of the training data
    val: Any | None
    inner: Any  # protocol.run_config.InnerSection: the run's [inner]
    device: torch.device
    seed: int
    inner_steps: int
    rank: int
    world_size: int
    prepared: dict[int, Prepared] = field(default_factory=dict)

    @classmethod
    def build(cls, start: Mapping[str, Any], rank: int, world_size: int) -> RankState:
        """The same model, data and outer state on every rank, from rank 0's `start` message."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from node.training.data import check_vocabulary, load_corpus
        from node.training.model import build_model, model_config
        from node.training.sharded_outer import ShardedSparseLoCo
        from protocol.run_config import RunConfig

        run = RunConfig.model_validate_json(start["run"])
        inner = run.inner
        if inner.batch_size % world_size:
            raise ValueError(f"the run's batch of {inner.batch_size} does not split over {world_size} ranks")
        corpus = load_corpus(start["data"])
        shard = corpus.train.shard(start["shard_index"], start["num_shards"])
        val = corpus.val if start["evaluate"] else None
        cfg = model_config(run)
        for data in (shard, val) if val is not None else (shard,):
            check_vocabulary(data, cfg.vocab_size, cfg.tokenizer_id)
        device = rank_device(start["device"], rank)
        model = build_model(cfg, run.model.seed)
        if run.model.init_from is not None:
            from node.training.hf import load_init_weights

            load_init_weights(model, run.model.init_from, run.model.init_sha256)
        model = model.to(device)
        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = flat_named_params(model)
        with torch.no_grad():
            local = {name: p.to_local() for name, p in params.items()}
        outer = ShardedSparseLoCo(
            local,
            {name: tuple(p.shape) for name, p in params.items()},
            run.outer,
            max_packet_bytes=run.exchange.max_packet_bytes,
        )
        return cls(
            model=model,
            optimizer=make_inner_optimizer(model, inner),
            outer=outer,
            shard=shard,
            val=val,
            inner=inner,
            device=device,
            seed=run.model.seed,
            inner_steps=run.inner.steps,
            rank=rank,
            world_size=world_size,
        )

    def train_round(self, round: int, on_step=None, on_step_queued=None) -> InnerResult:
        """Round `round`'s H steps on this rank's slice of every batch of the node's."""
        per_rank = self.inner.batch_size // self.world_size
        rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        start_step = round * self.inner_steps
        batches = (
            (x[rows], y[rows])
            for x, y in self.shard.batches(
                self.inner.batch_size, self.inner.seq_len, self.seed, "cpu", start_step=start_step
            )
        )
        result = run_inner_steps(
            self.model,
            self.optimizer,
            batches,
            start_step,
            self.inner_steps,
            self.inner,
            self.device,
            on_step,
            on_step_queued,
        )
        totals = torch.tensor([result.mean_loss, result.num_tokens], dtype=torch.float64)
        dist.all_reduce(totals)  # the node's mean loss and tokens, over its ranks
        return InnerResult(
            mean_loss=float(totals[0]) / self.world_size, num_tokens=int(totals[1]), compute_s=result.compute_s
        )

    def evaluate(self, num_batches: int) -> float | None:
        from node.training.data import EmptyData, evaluate

        if self.val is None:
            return None
        try:
            next(self.val.val_batches(self.inner.batch_size, self.inner.seq_len, 1))  # long enough?
        except EmptyData as e:  # the same on every rank
            log.warning("no validation loss: %s", e)
            self.val = None
            return None
        try:
            return evaluate(
                self.model,
                self.val,
                num_batches,
                batch_size=self.inner.batch_size,
                seq_len=self.inner.seq_len,
                device=self.device,
            )
        finally:
            # FSDP2 keeps the root's parameters gathered after a forward without backward, and would
            # train on those copies after the outer step wrote the shards: drop them now.
            self.model.reshard()


def execute(
    state: RankState,
    op: str,
    args: Mapping[str, Any],
    *,
    key=None,
    mirror: Mapping[str, torch.Tensor] | None = None,
    on_step=None,
    on_step_queued=None,
) -> Any:
    """One command, the same collective code on every rank; rank 0 passes its key and its host copy
    of the global model (`mirror`), and gets the results."""
    outer = state.outer
    if op == "train":
        return state.train_round(args["round"], on_step, on_step_queued)
    if op == "begin":
        return outer.begin_round()
    if op == "encode":
        return outer.make_payload(
            run_id=args["run_id"],
            round=args["round"],
            peer_id=args["peer_id"],
            base_digest=args["base_digest"],
            key=key,
        )
    if op == "prepare":
        prepared = outer.prepare(args["payloads"], args["public_keys"], run_id=args["run_id"], round=args["round"])
        state.prepared[args["token"]] = prepared
        for old in sorted(state.prepared)[:-KEPT_PREPARED]:
            del state.prepared[old]
        return prepared
    if op == "commit":
        prepared = state.prepared.pop(args["token"], None) if args["token"] is not None else None
        return outer.commit(prepared or Prepared(ApplyResult(accepted=[]), None))
    if op == "gather":  # the global model, tensor by tensor, into rank 0's host copy
        for name in outer.spec.shapes:
            full = outer.gather(name)
            if mirror is not None:
                mirror[name].detach().copy_(full)
        return None
    if op == "load":  # rank 0's host copy onto every rank's rows
        for name in outer.spec.shapes:
            outer.load(name, mirror[name].detach() if mirror is not None else None)
        return None
    if op == "return_unsent":  # every rank puts its rows of an unapplied packet back (no collective)
        return outer.return_unsent(
            args["payload"], args["public_key"], peer_id=args["peer_id"], run_id=args["run_id"], round=args["round"]
        )
    if op == "zero_errors":
        return outer.zero_error_buffers()
    if op == "evaluate":
        return state.evaluate(args["num_batches"])
    raise ValueError(f"unknown command {op!r}")


def follow(group: RankGroup) -> int:
    """A follower's life: build on rank 0's start message, run its commands until it says stop."""
    _watch_parent()
    state = None
    while True:
        message = broadcast_message(None)
        op, args = message["op"], message.get("args", {})
        if op == "stop":
            return 0
        if op == "start":
            state = RankState.build(args, group.rank, group.world_size)
            continue
        try:
            execute(state, op, args)
        except (ValueError, ProtocolError) as e:  # raised alike on every rank: rank 0 decides what follows
            log.warning("rank %d: %s failed: %s", group.rank, op, e)


def _watch_parent() -> None:
    """Exit when the process that started this follower is gone (no orphans after a kill -9).

    A follower started by rank 0 ignores SIGINT and SIGTERM: a Ctrl+C reaches the whole process
    group, and rank 0 must finish its step (collectives with every rank) before it stops them."""
    parent = os.environ.get("LOCOSWARM_PARENT_PID")
    if not parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != int(parent):
                os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Leader:
    """Rank 0's side of the command channel: broadcast a command, run it here too, under one lock
    (the node calls from several threads; the ranks must see one order)."""

    def __init__(self, group: RankGroup):
        self.group = group
        self._lock = threading.Lock()
        self.state: RankState | None = None

    def start(self, args: Mapping[str, Any]) -> RankState:
        with self._lock:
            broadcast_message({"op": "start", "args": dict(args)})
            self.state = RankState.build(args, 0, self.group.world_size)
            return self.state

    def __call__(self, op: str, args: Mapping[str, Any] | None = None, **local) -> Any:
        with self._lock:
            broadcast_message({"op": op, "args": dict(args or {})})
            return execute(self.state, op, args or {}, **local)

    def close(self) -> None:
        """Tell the followers to stop, then leave the group (rank 0's last word)."""
        with self._lock:
            if dist.is_initialized():
                try:
                    broadcast_message({"op": "stop"})
                except RuntimeError as e:  # a follower died first: the others exit on the broken group
                    log.warning("could not stop the node's other ranks cleanly: %s", e)
        self.group.close()


def main() -> int:
    """A follower process (`python -m node.training.distributed`), started by rank 0 or torchrun."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    threads = int(os.environ.get("LOCOSWARM_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    return RankGroup.from_env(os.environ.get("LOCOSWARM_DEVICE", "cpu")).follow()


if __name__ == "__main__":
    sys.exit(main())
