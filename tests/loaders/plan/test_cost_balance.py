"""CostModel (checked against FLOPs counted on real transformers models) and compute-balanced plans:
invariants (hypothesis), a golden case, the long-tail balance target, and the default plans
unchanged."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders import PlanError, PlannerConfig, plan_microbatches
from prealign.loaders.plan.cost import CostModel, balanced_steps
from prealign.schemas import ParallelLayout
from tests.loaders.plan.test_planner import LAYOUTS, check_plan

transformers = pytest.importorskip("transformers")


def counted_flops(cfg, lengths=(16, 32, 64)) -> tuple[float, float]:
    """(linear, quadratic) fitted exactly to the forward FLOPs torch's FlopCounterMode counts on a
    model built from ``cfg`` (eager attention: the full L x L score matrix), rotary tables
    excluded."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    flops = []
    for n in lengths:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randint(0, cfg.vocab_size, (1, n)))
        rotary = sum(
            sum(ops.values())
            for name, ops in counter.get_flop_counts().items()
            if name.endswith("rotary_emb")
        )  # RoPE's tables (a matmul in some transformers): left out
        flops.append(counter.get_total_flops() - rotary)
    a = np.array([[n, n * n] for n in lengths], dtype=np.float64)
    (linear, quadratic), *_ = np.linalg.lstsq(a, np.array(flops, dtype=np.float64), rcond=None)
    assert np.allclose(a @ [linear, quadratic], flops, rtol=0, atol=1e-3), (
        "FLOPs not linear + quadratic in L"
    )
    return linear, quadratic


DENSE = {
    "llama_gqa": lambda: transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=100,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=3, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=120,
    ),
    "mistral_head_dim": lambda: transformers.MistralConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        vocab_size=100,
    ),
    "gemma_geglu": lambda: transformers.GemmaConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=96,
        vocab_size=100,
    ),
    "gpt_neox_gelu": lambda: transformers.GPTNeoXConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=80,
        vocab_size=100,
    ),
}


@pytest.mark.parametrize("name", sorted(DENSE))
def test_from_hf_config_matches_counted_flops(name):
    cfg = DENSE[name]()
    linear, quadratic = counted_flops(cfg)
    full = CostModel.from_hf_config(cfg, causal=False)
    assert full.linear == pytest.approx(linear, abs=1e-3) and full.quadratic == pytest.approx(
        quadratic, abs=1e-6
    )
    causal = CostModel.from_hf_config(cfg)
    n = np.array(
        [16, 64, 1000]
    )  # (inside Mistral's default 4096 window: a window layer costs a full one's)
    assert causal.linear == full.linear and np.allclose(
        causal.of(n), n * full.linear + full.quadratic / 2 * n * n
    )
    no_head = CostModel.from_hf_config(cfg, lm_head=False)
    assert full.linear - no_head.linear == 2 * 64 * cfg.vocab_size


def active_matmul_flops(cfg) -> float:
    """Forward FLOPs per token of the matmuls a real model built from ``cfg`` runs, from its
    parameter shapes alone: 2 per weight of every matmul module (embedding lookups excluded, a tied
    LM head included), the routed experts' weights scaled by the share of experts a token visits."""
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    k = getattr(cfg, "num_experts_per_tok", None)
    total = 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.ndim >= 2:
                routed = (
                    ".experts" in f".{name}" and "shared" not in name
                )  # [E, ...] stacked routed experts
                total += 2 * p.numel() * (k / p.shape[0] if routed else 1)
    return total


MOE = {
    "mixtral": lambda: transformers.MixtralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
    ),
    "qwen2_moe_shared": lambda: transformers.Qwen2MoeConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
    ),
    "deepseek_v3_mla_first_dense": lambda: transformers.DeepseekV3Config(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=100,
        n_group=1,
        topk_group=1,
    ),
    "deepseek_v3_mla_no_q_lora": lambda: transformers.DeepseekV3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=24,
        vocab_size=100,
        n_group=1,
        topk_group=1,
    ),
    "qwen3_moe_mlp_only_layers": lambda: transformers.Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
        mlp_only_layers=[0],
    ),
    "qwen3_moe_sparse_step": lambda: transformers.Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
        decoder_sparse_step=2,
    ),
}


