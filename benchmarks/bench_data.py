"""The data stage on the packaged ShareGPT corpus (docs/data.md, "The data stage at scale").

Measured in one sitting, ratios against baselines run in the same sitting:
1. preparation rate (rows/s, tokens/s) of hpsft's data stage with 1 and 2 worker processes
   (fresh cache each), and its speed-up at 2;
2. per process, against the raw fast tokenizer's batch call on the same rendered text (each
   conversation rendered once by the chat template, `tokenizer(texts)` in batches of 64: the
   floor any masking tokenizer pays). Both tokenize every row whole, but hpsft counts the
   tokens it keeps (cut at --max-length) and the raw call all of them: the rows/s ratio
   compares like with like (on the first 3,000 ShareGPT rows at 2048, hpsft keeps 89 % of
   the tokens, so its tokens/s ratio is 0.89 of its rows/s ratio);
3. `hpsft prepare-data` (2 processes, its default truncation: leading whole turns) against the
   stage's 2 processes with the same truncation on the same file: the command's rows/s as a
   share of the stage's (its time counts the tokenizer load and the parquet written; neither
   counts its Python imports);
4. against a `datasets.map(num_proc=2)` pipeline of the same rows through the same per-row
   function (hpsft's row_sequences: the same template and masks), written to datasets' Arrow
   cache;
5. preparation's peak RSS (the preparing process with 1 worker: ru_maxrss) at 1x and at the
   largest --scales (the corpus repeated), same shard size;
6. with a warm store, a one-process training run of 1 step (the 2-layer test model): its
   wall time to the end of step 1 and perf/rss_anon_gib, at 1x and at the largest scale;
7. max/mean tokens per rank of each step's global batch, dealt every n-th vs split by
   hpsft/data/balance.py, at 8 and 64 ranks x 8 sequences, on the store's lengths.

    python benchmarks/bench_data.py [--scales 1,4] [--max-length 2048] [--rows N] [--shard-mb 4] [--skip-datasets]

`--rows N`: only the first N conversations (a quick look); `--scales 1,4` writes the corpus
repeated as one JSONL file per scale under --work (default .cache/bench_data).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# The raw tokenizer baseline runs in this process: without this, the fast tokenizer's batch call
# spreads over every core (rayon), and "per process" would compare one process with all cores
# (it did until 2026-12-01: 4.4 s wall for 7.7 s of CPU on 2 cores, the 0.56-0.69x of before).
os.environ["TOKENIZERS_PARALLELISM"] = "false"

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".cache" / "models" / "smollm2-135m-2l"

PREPARE = """
import json, resource, sys, time
from hpsft.data.preparation import LocalRunner, prepared_store
from hpsft.data.rows import TokenizeOptions
from hpsft.models import load_tokenizer

if __name__ == "__main__":
    path, cache, num_proc, max_length, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    # The keys as data.* defaults them (None: the layout's own column), so that first_step's run
    # finds this store warm.
    opts = TokenizeOptions(None, None, None, "tools", None, max_length, sys.argv[7], "skip")
    tokenizer = load_tokenizer(model)
    start = time.perf_counter()
    store = prepared_store(path, tokenizer, opts, cache, LocalRunner(num_proc), shard_mb=float(sys.argv[6]))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rows": store.summary["rows"], "tokens": store.summary["tokens"],
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "store": str(store.shard_files[0][0].parent)}))
"""


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}


def run_snippet(code: str, *args) -> dict:
    """Runs one of this file's measuring snippets in a fresh process: the JSON of its last line."""
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env(), capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepare(path: Path, cache: Path, num_proc: int, max_length: int, shard_mb: float,
            truncation: str = "right") -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    return run_snippet(PREPARE, path, cache, num_proc, max_length, MODEL, shard_mb, truncation)


def raw_tokenizer_rate(rows: list[dict], max_rows: int) -> dict:
    """Tokens/s of the fast tokenizer's batch call on each conversation rendered once, on one
    core (TOKENIZERS_PARALLELISM=false, as hpsft's preparing processes run it)."""
    from hpsft.data.chat_messages import normalize_messages
    from hpsft.models import load_tokenizer

    tokenizer = load_tokenizer(str(MODEL))
    texts = [tokenizer.apply_chat_template(normalize_messages(r["messages"]), tokenize=False) for r in rows[:max_rows]]
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 64):
        tokens += sum(len(ids) for ids in tokenizer(texts[i:i + 64], add_special_tokens=False)["input_ids"])
    seconds = time.perf_counter() - start
    return {"rows": len(texts), "tokens": tokens, "seconds": seconds}


