"""LoRA on vision-language models (hpsft/models/lora.py's vision_exclusion): the adapters go on the
language model's linear layers only, the vision tower and projector stay frozen; against PEFT's own
LoRA on the model's own Hugging Face forward (model level), and through `hpsft train` / `hpsft
export` on the tiny Qwen2-VL folder (DP=2 ZeRO-2 == one process; the merged export == PEFT's
merge_and_unload of the same adapters)."""

import pytest
import torch
from torch import nn

from hpsft.config.schema import LoraConfig
from hpsft.models.lora import add_lora, lora_layers
from tests.test_image_data_stage import (image_data, mixed_layout_data, step_figures, tiny_vl_folder,  # noqa: F401
                                         vl_overrides, vl_tokenizer)
from tests.test_vision_lm import (conversations, llava_conversations, own_forward_loss, packed_loss,  # noqa: F401
                                  tiny_llava, tiny_qwen2_vl, tokenizer, vision_row)

RANK, ALPHA, SEED = 4, 8, 0


def language_model_linears(lm, targets: list[str]) -> list[str]:
    """The reference's own choice of layers: the language model's nn.Linear modules (the LM head is
    outside model.language_model), all of them for all-linear, else those whose last name is a target."""
    names = [name for name, module in lm.named_modules()
             if isinstance(module, nn.Linear) and name.startswith("model.language_model.")]
    return names if targets == ["all-linear"] else [name for name in names if name.rpartition(".")[2] in targets]


@pytest.mark.parametrize("family, targets", [("qwen2_vl", ["all-linear"]), ("llava", ["all-linear"]),
                                             ("llava", ["q_proj", "v_proj", "up_proj"]),
                                             ("qwen2_5_vl", ["q_proj", "v_proj", "up_proj"])])
def test_lora_on_packed_image_chats_equals_pefts_on_the_models_own_forward(request, tokenizer, family, targets):
    """A packed row of 3 chats (one image, text only, two images) with hpsft's adapters (add_lora)
    == PEFT's get_peft_model on the model's own forward per conversation, PEFT given the language
    model's linear layers by name and hpsft's adapter weights (A as seeded, B drawn non-zero so A
    gets a gradient too): the same layers adapted (none in the tower: LLaVA's CLIP tower has its
    own q_proj/v_proj, Qwen2.5-VL's its own up_proj, all-linear reaches every tower linear), loss and unclipped grad norm over
    the adapters (fp32, <= 1e-5 relative), each adapter's gradient, and no gradient on any
    frozen parameter, tower or base. Measured: see docs/lora.md ("Vision-language models").
    Planted: no tower exclusion (vision_exclusion returning None) -> every case failed on the adapted
    layers (Qwen2-VL 10 more, LLaVA all-linear 14, LLaVA's list 4: CLIP's q_proj; Qwen2.5-VL 2: its
    tower's mlp.up_proj), and the refusal test below DID NOT RAISE."""
    import peft

    lm = tiny_llava(tokenizer) if family == "llava" else tiny_qwen2_vl(tokenizer, family)
    expected = language_model_linears(lm, targets)
    reference = peft.get_peft_model(
        tiny_llava(tokenizer) if family == "llava" else tiny_qwen2_vl(tokenizer, family),  # the same seeded weights
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=expected))
    add_lora(lm, LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets), SEED)
    assert sorted(lora_layers(lm)) == sorted(expected)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for name, param in lm.named_parameters():
            if ".lora_B." in name:
                nn.init.normal_(param, std=0.05)
    adapters = {name: param for name, param in lm.named_parameters() if param.requires_grad}
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in adapters.items():
            ref_params[f"base_model.model.{name}"].copy_(param)
    assert {name for name, p in ref_params.items() if p.requires_grad} == {f"base_model.model.{n}" for n in adapters}

    chats = request.getfixturevalue("llava_conversations" if family == "llava" else "conversations")
    ref_loss, ref_norm = own_forward_loss(reference, chats)
    loss, norm, packed = packed_loss(lm, vision_row(chats), freeze_vision=True)  # as the worker builds it for LoRA
    print(f"{family} {targets}: loss {loss:.8f} vs PEFT {ref_loss:.8f}, grad norm {norm:.8f} vs PEFT {ref_norm:.8f}")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    assert {n for n, p in packed.named_parameters() if p.grad is not None} == set(adapters)
    assert {n for n, p in reference.named_parameters() if p.grad is not None} == {f"base_model.model.{n}"
                                                                                  for n in adapters}
    worst = max((adapters[n].grad - ref_params[f"base_model.model.{n}"].grad).abs().max().item() for n in adapters)
    assert worst <= 1e-5 * ref_norm, worst