@pytest.mark.parametrize("name", sorted(MOE))
def test_from_hf_config_moe_and_mla_match_the_real_model(name):
    """MoE / MLA: the linear term from the real model's parameter shapes (FlopCounterMode does not
    see HF's routed experts), the quadratic one counted (eager attention scores)."""
    cfg = MOE[name]()
    full = CostModel.from_hf_config(cfg, causal=False)
    assert full.linear == pytest.approx(active_matmul_flops(cfg), abs=1e-6)
    assert full.quadratic == pytest.approx(counted_flops(cfg)[1], abs=1e-6)
    assert CostModel.from_hf_config(cfg).quadratic == full.quadratic / 2


def test_parameter_count_derivation_agrees_with_counted_flops_on_dense_models():
    for name in (
        "llama_gqa",
        "gpt2",
        "gemma_geglu",
    ):  # the MoE test's reference, checked where both work
        cfg = DENSE[name]()
        assert active_matmul_flops(cfg) == pytest.approx(counted_flops(cfg)[0], abs=1e-3)


WINDOWED = {
    "gemma2": lambda: transformers.Gemma2Config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=100,
        sliding_window=24,
    ),
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=96,
        vocab_size=100,
        sliding_window=24,
    ),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_sliding_window_layers_are_linear_beyond_the_window(name):
    cfg = WINDOWED[name]()
    cost = CostModel.from_hf_config(cfg)
    windowed = sum(
        t == "sliding_attention"
        for t in (
            getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
        )
    )
    assert windowed and [w for w, _ in cost.windows] == [24]
    full_cfg = WINDOWED[name]()
    full_cfg.sliding_window, full_cfg.layer_types = None, None
    if hasattr(full_cfg, "layer_types"):
        full_cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    full = CostModel.from_hf_config(full_cfg)
    assert full.windows == () and full.linear == cost.linear
    n = np.arange(1, 200)
    diff = full.of(n) - cost.of(n)
    assert not diff[:24].any(), "within the window a window layer costs what a full one does"
    per_pair = full.quadratic / cfg.num_hidden_layers  # one causal layer's score FLOPs per L**2
    m = np.minimum(n, 24)
    assert np.allclose(
        cost.of(n), full.of(n) - windowed * per_pair * (n * n - m * m - 48 * (n - m))
    )
    assert np.allclose(
        np.diff(cost.of(n)[30:], 2), 2 * (full.quadratic - windowed * per_pair)
    )  # linear beyond
    # eager (causal=False) computes every pair of every layer, windowed or not: counted on the real
    # model
    eager = CostModel.from_hf_config(cfg, causal=False)
    assert eager.windows == () and eager.quadratic == pytest.approx(counted_flops(cfg)[1], abs=1e-6)


def test_from_hf_config_refuses_what_it_cannot_model():
    moe = MOE["mixtral"]()
    moe.moe_layers = [1]
    with pytest.raises(PlanError, match="moe_layers"):
        CostModel.from_hf_config(moe)
    gemma = WINDOWED["gemma2"]()
    gemma.layer_types = ["chunked_attention"] * 4
    with pytest.raises(PlanError, match="chunked_attention"):
        CostModel.from_hf_config(gemma)
    with pytest.raises(PlanError, match="windows"):
        CostModel(linear=1, windows=((0, 1.0),))
    assert PlannerConfig(cost=CostModel(linear=1, windows=((8, 2.0),)).to_dict()).cost == CostModel(
        linear=1, windows=((8, 2.0),)
    )
    assert "windows" not in CostModel(linear=1).to_dict()  # the fingerprints of before


