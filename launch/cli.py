"""The ``ep-runtime`` command.

    ep-runtime train ...              the main job: local processes, or Ray actors (--launcher ray)
    ep-runtime plan ...               expert placement (``topology.report``)
    ep-runtime bench <name> ...       benchmarks (``ep_runtime.bench.<name>``, listed in ``BENCHMARKS``)

``plan`` and ``bench`` hand their remaining arguments to the module's ``main(argv)``; the
benchmarks that start processes get them started through ``launch.start``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ep_runtime.failures import RankFailed
from ep_runtime.options import check_launch, resolve, train_parser
from ep_runtime.run_log import log_dir, log_path

from .start import start_workers


def launch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """How ``ep-runtime train`` starts its workers (not used under torchrun, which starts them)."""
    g = parser.add_argument_group("launching (torchrun starts its own workers)")
    g.add_argument("--launcher", choices=("local", "ray"), default="local",
                   help="local processes (default), or Ray actors on a Ray cluster")
    g.add_argument("--num-workers", "--nproc", dest="num_workers", type=int,
                   help="worker processes (default: one per GPU; on the CPU the local launcher starts "
                        "max(2, pp x ep), Ray 2)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="restart the job this many times after a worker failure, from the newest checkpoint "
                        "(default 0: fail at once, naming the rank)")
    ray = parser.add_argument_group("ray launcher")
    ray.add_argument("--address", help="Ray cluster: auto, or HOST:PORT (default: RAY_ADDRESS, else a local Ray)")
    ray.add_argument("--gpus-per-worker", type=float, help="GPUs per worker (default: 1 if the cluster has GPUs)")
    ray.add_argument("--cpus-per-worker", type=float, help="CPUs per worker (default 1)")
    return parser


def _root_cause(failure) -> tuple[int, str]:
    """The failed rank and its error, out of torch elastic's report: the earliest failure that
    recorded an error (a process that was killed, or ended by another rank's report, records
    none), else the first."""
    recorded = {rank: f for rank, f in failure.failures.items() if isinstance(f.message, dict)}
    if recorded:
        rank = min(recorded, key=lambda r: recorded[r].timestamp)
        lines = [line.strip() for line in recorded[rank].message.get("message", "").splitlines() if line.strip()]
        message = lines[0] if lines else f"exit code {recorded[rank].exitcode}"
        return rank, message.removeprefix(f"{RankFailed.__name__}: ")
    rank, first = failure.get_first_failure()
    if first.exitcode < 0:
        return rank, f"rank {rank} was killed by {signal.Signals(-first.exitcode).name} before it recorded an error"
    return rank, f"rank {rank} exited with code {first.exitcode} before it recorded an error"


def _train(a: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s [launcher] %(message)s", datefmt="%H:%M:%S")
    if a.launcher != "ray":
        given = [flag for flag, value in (("--address", a.address), ("--gpus-per-worker", a.gpus_per_worker),
                                          ("--cpus-per-worker", a.cpus_per_worker)) if value is not None]
        if given:
            raise SystemExit(f"ep-runtime train: {', '.join(given)}: only with --launcher ray")
    try:
        cfg, origins = resolve(a)
        num_workers = a.num_workers
        if num_workers is None and a.launcher == "local":  # Ray's default depends on the cluster: it decides
            import torch

            num_workers = torch.cuda.device_count() or max(2, cfg.parallel.pp * (cfg.parallel.ep or 1))
        if num_workers is not None:
            check_launch(cfg, num_workers, origins)
    except ValueError as error:
        raise SystemExit(f"ep-runtime train: {error}") from None
    _quiet_torch_launcher_logs()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ep_runtime.train import worker

    from .ray import WorkerFailed

    logs = log_dir(cfg.train)
    try:
        results = start_workers(worker, cfg, launcher=a.launcher, num_workers=num_workers,
                                max_restarts=a.max_restarts, address=a.address, gpus_per_worker=a.gpus_per_worker,
                                cpus_per_worker=a.cpus_per_worker)
    except WorkerFailed as failure:
        raise SystemExit(f"ep-runtime train: {failure} (logs: {logs}/)") from None
    except ChildFailedError as failure:
        rank, cause = _root_cause(failure)
        raise SystemExit(f"ep-runtime train: {cause} (log: {log_path(cfg.train, rank)})") from None
    except (KeyboardInterrupt, SignalException) as stop:
        signal_name = getattr(getattr(stop, "sigval", None), "name", "SIGINT")
        what = "Ctrl-C (SIGINT)" if signal_name == "SIGINT" else signal_name
        print(f"ep-runtime train: stopped by {what}; every worker ended (logs: {logs}/)", file=sys.stderr)
        # Out without the interpreter's teardown: the job store's native threads may still run when
        # it destroys them, and the process then aborts ("terminate called without an active
        # exception", exit -6) after the line above.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    first = results[0]
    losses, resumed = first["losses"], first["first_step"] > 1
    where = f" (resumed at step {first['first_step']})" if resumed else ""
    summary = f": loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""
    # Said here, not only by rank 0: Ray's log stream may lose a worker's last lines.
    run_dir = logs.parent
    print(f"trained {len(losses)} steps on {len(results)} processes{where}{summary} (metrics: "
          f"{run_dir / 'metrics.jsonl'}, logs: {logs}/)")


def _quiet_torch_launcher_logs() -> None:
    """torch elastic logs every worker's traceback, and each worker it stops; the workers' own
    log files hold the tracebacks, and the last line here names the cause. Call it before any
    worker starts."""
    import importlib
    import logging

    importlib.import_module("torch.distributed.launcher.api")  # creates its loggers, some with levels of their own

    # Workers killed mid-step leave semaphores behind; Python's resource tracker, which takes its
    # warning filters from these options, would warn of each after the job's last line.
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


BENCHMARKS = {
    "kernels": "every kernel against its peers (tile-kernels, torch.compile, eager) at DeepSeek-V3 / V4 shapes",
    "dispatch": "dispatch and combine per backend against NCCL all_to_all_single, all_to_all_vdev and the P2P copy",
    "ep-scaling": "the MoE layer and its dispatch/combine at EP sizes 1, 2, 4, ... (weak and strong scaling)",
    "pipeline": "each pipeline schedule's step time, bubble fraction and peak memory per stage",
    "mhc-overhead": "an mHC sublayer (pre + post, forward and backward) as a fraction of the MoE layer",
    "grouped-gemm": "the experts' FP8 grouped GEMMs (forward, data and weight gradients) against bf16 _grouped_mm",
}


def _bench(name: str, argv: list[str]) -> None:
    """Runs the benchmark's ``main(argv)``, handing the ones that start processes (a ``start``
    parameter) the launchers."""
    import importlib
    import inspect

    bench_main = importlib.import_module(f"ep_runtime.bench.{name.replace('-', '_')}").main
    if "start" in inspect.signature(bench_main).parameters:
        bench_main(argv, start=start_workers)
    else:
        bench_main(argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ep-runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    launch_arguments(train_parser(sub.add_parser("train", help="train the tiny MoE model with expert parallelism")))
    plan = sub.add_parser("plan", help="place experts on a cluster (ep-runtime plan --help)", add_help=False)
    plan.add_argument("args", nargs=argparse.REMAINDER)
    listing = "\n".join(f"  {name:14s} {what}" for name, what in BENCHMARKS.items())
    bench = sub.add_parser("bench", help="benchmarks: ep-runtime bench <name> --help",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=f"benchmarks (each takes --help):\n{listing}")
    bench.add_argument("name", choices=BENCHMARKS, metavar="name", help="one of the benchmarks below")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    args, rest = parser.parse_known_args(argv)  # plan and bench take options of their own
    if args.command == "train":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        _train(args)
    elif args.command == "plan":
        from topology.report import main as plan_main

        plan_main(rest + args.args)
    else:
        _bench(args.name, rest + args.args)


if __name__ == "__main__":
    main(sys.argv[1:])
