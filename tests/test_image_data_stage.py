"""Vision-language SFT through the data stage and the trainer (docs/vision.md): image chat rows on
real photographs (scikit-image's) -> tokens in the token store and patches memory-mapped beside
them (hpsft/data/image_sequences.py, preparation.py with an image processor), prepared in
parallel and by a team of ranks as one process would, resumed by shard, a missing image refused
naming its file and row; store sequences collated and packed as the model's own forward sees
them; `hpsft train` of LLaVA and Qwen2.5-VL as their own forward computes (DP=2 and SP=2:
test_vision_training.py; a frozen tower: test_frozen_tower_zero3.py); `hpsft inspect-data`
showing where each image's tokens go."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpsft.data.image_rows import IMAGE_MARK, IMAGE_PAD, VISION_END, VISION_START, LlavaImages
from hpsft.data.preparation import LocalRunner, prepared_store
from hpsft.data.rows import DataError
from hpsft.data.shards import plan_shards
from tests.conftest import REPO, TEST_MODEL, train_env, write_jsonl
from tests.test_export import folder_weights
from tests.test_data_stage import options

PHOTOS = {"astronaut.jpg": ("astronaut", (112, 84)), "coffee.png": ("coffee", (140, 112)),
          "chelsea.jpg": ("chelsea", (56, 84)), "camera.png": ("camera", (84, 84))}


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)


def llava_images(tokenizer) -> LlavaImages:
    """The tiny LLaVA's layout (what load_image_processor gives for its folder): CLIP's processor
    at the tower's 42 x 42, patches of 14, the "full" strategy (CLS kept: 3 * 3 + 1 = 10 tokens)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from tests.test_vision_lm import LLAVA_IMAGE

    return LlavaImages(CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE}, crop_size=LLAVA_IMAGE), 14, "full",
                       tokenizer.convert_tokens_to_ids(IMAGE_MARK))


FAMILIES = ["qwen2_vl", "llava"]


def family_processor(family: str, tokenizer):
    """What the data stage is handed for the family's tiny model folder."""
    return llava_images(tokenizer) if family == "llava" else image_processor()


def tiny_model(family: str, tokenizer):
    """The family's tiny model (qwen2_vl, qwen2_5_vl, llava with the "full" strategy)."""
    from tests.test_vision_lm import tiny_llava, tiny_qwen2_vl

    if family == "llava":
        return tiny_llava(tokenizer, vision_feature_select_strategy="full")
    return tiny_qwen2_vl(tokenizer, family)


