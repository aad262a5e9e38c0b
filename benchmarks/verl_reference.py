"""Load verl 0.9.1's ``verl/models/mcore/util.py`` (installed with ``pip install --no-deps
verl==0.9.1``) without importing the rest of verl (ray, wandb...), with megatron-core's
parallel-state getters patched to given tp/cp sizes and rank. Benchmark-only helper: verl's code is
run, never copied.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types


def load_verl_mcore_util():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed: pip install --no-deps verl==0.9.1")
    root = spec.submodule_search_locations[0]
    stubs = {
        "verl": types.ModuleType("verl"),
        "verl.utils": types.ModuleType("verl.utils"),
        "verl.utils.device": types.ModuleType("verl.utils.device"),
        "verl.utils.model": types.ModuleType("verl.utils.model"),
    }
    stubs["verl.utils.device"].is_npu_available = False
    stubs["verl.utils.model"].CausalLMOutputForPPO = type("CausalLMOutputForPPO", (), {})
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        mod_spec = importlib.util.spec_from_file_location(
            "verl_mcore_util", f"{root}/models/mcore/util.py"
        )
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        # verl installs Logger.warning_once at package import; its loop calls it on CP padding.
        if not hasattr(module.logger, "warning_once"):
            module.logger.warning_once = lambda *args, **kwargs: None
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


@contextlib.contextmanager
def patched_parallel_state(module, *, tp: int, cp: int, cp_rank: int):
    """Make ``module.mpu`` report the given sizes (restored on exit)."""
    mpu = module.mpu
    names = {
        "get_tensor_model_parallel_world_size": lambda *a, **k: tp,
        "get_context_parallel_world_size": lambda *a, **k: cp,
        "get_context_parallel_rank": lambda *a, **k: cp_rank,
    }
    saved = {n: getattr(mpu, n) for n in names}
    for n, f in names.items():
        setattr(mpu, n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(mpu, n, f)
