"""Parallel sizes and ranks of this process: the one module that reads
``megatron.core.parallel_state``.

Everything else takes ranks and sizes as plain ints, so multi-rank logic is testable in one process.
"""

from __future__ import annotations

from .errors import ConfigError


def import_megatron(module: str):
    """``importlib.import_module(module)`` (a ``megatron.core`` module) without the warnings
    megatron-core prints on import where Transformer Engine / Apex are absent, and the deprecations
    it triggers: only those, and only during this import. Once imported, the module is returned as
    it is (no process-wide warnings state touched again: this runs on every ``to_packed_seq_params``
    call)."""
    import importlib
    import sys
    import warnings

    if module in sys.modules:
        return sys.modules[module]
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Transformer Engine and Apex are not installed", category=UserWarning
        )
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        return importlib.import_module(module)


def _group_size_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def megatron_parallel_sizes(pg_collection=None) -> dict[str, int]:
    """``{"tp", "cp", "dp", "tp_rank", "cp_rank", "dp_rank"}`` from megatron-core.

    Reads ``pg_collection`` (a megatron-core ``ProcessGroupCollection``, the API newer releases pass
    around) when given, else the initialised ``parallel_state`` (0.x), falling back to
    ``ProcessGroupCollection.use_mpu_process_groups()`` where the getters moved.
    """
    not_ready = (
        "megatron-core parallel state is not (fully) initialised{}; call "
        "parallel_state.initialize_model_parallel(...) first, or pass sizes as ints"
    )
    if pg_collection is None:
        ps = import_megatron("megatron.core.parallel_state")

        try:
            if hasattr(ps, "get_tensor_model_parallel_world_size"):  # 0.x: module-level getters
                if not ps.model_parallel_is_initialized():
                    raise ConfigError(not_ready.format(""))
                return {
                    "tp": ps.get_tensor_model_parallel_world_size(),
                    "cp": ps.get_context_parallel_world_size(),
                    "dp": ps.get_data_parallel_world_size(),
                    "tp_rank": ps.get_tensor_model_parallel_rank(),
                    "cp_rank": ps.get_context_parallel_rank(),
                    "dp_rank": ps.get_data_parallel_rank(),
                }
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        except (AssertionError, ImportError) as exc:  # a group megatron-core did not build
            raise ConfigError(not_ready.format(f" ({exc})")) from None
    (tp, tp_rank), (cp, cp_rank), (dp, dp_rank) = (
        _group_size_rank(getattr(pg_collection, name)) for name in ("tp", "cp", "dp")
    )
    return {
        "tp": tp,
        "cp": cp,
        "dp": dp,
        "tp_rank": tp_rank,
        "cp_rank": cp_rank,
        "dp_rank": dp_rank,
    }


def data_parallel_info() -> dict[str, int]:
    """``{"dp", "dp_rank", "cp", "cp_rank", "tp", "tp_rank"}`` of this process, for data loaders.

    megatron-core's ``parallel_state`` when initialised; else ``torch.distributed`` (every rank a DP
    rank, tp = cp = 1); else a single process.
    """
    try:
        return megatron_parallel_sizes()
    except (ConfigError, ImportError, AssertionError):  # no megatron-core parallel state here
        pass
    import torch.distributed as dist  # here: planning imports this module, and needs no torch

    if dist.is_available() and dist.is_initialized():
        return {
            "dp": dist.get_world_size(),
            "dp_rank": dist.get_rank(),
            "cp": 1,
            "cp_rank": 0,
            "tp": 1,
            "tp_rank": 0,
        }
    return {"dp": 1, "dp_rank": 0, "cp": 1, "cp_rank": 0, "tp": 1, "tp_rank": 0}