# The imports before the clock, as PREPARE's (importing transformers took 2.3 s on the loaded 2-core machine).
PREPARE_DATA = """
import json, sys, time
from hpsft.commands.prepare_data import main
from hpsft.models.loading import load_tokenizer

if __name__ == "__main__":
    start = time.perf_counter()
    assert main(sys.argv[1:]) == 0
    print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def prepare_data_rate(path: Path, out_dir: Path, num_proc: int, max_length: int) -> dict:
    """`hpsft prepare-data` on the same file, its default truncation (turns): the command's
    time from its start, its imports done (tokenizer load, rows read and fitted on the stage's
    pool, parquet written), its rows from its report."""
    shutil.rmtree(out_dir, ignore_errors=True)
    seconds = run_snippet(PREPARE_DATA, path, "--out", out_dir, "--tokenizer", MODEL, "--max-length", max_length,
                          "--num-proc", num_proc)["seconds"]
    report = json.loads((out_dir / "report.json").read_text())
    return {"seconds": seconds, "rows": report["rows_read"], "kept": report["rows_kept"]}


DATASETS_MAP = """
import json, sys, time
import datasets
from hpsft.data.row_sequences import row_sequences
from hpsft.data.rows import TokenizeOptions
from hpsft.models import load_tokenizer

OPTS = TokenizeOptions("messages", "prompt", "response", "tools", None, int(sys.argv[3]), "right", "skip")
TOKENIZER = load_tokenizer(sys.argv[4])


def tokenize(row):
    (ids, mask), = row_sequences({"messages": row["messages"]}, TOKENIZER, OPTS).sequences
    return {"input_ids": ids, "loss_mask": mask}


if __name__ == "__main__":
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[2])
    ds = ds.map(tokenize, num_proc=2, remove_columns=ds.column_names)
    print(json.dumps({"seconds": time.perf_counter() - start, "rows": len(ds),
                      "tokens": sum(len(x) for x in ds["input_ids"])}))