def test_from_hf_config_vlm_reads_its_text_config():
    vlm = transformers.Qwen2VLConfig(text_config=DENSE["qwen2"]().to_dict())
    assert CostModel.from_hf_config(vlm) == CostModel.from_hf_config(DENSE["qwen2"]())


def test_cost_model_checks():
    assert CostModel(linear=2, quadratic=1).of([3]).tolist() == [15.0]
    for bad in (
        {"linear": -1},
        {"linear": float("nan")},
        {"linear": 0, "quadratic": 0},
        {"quadratic": True},
    ):
        with pytest.raises(PlanError):
            CostModel(**bad)
    with pytest.raises(PlanError, match="cost"):
        PlannerConfig(cost=3)
    with pytest.raises(PlanError, match="hidden_size"):
        CostModel.from_hf_config(object())
    gpt2 = DENSE["gpt2"]()  # gated=True: a third FFN matrix per layer
    assert (
        CostModel.from_hf_config(gpt2, gated=True).linear - CostModel.from_hf_config(gpt2).linear
        == 3 * 2 * 64 * 256
    )


def test_config_round_trip_keeps_old_fingerprints():
    assert (
        "cost" not in PlannerConfig().to_dict()
    )  # saved states of before fingerprint the same dict
    cfg = PlannerConfig(cost=CostModel(linear=3, quadratic=0.5))
    assert PlannerConfig.from_dict(cfg.to_dict()) == cfg


def digest(plan) -> str:
    return hashlib.sha256(
        json.dumps([plan.microbatches, plan.steps, plan.padded_lengths.tolist()]).encode()
    ).hexdigest()[:16]


# digests of the plans before CostModel existed (same code path for cost=None): saved states resume
@pytest.mark.parametrize(
    "seed,layout,budget,dp,k,opts,expected",
    [
        (0, ParallelLayout(), 4096, 4, 1, {}, "c9f21b1456473ddc"),
        (1, ParallelLayout(cp=2), 8192, 8, 2, {}, "b2c9b18067a5377d"),
        (
            2,
            ParallelLayout(tp=2, cp=2, fp8="fp8"),
            16384,
            3,
            3,
            {"chunk_size": 700},
            "bd6c46d622fc9911",
        ),
        (
            3,
            ParallelLayout(cp=4),
            32768,
            8,
            2,
            {"strategy": "first_fit", "oversize": "skip"},
            "9d9ea5ddcb321d55",
        ),
    ],
)
def test_token_only_default_reproduces_previous_plans(seed, layout, budget, dp, k, opts, expected):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(7.5, 1.1, 3000), 1, budget + 500).astype(int)
    opts = {"oversize": "truncate", **opts}
    plan = plan_microbatches(
        lengths,
        layout=layout,
        token_budget=budget,
        dp_size=dp,
        microbatches_per_step=k,
        seed=seed,
        **opts,
    )
    assert digest(plan) == expected


def long_tail(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(2048), 1.0, n), 512, 32768).astype(np.int64)


