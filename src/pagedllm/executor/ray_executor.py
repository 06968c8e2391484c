"""Tensor parallelism with Ray (--distributed-executor-backend ray): ranks 1..N-1 are Ray actors
instead of processes spawned here, so that they may run on any node of a Ray cluster; rank 0
stays the engine's own process (the driver worker: scheduler, KV block manager, sampling). All
else is the multiproc executor's: each actor runs the same run_worker, joins the same
torch.distributed group and replays the same step messages (distributed.step_channel). Only who
starts the ranks, how a lost one shows and how they are stopped differ.

Placement: a placement group of one bundle per rank, {"CPU": this node's cores / N} (and one GPU
on CUDA), PACK unless PAGEDLLM_RAY_PLACEMENT names another of Ray's strategies. Bundle 0 is
rank 0's, held on this process's node (a sliver of Ray's `node:<ip>` resource) so that the
actors do not take its cores (and GPU: rank 0 keeps its node's first, or LOCAL_RANK's); bundle
r is rank r's actor, which sees only the GPU Ray gives it. The ranks meet at --master-addr /
--master-port when given, else at this node's address as Ray knows it (one the other nodes
reach) and a free port.

Liveness: an actor's `run` call lasts as long as its rank, so its result becoming ready (an
error: the actor died or was killed) is how a lost rank shows. A rank cannot watch rank 0's
process across nodes as a spawned one does (procs.die_with_parent); instead it exits when its
group breaks (its collective fails once rank 0's sockets close), Ray ends the actors of an owner
(this process) that is gone, and shutdown, run at exit too, kills any actor left.
"""

from __future__ import annotations

import logging
import os
import socket
from concurrent import futures

import torch

from pagedllm.cpu_info import available_cpus
from pagedllm.distributed.process_group import launched_rank
from pagedllm.executor.multiproc import MultiprocExecutor, run_worker

logger = logging.getLogger("pagedllm")

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PLACEMENT_TIMEOUT = 120.0  # seconds for the cluster to place the group and start its actors


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "--distributed-executor-backend ray needs Ray, which is not installed: "
            "pip install pagedllm[ray]"
        ) from e
    return ray


class RankActor:
    """One rank > 0, in a Ray worker process (made an actor class by ray.remote at launch)."""

    def where(self) -> tuple[str, int]:
        """This actor's node id and process id (asked first: `run` holds the actor)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, config, rank: int, address: tuple[str, int], num_cpus: int) -> None:
        """Be `rank` until rank 0 says shutdown. Ending any other way, the process exits at
        once: its group is broken for good and rank 0 may be gone, with no one to stop it."""
        torch.set_num_threads(num_cpus)  # its bundle's cores (init_device may lower it)
        if torch.device(config.device.device).type == "cuda":
            os.environ["LOCAL_RANK"] = "0"  # Ray shows each actor its own GPU only
        try:
            run_worker(config, rank, address)
        except BaseException:
            logger.exception("tensor-parallel rank %d (Ray actor) failed", rank)
            logging.shutdown()
            os._exit(1)


class RayExecutor(MultiprocExecutor):
    """Ranks 1..N-1 as Ray actors in a placement group (see the module's docstring). It joins
    --ray-address, else RAY_ADDRESS, else what ray.init() finds (a cluster started on this host,
    else a new local one), unless this process is connected to Ray already; it disconnects (and
    stops the local cluster it started, if it did) at shutdown only if it connected. (One
    process is one rank of one group: there is no second executor to share the connection.)"""

    def _launch(self, size: int) -> tuple[str, int]:
        ray = import_ray()
        if self.config.parallel.nnodes != 1 or launched_rank() is not None:
            raise ValueError(
                "--distributed-executor-backend ray places every rank on the Ray cluster itself: "
                "it takes neither --nnodes nor ranks started by a launcher (torchrun)"
            )
        self.actors: list = []
        self.nodes: list[str] = []  # each actor's Ray node id
        self.pids: list[int] = []  # and process id
        self._runs: list = []  # each actor's `run` call
        self._ends: list[futures.Future] = []  # and as futures
        self._pg = None
        self._lost: str | None = None
        self._owns_ray = not ray.is_initialized()
        try:
            return self._start_actors(ray, size)
        except BaseException:
            self._stop_ranks(0)
            raise

    def _start_actors(self, ray, size: int) -> tuple[str, int]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = self.config.parallel
        strategy = os.environ.get("PAGEDLLM_RAY_PLACEMENT", "PACK")
        if strategy not in STRATEGIES:
            raise ValueError(f"PAGEDLLM_RAY_PLACEMENT={strategy}: one of {', '.join(STRATEGIES)}")
        if self._owns_ray:
            ray.init(address=parallel.ray_address, include_dashboard=False)
        here = ray.get_runtime_context().get_node_id()
        ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == here)
        cpus = max(1, available_cpus() // size)
        gpus = int(torch.device(self.config.device.device).type == "cuda")
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        bundles = [{**bundle, f"node:{ip}": 0.001}] + [bundle] * (size - 1)
        self._pg = placement_group(bundles, strategy=strategy)
        if not self._pg.wait(PLACEMENT_TIMEOUT):
            raise RuntimeError(
                f"the Ray cluster could not place {size} ranks of {bundle} ({strategy}, rank 0 "
                f"on this node, {ip}) in {PLACEMENT_TIMEOUT:.0f} s; it has "
                f"{ray.available_resources()} available"
            )
        actor_class = ray.remote(RankActor)
        for rank in range(1, size):
            where = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            options = dict(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=where)
            self.actors.append(actor_class.options(**options).remote())
        placed = ray.get([a.where.remote() for a in self.actors], timeout=PLACEMENT_TIMEOUT)
        self.nodes, self.pids = [n for n, _ in placed], [p for _, p in placed]
        address = (parallel.master_addr or ip, parallel.master_port or _free_port(ip))
        self._runs = [
            actor.run.remote(self.config, rank, address, cpus)
            for rank, actor in enumerate(self.actors, start=1)
        ]
        self._ends = [run.future() for run in self._runs]
        logger.info("Ray: ranks 1..%d are actors (%s, %d node(s)); they meet at %s:%d",
                    size - 1, strategy, len({here, *self.nodes}), *address)  # fmt: skip
        return address

    def dead(self, wait: float = 0.0) -> str | None:
        """Why the group is broken (an actor's `run` ended: it died, was killed, or failed), or
        None, waiting up to `wait` seconds for an actor that is going. Each run is watched as a
        future (ray.wait would cost a call into Ray's core worker at every step)."""
        if self._lost is None and self._ends:
            done, _ = futures.wait(self._ends, timeout=wait, return_when=futures.FIRST_COMPLETED)
            if done:
                end = min(done, key=self._ends.index)
                rank = self._ends.index(end) + 1
                error = end.exception()
                why = "its run ended" if error is None else _first_line(error)
                self._lost = (
                    f"tensor-parallel worker rank {rank} exited (Ray actor, pid "
                    f"{self.pids[rank - 1]}: {why})"
                )
        return self._lost

    def _stop_ranks(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the actors' runs to end (told to shut down), then
        kill every actor (so the processes go now, not when Ray collects the handles), free
        the placement group, and leave Ray if this executor joined it."""
        ray = import_ray()
        if not ray.is_initialized():
            return
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        for actor in self.actors:
            ray.kill(actor)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
