"""The data stage: a data source's rows -> a token store (hpsft/data/token_store.py), shard by
shard, in parallel, resumable, never waited for inside a collective.

A source's store lives in `<data.cache_dir>/<key>/`, the key a hash of what decides its
content: the input files (resolved path, size, modification time), the tokenizer (its
vocabulary, special tokens and chat template), the tokenization options, the shard size and
the code that turns rows into tokens. The images a data file names are known only once its
rows are read, so they are the key's second part, kept per shard: each image shard's sidecar
lists the identity (the same resolved path, size, modification time) of every image it read,
taken as it was read; a shard whose image changed or went is prepared again. Reusing a store
costs one stat per distinct image of a shard (no image read: at 10^6 images, 10^6 stats and
the sidecars' lists parsed), nothing for a text store. In it:

    shard-00000.arrow, shard-00000.json, ...   each shard's sequences, and its completion mark
    store.json                                 the plan and the totals, once every shard is done

Who prepares which shard (a `runner`):
- LocalRunner: this process, over `num_proc` worker processes (a pool started by forkserver,
  each with its own copy of the tokenizer);
- TeamRunner (SPMD): the ranks that see the same cache folder (all ranks on a shared file
  system, the ranks of a node on a node-local one) split the shards (shard i to the rank
  i mod team size), each over its own worker processes, then wait for the others' shards by
  watching the folder (a file condition polled every second, with progress: no collective
  and no timeout). A rank that fails writes its `hpsft: error:` message to the folder, and
  the waiting ranks stop with it;
- hpsft.ray.data_preparation.RayTaskRunner: the Ray driver runs the shards as Ray tasks over
  the cluster's CPUs.
A shard is complete once its sidecar is written and its Arrow file is intact, so a crash or
preemption mid-preparation resumes from the finished shards; a damaged shard file is
rebuilt, naming it.
"""

import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from hpsft.data import chat_messages, chat_tokenize, image_rows, image_sequences, patch_store, \
    row_sequences as row_sequences_module, rows, shards, token_store
from hpsft.data.chat_messages import BadRow
from hpsft.data.image_rows import LlavaImages, image_layout
from hpsft.data.image_sequences import image_rows_sequences
from hpsft.data.patch_store import MappedPatches, PatchWriter
from hpsft.data.row_sequences import rows_sequences
from hpsft.data.rows import DataError, TokenizeOptions, UnreadableRow
from hpsft.data.shards import Shard, expand_entry, plan_shards, shard_rows
from hpsft.data.token_store import DamagedShard, MappedShard, ShardWriter, TokenStore
from hpsft.utils.files import file_identity, write_atomically, write_json_atomically
from hpsft.utils.progress import progress_bar

STORE_FORMAT = 1
MANIFEST = "store.json"
DEFAULT_SHARD_MB = 16.0
POLL_S = 1.0  # how often a waiting rank looks at the store folder
ROWS_PER_CALL = 64  # rows tokenized by one call (the fast tokenizer's batch call beats 64 single ones)
# The modules whose rules turn rows into tokens: a store written under other rules is not reused.
TOKENIZATION_CODE = (chat_messages, chat_tokenize, rows, row_sequences_module, shards, token_store, image_rows,
                     image_sequences, patch_store)


def default_num_proc() -> int:
    """The cores this process may use, shared with the other ranks of its node."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def tokenizer_identity(tokenizer) -> dict:
    """What of a tokenizer decides the tokens (not where it was loaded from: a store prepared
    on CPU nodes is valid for the same tokenizer in another folder)."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return {
        "vocabulary sha256": hashlib.sha256(vocabulary.encode()).hexdigest(),
        "size": len(tokenizer),
        "special tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat template sha256": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest(),
        "class": type(tokenizer).__name__,
    }


