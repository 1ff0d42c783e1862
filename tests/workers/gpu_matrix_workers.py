"""Workers of the multi-GPU training matrix (``tests/runtime/test_gpu_matrix.py``): one launch
trains several configurations in turn, in the same processes, each a few steps."""

import torch.distributed as dist

from ep_runtime.options import job_config_from_args, train_parser
from ep_runtime.parallel import init_parallel
from ep_runtime.train import _Position, _train


def train_each(argvs: list[list[str]]) -> dict[str, list[float] | str]:
    """``ep-runtime train`` options -> this rank's losses, or the error a configuration raised."""
    results = {}
    for argv in argvs:
        cfg = job_config_from_args(train_parser().parse_args(argv))
        try:
            results[" ".join(argv)] = _train(cfg, init_parallel(cfg.parallel), _Position())["losses"]
        except Exception as exc:  # noqa: BLE001 - the matrix reports every configuration
            results[" ".join(argv)] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if dist.get_rank() == 0:  # progress through a long matrix (shown with pytest -s)
            print(f"matrix: {' '.join(argv)} -> {results[' '.join(argv)]}", flush=True)
    dist.destroy_process_group()
    return results
