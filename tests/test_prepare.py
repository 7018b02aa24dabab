"""hpsft prepare-data on a user's data (JSONL, parquet, a `datasets` folder of ShareGPT turns)
and hpsft prepare-model on Hugging Face folders: the report counts the rows written, the
written data is what hpsft's loader reads, the written model is the source's."""

import dataclasses
import json
import shutil
from collections import Counter

import pyarrow.parquet as pq
import pytest
import torch

from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.preparation import prepared_store
from hpsft.data.rows import TokenizeOptions
from hpsft.data.shards import read_rows
from hpsft.commands.prepare_data import main as prepare_data
from hpsft.commands.prepare_model import main as prepare_model
from tests.conftest import columns, write_jsonl, write_parquet
from tests.test_chat_data import spans

MAX_LENGTH = 128


def as_sharegpt(messages: list[dict]) -> list[dict]:
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": speaker.get(m["role"], m["role"]), "value": m["content"]} for m in messages]


def planted_rows(chat_rows, tokenizer, key: str, sharegpt: bool):
    """Rows with a known fate: (rows, the conversations to keep, dropped count per reason)."""
    fits = [c for c in chat_rows if len(tokenize_conversation(tokenizer, c)[0]) <= MAX_LENGTH][:20]
    chat = as_sharegpt if sharegpt else list
    long_text = " ".join(["a long answer that runs on"] * 60)
    good = [{key: chat(c)} for c in fits] + [{"prompt": "What is 2 + 2?", "response": "4"}]
    rows = good + [
        {key: chat(fits[0])},  # duplicate
        {"text": "a row that is no chat"},  # malformed
        {key: chat([{"role": "wizard", "content": "abracadabra"}, {"role": "assistant", "content": "ok"}])},
        {key: []},  # empty
        {key: chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "   "}])},  # empty
        {key: chat([{"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": long_text}])},
        {key: chat([{"role": "user", "content": long_text}, {"role": "assistant", "content": "No."}])},
    ]
    keep = fits + [[{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]]
    return rows, keep, {"malformed": 2, "empty": 2, "duplicate": 1, "over_max_length": 2}


def write_input(kind: str, rows: list[dict], tmp_path):
    if kind == "jsonl":
        path = tmp_path / "chats.jsonl"
        write_jsonl(rows, path)
        with open(path, "a") as f:
            f.write('{"messages": [truncated\n')  # one more malformed row: not JSON
        return path
    if kind == "parquet":
        return write_parquet(rows, tmp_path / "chats.parquet")
    import datasets

    splits = datasets.DatasetDict(train=datasets.Dataset.from_dict(columns(rows)),
                                  test=datasets.Dataset.from_dict(columns(rows[:2])))
    splits.save_to_disk(tmp_path / "chats_dataset")
    return tmp_path / "chats_dataset"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_prepare_data_report_counts_the_rows_written(kind, tmp_path, capsys, chat_rows, tokenizer, model_path):
    sharegpt = kind == "datasets"
    key = "conversations" if sharegpt else "messages"
    rows, keep, dropped = planted_rows(chat_rows, tokenizer, key, sharegpt)
    source = write_input(kind, rows, tmp_path)
    dropped["malformed"] += kind == "jsonl"
    out = tmp_path / "out"
    assert prepare_data([str(source), "--out", str(out), "--messages-key", key, "--dedupe", "--tokenizer", model_path,
                         "--max-length", str(MAX_LENGTH), "--val-fraction", "0.2", "--seed", "3"]) == 0
    printed = capsys.readouterr().out

    report = json.loads((out / "report.json").read_text())
    assert report["rows_read"] == len(rows) + (kind == "jsonl")
    assert report["dropped"] == dropped
    assert report["rows_kept"] == len(keep) == report["rows_read"] - sum(dropped.values())
    n_val = round(len(keep) * 0.2)
    train, val = out / "train.parquet", out / "val.parquet"
    assert report["written"] == {str(train): len(keep) - n_val, str(val): n_val}
    for path, n in report["written"].items():
        assert pq.read_metadata(path).num_rows == n and f"{path} ({n} rows)" in printed
    written = [row["messages"] for path in (train, val) for row in read_rows(path)]
    assert sorted(map(json.dumps, written)) == sorted(map(json.dumps, keep))

    # hpsft's loader reads the written files as they are, every row within max_length, with
    # the token counts of the report.
    opts = TokenizeOptions(messages_key="messages", prompt_key="prompt", response_key="response", tools_key="tools",
                           chat_template=None, max_length=MAX_LENGTH, truncation="error", bad_rows="error")
    sets = [prepared_store(str(p), tokenizer, opts, tmp_path / "tokenized") for p in (train, val)]
    lengths = sorted(int(n) for ds in sets for n in ds.lengths)
    assert len(lengths) == len(keep)
    assert report["token_lengths"]["max"] == lengths[-1] <= MAX_LENGTH
    assert report["token_lengths"]["p50"] == lengths[len(lengths) // 2 - (len(lengths) % 2 == 0)]
    assert report["token_lengths"]["total"] == sum(lengths)
    assert report["token_lengths"]["supervised"] == sum(int(ds[i]["loss_mask"].sum()) for ds in sets
                                                        for i in range(len(ds)))


def test_prepare_data_refuses_what_it_cannot_read(tmp_path, capsys):
    folder = tmp_path / "not_a_dataset"
    folder.mkdir()
    assert prepare_data([str(folder), "--out", str(tmp_path / "out")]) == 2
    assert "not_a_dataset holds no data file" in capsys.readouterr().err
    rows = write_jsonl([{"messages": []}, {"text": "x"}], tmp_path / "bad.jsonl")
    assert prepare_data([rows, "--out", str(tmp_path / "out")]) == 2
    assert "no row of" in capsys.readouterr().err and not (tmp_path / "out" / "train.parquet").exists()
    assert prepare_data(["--out", str(tmp_path / "out"), "--dedupe"]) == 2  # the packaged corpora
    assert "--dedupe go with input files" in capsys.readouterr().err
    assert prepare_data(["--out", str(tmp_path / "out"), "--sharegpt-only"]) == 2
    assert "give --sharegpt N" in capsys.readouterr().err


def test_the_packaged_sharegpt_alone(tmp_path, capsys):
    """`make data-sharegpt`'s command at 20 conversations: ShareGPT's and no chatterbot row."""
    from hpsft.assets.chat_corpora import sharegpt_conversations

    assert prepare_data(["--out", str(tmp_path / "sg"), "--sharegpt", "20", "--sharegpt-only"]) == 0
    written = [row for name in ("train", "val") for row in pq.read_table(tmp_path / "sg" / f"{name}.parquet")
               .column("messages").to_pylist()]
    expected = sharegpt_conversations(20)
    assert len(written) == 20 and sorted(map(str, written)) == sorted(map(str, expected))


def test_prepare_model_copies_and_cuts_a_hugging_face_folder(tmp_path, capsys, model_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "one_layer"
    assert prepare_model([model_path, "--out", str(out), "--num-layers", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(out)
    source = load_file(f"{model_path}/model.safetensors")
    written = load_file(out / "model.safetensors")
    kept = {k for k in source if ".layers." not in k or ".layers.0." in k}
    assert set(written) == kept and all(torch.equal(written[k], source[k]) for k in kept)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == len(model.model.layers) == 1
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(model_path).chat_template

    assert prepare_model([model_path, "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level BPE spelling of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    spelling = dict(zip(printable, printable)) | {b: 256 + i for i, b in enumerate(others)}
    return [chr(spelling[b]) for b in range(256)]


def write_tiny_gguf(path, hidden: int = 16, layers: int = 2) -> dict:
    """A Llama GGUF (fp32, random weights, a byte-level BPE tokenizer with a ChatML template) small
    enough to load in a second; returns its tensors by GGUF name."""
    import numpy as np

    gguf = pytest.importorskip("gguf")

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + byte_level_alphabet() + ["hi", "Ġt", "Ġth"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // 2)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))  # 3: control
    writer.add_token_merges(["h i", "Ġ t", "Ġt h"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (hidden // 2, hidden),
                   f"blk.{i}.attn_v.weight": (hidden // 2, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden)}
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_prepare_model_converts_a_gguf_file(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tensors = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "from_gguf"
    assert prepare_model([str(tmp_path / "tiny.gguf"), "--out", str(out), "--num-layers", "1"]) == 0
    written = load_file(out / "model.safetensors")
    assert not any(".layers.1." in k for k in written)
    # Tensors the loader takes as they are (q and k it permutes back to Hugging Face's rotary layout).
    for gguf_name, hf_name in [("token_embd", "embed_tokens"), ("output_norm", "norm"),
                               ("blk.0.attn_v", "layers.0.self_attn.v_proj"),
                               ("blk.0.ffn_down", "layers.0.mlp.down_proj"),
                               ("blk.0.ffn_norm", "layers.0.post_attention_layernorm")]:
        assert torch.equal(written[f"model.{hf_name}.weight"], torch.from_numpy(tensors[f"{gguf_name}.weight"]))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False) == \
        "<|im_start|>user\nhi there<|im_end|>\n"
    assert tokenizer.decode(tokenizer("hi there")["input_ids"]) == "hi there"


def test_prepare_model_warns_of_a_missing_chat_template_and_refuses_a_missing_tokenizer(tmp_path, capsys, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = tmp_path / "tiny"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(source, no_tokenizer)
    plain = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    plain.save_pretrained(source)
    (source / "chat_template.jinja").unlink(missing_ok=True)

    assert prepare_model([str(source), "--out", str(tmp_path / "out")]) == 0
    assert "has no chat template" in capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 2

    assert prepare_model([str(no_tokenizer), "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "hpsft: error:" in err and "no tokenizer loads from it" in err


@pytest.mark.parametrize("policy", ["turns", "split"])
def test_prepare_data_fits_long_conversations_by_turns(policy, tmp_path, capsys, tokenizer, model_path):
    """--truncation turns|split on real ShareGPT rows: what is written loads with
    data.truncation=error at --max-length (every sequence fits), trains each kept assistant
    turn once (turns: the leading ones of each row), and the report counts add up."""
    from hpsft.assets.chat_corpora import sharegpt_conversations

    conversations = sharegpt_conversations(40)
    source = write_jsonl([{"messages": c} for c in conversations], tmp_path / "sharegpt.jsonl")
    out = tmp_path / "out"
    assert prepare_data([source, "--out", str(out), "--tokenizer", model_path, "--max-length", "512",
                         "--truncation", policy]) == 0
    report = json.loads((out / "report.json").read_text())
    counts = report["counts"]
    over = sum(len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"])
               > 512 for c in conversations)
    assert report["truncation"] == policy and counts["over_max_length_rows"] == over > 10
    assert counts[f"{policy}_rows"] == over - report["dropped"]["over_max_length"]
    assert report["rows_kept"] == len(conversations) - report["dropped"]["over_max_length"]
    opts = TokenizeOptions(messages_key="messages", prompt_key="prompt", response_key="response", tools_key="tools",
                           chat_template=None, max_length=512, truncation="error", bad_rows="error")
    data = prepared_store(str(out / "train.parquet"), tokenizer, opts, tmp_path / "tokenized")
    fitted = counts["split_sequences"] if policy == "split" else counts["turns_rows"]  # rows written for the long ones
    assert len(data) == report["written"][str(out / "train.parquet")] == len(conversations) - over + fitted
    supervised, supervised_tokens = Counter(), 0
    for item in (data[i] for i in range(len(data))):
        supervised.update(tokenizer.decode(item["input_ids"][a:b]) for a, b in spans(item["loss_mask"].tolist()))
        supervised_tokens += int(item["loss_mask"].sum())
    turns = Counter(m["content"] + "<|im_end|>" for c in conversations for m in c if m["role"] == "assistant")
    assert all(supervised[t] <= turns[t] for t in supervised) and set(supervised) <= set(turns)
    assert sum(turns.values()) - sum(supervised.values()) == counts.get("dropped_turns", 0)
    assert report["token_lengths"]["max"] <= 512 and report["token_lengths"]["supervised"] == supervised_tokens
    if policy == "turns":  # each written row is the start of its conversation
        written = [row["messages"] for row in read_rows(out / "train.parquet")]
        assert all(any(c[:len(w)] == w for c in conversations) for w in written)


def test_prepare_data_writes_the_store_a_training_job_reads_without_tokenizing(tmp_path, capsys, tokenizer,
                                                                              model_path):
    """prepare-data --truncation split --store over 2 worker processes (rows fitted and then
    tokenized in parallel) on real ShareGPT rows: its report equals the one-process run's,
    train.store/ holds exactly the sequences the trainer's data stage makes of train.parquet,
    a training run naming the store prepares nothing, and the store refuses a run whose
    data.max_length it exceeds or whose tokenizer differs. Catches: workers that reorder or
    lose rows, a store written with other options than the rows it came from."""
    from transformers import AutoTokenizer

    from hpsft.assets.chat_corpora import sharegpt_conversations
    from hpsft.data.rows import DataError
    from tests.conftest import base_overrides, run_cli
    from tests.test_spmd_training import assert_ok

    source = write_jsonl([{"messages": c} for c in sharegpt_conversations(40)], tmp_path / "sharegpt.jsonl")
    reports = []
    for num_proc in ("1", "2"):
        out = tmp_path / f"out{num_proc}"
        assert prepare_data([source, "--out", str(out), "--tokenizer", model_path, "--max-length", "512",
                             "--truncation", "split", "--num-proc", num_proc, "--shard-mb", "0.05"]
                            + (["--store"] if num_proc == "2" else [])) == 0
        report = json.loads((out / "report.json").read_text())
        reports.append({k: v for k, v in report.items() if k not in ("written", "stores")})
    assert reports[0] == reports[1]
    store_dir = out / "train.store"
    assert report["stores"][str(store_dir)]["sequences"] == report["written"][str(out / "train.parquet")]
    opts = TokenizeOptions(messages_key="messages", prompt_key="prompt", response_key="response", tools_key="tools",
                           chat_template=None, max_length=512, truncation="error", bad_rows="error")
    store = prepared_store(str(store_dir), tokenizer, opts, tmp_path / "unused")
    trainers = prepared_store(str(out / "train.parquet"), tokenizer, opts, tmp_path / "tokenized")
    assert len(store) == len(trainers) > 40
    for i in range(len(store)):
        assert torch.equal(store[i]["input_ids"], trainers[i]["input_ids"])
        assert torch.equal(store[i]["loss_mask"], trainers[i]["loss_mask"])

    run = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, str(store_dir), None, run, **{
        "data.max_length": 512, "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 4,
        "trainer.total_steps": 1, "trainer.export_hf": "false"}))
    assert_ok(proc)
    rows = report["stores"][str(store_dir)]["rows"]
    assert "preparing data" not in proc.stdout, proc.stdout[-2000:]
    assert f"hpsft: data train: {rows} rows -> {len(store)} sequences" in proc.stdout, proc.stdout[-2000:]
    assert not (run.parent / "tokcache").exists()
    with pytest.raises(DataError, match=r"holds sequences of up to \d+ tokens > data.max_length=256"):
        prepared_store(str(store_dir), tokenizer, dataclasses.replace(opts, max_length=256), tmp_path / "unused")
    other = AutoTokenizer.from_pretrained(model_path)
    other.add_tokens(["<hpsft-extra>"])
    with pytest.raises(DataError, match="was prepared with another tokenizer"):
        prepared_store(str(store_dir), other, opts, tmp_path / "unused")


def test_the_default_keeps_long_sharegpt_rows_and_counts_the_supervised_tokens_lost(tmp_path, capsys, model_path):
    """No --truncation: the packaged ShareGPT records as shipped keep their long rows (their
    leading turns), and under every policy the supervised tokens written plus those the report
    says were lost are the same total: the rows' own.
    Planted: lost_supervised_tokens not counted for rows no turn of which fits: the totals
    differed (turns and split 50,095, drop 52,555)."""
    from itertools import islice

    from hpsft.assets.chat_corpora import sharegpt_records

    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(list(islice(sharegpt_records(), 60))))
    reports = {}
    for policy in (None, "drop", "split"):
        out = tmp_path / f"out_{policy}"
        flags = [] if policy is None else ["--truncation", policy]
        assert prepare_data([str(source), "--out", str(out), "--tokenizer", model_path, "--max-length", "1024",
                             *flags]) == 0
        reports[policy] = json.loads((out / "report.json").read_text())
        assert f"rows over --max-length 1024 (--truncation {policy or 'turns'})" in capsys.readouterr().out
    default, drop = reports[None], reports["drop"]
    assert default["truncation"] == "turns" and default["counts"]["turns_rows"] > 10
    assert default["rows_kept"] == drop["rows_kept"] + default["counts"]["turns_rows"]
    totals = {policy: r["token_lengths"]["supervised"] + r["counts"].get("lost_supervised_tokens", 0)
              for policy, r in reports.items()}
    assert len(set(totals.values())) == 1, totals


@pytest.mark.parametrize("kind", ["jsonl", "json_array"])
def test_rows_read_in_ranges_by_two_processes_are_the_rows_read_whole_by_one(kind, tmp_path, monkeypatch, chat_rows,
                                                                             tokenizer):
    """kept_rows over 2 processes with 4 KiB ranges (a JSONL file: its line ranges; a JSON array
    read whole: windows of 64-row blocks) keeps, drops and names the same rows, in the same
    order, as one process reading the file in one range: the duplicate and the malformed row
    lie in later ranges than the rows they are judged against.
    Planted: outcomes gathered in completion order, not sorted by row (the sort in kept_rows
    removed): jsonl and json_array failed, the kept records differed at index 0; RowRange.holds
    always true (each window keeping every row of the JSON array): json_array failed, the kept
    records and the reports differed."""
    from hpsft.data import prepare_files

    rows = [{"messages": c} for c in chat_rows[:300]]
    rows[250] = rows[3]  # a duplicate, 6 ranges later
    rows[280] = {"text": "no chat"}  # malformed
    if kind == "jsonl":
        path = tmp_path / "chats.jsonl"
        write_jsonl(rows, path)
    else:
        path = tmp_path / "chats.json"
        path.write_text(json.dumps(rows))
    opts = TokenizeOptions(None, None, None, "tools", None, 64, "turns", "skip")

    def kept(num_proc: int, range_bytes: int):
        monkeypatch.setattr(prepare_files, "RANGE_BYTES", range_bytes)
        return prepare_files.kept_rows([path], opts, tokenizer, dedupe=True, num_proc=num_proc)

    whole_rows, whole_report = kept(1, 1 << 30)
    ranged_rows, ranged_report = kept(2, 4096)
    assert len(prepare_files.row_ranges([path], None, 2, True)) >= 4  # jsonl: 21 ranges, json_array: 4 windows
    assert ranged_rows == whole_rows and ranged_report == whole_report
    assert whole_report["dropped"]["duplicate"] == whole_report["dropped"]["malformed"] == 1
    assert whole_report["dropped_examples"]["duplicate"] == [f"{path} row 250: same messages and tools as an earlier "
                                                             "row"]