def code_sha256() -> str:
    h = hashlib.sha256()
    for module in TOKENIZATION_CODE:
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def processor_identity(processor) -> str | None:
    """What of an image processor decides the patches (its settings), None for a text model."""
    if processor is None:
        return None
    return hashlib.sha256(json.dumps(processor.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


def store_identity(files: list[Path], tokenizer, opts: TokenizeOptions, shard_bytes: int, processor=None) -> dict:
    identity = {
        "format": STORE_FORMAT,
        "inputs": [dict(zip(("path", "bytes", "mtime_ns"), file_identity(p))) for p in files],
        "tokenizer": tokenizer_identity(tokenizer),
        "options": asdict(opts),
        "shard_bytes": shard_bytes,
        "code sha256": code_sha256(),
    }
    if processor is not None:  # a text store's key stays what it was
        identity["image processor sha256"] = processor_identity(processor)
    return identity


def store_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


# ---- one shard, in a worker process ------------------------------------------------------

@dataclass(frozen=True)
class ShardJob:
    index: int
    shard: Shard
    store_dir: str

    @property
    def arrow_path(self) -> Path:
        return Path(self.store_dir) / f"shard-{self.index:05d}.arrow"

    @property
    def sidecar_path(self) -> Path:
        return Path(self.store_dir) / f"shard-{self.index:05d}.json"


WORKER_STATE: dict = {}  # the tokenizer, options and image processor of this worker process (init_worker)


def init_worker(tokenizer, opts: TokenizeOptions, processor=None) -> None:
    """`processor`: the image processor of a vision-language model (None: text rows)."""
    WORKER_STATE.update(tokenizer=tokenizer, opts=opts, processor=processor)


def worker_pool(workers: int, tokenizer, opts: TokenizeOptions, processor=None):
    """`workers` processes tokenizing with these options (WORKER_STATE set by init_worker),
    for run_jobs. forkserver:
    workers start from a clean process, not a fork of this one (its threads, e.g.
    torch.distributed's, would be copied mid-state)."""
    return multiprocessing.get_context("forkserver").Pool(workers, init_worker, (tokenizer, opts, processor))


def prepare_shard(job: ShardJob) -> dict:
    """Tokenize one shard into its Arrow file, then write its sidecar; returns the sidecar.
    Rows go through rows_sequences ROWS_PER_CALL at a time (one tokenizer call for all)."""
    tokenizer, opts, processor = WORKER_STATE["tokenizer"], WORKER_STATE["opts"], WORKER_STATE.get("processor")
    start = time.perf_counter()
    writer = ShardWriter(job.arrow_path)
    # A vision-language model's store: each sequence's image patches beside its tokens.
    layout = None if processor is None else image_layout(processor)
    patches = None if layout is None else PatchWriter(job.arrow_path, layout.row_shape, layout.grid_width)
    tally = {"rows": 0, "skipped": 0, "counts": Counter(), "images": 0, "image_files": {}}

    def sequences_of(readable_rows: list) -> list:
        if processor is None:
            return rows_sequences(readable_rows, tokenizer, opts)
        return image_rows_sequences(readable_rows, tokenizer, processor, opts, job.shard.path)

    def tokenize(chunk: list[tuple[int, object]]) -> None:
        readable = [(row_no, row) for row_no, row in chunk if not isinstance(row, UnreadableRow)]
        results = dict(zip((row_no for row_no, _ in readable), sequences_of([row for _, row in readable])))
        for row_no, row in chunk:
            result = results.get(row_no, BadRow(row.reason) if isinstance(row, UnreadableRow) else None)
            if isinstance(result, BadRow):
                if opts.bad_rows == "skip":
                    tally["skipped"] += 1
                    continue
                raise DataError(f"{job.shard.path} row {row_no}: {result} (set data.bad_rows=skip to skip such "
                                "rows)")
            if patches is not None:
                for pixels, grids in result.patches:
                    patches.add(pixels, grids)
                    tally["images"] += len(grids)
                tally["image_files"].update(dict.fromkeys(result.image_files))  # distinct, in order
                result = result.sequences
            tally["counts"].update(result.counts)  # a dropped row included (dropped_over_max_length)
            for ids, mask in result.sequences:
                writer.add(ids, mask, row_no)

    try:
        chunk = []
        for row_no, row in shard_rows(job.shard):
            tally["rows"] += 1
            chunk.append((row_no, row))
            if len(chunk) == ROWS_PER_CALL:
                tokenize(chunk)
                chunk = []
        tokenize(chunk)
        if patches is not None:
            patches.close()  # before the tokens: a shard whose Arrow file is in place has its patches
        held = writer.close()
    except BaseException:
        writer.abort()
        if patches is not None:
            patches.abort()
        raise
    if patches is not None:
        held["images"] = tally["images"]
        held["image_files"] = [list(identity) for identity in tally["image_files"]]
    sidecar = {"shard": asdict(job.shard), "rows": tally["rows"], "skipped_rows": tally["skipped"],
               "counts": dict(tally["counts"]), **held, "seconds": round(time.perf_counter() - start, 3)}
    write_json_atomically(job.sidecar_path, sidecar)
    return sidecar


def completed_sidecar(job: ShardJob, repair: bool = True) -> dict | None:
    """The shard's sidecar if the shard is complete and its file intact, else None. With
    `repair` a damaged shard is reported and its sidecar removed, so that it is prepared again;
    a rank watching another's shards only waits (a shared file system may show a new file's
    size late)."""
    try:
        sidecar = json.loads(job.sidecar_path.read_text())
    except (OSError, ValueError):
        return None
    if sidecar.get("shard") != asdict(job.shard):
        return None
    changed = changed_image(sidecar)
    if changed is not None:
        if repair:
            print(f"hpsft: {changed} since tokenized shard {job.arrow_path} was prepared: preparing it again",
                  file=sys.stderr, flush=True)
            job.sidecar_path.unlink(missing_ok=True)
        return None
    try:
        MappedShard(job.arrow_path, sidecar)
        if "images" in sidecar:
            check_patches(job.arrow_path, sidecar)
    except DamagedShard as err:
        if repair:
            print(f"hpsft: {err}: preparing it again", file=sys.stderr, flush=True)
            job.sidecar_path.unlink(missing_ok=True)
        return None
    return sidecar


def changed_image(sidecar: dict) -> str | None:
    """What changed of the images a shard read (its sidecar's file identities), None if none did."""
    for path, size, mtime_ns in sidecar.get("image_files", ()):
        try:
            now = file_identity(Path(path))
        except OSError:
            return f"image {path} is gone"
        if now != (path, size, mtime_ns):
            return f"image {path} changed (size, modification time)"
    return None


def store_images_changed(store_dir: Path, manifest: dict) -> str | None:
    """What changed of the images a complete store's shards read (text store: nothing to check)."""
    if "images" not in manifest:
        return None
    for i in range(len(manifest["shards"])):
        try:
            sidecar = json.loads((store_dir / f"shard-{i:05d}.json").read_text())
        except (OSError, ValueError):
            return f"the sidecar of shard {i} is unreadable"
        changed = changed_image(sidecar)
        if changed is not None:
            return changed
    return None


def check_patches(arrow_path: Path, sidecar: dict) -> None:
    """An image shard's patch files hold what its sidecar says (one entry per sequence)."""
    try:
        mapped = MappedPatches(arrow_path)
    except DataError as err:
        raise DamagedShard(f"the image patches of tokenized shard {arrow_path} are damaged: {err}") from None
    if (len(mapped), len(mapped.grid_thw)) != (sidecar["sequences"], sidecar["images"]):
        raise DamagedShard(f"the image patches of tokenized shard {arrow_path} are damaged: they hold "
                           f"{len(mapped)} sequences and {len(mapped.grid_thw)} images, {sidecar['sequences']} and "
                           f"{sidecar['images']} were written")


# ---- who prepares which shards -----------------------------------------------------------

class Progress:
    """Shards, rows, tokens/s and ETA of one source's preparation (a bar on a terminal) and a
    closing line."""

    def __init__(self, name: str, jobs: list[ShardJob], shown: bool):
        self.name, self.shown = name, shown
        self.total_bytes = sum(job.shard.input_bytes for job in jobs)
        self.done_bytes = self.rows = self.tokens = 0
        self.start = time.perf_counter()
        self.bar = progress_bar(shown, total=len(jobs), desc=f"prepare {name}", unit="shard")

    def add(self, sidecar: dict) -> None:
        self.done_bytes += sidecar["shard"]["input_bytes"]
        self.rows += sidecar["rows"]
        self.tokens += sidecar["tokens"]
        elapsed = time.perf_counter() - self.start
        left = elapsed * (self.total_bytes - self.done_bytes) / max(self.done_bytes, 1)
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self.rows} rows, {self.tokens / max(elapsed, 1e-9):.0f} tok/s, "
                                 f"ETA {time.strftime('%H:%M:%S', time.gmtime(left))}")

    def close(self) -> None:
        self.bar.close()