def test_a_target_that_only_the_tower_or_nothing_has_is_refused_by_name(tokenizer):
    """A listed target that adapts no language-model layer is refused naming model.lora.target_modules:
    LLaVA's CLIP `out_proj` (the decoder's is o_proj) beside a real target, a saved-checkpoint name the
    model does not have. Alone, PEFT refuses a tower-only target itself (all its matches excluded)."""
    from hpsft.utils.errors import UserInputError

    for targets, named in ((["q_proj", "out_proj"], "'out_proj' names only layers of the vision tower"),
                           (["q_proj", "model.layers.0.mlp.up_proj"], "'model.layers.0.mlp.up_proj' names no layer"),
                           (["fc1"], "No modules were targeted")):
        with pytest.raises(UserInputError, match="model.lora.target_modules=") as refused:
            add_lora(tiny_llava(tokenizer), LoraConfig(rank=RANK, target_modules=targets), SEED)
        assert named in str(refused.value), str(refused.value)


@pytest.mark.slow
def test_lora_on_qwen2_vl_at_dp2_zero2_equals_one_process_and_exports_pefts_merge(image_data, tmp_path,
                                                                                  vl_tokenizer):
    """`hpsft train` with model.lora (all-linear, rank 4) on the tiny Qwen2-VL folder, 2 steps of the
    mixed layout (at DP=2 rank 0's micro-batch has the images, rank 1's none): 2 ranks under ZeRO-2
    == one process (loss and unclipped grad norm per step, fp32, <= 1e-5 relative); `hpsft export`
    of the DP=2 run's checkpoint (merged) == PEFT's merge_and_unload of the run's adapter folder on
    the model folder's weights, every tensor (the tower and projector the folder's), and == the
    run's end-of-run hf/. Each run's subprocess has a 300 s timeout. Measured: docs/lora.md.
    Planted: the worker's PackedVisionLM not freezing the tower under LoRA (freeze_vision=cfg.freeze_vision)
    -> the DP=2 run failed at its end-of-run export, "PEFT kept 28 of the 59 adapter tensors"."""
    import peft
    from transformers import AutoModelForImageTextToText

    from tests.conftest import assert_ok, rel_diff, run_cli

    data = mixed_layout_data(image_data)
    model = tiny_vl_folder(tmp_path / "model", vl_tokenizer)
    lora = {"model.lora.rank": RANK, "model.lora.alpha": ALPHA, "engine.zero_stage": 2, "trainer.total_steps": 2,
            "optim.lr": 1e-2}
    for name, nproc, extra in (("one", 1, {}), ("dp2", 2, {"trainer.export_hf": "true"})):
        assert_ok(run_cli("hpsft.train", vl_overrides(model, data, tmp_path / name, **lora, **extra), nproc=nproc,
                          timeout=300))
    reference, figures = step_figures(tmp_path / "one"), step_figures(tmp_path / "dp2")
    print("one process", reference, "\nDP=2 ZeRO-2", figures)
    assert len(reference) == 2
    for (loss, norm), (ref_loss, ref_norm) in zip(figures, reference, strict=True):
        assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(norm, ref_norm) <= 1e-5, (loss, norm, ref_loss, ref_norm)

    assert_ok(run_cli("hpsft.export", [str(tmp_path / "dp2"), str(tmp_path / "exported")], timeout=300))
    base = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "dp2" / "hf" / "adapter").merge_and_unload().state_dict()
    folder = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).state_dict()
    for exported_folder in ("exported", "dp2/hf"):
        exported = AutoModelForImageTextToText.from_pretrained(tmp_path / exported_folder,
                                                               dtype=torch.float32).state_dict()
        assert exported.keys() == merged.keys()
        worst = max((exported[name] - merged[name]).abs().max().item() for name in merged)
        print(f"{exported_folder} vs PEFT's merge: largest difference {worst:.3g}")
        assert worst <= 1e-6, (exported_folder, worst)
    changed = [name for name in merged if not torch.equal(merged[name], folder[name])]
    assert changed and all("language_model.layers." in name for name in changed), changed
