"""One tensor-parallel rank in its own process: joins the process group, builds a ModelRunner on its shard, then
runs every step it receives until told to stop. Started by worker/executor.py, which runs `main()`.

Steps arrive through the node's shared-memory ring; the leader of a node other than 0 receives them from global
rank 0 over torch.distributed and writes that ring for its node. Rank 0 writes each step's result back as soon
as the device has finished it, and never later than when it has launched the next step: so a driver that waits
gets its result, and one that schedules ahead finds the device busy. A worker dies with its parent
(PR_SET_PDEATHSIG) and ignores Ctrl-C, which its parent handles.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass

import msgspec
import torch

from surge.config import EngineConfig
from surge.core.scheduler_output import SchedulerOutput
from surge.distributed.lifecycle import ParentGone, die_with_parent, freeze_startup_objects
from surge.distributed.parallel_state import PeerLostError, destroy_distributed, init_distributed, relay_bytes
from surge.distributed.shm_broadcast import RingHandle, ShmRing
from surge.worker.model_runner import ModelRunner, PendingOutput

# Exit code of a rank whose collective failed because another rank went away: the other rank is the culprit.
PEER_LOST_EXIT = 3


@dataclass
class WorkerArgs:
    config: EngineConfig
    rank: int  # global rank
    local_rank: int
    parent_pid: int
    ready_fd: int  # the worker writes one WorkerReady here
    step_ring: RingHandle | None  # the node's ring this rank reads; None for the leader of a node other than 0
    step_reader: int | None
    relay_ring: RingHandle | None  # leader of a node other than 0: the ring it writes for its node
    result_ring: RingHandle | None  # rank 0: where each step's result goes


class WorkerReady(msgspec.Struct, array_like=True):
    num_blocks: int = 0
    error: str | None = None
    load_seconds: float = 0.0  # the rank's weight load (from disk or the weight cache)


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        config = args.config
        pc = config.parallel_config
        if config.device.type == "cuda":
            device = torch.device("cuda", args.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            # The node's ranks share its cores; oversubscribed threads spin against each other.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.local_world_size))
        config = dataclasses.replace(config, device=device)
        init_distributed(pc, args.rank, device)
        torch.manual_seed(config.seed)  # as EngineCore does: unseeded sampling matches one rank's
        self.relays_to_nodes = args.rank == 0 and pc.nnodes > 1
        self.runner = ModelRunner(config)
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._unsent: PendingOutput | None = None  # rank 0: a launched step whose result is not written yet
        self.step_ring = ShmRing.attach(args.step_ring, args.step_reader) if args.step_ring else None
        self.relay_ring = ShmRing.attach(args.relay_ring, None) if args.relay_ring else None
        self.result_ring = ShmRing.attach(args.result_ring, None) if args.result_ring else None
        self._encoder = msgspec.msgpack.Encoder()

    def check_parent(self) -> None:
        if os.getppid() != self.args.parent_pid:
            raise ParentGone(1)

    def next_step(self) -> bytes:
        if self.step_ring is not None:
            data = self.step_ring.read(check=self.check_parent, idle=self._send_if_ready)
            if self.relays_to_nodes:
                relay_bytes(data)
            return data
        data = relay_bytes(None)  # the leader of a node other than 0
        if self.relay_ring is not None:
            self.relay_ring.write(data, check=self.check_parent)
        return data

    def run(self) -> None:
        while True:
            msg = self._decoder.decode(self.next_step())
            if msg.shutdown:
                return
            launched = self.runner.execute_async(msg)
            if self.result_ring is not None:
                self._send()  # the step before: it ran while this one was prepared
                self._unsent = launched
                self._send_if_ready()

    def _send(self) -> None:
        if self._unsent is not None:
            out, self._unsent = self._unsent.result(), None
            self.result_ring.write(self._encoder.encode(out), check=self.check_parent)

    def _send_if_ready(self) -> None:
        if self._unsent is not None and self._unsent.ready():
            self._send()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    args: WorkerArgs = pickle.load(sys.stdin.buffer)  # from the parent that spawned us, never from a socket
    die_with_parent(args.parent_pid)
    encoder = msgspec.msgpack.Encoder()
    try:
        worker = Worker(args)
    except ParentGone:
        raise
    except BaseException as e:
        traceback.print_exc()
        os.write(args.ready_fd, encoder.encode(WorkerReady(error=f"rank {args.rank}: {type(e).__name__}: {e}")))
        return 1
    os.write(args.ready_fd, encoder.encode(WorkerReady(num_blocks=worker.runner.kv_cache_config.num_blocks,
                                                       load_seconds=worker.runner.load_seconds)))
    os.close(args.ready_fd)
    freeze_startup_objects()
    try:
        worker.run()
    except PeerLostError as e:
        print(f"surge worker rank {args.rank}: {e}", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT
    if worker.runner.kv_connector is not None:
        worker.runner.kv_connector.shutdown()
    destroy_distributed()
    return 0


def run() -> None:
    """The process entry point: exits without the interpreter's slow teardown once the rank is done."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