def run_jobs(work, jobs: list, num_proc: int, tokenizer, opts: TokenizeOptions, done, processor=None) -> None:
    """work(job) for every job (a module-level function: workers import it), on `num_proc`
    processes: this one and num_proc - 1 workers of a pool (worker_pool); done(job, result)
    runs here as each finishes. The data stage's shards (LocalRunner) and prepare-data's row
    ranges (data/prepare_files.py).

    This process works too, from the start: a worker takes seconds to start (it imports torch
    and transformers and unpickles the tokenizer: 4-6 s here), which on 2 cores was most of
    what 2 processes gained on the packaged ShareGPT corpus. Each worker is kept one job
    ahead; this process takes the next job whenever none is waiting for it."""
    init_worker(tokenizer, opts, processor)
    workers = min(num_proc, len(jobs)) - 1
    if workers < 1:
        for job in jobs:
            done(job, work(job))
        return
    todo, running = list(reversed(jobs)), []
    with worker_pool(workers, tokenizer, opts, processor) as pool:
        while todo or running:
            for job, result in [r for r in running if r[1].ready()]:
                running.remove((job, result))
                done(job, result.get())
            while todo and len(running) < workers:
                job = todo.pop()
                running.append((job, pool.apply_async(work, (job,))))
            if todo:
                job = todo.pop()
                done(job, work(job))
            elif running:
                running[0][1].wait()