"""


def datasets_map_rate(path: Path, cache: Path, max_length: int) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    return run_snippet(DATASETS_MAP, path, cache, max_length, MODEL)


def first_step(path: Path, cache: Path, out_dir: Path, max_length: int, shard_mb: float) -> dict:
    """A 1-step, one-process run on the warm store: wall time and RssAnon after step 1."""
    shutil.rmtree(out_dir, ignore_errors=True)
    args = [f"model.path={MODEL}", f"data.train_files=[{path}]", "data.val_files=[]", f"data.max_length={max_length}",
            "data.truncation=right", "data.bad_rows=skip", f"data.cache_dir={cache}", f"data.shard_mb={shard_mb}",
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=4", f"trainer.output_dir={out_dir}", "trainer.progress_bar=false",
            "trainer.loggers=[jsonl]", "trainer.total_steps=1", "trainer.export_hf=false",
            "trainer.peak_flops_per_device=1e12"]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpsft.train", *args], env=env(), capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if "perf/rss_anon_gib" in m)
    return {"seconds": time.perf_counter() - start, "rss_anon_gib": step["perf/rss_anon_gib"],
            "preparing": "preparing data" in out.stdout}


def balance_table(lengths: np.ndarray) -> list[str]:
    from hpsft.data.balance import split_by_cost

    lines = ["| ranks x sequences | dealt every n-th: mean / worst max/mean | split by tokens: mean / worst |",
             "|---|---|---|"]
    order = np.random.default_rng(0).permutation(lengths.size)
    for ranks in (8, 64):
        batch_size = ranks * 8
        if lengths.size < batch_size:
            lines.append(f"| {ranks} x 8 | fewer sequences ({lengths.size}) than one global batch | |")
            continue
        dealt, split = [], []
        for step in range(lengths.size // batch_size):
            batch = lengths[order[step * batch_size:(step + 1) * batch_size]]
            loads = [batch[r::ranks].sum() for r in range(ranks)]
            dealt.append(max(loads) / np.mean(loads))
            loads = [batch[p].sum() for p in split_by_cost(batch, ranks)]
            split.append(max(loads) / np.mean(loads))
        lines.append(f"| {ranks} x 8 | {np.mean(dealt):.3f} / {max(dealt):.3f} | {np.mean(split):.4f} / "
                     f"{max(split):.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", default="1,4")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "bench_data")
    parser.add_argument("--skip-datasets", action="store_true")
    parser.add_argument("--shard-mb", type=float, default=4.0, help="data.shard_mb (default 4: 16 shards at 1x)")
    args = parser.parse_args()
    from hpsft.assets.chat_corpora import sharegpt_conversations

    scales = [int(s) for s in args.scales.split(",")]
    rows = [{"messages": c} for c in sharegpt_conversations(args.rows or 10**9)]
    args.work.mkdir(parents=True, exist_ok=True)
    files = {}
    for scale in scales:
        files[scale] = args.work / f"sharegpt_x{scale}.jsonl"
        with open(files[scale], "w") as f:
            for _ in range(scale):
                f.writelines(json.dumps(r) + "\n" for r in rows)
    base = files[scales[0]]
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; corpus: {len(rows)} conversations "
          f"({base.stat().st_size / 2**20:.0f} MiB JSONL), max_length {args.max_length}", flush=True)

    one = prepare(base, args.work / "cache-p1", 1, args.max_length, args.shard_mb)
    two = prepare(base, args.work / "cache-p2", 2, args.max_length, args.shard_mb)
    raw = raw_tokenizer_rate(rows, max_rows=min(len(rows), 3000))
    print("\n| preparation (x{}) | rows/s | tokens/s | ratio |".format(scales[0]))
    print("|---|---|---|---|")
    for name, r in (("hpsft, 1 process", one), ("hpsft, 2 processes", two)):
        print(f"| {name} | {r['rows'] / r['seconds']:.0f} | {r['tokens'] / r['seconds']:.0f} | "
              f"{one['seconds'] / r['seconds']:.2f}x of 1 process |")
    raw_rate = raw["tokens"] / raw["seconds"]
    print(f"| raw tokenizer batch call, 1 process ({raw['rows']} rows) | {raw['rows'] / raw['seconds']:.0f} | "
          f"{raw_rate:.0f} | hpsft 1 process = {one['tokens'] / one['seconds'] / raw_rate:.2f}x of its tokens/s, "
          f"{one['rows'] / one['seconds'] / (raw['rows'] / raw['seconds']):.2f}x of its rows/s |")
    # prepare-data against the stage on the same rows, both with truncation=turns (prepare-data's
    # default) and 2 processes: the command's rows/s as a share of the stage's (issue 39: >= 0.9).
    stage = prepare(base, args.work / "cache-p2-turns", 2, args.max_length, args.shard_mb, truncation="turns")
    command = prepare_data_rate(base, args.work / "prepare-data", 2, args.max_length)
    print(f"| hpsft prepare-data, 2 processes, truncation turns ({command['kept']} of {command['rows']} rows kept) | "
          f"{command['rows'] / command['seconds']:.0f} | | {stage['seconds'] / command['seconds']:.2f}x of the stage's "
          f"rows/s ({stage['rows'] / stage['seconds']:.0f}, 2 processes, truncation turns) |")
    if not args.skip_datasets:
        ds = datasets_map_rate(base, args.work / "hf-cache", args.max_length)
        print(f"| datasets.map(num_proc=2), same row function | {ds['rows'] / ds['seconds']:.0f} | "
              f"{ds['tokens'] / ds['seconds']:.0f} | hpsft 2 processes = {ds['seconds'] / two['seconds']:.2f}x "
              "its speed |")

    print("\n| scale | tokens | preparation peak RSS (1 process) | run to end of step 1 (warm store) | RssAnon at "
          "step 1 |")
    print("|---|---|---|---|---|")
    results = {}
    for scale in (scales[0], scales[-1]):
        if scale == scales[0]:
            prep, prep_peak = one, one["peak_rss"]
        else:
            prep = prepare(files[scale], args.work / f"cache-x{scale}", 2, args.max_length, args.shard_mb)
            # The peak of one process, as at 1x.
            prep_peak = prepare(files[scale], args.work / f"cache-x{scale}-p1", 1, args.max_length,
                                args.shard_mb)["peak_rss"]
        cache = Path(prep["store"]).parent
        run = first_step(files[scale], cache, args.work / f"run-x{scale}", args.max_length, args.shard_mb)
        assert not run["preparing"], "the run prepared data: the store was not warm"
        results[scale] = (prep_peak, run)
        print(f"| {scale}x | {prep['tokens']} | {prep_peak / 2**30:.3f} GiB | {run['seconds']:.1f} s | "
              f"{run['rss_anon_gib']:.3f} GiB |", flush=True)
    if len(results) == 2:
        (p0, r0), (p1, r1) = results[scales[0]], results[scales[-1]]
        print(f"\nratios {scales[-1]}x / {scales[0]}x: preparation peak {p1 / p0:.3f}, time to step 1 "
              f"{r1['seconds'] / r0['seconds']:.3f}, RssAnon {r1['rss_anon_gib'] / r0['rss_anon_gib']:.3f}")

    from hpsft.data.preparation import MANIFEST, open_store

    store_dir = Path(one["store"])
    store = open_store(store_dir, json.loads((store_dir / MANIFEST).read_text()))
    print("\n" + "\n".join(balance_table(store.lengths.astype(np.int64))))


if __name__ == "__main__":
    main()
