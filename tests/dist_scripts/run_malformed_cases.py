"""Run every case of tests/data/malformed/cases.yaml through the CLI's `main` in this one
process and write what each printed and left behind as JSON.

Usage: run_malformed_cases.py MODEL_DIR SCRATCH_DIR REPORT.json

One process for the whole corpus: torch, transformers and DeepSpeed are imported once
instead of once per case (the corpus would otherwise take minutes). `stage: config` cases
run first, so whether they imported anything heavy can still be seen.
"""

import io
import json
import shutil
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent.parent / "data" / "malformed"
BASE_ARGS = [
    "model.path={model}", "data.train_files=[{data}/good.jsonl]", "data.val_files=[]", "data.max_length=256",
    "data.cache_dir={tmp}/tokcache", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4",
    "trainer.output_dir={tmp}/run", "trainer.progress_bar=false", "trainer.loggers=[jsonl]",
    "trainer.total_steps=1", "trainer.export_hf=false", "trainer.peak_flops_per_device=1e12",
]


def copy_model(model: Path, tmp: Path, without: tuple[str, ...]) -> Path:
    folder = tmp / "model"
    shutil.copytree(model, folder, ignore=shutil.ignore_patterns(*without))
    return folder


def model_without_chat_template(model: Path, tmp: Path) -> None:
    folder = copy_model(model, tmp, ("chat_template.jinja",))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))


def model_with_remote_code(model: Path, tmp: Path) -> None:
    config_path = copy_model(model, tmp, ()) / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    config_path.write_text(json.dumps(config))


def vision_model(model: Path, tmp: Path) -> Path:
    """{tmp}/model: the tiny Qwen2-VL folder of tests/test_image_data_stage.py (its tokenizer with
    the image tokens, its image processor), built once per corpus run and copied."""
    built = tmp.parent / "vision-model"
    if not built.exists():
        from transformers import AutoTokenizer

        from tests.test_image_data_stage import tiny_vl_folder
        from tests.test_vision_lm import IMAGE_TOKENS

        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
        tiny_vl_folder(built, tokenizer)
    return Path(shutil.copytree(built, tmp / "model"))


SETUPS = {
    "vision_model": vision_model,
    "vision_model_without_image_processor": lambda model, tmp: (
        vision_model(model, tmp) / "preprocessor_config.json").unlink(),
    "model_without_config": lambda model, tmp: copy_model(model, tmp, ("config.json",)),
    "model_without_weights": lambda model, tmp: copy_model(model, tmp, ("*.safetensors",)),
    "model_config_not_json": lambda model, tmp: (copy_model(model, tmp, ()) / "config.json").write_text("{oops"),
    "model_without_chat_template": model_without_chat_template,
    "model_with_remote_code": model_with_remote_code,
}


def setup(step: str, model: Path, tmp: Path) -> None:
    if step.startswith("copy "):
        name = step.removeprefix("copy ")
        shutil.copytree(DATA / name, tmp / name)
    else:
        SETUPS[step](model, tmp)


def files_under(folder: Path) -> dict:
    """{relative path: file content} of every file under `folder` ({} when it does not exist)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes().hex() for p in sorted(folder.rglob("*")) if p.is_file()}


def output_dir(argv: list[str]) -> Path:
    return Path([a for a in argv if a.startswith("trainer.output_dir=")][-1].split("=", 1)[1])


def run_case(case: dict, model: Path, scratch: Path) -> dict:
    from hpsft.commands.train import main

    tmp = scratch / case["id"]
    tmp.mkdir(parents=True)
    for step in case.get("setup", ()):
        setup(step, model, tmp)
    argv = [a.format(data=DATA, model=model, tmp=tmp) for a in BASE_ARGS + case["args"]]
    out = output_dir(argv)
    before = files_under(out)
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as exit:  # argparse
            status = exit.code
        except BaseException:  # main lets nothing through: this is a bug of main itself
            traceback.print_exc()
            status = "raised"
    return {
        "status": status,
        "stderr": stderr.getvalue(),
        "output_dir_unchanged": files_under(out) == before,
        "latest_written": (out / "checkpoints" / "latest").exists() and "checkpoints/latest" not in before,
        "heavy_imports": sorted(m for m in ("torch.distributed", "deepspeed", "transformers") if m in sys.modules),
        "data_prepared": (tmp / "tokcache").exists(),
        "tmp": str(tmp),
    }


def main() -> None:
    model, scratch, report = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    cases = yaml.safe_load((DATA / "cases.yaml").read_text())
    cases.sort(key=lambda case: case.get("stage") != "config")  # stable: config cases first
    results = {case["id"]: run_case(case, model, scratch) for case in cases}
    report.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