class LocalRunner:
    """Every job on `num_proc` processes: this one and num_proc - 1 workers (run_jobs)."""

    def __init__(self, num_proc: int):
        self.num_proc = num_proc

    def run(self, jobs: list[ShardJob], tokenizer, opts: TokenizeOptions, progress: Progress,
            between=lambda: None, processor=None) -> None:
        """`between()` runs after each finished shard (a team checks the others' progress);
        `processor`: a vision-language model's image processor (init_worker)."""
        def done(_job: ShardJob, sidecar: dict) -> None:
            progress.add(sidecar)
            between()

        run_jobs(prepare_shard, jobs, self.num_proc, tokenizer, opts, done, processor)


@dataclass(frozen=True)
class Team:
    """The ranks preparing shards together: this one is `index` of `size` of them; `attempt`
    names this start of the job (every rank knows it), for its error files."""

    rank: int
    index: int
    size: int
    attempt: str


class TeamRunner:
    """A share of the shards here, then wait for the team's other shards (see the module doc)."""

    def __init__(self, team: Team, num_proc: int):
        self.team, self.local = team, LocalRunner(num_proc)

    def error_dir(self, store_dir: Path) -> Path:
        return store_dir / "errors" / self.team.attempt

    def check_others(self, store_dir: Path) -> None:
        """Stop with the first failure another rank of the team reported."""
        folder = self.error_dir(store_dir)
        if folder.is_dir():
            for path in sorted(folder.glob("rank-*.txt")):
                raise OtherRankFailed(f"data preparation failed on rank {path.stem[len('rank-'):]}: "
                                      f"{path.read_text().strip()}")

    def report_failure(self, store_dir: Path, err: Exception) -> None:
        folder = self.error_dir(store_dir)
        folder.mkdir(parents=True, exist_ok=True)
        message = str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}"
        write_atomically(folder / f"rank-{self.team.rank}.txt", lambda tmp: tmp.write_text(message + "\n"))

    def run(self, jobs: list[ShardJob], tokenizer, opts: TokenizeOptions, progress: Progress,
            processor=None) -> None:
        store_dir = Path(jobs[0].store_dir)
        mine = [job for job in jobs if job.index % self.team.size == self.team.index]
        theirs = {job.index: job for job in jobs if job.index % self.team.size != self.team.index}

        def collect_theirs():
            self.check_others(store_dir)
            for index, job in list(theirs.items()):
                sidecar = completed_sidecar(job, repair=False) if job.sidecar_path.is_file() else None
                if sidecar is not None:
                    progress.add(sidecar)
                    del theirs[index]

        try:
            self.local.run(mine, tokenizer, opts, progress, between=collect_theirs, processor=processor)
        except Exception as err:
            if not isinstance(err, OtherRankFailed):
                self.report_failure(store_dir, err)
            raise
        while theirs:
            time.sleep(POLL_S)
            collect_theirs()


