"""The per-model data contract (prealign.schemas.contract): each family and text LM declares its
positions, attention structure and recurrent state; check_startup refuses, on every rank and before
the batch reaches the model, what the consumer cannot run, with a typed error naming the model, the
layer kind, the installed version and the way out."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prealign.collate import THDCollator
from prealign.collate.vision import FAMILIES, model_contract
from prealign.schemas import ParallelLayout, causal_lm_schema, check_startup
from prealign.schemas.contract import (
    MEGATRON_GDN_PACKED,
    Consumer,
    ConsumerUnsupportedError,
    ModelContract,
    check_consumer,
)
from prealign.schemas.errors import ConfigError, PackingUnsupportedError
from tests.conftest import free_port

transformers = pytest.importorskip("transformers")
SCHEMA = causal_lm_schema()
LAYOUT = ParallelLayout(tp=2)


def batch() -> dict:
    return THDCollator(schema=SCHEMA, layout=LAYOUT)(
        [{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(1, 4)}]
    )


def gemma3():
    return model_contract(transformers.Gemma3Config())


def gdn():
    return model_contract(transformers.Qwen3NextConfig())


def test_every_family_declares_a_valid_contract():
    for family in FAMILIES:
        c = ModelContract(
            model=family.model_types[0],
            position_kind=family.position_kind,
            media_attention=family.media_attention,
            local_attention=family.local_attention,
        )
        assert "position_ids" in c.fields()
    assert model_contract(transformers.Qwen2VLConfig()).fields() == (
        "position_ids",
        "mrope_position_ids",
        "cu_seqlens_padded",
    )
    assert model_contract(transformers.Qwen3_5Config()).fields()[-1] == "seq_idx"
    with pytest.raises(ConfigError, match="local_attention"):
        ModelContract(model="x", local_attention="windowed")


def test_text_models_read_their_layer_types():
    assert (gdn().linear_attention, gdn().local_attention) == (True, None)
    assert model_contract(transformers.Llama4TextConfig()).local_attention == "chunked"
    assert model_contract(transformers.Gemma3TextConfig()).local_attention == "sliding"
    assert model_contract(transformers.Gemma3TextConfig()).media_attention == "causal"
    assert model_contract({"model_type": "llama"}) == ModelContract(model="llama")


def test_gemma3_with_flash_attention_is_refused_naming_the_way_out():
    for impl in ("flash_attention_2", "flash_attention_3"):
        with pytest.raises(ConsumerUnsupportedError) as err:
            check_startup(batch(), SCHEMA, LAYOUT, contract=gemma3(), consumer=Consumer.hf(impl))
        e = err.value
        assert (e.model, e.layer) == ("gemma3", "bidirectional image-attention")
        assert e.version == f"transformers {transformers.__version__}" and e.version in str(e)
        assert "'sdpa'" in e.way_out and "flex_attention" in e.way_out
        assert isinstance(e, PackingUnsupportedError)
    for impl in ("sdpa", "eager", "flex_attention"):
        assert check_startup(batch(), SCHEMA, LAYOUT, contract=gemma3(), consumer=Consumer.hf(impl))


def test_gated_deltanet_on_megatron_core_packed_is_refused():
    """megatron-core 0.16.1 (pinned) raises NotImplementedError for packed sequences in
    GatedDeltaNet.forward and asserts context_parallel_size == 1; the floor's 0.14 has no
    GatedDeltaNet: refused on both."""
    version = Consumer.megatron().installed_version()
    with pytest.raises(ConsumerUnsupportedError) as err:
        check_startup(batch(), SCHEMA, LAYOUT, contract=gdn(), consumer=Consumer.megatron())
    e = err.value
    assert (e.model, e.layer, e.version) == (
        "qwen3_next",
        "Gated DeltaNet (linear_attention)",
        f"megatron-core {version}",
    )
    assert "NotImplementedError" in e.problem and "BSHD" in e.way_out and "newer" not in e.way_out
    assert "megatron-core release whose GatedDeltaNet takes packed sequences" in e.way_out
    check_consumer(gdn(), Consumer.megatron(), packed=False, cp=1)  # one sequence per row: runs
    with pytest.raises(ConsumerUnsupportedError, match="context_parallel_size == 1"):
        check_consumer(gdn(), Consumer.megatron(), packed=False, cp=2)
    check_consumer(
        model_contract(transformers.Qwen3VLConfig()), Consumer.megatron(), packed=True, cp=2
    )


def test_the_refusal_matches_the_installed_megatron_core_source():
    """What the contract claims, read in the installed megatron-core: when a release takes packed
    sequences, this fails until MEGATRON_GDN_PACKED names it."""
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core.ssm") is None
        or importlib.util.find_spec("megatron.core.ssm.gated_delta_net") is None
    ):
        assert MEGATRON_GDN_PACKED is None  # no GatedDeltaNet at all (megatron-core 0.14)
        return
    from megatron.core.ssm import gated_delta_net
    from megatron.core.transformer import transformer_config

    forward = inspect.getsource(gated_delta_net.GatedDeltaNet.forward)
    assert "packed_seq_params is not None" in forward and "NotImplementedError" in forward
    assert "self.context_parallel_size == 1" in inspect.getsource(
        transformer_config.TransformerConfig
    )
    assert MEGATRON_GDN_PACKED is None


def test_hf_refusals_by_layer_kind():
    llama4 = model_contract(transformers.Llama4TextConfig())
    with pytest.raises(
        ConsumerUnsupportedError, match="max_seqs=1"
    ):  # per-sequence chunks: mask, not flash
        check_consumer(llama4, Consumer.hf("flash_attention_2"), packed=True)
    check_consumer(llama4, Consumer.hf("sdpa"), packed=True)  # tests/consumers/test_llama4.py
    check_consumer(llama4, Consumer.hf("sdpa"), packed=False)
    if (
        importlib.util.find_spec("fla") is None
    ):  # the CPU CI: no kernels, the pure-torch GDN cannot pack
        with pytest.raises(ConsumerUnsupportedError, match="fla, causal_conv1d not importable"):
            check_consumer(gdn(), Consumer.hf("sdpa"), packed=True)
    check_consumer(gdn(), Consumer.hf("sdpa"), packed=False)
    check_consumer(
        model_contract(transformers.Gemma3TextConfig()),
        Consumer.hf("flash_attention_2"),
        packed=True,
    )
    no_packing = ParallelLayout(tp=2, max_seqs=1)
    one = THDCollator(schema=SCHEMA, layout=no_packing)([{"input_ids": torch.arange(1, 6)}])
    assert check_startup(one, SCHEMA, no_packing, contract=llama4, consumer=Consumer.hf("sdpa"))


def test_the_error_keeps_its_fields_across_processes_and_the_arguments_go_together():
    with pytest.raises(ConsumerUnsupportedError) as err:
        check_consumer(gemma3(), Consumer.hf("flash_attention_2"))
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is ConsumerUnsupportedError and again.details() == err.value.details()
    with pytest.raises(ConfigError, match="together"):
        check_startup(batch(), SCHEMA, LAYOUT, contract=gemma3())
    with pytest.raises(ConfigError, match="attn_implementation"):
        Consumer.hf("flash")


# ---- every rank
# ------------------------------------------------------------------------------------
WORLD = 2
SCENARIOS = {
    "gemma3 flash on every rank": lambda rank: (gemma3(), Consumer.hf("flash_attention_2")),
    "gemma3 flash on rank 1 only": lambda rank: (
        gemma3(),
        Consumer.hf("flash_attention_2" if rank else "sdpa"),
    ),
    "gdn megatron packed": lambda rank: (gdn(), Consumer.megatron()),
    "gemma3 sdpa": lambda rank: (gemma3(), Consumer.hf("sdpa")),
}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    results = {}
    for name, make in SCENARIOS.items():
        contract, consumer = make(rank)
        try:
            results[name] = {
                "fingerprint": check_startup(
                    batch(), SCHEMA, LAYOUT, contract=contract, consumer=consumer, timeout=30
                )
            }
        except Exception as exc:  # noqa: BLE001 - the test inspects every outcome
            results[name] = {
                "error": type(exc).__name__,
                "message": str(exc),
                "details": getattr(exc, "details", lambda: None)(),
            }
    if rank == 0:  # rank 0 hosts the store
        time.sleep(1.0)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.mark.slow
def test_every_rank_raises_the_typed_error(tmp_path):
    ctx = mp.spawn(_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=2.0):
            assert time.monotonic() < deadline, (
                "check_startup processes still running after 120 s (a hang)"
            )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    for name in (
        "gemma3 flash on every rank",
        "gemma3 flash on rank 1 only",
        "gdn megatron packed",
    ):
        for rank in range(WORLD):
            o = out[rank][name]
            assert o.get("error") == "ConsumerUnsupportedError", (name, rank, o)
            assert "Way out:" in o["message"]
    assert out[0]["gemma3 flash on rank 1 only"]["details"]["consumer"].endswith(
        "'flash_attention_2'"
    )
    assert out[0]["gdn megatron packed"]["details"]["layer"] == "Gated DeltaNet (linear_attention)"
    assert out[0]["gemma3 sdpa"]["fingerprint"] == out[1]["gemma3 sdpa"]["fingerprint"]