def own_processing(family: str, tokenizer, photos: list[Path]) -> tuple[np.ndarray, np.ndarray | None, int]:
    """The pixel_values, image_grid_thw (None for LLaVA) and number of image tokens of these
    photographs as transformers' own processing gives them: Qwen2-VL's image processor called per
    image (grid_t*grid_h*grid_w / 2**2 tokens each); LlavaProcessor itself (its tokenizer's count
    of <image> in the text it expands, the "full" strategy with CLIP's one extra CLS token)."""
    from transformers import LlavaProcessor

    images = [Image.open(photo).convert("RGB") for photo in photos]
    if family == "qwen2_vl":
        own = [image_processor()(images=image, return_tensors="np") for image in images]
        grids = np.concatenate([o["image_grid_thw"] for o in own])
        return np.concatenate([o["pixel_values"] for o in own]), grids, int(grids.prod(axis=1).sum()) // 4
    processor = LlavaProcessor(image_processor=llava_images(tokenizer).processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="full", num_additional_image_tokens=1)
    out = processor(text=IMAGE_MARK * len(images), images=images, return_tensors="np")
    return out["pixel_values"], None, int((out["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE_MARK)).sum())


@pytest.fixture(scope="module")
def vl_tokenizer():
    from transformers import AutoTokenizer

    from tests.test_vision_lm import IMAGE_TOKENS  # those three and the ones tiny_qwen2_vl's config names

    tok = AutoTokenizer.from_pretrained(TEST_MODEL)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    assert {VISION_START, IMAGE_PAD, VISION_END} <= set(IMAGE_TOKENS)
    return tok


def image_rows(n: int, last_image: str = "camera.png") -> list[dict]:
    """n rows cycling through OpenAI content parts (two images), LLaVA `<image>` + images (one),
    and text only; the last row shows `last_image`."""
    shapes = [
        lambda k: {"messages": [{"role": "user", "content": [
            {"type": "image", "image": "imgs/astronaut.jpg"}, {"type": "text", "text": f"and {k}"},
            {"type": "image_url", "image_url": {"url": "imgs/coffee.png"}}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": f"An astronaut and a coffee, number {k}."}]},
        lambda k: {"conversations": [{"from": "human", "value": f"<image>\nWhat animal is this ({k})?"},
                                     {"from": "gpt", "value": "A cat, sitting." * (k % 3 + 1)}],
                   "images": ["imgs/chelsea.jpg"]},
        lambda k: {"messages": [{"role": "user", "content": f"Say hello {k} times."},
                                {"role": "assistant", "content": "hello " * k}]},
    ]
    rows = [shapes[k % 3](k) for k in range(n)]
    rows[-1] = {"messages": [{"role": "user", "content": [{"type": "image", "image": f"imgs/{last_image}"},
                                                          {"type": "text", "text": "What is this?"}]},
                             {"role": "assistant", "content": "A photographer with a camera."}]}
    return rows


@pytest.fixture
def image_data(tmp_path) -> Path:
    """18 image rows in tmp_path/data/train.jsonl, their photographs in tmp_path/data/imgs."""
    from skimage import data as photos

    (tmp_path / "data" / "imgs").mkdir(parents=True)
    for name, (photo, size) in PHOTOS.items():
        image = Image.fromarray(getattr(photos, photo)()).convert("RGB").resize(size)
        image.save(tmp_path / "data" / "imgs" / name)
    return Path(write_jsonl(image_rows(18), tmp_path / "data" / "train.jsonl"))


def store_items(store) -> list[dict]:
    return [{key: value.tolist() if hasattr(value, "tolist") else value for key, value in store[i].items()}
            for i in range(len(store))]


@pytest.mark.parametrize("family", FAMILIES)
def test_image_rows_prepared_in_parallel_equal_one_process_and_the_processor(image_data, tmp_path, vl_tokenizer,
                                                                             family):
    """18 image rows (two images, one image, text only) prepared as one shard here and as ~6 shards
    over 2 worker processes: the same tokens, masks, patches and grids per sequence. Each
    sequence's pixel_values (and grids) equal transformers' own processing of its row's images in
    order (exact; own_processing: Qwen2-VL's image processor, LLaVA's LlavaProcessor), and its
    input_ids hold as many image tokens as that processing gives (Qwen2-VL t*h*w/4 per image,
    LLaVA 10 per 42 x 42 image), none under the loss mask; LLaVA's items have no image_grid_thw.
    Planted bugs: TokenStore.__getitem__ reads the patches of the next sequence of its shard -> the
    1-shard and 5-shard stores' items differed (assert store_items(one) == store_items(many)
    failed); (llava) LlavaImages.token_counts without the "full" strategy's CLS token -> 9 <image>
    tokens per image where LlavaProcessor gives 10 (assert 18 == 20 on row 0)."""
    processor = family_processor(family, vl_tokenizer)
    opts = options()
    one = prepared_store(str(image_data), vl_tokenizer, opts, tmp_path / "one", LocalRunner(1), shard_mb=64,
                         processor=processor)
    many = prepared_store(str(image_data), vl_tokenizer, opts, tmp_path / "many", LocalRunner(2),
                          shard_mb=image_data.stat().st_size / 6 / 2**20, processor=processor)
    assert len(many.summary["shards"]) >= 5 and many.summary["images"] == one.summary["images"] == 19
    assert store_items(one) == store_items(many)
    assert isinstance(many.patches[0].pixels, np.memmap)
    pad = vl_tokenizer.convert_tokens_to_ids(IMAGE_MARK if family == "llava" else IMAGE_PAD)
    rows = image_rows(18)
    for i, row in enumerate(rows):
        item = one[i]
        assert ("image_grid_thw" in item) == (family == "qwen2_vl")
        names = [part.get("image") or part.get("image_url", {}).get("url") for m in row.get("messages", [])
                 if isinstance(m["content"], list) for part in m["content"] if part["type"] != "text"]
        names += row.get("images", [])
        if not names:
            assert item["pixel_values"].shape[0] == 0 and item.get("image_grid_thw", np.zeros(0)).shape[0] == 0
            continue
        pixels, grids, tokens = own_processing(family, vl_tokenizer, [image_data.parent / name for name in names])
        np.testing.assert_array_equal(item["pixel_values"].numpy(), pixels)
        if grids is not None:
            np.testing.assert_array_equal(item["image_grid_thw"].numpy(), grids)
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        assert ids.count(pad) == tokens, (i, ids.count(pad), tokens)
        assert not any(m for t, m in zip(ids, mask) if t == pad)
    # The token budget counts the image tokens: the store's lengths include them.
    assert one.lengths.tolist() == [len(item["input_ids"]) for item in store_items(one)]


def test_llavas_image_token_is_checked_by_name(image_data, tmp_path, vl_tokenizer):
    """LLaVA's rows need the tokenizer's <image> token, and it must be the model config's
    image_token_id: a tokenizer without it (the text model's) and a layout whose config names
    another id are refused naming the token before any shard is prepared.
    Planted bug: check_image_tokens without the image_token_id comparison -> DID NOT RAISE (the
    store prepared, every image's features bound for token 49154's embedding rows... never read)."""
    from transformers import AutoTokenizer

    with pytest.raises(DataError, match=r"has no tokens \['<image>'\]"):
        prepared_store(str(image_data), AutoTokenizer.from_pretrained(TEST_MODEL), options(), tmp_path / "a",
                       LocalRunner(1), processor=llava_images(vl_tokenizer))
    layout = llava_images(vl_tokenizer)
    layout.image_token_id += 1
    with pytest.raises(DataError, match=rf"has <image> as token {layout.image_token_id - 1}, the model's config.json "
                                        rf"has image_token_id={layout.image_token_id}"):
        prepared_store(str(image_data), vl_tokenizer, options(), tmp_path / "b", LocalRunner(1), processor=layout)
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").rglob("shard-*"))


TEAM_SCRIPT = """
import sys
from transformers import AutoTokenizer
from hpsft.data.preparation import Team, TeamRunner, prepared_store
from tests.test_data_stage import options
from tests.test_image_data_stage import image_processor

if __name__ == "__main__":
    path, cache, shard_mb, tokenizer_dir, rank = sys.argv[1:6]
    runner = TeamRunner(Team(int(rank), int(rank), 2, "attempt-1"), 1)
    prepared_store(path, AutoTokenizer.from_pretrained(tokenizer_dir), options(), cache, runner,
                   shard_mb=float(shard_mb), processor=image_processor())
"""


@pytest.mark.slow
def test_two_ranks_preparing_image_rows_together_equal_one_process(image_data, tmp_path, vl_tokenizer):
    """Two ranks (processes) of a team sharing the cache folder split ~6 shards of image rows: each
    shard's Arrow, patch and index files are byte-identical to one process's preparation. Planted
    bug: TeamRunner.run not handing the processor to its local runner (the rank's shards prepared
    as text) -> the ranks exited non-zero, a traceback from prepare()."""
    shard_mb = image_data.stat().st_size / 6 / 2**20
    vl_tokenizer.save_pretrained(tmp_path / "tok")
    ranks = [subprocess.Popen([sys.executable, "-c", TEAM_SCRIPT, str(image_data), str(tmp_path / "team"),
                               str(shard_mb), str(tmp_path / "tok"), str(rank)], cwd=REPO, env=train_env(),
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    prepared_store(str(image_data), vl_tokenizer, options(), tmp_path / "one", LocalRunner(1), shard_mb=shard_mb,
                   processor=image_processor())
    (team_dir,), (one_dir,) = list((tmp_path / "team").iterdir()), list((tmp_path / "one").iterdir())
    assert team_dir.name == one_dir.name
    files = sorted(p.name for p in one_dir.glob("shard-*") if not p.name.endswith(".json"))
    assert len(files) >= 15  # >= 5 shards x (arrow, patches, index)
    for name in files:
        assert (team_dir / name).read_bytes() == (one_dir / name).read_bytes(), name


def test_a_missing_image_is_refused_by_row_and_the_preparation_resumes_by_shard(image_data, tmp_path, vl_tokenizer,
                                                                                capsys):
    """The last row's image is missing: preparation stops naming the data file, the row and the
    image, after the shards before it are complete. With the image added, the rerun prepares only
    the last shard and shard 0, whose patch files were deleted, and every shard's token, patch and
    index files are byte-identical to a preparation that was never interrupted. Planted bug:
    completed_sidecar not checking the patch files -> the rerun took shard 0 as done and failed
    opening the store (DataError "the image patches of .../shard-00000.arrow are missing")."""
    write_jsonl(image_rows(18, last_image="later.png"), image_data)
    shard_mb = image_data.stat().st_size / 6 / 2**20
    n = len(plan_shards([image_data], int(shard_mb * 2**20)))
    cache, processor = tmp_path / "cache", image_processor()
    with pytest.raises(DataError, match=rf"{image_data} row 17: image 'imgs/later.png' not found"):
        prepared_store(str(image_data), vl_tokenizer, options(), cache, LocalRunner(1), shard_mb=shard_mb,
                       processor=processor)
    (store_dir,) = list(cache.iterdir())
    assert len(list(store_dir.glob("shard-*.json"))) == n - 1
    for suffix in (".patches", ".patches.npz"):  # shard 0's patches lost: shard 0 prepared again too
        (store_dir / f"shard-00000.arrow{suffix}").unlink()
    (image_data.parent / "imgs" / "camera.png").rename(image_data.parent / "imgs" / "later.png")
    capsys.readouterr()
    prepared_store(str(image_data), vl_tokenizer, options(), cache, LocalRunner(1), shard_mb=shard_mb,
                   processor=processor, report=True)
    assert f"2 of {n} shards to tokenize ({n - 2} done before)" in capsys.readouterr().out
    straight = tmp_path / "straight"
    prepared_store(str(image_data), vl_tokenizer, options(), straight, LocalRunner(1), shard_mb=shard_mb,
                   processor=processor)
    (straight_dir,) = list(straight.iterdir())
    assert straight_dir.name == store_dir.name
    files = sorted(p.name for p in straight_dir.glob("shard-*") if not p.name.endswith(".json"))
    assert len(files) == 3 * n
    for name in files:
        assert (store_dir / name).read_bytes() == (straight_dir / name).read_bytes(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_selected_store_sequences_pack_into_a_row_the_models_own_forward_agrees_with(image_data, tmp_path,
                                                                                      vl_tokenizer, family):
    """Store sequences collated (collate_jagged), a micro-batch selected out of order (select, as the
    worker's bins do: a one-image chat, a text-only one, a two-image chat, the last row's photo: 4
    images of 3 photographs in one row) and packed (packed_row): a tiny Qwen2-VL's (LLaVA's, CLIP
    tower, "full" strategy) PackedVisionLM loss and unclipped grad norm on that row equal the
    model's own Hugging Face forward run on each of those store items alone (fp32, 1e-5 relative).
    Measured: Qwen2-VL loss 10.830143 (rel 0.0), grad norm 3.18304945 vs 3.18304956 (rel 3.4e-08).
    Planted bugs: collate_jagged's image offsets rotated by one sequence (each sequence given its
    neighbour's grids) -> PackedVisionLM refused the Qwen2-VL row (ValueError "sequence 0 has 6
    image placeholder tokens, which are not the tokens of whole images 0.. of the row"); (llava)
    packed_row's pixel_values with the first two images swapped (an image's pixels given to its
    neighbour in the row) -> loss 10.828734 vs the own forward's 10.831293 (2.4e-4), failed."""
    import torch

    from hpsft.data.batch import collate_jagged, packed_row, select
    from tests.test_vision_lm import own_forward_loss, packed_loss

    store = prepared_store(str(image_data), vl_tokenizer, options(), tmp_path / "cache", LocalRunner(1),
                           processor=family_processor(family, vl_tokenizer))
    batch = collate_jagged([store[i] for i in range(len(store))])
    chosen = [4, 2, 0, len(store) - 1]
    row = packed_row(select(batch, chosen))
    conversations = [own_forward_input(store[i]) for i in chosen]
    assert [c["pixel_values"] is None for c in conversations] == [False, True, False, False]
    assert ("image_grid_thw" in row) == (family == "qwen2_vl")
    lm = tiny_model(family, vl_tokenizer)
    ref_loss, ref_norm = own_forward_loss(lm, conversations)
    loss, norm, _ = packed_loss(lm, row)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    assert torch.equal(row["pixel_values"], torch.cat([c["pixel_values"] for c in conversations
                                                       if c["pixel_values"] is not None]))


def own_forward_input(item) -> dict:
    """A store item as test_vision_lm.own_forward_loss takes a conversation (no images: None)."""
    has_images = item["pixel_values"].shape[0] > 0
    return {"input_ids": item["input_ids"], "loss_mask": item["loss_mask"],
            "pixel_values": item["pixel_values"] if has_images else None,
            "image_grid_thw": item.get("image_grid_thw") if has_images else None}


def tiny_vl_folder(folder: Path, tokenizer, family: str = "qwen2_vl") -> str:
    """The family's 2-layer model (tiny_model) saved with its tokenizer and image processor
    (LLaVA's: CLIP's at the tower's 42 x 42): the model folder `hpsft train` takes."""
    tiny_model(family, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (llava_images(tokenizer).processor if family == "llava" else image_processor()).save_pretrained(folder)
    return str(folder)


def vl_overrides(model, train, run_dir, **extra) -> list[str]:
    """3 steps of 4 sequences in the file's order, 2 per micro-batch: at DP=2 each rank runs one
    micro-batch a step (the mixed layout below)."""
    from tests.conftest import base_overrides

    return base_overrides(model, train, None, run_dir, **{
        "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 2, "data.shuffle": "false",
        "trainer.total_steps": 3, "optim.grad_clip": 0.0, "trainer.save_every": 0, "trainer.export_hf": "false",
        **extra})


# image_rows(18) positions in the order trained (vl_overrides: unshuffled, steps of 4): step 1 one
# two-image row and three text rows, step 2 the one-image camera row and three text rows, step 3
# text only. The sampler's split (tokens plus the tower's cost, which on the tiny model outweighs
# the decoder's: an image row is a part alone) then gives rank 1 of steps 1 and 2 only text rows,
# and both ranks of step 3 (checked in the test).
MIXED_LAYOUT = [0, 2, 5, 8, 17, 14, 11, 8, 2, 5, 11, 14]


def mixed_layout_data(image_data: Path) -> Path:
    return Path(write_jsonl([image_rows(18)[i] for i in MIXED_LAYOUT], image_data.with_name("mixed.jsonl")))


def ranks_with_images(data: Path, cache: Path, tokenizer, model: str) -> list[list[bool]]:
    """Per step of vl_overrides' layout, per rank of 2: whether that rank's share has an image, the
    shares split as the trainer's sampler splits them (tokens plus the model's tower cost)."""
    from transformers import AutoConfig

    from hpsft.data.balance import SequenceCost, split_by_cost
    from hpsft.models.vision_cost import VisionTowerCost

    store = prepared_store(str(data), tokenizer, options(max_length=256), cache, LocalRunner(1),
                           processor=image_processor())
    cost = SequenceCost(tower_cost=VisionTowerCost(AutoConfig.from_pretrained(model)))
    steps = [list(range(first, first + 4)) for first in range(0, len(store), 4)]
    costs = [cost([len(store[i]["input_ids"]) for i in step], [store.image_grids(i) for i in step]) for step in steps]
    return [[any(store[step[i]]["pixel_values"].shape[0] > 0 for i in part) for part in split_by_cost(cost, 2)]
            for step, cost in zip(steps, costs)]


def step_figures(run_dir) -> list[tuple[float, float]]:
    from tests.conftest import read_metrics

    return [(m["train/loss"], m["train/grad_norm"]) for m in read_metrics(run_dir) if "train/loss" in m]


def parameters_of(folder: Path) -> dict:
    """The parameters of the model a folder holds, loaded by transformers, by their names."""
    from transformers import AutoModelForImageTextToText

    return {name: p.detach() for name, p in AutoModelForImageTextToText.from_pretrained(folder).named_parameters()}


@pytest.mark.slow
def test_llava_and_qwen2_5_vl_train_through_the_cli_as_their_own_forward_computes(image_data, tmp_path, vl_tokenizer):
    """`hpsft train` (one process, no shuffle, 2 steps: step k trains store sequences 4(k-1)..4k-1,
    2 per micro-batch) on a tiny LLaVA folder (CLIP tower, Llama decoder, CLIP's image processor, the
    "full" strategy) and a tiny Qwen2.5-VL folder (windowed tower attention): each step's loss
    and unclipped grad norm == the model's own Hugging Face forward on those sequences alone
    (test_vision_lm.own_forward_loss), run on the folder's weights for step 1 and on
    `hpsft export` of the step-1 checkpoint for step 2 (fp32, <= 1e-5 relative); 2 ranks under
    ZeRO-3 give the one process's figures (<= 1e-5)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tests.conftest import assert_ok, rel_diff, run_cli
    from tests.test_vision_lm import own_forward_loss

    def check(family: str, step: int, weights, store, figures: tuple[float, float]) -> None:
        lm = AutoModelForImageTextToText.from_pretrained(weights, dtype=torch.float32)
        sequences = [own_forward_input(store[i]) for i in range(4 * (step - 1), 4 * step)]
        (loss, norm), (ref_loss, ref_norm) = figures, own_forward_loss(lm, sequences)
        print(f"{family} step {step}: loss {loss:.8f} vs own {ref_loss:.8f}, grad norm {norm:.8f} vs own {ref_norm:.8f}")
        assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(norm, ref_norm) <= 1e-5, (family, step, loss, ref_loss,
                                                                                       norm, ref_norm)

    for family in ("llava", "qwen2_5_vl"):
        model = tiny_vl_folder(tmp_path / family / "model", vl_tokenizer, family)
        run, step_1 = tmp_path / family / "run", tmp_path / family / "step_1"
        assert_ok(run_cli("hpsft.train", vl_overrides(model, image_data, run, **{
            "trainer.save_every": 1, "trainer.total_steps": 2})))
        store = prepared_store(str(image_data), vl_tokenizer, options(max_length=256), tmp_path / family / "store",
                               LocalRunner(1), processor=family_processor(family, vl_tokenizer))
        figures = step_figures(run)
        assert len(figures) == 2
        check(family, 1, model, store, figures[0])
        assert_ok(run_cli("hpsft.export", [str(run / "checkpoints" / "global_step_1"), str(step_1)]))
        check(family, 2, step_1, store, figures[1])
        # DP=2 ZeRO-3 (the folder's saved names mapped by transformers' renamings) == one process.
        zero3 = tmp_path / family / "zero3"
        assert_ok(run_cli("hpsft.train", vl_overrides(model, image_data, zero3, **{
            "engine.zero_stage": 3, "trainer.total_steps": 2}), nproc=2, timeout=300))
        for (loss, norm), (ref_loss, ref_norm) in zip(step_figures(zero3), figures, strict=True):
            print(f"{family} DP=2 ZeRO-3: loss {loss:.8f} vs {ref_loss:.8f}, grad norm {norm:.8f} vs {ref_norm:.8f}")
            assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(norm, ref_norm) <= 1e-5, (family, loss, ref_loss,
                                                                                           norm, ref_norm)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def assert_exported_as_at_the_end(run: Path, exported: Path) -> None:
    """`hpsft export` of the run's last checkpoint into `exported` equals its end-of-run hf/, every
    tensor (the vision tower's among them)."""
    from tests.conftest import assert_ok, run_cli

    assert_ok(run_cli("hpsft.export", [str(run), str(exported)]))
    end_of_run, weights = folder_weights(run / "hf"), folder_weights(exported)
    assert weights.keys() == end_of_run.keys() and any(".visual." in name for name in weights), run
    assert all(torch_equal(weights[name], end_of_run[name]) for name in end_of_run), run


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_data_shows_where_each_images_tokens_go(image_data, tmp_path, vl_tokenizer, capsys, family):
    """hpsft inspect-data with a vision-language model folder: for each shown sequence, each image's
    size (Qwen2-VL: the processor's own grid on that photograph; LLaVA: the tower's pixels) and its
    run of image tokens (as many as transformers' own processing gives: own_processing), at the
    positions the data stage's store holds them (the store's input_ids, searched independently);
    the image tokens written once with their count. Planted bugs: image_token_lines printing each
    run from the token after its start (begin + 1) -> the line "image 1: grid 1x6x8 patches ->
    tokens 25-36" of row 0 was not in the output (26-36 printed); LlavaImages.image_notes giving
    each image one token fewer -> the LLaVA case failed (no line "image 1: 42x42 pixels -> tokens
    24-33 (10 image tokens")."""
    from hpsft.commands.inspect_data import main

    model = tiny_vl_folder(tmp_path / "model", vl_tokenizer, family)
    store = prepared_store(str(image_data), vl_tokenizer, options(), tmp_path / "cache", LocalRunner(1),
                           processor=family_processor(family, vl_tokenizer))
    assert main([f"model.path={model}", f"data.train_files=[{image_data}]", "data.max_length=1024",
                 "--rows", "2", "--color", "never", "--stats-rows", "2"]) == 0
    out = capsys.readouterr().out
    mark = IMAGE_PAD if family == "qwen2_vl" else IMAGE_MARK
    pad = vl_tokenizer.convert_tokens_to_ids(mark)
    for row, names in ((0, ["astronaut.jpg", "coffee.png"]), (1, ["chelsea.jpg"])):
        ids = store[row]["input_ids"].tolist()
        starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]
        for k, (name, start) in enumerate(zip(names, starts, strict=True)):
            pixels, grids, n = own_processing(family, vl_tokenizer, [image_data.parent / "imgs" / name])
            size = f"grid {grids[0][0]}x{grids[0][1]}x{grids[0][2]} patches" if family == "qwen2_vl" else \
                f"{pixels.shape[2]}x{pixels.shape[3]} pixels"
            assert ids[start:start + n] == [pad] * n and ids[start + n] != pad
            line = f"  image {k + 1}: {size} -> tokens {start}-{start + n - 1} ({n} image tokens"
            assert line in out, (line, out[-3000:])
            if k == 0:
                assert f"{mark}x{n}" in out


def test_touching_placeholders_are_told_apart_by_their_counts():
    """Two LLaVA images written `<image><image>` make one run of image tokens: each image takes
    its own count of it; a run short of an image's count is reported, not printed as tokens."""
    from hpsft.data.inspection import image_token_lines

    ids = [1, 2] + [9] * 20 + [3]
    images = [("42x42 pixels", 10, "3x3 patches of 14 + CLS")] * 2
    assert image_token_lines(ids, 9, images) == [
        "  image 1: 42x42 pixels -> tokens 2-11 (10 image tokens = 3x3 patches of 14 + CLS)",
        "  image 2: 42x42 pixels -> tokens 12-21 (10 image tokens = 3x3 patches of 14 + CLS)"]
    assert "not one run" in image_token_lines(ids[:15] + [3] + ids[15:], 9, images)[-1]
    assert "20 image tokens, 10 of them the images'" in image_token_lines(ids, 9, images[:1])[-1]


def own_next_token_logits(folder: Path, tokenizer, photo: Path, prompt: str):
    """The tiny model's logits at the last prompt position, inputs built here from the processor's
    own call and Qwen2-VL's placeholder rule (one <|vision_start|>, grid_t*grid_h*grid_w / 2**2
    <|image_pad|>, <|vision_end|> before the text), independently of hpsft/models/generation.py."""
    import torch
    from transformers import AutoModelForImageTextToText

    processed = image_processor()(images=Image.open(photo).convert("RGB"), return_tensors="pt")
    tokens = int(processed["image_grid_thw"].prod()) // 4
    text = VISION_START + IMAGE_PAD * tokens + VISION_END + prompt
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=input_ids, pixel_values=processed["pixel_values"],
                     image_grid_thw=processed["image_grid_thw"],
                     mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits[0, -1]


def test_generate_with_an_image_gives_the_models_own_greedy_next_token(image_data, tmp_path, vl_tokenizer, capsys):
    """Greedy generation with an image on a tiny Qwen2-VL folder (hpsft/models/generation.py, the
    folder loaded as `hpsft generate` loads it): for each of two photographs the first generated
    token is the argmax of the model's own forward logits at the prompt's last position, inputs
    built independently (own_next_token_logits), and the two photographs' logits differ
    (max |diff| > 1e-3), so the image reaches the model. `hpsft generate --image` prints the
    reply under the image and prompt. Measured: max |logit diff| astronaut vs coffee 0.180 (both argmax 32315).
    Planted bug: prompt_inputs not handing the pixel_values to the model -> the astronaut's first token 22388, the
    argmax 32315 (logits 0.6223 vs 0.6548)."""
    from hpsft.commands.generate import main
    from hpsft.models.generation import generated_tokens, load_for_generation
    from hpsft.models.loading import load_image_processor

    folder = tiny_vl_folder(tmp_path / "model", vl_tokenizer)
    model, tokenizer = load_for_generation(Path(folder))
    prompt, logits = "What is in this picture?", {}
    for name in ("astronaut.jpg", "coffee.png"):
        photo = image_data.parent / "imgs" / name
        logits[name] = own_next_token_logits(Path(folder), vl_tokenizer, photo, prompt)
        first = generated_tokens(model, tokenizer, [{"role": "user", "content": prompt}], 1, 0.0, [photo],
                                 load_image_processor(folder))
        assert first.tolist() == [int(logits[name].argmax())], (first, logits[name].topk(2))
    diff = float((logits["astronaut.jpg"] - logits["coffee.png"]).abs().max())
    assert diff > 1e-3, diff
    assert main([folder, "--image", str(photo), "--prompt", prompt, "--max-new-tokens", "2"]) == 0
    assert f"### user\n[image {photo}]\n{prompt}\n### assistant\n" in capsys.readouterr().out


def test_generate_refuses_an_image_with_several_prompts_or_a_text_model(image_data, tmp_path, vl_tokenizer,
                                                                        capsys):
    """--image with two --prompt is refused naming --image and --prompt; --image on a text model
    folder is refused naming --image and the missing vision_config, both before any model loads; a
    missing image file is refused naming --image and the file.
    Planted bug: the text-model check removed -> the misleading "model.path=... is a
    vision-language model without a usable image processor" error instead."""
    from hpsft.commands.generate import main

    photo = str(image_data.parent / "imgs" / "camera.png")
    folder = tiny_vl_folder(tmp_path / "model", vl_tokenizer)
    assert main([folder, "--image", photo, "--prompt", "a", "--prompt", "b"]) == 2
    assert "--image goes with one --prompt, got 2 prompts" in capsys.readouterr().err
    assert main([str(TEST_MODEL), "--image", photo, "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "--image:" in err and "is a text model (its config.json has no vision_config)" in err, err
    assert main([folder, "--image", str(tmp_path / "nowhere.png"), "--prompt", "a"]) == 2
    assert "--image: image " in (err := capsys.readouterr().err) and "nowhere.png' not found" in err, err


def test_an_image_replaced_in_place_prepares_its_shards_again_and_an_unchanged_store_is_reused(
        image_data, tmp_path, vl_tokenizer, capsys):
    """The images are the store key's second part (preparation.py: each shard's sidecar holds the
    path, size and mtime_ns of the images it read). Prepared once (~12 shards), then again unchanged:
    reused, nothing tokenized. Then imgs/chelsea.jpg (rows 1, 4, ...) is overwritten with another
    photograph of another size: the rerun prepares exactly the shards whose rows show it, names the
    image, and the store then holds the new image's patches (== the processor's own call on the new
    file), in the same store folder. Planted bug: changed_image always None (the key ignores the
    images) -> the rerun printed only the store's summary line, no "image ... changed" and nothing
    tokenized: the old store, with the old image's patches, was reused."""
    shard_mb = image_data.stat().st_size / 12 / 2**20
    cache, processor = tmp_path / "cache", image_processor()

    def prepare():
        capsys.readouterr()
        store = prepared_store(str(image_data), vl_tokenizer, options(), cache, LocalRunner(1), shard_mb=shard_mb,
                               processor=processor, report=True)
        return store, capsys.readouterr()

    first, _ = prepare()
    n = len(first.summary["shards"])
    assert n >= 8
    _, unchanged = prepare()
    assert "shards to tokenize" not in unchanged.out
    rows = image_rows(18)
    shown = [i for i, row in enumerate(rows) if row.get("images") == ["imgs/chelsea.jpg"]]
    old_grids = [first[i]["image_grid_thw"].numpy().copy() for i in shown]
    starts = [s["first_row"] for s in first.summary["shards"]] + [len(rows)]
    showing = [i for i in range(n) if any(starts[i] <= row_no < starts[i + 1] for row_no in shown)]
    assert 0 < len(showing) < n
    chelsea = image_data.parent / "imgs" / "chelsea.jpg"
    from skimage import data as photos
    Image.fromarray(photos.coffee()).convert("RGB").resize((84, 56)).save(chelsea, format="JPEG")
    again, replaced = prepare()
    assert f"image {chelsea.resolve()} changed" in replaced.err
    assert f"{len(showing)} of {n} shards to tokenize ({n - len(showing)} done before)" in replaced.out
    assert len(list(cache.iterdir())) == 1
    own = processor(images=Image.open(chelsea).convert("RGB"), return_tensors="np")
    for i, old in zip(shown, old_grids):
        np.testing.assert_array_equal(again[i]["pixel_values"].numpy(), own["pixel_values"])
        np.testing.assert_array_equal(again[i]["image_grid_thw"].numpy(), own["image_grid_thw"])
        assert not np.array_equal(old, own["image_grid_thw"])
    _, reused = prepare()
    assert "shards to tokenize" not in reused.out and "changed" not in reused.err


@pytest.mark.parametrize("settings, named", [
    (["engine.tensor_parallel_size=2"], "engine.tensor_parallel_size=2"),
    (["engine.name=megatron"], "engine.name=megatron"),
    (["model.lora.rank=4", "engine.zero_stage=3"], "model.lora.rank > 0 with engine.zero_stage=3"),
    (["model.lora.rank=4", "engine.sequence_parallel_size=2"], "model.lora.rank > 0 with engine.sequence_parallel_size>1"),
    (["model.lora.rank=4", "model.lora.quantize_base=nf4"], "model.lora.quantize_base=nf4"),
    (["model.lora.rank=4", "model.lora.use_dora=true"], "model.lora.use_dora=true"),
])
def test_vision_layouts_not_trained_yet_are_refused_by_name(settings, named):
    """What a vision-language model does not train under yet is refused naming the setting, and
    SP=2, ZeRO-3, the two together, or LoRA (at ZeRO-2, tests/test_vision_lora.py) alone is not (each is tested by
    a slow training test). Planted: the SP x ZeRO-3 entry dropped -> DID NOT RAISE for its case (when it was
    refused); the entry put back -> the SP=2 with ZeRO-3 case raised; the LoRA x ZeRO-3 entry dropped -> DID NOT
    RAISE for its case."""
    from hpsft.config import load_config
    from hpsft.trainer.sft_trainer import check_vision_layout
    from hpsft.utils.errors import UserInputError

    with pytest.raises(UserInputError, match=re.escape(f"train with {named} yet")):
        check_vision_layout(load_config(None, ["model.path=/some/vl-model", *settings]))
    for trained in (["engine.sequence_parallel_size=2"], ["engine.zero_stage=3"],
                    ["engine.sequence_parallel_size=2", "engine.zero_stage=3"], ["model.lora.rank=4"]):
        check_vision_layout(load_config(None, ["model.path=/some/vl-model", *trained]))