class OtherRankFailed(DataError):
    pass


# ---- a source's store ---------------------------------------------------------------------

def manifest_of(store_dir: Path, key: str) -> dict | None:
    try:
        manifest = json.loads((store_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("key") == key else None


def summarize(identity: dict, key: str, plan: list[Shard], sidecars: list[dict]) -> dict:
    counts = Counter()
    for sidecar in sidecars:
        counts.update(sidecar["counts"])
    return {
        "key": key,
        **identity,
        "shards": [asdict(shard) for shard in plan],
        "rows": sum(s["rows"] for s in sidecars),
        "skipped_rows": sum(s["skipped_rows"] for s in sidecars),
        "sequences": sum(s["sequences"] for s in sidecars),
        "tokens": sum(s["tokens"] for s in sidecars),
        "supervised_tokens": sum(s["supervised_tokens"] for s in sidecars),
        "counts": dict(sorted(counts.items())),
        "shard_files": [{k: s[k] for k in ("sequences", "tokens", "supervised_tokens", "longest", "file_bytes",
                                           "images") if k in s}
                        for s in sidecars],
        **({"images": sum(s["images"] for s in sidecars)} if "image processor sha256" in identity else {}),
    }


def open_store(store_dir: Path, manifest: dict) -> TokenStore:
    files = [(store_dir / f"shard-{i:05d}.arrow", held) for i, held in enumerate(manifest["shard_files"])]
    return TokenStore(files, manifest)


def is_store(entry: str) -> bool:
    """A folder holding a prepared store (hpsft prepare-data --store writes one)."""
    return (Path(entry) / MANIFEST).is_file()


def prepared_store(entry: str, tokenizer, opts: TokenizeOptions, cache_dir: str | Path, runner=None,
                   shard_mb: float = DEFAULT_SHARD_MB, name: str | None = None, report: bool = False,
                   bar: bool = False, processor=None) -> TokenStore:
    """The token store of one data source: an entry of data.train_files naming a file, folder
    or glob (prepared into data.cache_dir by `runner`, default this process alone, unless
    already complete there), or a folder holding a store prepared before. `report`: this
    process prints what is prepared and what the store holds (one rank does); `bar`: and a
    progress bar on a terminal. `processor`: a vision-language model's image processor; its
    rows' images go into patch files beside the shards (hpsft/data/patch_store.py)."""
    name = name or Path(entry).name
    if is_store(entry):
        store_dir = Path(entry)
        manifest = checked_manifest(store_dir, tokenizer, opts, processor)
        try:
            store = open_store(store_dir, manifest)
        except DamagedShard as err:
            raise DataError(f"{err}: prepare the store again (hpsft prepare-data ... --store)") from None
    else:
        store_dir, manifest = prepare(entry, tokenizer, opts, cache_dir, runner, shard_mb, name, report, bar,
                                      processor=processor)
        try:
            store = open_store(store_dir, manifest)
        except DamagedShard as err:  # prepared again, shard by shard
            print(f"hpsft: {err}: preparing the damaged shards again", file=sys.stderr, flush=True)
            store_dir, manifest = prepare(entry, tokenizer, opts, cache_dir, runner, shard_mb, name, report, bar,
                                          check_shards=True, processor=processor)
            store = open_store(store_dir, manifest)
    if report:
        print(f"hpsft: data {name}: {summary_text(manifest)} ({store_dir})", flush=True)
    return store


def checked_manifest(store_dir: Path, tokenizer, opts: TokenizeOptions, processor=None) -> dict:
    """A prepared store's manifest, if it fits this run: the same tokenizer (vocabulary, special
    tokens, chat template), the same image processor (or none for both) and no sequence over
    data.max_length."""
    manifest = json.loads((store_dir / MANIFEST).read_text())
    if manifest.get("format") != STORE_FORMAT:
        raise DataError(f"{store_dir} is a token store of format {manifest.get('format')}, this hpsft reads "
                        f"format {STORE_FORMAT}: prepare it again")
    if manifest.get("image processor sha256") != processor_identity(processor):
        kind = "with image patches" if "images" in manifest else "of text only"
        raise DataError(f"{store_dir} is a token store {kind}, prepared for another image processor than this "
                        f"{'vision-language' if processor else 'text'} model's: prepare it for this model")
    ours = tokenizer_identity(tokenizer)
    differing = [key for key in ours if manifest["tokenizer"].get(key) != ours[key]]
    if differing:
        raise DataError(f"{store_dir} was prepared with another tokenizer ({', '.join(differing)} differ from "
                        f"{tokenizer.name_or_path}'s): prepare it with this model's tokenizer, or train the model "
                        "it was prepared for")
    changed = store_images_changed(store_dir, manifest)
    if changed is not None:
        raise DataError(f"{store_dir}: {changed} since the store was prepared: prepare it again (hpsft "
                        "prepare-data ... --store)")
    longest = max(held["longest"] for held in manifest["shard_files"])
    if longest > opts.max_length:
        raise DataError(f"{store_dir} holds sequences of up to {longest} tokens > data.max_length={opts.max_length}: "
                        f"raise data.max_length, or prepare the store with --max-length {opts.max_length}")
    return manifest


def make_cache_folder(folder: Path, cache_dir: str | Path) -> None:
    """Create `folder` (data.cache_dir or a store in it), or fail naming data.cache_dir."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"data.cache_dir={cache_dir}: cannot write the tokenized data there ({err.strerror}); "
                        "choose another data.cache_dir") from None


def prepare(entry: str, tokenizer, opts: TokenizeOptions, cache_dir: str | Path, runner, shard_mb: float,
            name: str, report: bool, bar: bool, check_shards: bool = False,
            store_dir: Path | None = None, processor=None) -> tuple[Path, dict]:
    """The store folder of `entry` in cache_dir (or `store_dir`) and its manifest, after
    preparing the shards not complete there. A complete store's shards are checked when it is
    opened, or here with `check_shards`."""
    files = expand_entry(entry)
    if opts.chat_template is None and tokenizer.chat_template is None:
        raise DataError(f"the tokenizer of {tokenizer.name_or_path} has no chat template: name one with "
                        "data.chat_template=<Jinja text or .jinja file>")
    if processor is not None:
        check_image_tokens(tokenizer, processor)
    shard_bytes = max(1, int(shard_mb * (1 << 20)))
    identity = store_identity(files, tokenizer, opts, shard_bytes, processor)
    key = store_key(identity)
    store_dir = store_dir or Path(cache_dir) / key
    manifest = manifest_of(store_dir, key)
    if manifest is not None and not check_shards and store_images_changed(store_dir, manifest) is None:
        return store_dir, manifest
    plan = [Shard(**shard) for shard in manifest["shards"]] if manifest else plan_shards(files, shard_bytes)
    if not plan:
        raise DataError(f"no usable rows in {entry}: its files are empty")
    make_cache_folder(store_dir, cache_dir)  # before tokenizing, which can take long
    jobs = [ShardJob(i, shard, str(store_dir)) for i, shard in enumerate(plan)]
    done = {job.index: completed_sidecar(job) for job in jobs}
    missing = [job for job in jobs if done[job.index] is None]
    if missing:
        if report:
            print(f"hpsft: preparing data {name}: {len(missing)} of {len(jobs)} shards to tokenize "
                  f"({len(jobs) - len(missing)} done before) into {store_dir}", flush=True)
        progress = Progress(name, missing, report and bar)
        try:
            (runner or LocalRunner(1)).run(missing, tokenizer, opts, progress, processor=processor)
        finally:
            progress.close()
        if report:
            seconds = time.perf_counter() - progress.start
            print(f"hpsft: prepared data {name}: {progress.rows} rows, {progress.tokens} tokens in {seconds:.1f} s "
                  f"({progress.tokens / max(seconds, 1e-9):.0f} tokens/s)", flush=True)
        done = {job.index: completed_sidecar(job) for job in jobs}
        lost = [job.arrow_path.name for job in jobs if done[job.index] is None]
        if lost:
            raise DataError(f"data preparation finished but shards {lost} of {store_dir} are not complete: were "
                            "they removed meanwhile? Run again to prepare them")
    manifest = summarize(identity, key, plan, [done[job.index] for job in jobs])
    if manifest["sequences"] == 0:
        raise DataError(f"no usable rows in {[str(f) for f in files]}")
    write_json_atomically(store_dir / MANIFEST, manifest)
    return store_dir, manifest


def check_image_tokens(tokenizer, processor) -> None:
    """A vision-language model's tokenizer writes each image placeholder as one token (LLaVA's
    `<image>`: the model config's image_token_id)."""
    vocabulary = tokenizer.get_vocab()
    missing = [t for t in image_layout(processor).tokens if t not in vocabulary]
    if missing:
        raise DataError(f"the tokenizer of {tokenizer.name_or_path} has no tokens {missing}: image rows need the "
                        "vision-language model's own tokenizer (its folder's tokenizer files)")
    if isinstance(processor, LlavaImages) and vocabulary[processor.image_token] != processor.image_token_id:
        raise DataError(f"the tokenizer of {tokenizer.name_or_path} has {processor.image_token} as token "
                        f"{vocabulary[processor.image_token]}, the model's config.json has image_token_id="
                        f"{processor.image_token_id}: use the tokenizer the model was built with")


def summary_text(manifest: dict) -> str:
    """What a store holds and what the data stage did to get there, in one line."""
    counts = ", ".join(f"{event} {n}" for event, n in manifest["counts"].items())
    images = f", {manifest['images']} images" if "images" in manifest else ""
    return (f"{manifest['rows']} rows -> {manifest['sequences']} sequences{images}, {manifest['tokens']} tokens "
            f"({manifest['supervised_tokens']} supervised), {manifest['skipped_rows']} rows skipped"
            + (f"; {counts}" if counts else ""))
