"""The Megatron engine (engine.name: megatron) under the same optimizer-step claims as every
ZeRO stage (tests/step_claims.py): at DP=2, TP=2 and PP=2 (one 2-rank launch) and TP=2 x PP=2
(a 4-rank launch), each against the fp64 plain-torch reference: the unclipped gradient norms,
the clip, the non-finite step skipped without moving the schedule, warmup then cosine, AdamW
without decay on 1-D weights, the whole Hugging Face weights gathered after the steps, and the
per-rank checkpoint resuming into the same steps. And what the engine's config refuses."""

import pytest

from hpsft.config import load_config
from hpsft.config.schema import EngineConfig
from tests.step_claims import assert_steps_as_documented, run_layouts

pytest.importorskip("megatron.core")

TWO_RANKS = {"dp2": "megatron:tensor_parallel_size=1", "tp2": "megatron:tensor_parallel_size=2",
             "pp2": "megatron:pipeline_parallel_size=2"}
DP_SIZE = {"dp2": 2, "tp2": 1, "pp2": 1}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("megatron_two_ranks"), list(TWO_RANKS.values()), nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_RANKS)
def test_megatron_at_two_ranks_steps_as_documented_against_fp64_reference(two_rank_runs, name):
    """Planted, one at a time (docs/testing.md has the figures): the padding row's gradient
    from its lookups kept (model.keep_padding_row_still removed); the schedule moved by a
    skipped step (updates counted like taken)."""
    run = two_rank_runs[TWO_RANKS[name]]
    assert run["dp_size"] == DP_SIZE[name]
    assert_steps_as_documented(run, two_rank_runs["reference"], f"megatron {name}")


@pytest.mark.slow
def test_megatron_tp2_pp2_at_four_ranks_steps_as_documented_against_fp64_reference(tmp_path):
    layout = "megatron:tensor_parallel_size=2,pipeline_parallel_size=2"
    results = run_layouts(tmp_path, [layout], nproc=4)
    assert results[layout]["dp_size"] == 1
    assert_steps_as_documented(results[layout], results["reference"], "megatron tp2 x pp2")


@pytest.mark.parametrize("keys, message", [
    ({"sequence_parallel_size": 2}, "no sequence parallelism"),
    ({"offload_optimizer": True}, "ZeRO-Offload"),
])
def test_megatron_engine_config_refuses_what_it_has_not(keys, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(name="megatron", **keys)


def test_megatron_engine_refuses_lora():
    with pytest.raises(ValueError, match="model.lora.rank=8 with engine.name=megatron"):
        load_config(None, ["engine.name=megatron", "model.lora.rank=8"])