def step_costs(plan, lengths, cost):
    """float64 [steps, dp]: each rank's cost in each step."""
    per_mb = np.array(
        [
            [cost.of(lengths[list(mb)]).sum() if mb else 0.0 for mb in rank]
            for rank in plan.microbatches
        ]
    )
    bounds = np.cumsum((0,) + plan.steps)
    return np.stack([per_mb[:, a:b].sum(1) for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("seed", [0, 1])
def test_long_tail_steps_balanced_by_compute(seed):
    lengths, cost = long_tail(seed=seed), CostModel(linear=24576, quadratic=1)
    kw = dict(
        layout=ParallelLayout(), token_budget=32768, dp_size=8, microbatches_per_step=2, seed=seed
    )
    by_tokens, by_cost = (
        plan_microbatches(lengths, **kw),
        plan_microbatches(lengths, cost=cost, **kw),
    )
    for plan in (by_tokens, by_cost):
        check_plan(plan, lengths, kw["layout"], 32768, 8)

    def ratio(plan):
        c = step_costs(plan, lengths, cost)
        return c.max(1).sum() / c.mean(1).sum()

    assert ratio(by_tokens) > 1.12  # what token balance leaves
    assert ratio(by_cost) <= 1.05
    assert by_cost.stats.imbalance == pytest.approx(
        ratio(by_cost)
    )  # the stats measure cost under a cost model
    assert sorted(map(len, by_cost.microbatches)) == sorted(map(len, by_tokens.microbatches))


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=200),
    layout=st.sampled_from(LAYOUTS),
    budget=st.sampled_from([256, 300, 512, 1000]),
    dp=st.integers(1, 4),
    k=st.integers(1, 3),
    quadratic=st.sampled_from([0.0, 0.01, 1.0]),
    pool=st.integers(1, 4),
    chunk=st.sampled_from([7, 40, 16384]),
    seed=st.one_of(st.none(), st.integers(0, 3)),
)
def test_cost_plan_invariants(lengths, layout, budget, dp, k, quadratic, pool, chunk, seed):
    try:
        plan = plan_microbatches(
            lengths,
            layout=layout,
            token_budget=budget,
            dp_size=dp,
            microbatches_per_step=k,
            oversize="skip",
            seed=seed,
            step_pool=pool,
            chunk_size=chunk,
            cost=CostModel(linear=1, quadratic=quadratic),
        )
    except PlanError:
        return  # budget below the smallest padded micro-batch: refused up front (test_planner)
    check_plan(
        plan, lengths, layout, budget, dp
    )  # budget kept, every sample once, same count on every rank
    assert all(s == k for s in plan.steps[:-1]) and (not plan.steps or plan.steps[-1] <= k)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.floats(0, 1e6), min_size=1, max_size=60),
    dp=st.integers(1, 5),
    k=st.integers(1, 3),
)
def test_balanced_steps_is_a_permutation_of_whole_steps(costs, dp, k):
    n = len(costs) - len(costs) % (dp * k)
    steps = balanced_steps(list(range(n)), np.array(costs[:n]), dp, k)
    assert all(len(s) == dp * k for s in steps)
    assert sorted(i for s in steps for i in s) == list(range(n))
    shares = [[sum(costs[i] for i in s[r * k : (r + 1) * k]) for r in range(dp)] for s in steps]
    assert all(
        max(a) >= max(b) - 1e-6 * max(1.0, max(b)) for a, b in zip(shares, shares[1:])
    )  # costliest first


def test_golden_cost_plan():
    """Four full micro-batches of 1000 tokens: equal by tokens, not by cost (L + L^2). Costs 1001000
    (one sequence of 1000), 501000 (2 x 500), 251000 (4 x 250), 101000 (10 x 100): the best 2 + 2
    split pairs the costliest with the cheapest; the token deal pairs by arrival."""
    lengths = [1000, 500, 500, 250, 250, 250, 250] + [100] * 10
    kw = dict(layout=ParallelLayout(), token_budget=1000, dp_size=2, microbatches_per_step=2)
    cost = CostModel(linear=1, quadratic=1)
    by_tokens, by_cost = (
        plan_microbatches(lengths, **kw),
        plan_microbatches(lengths, cost=cost, **kw),
    )
    tens = tuple(range(7, 17))
    assert by_tokens.microbatches == (((0,), (3, 4, 5, 6)), ((1, 2), tens))
    assert by_cost.microbatches == (((0,), tens), ((1, 2), (3, 4, 5, 6)))
    assert by_cost.real_tokens.tolist() == [[1000, 1000], [1000, 1000]]
    rank_cost = [
        sum(cost.of([lengths[i] for i in mb]).sum() for mb in rank) for rank in by_cost.microbatches
    ]
    assert rank_cost == [1102000, 752000]
    assert by_cost.stats.imbalance == pytest.approx(1102000 / 927000)
    assert by_tokens.stats.imbalance == 1.0  # by tokens it looks perfect
