"""Task "dataset": local files tokenized by a local tokenizer into a cached memory map;
windows and packed rows; held-out evaluation under sequence parallelism.

Everything is made here: a small BPE trained with ``tokenizers`` and saved to a folder,
JSONL / Parquet / saved-dataset files. References are independent of the code under test:
the transformers tokenizer itself, a single-process sdpa model per document."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from tests.support.helpers import HF_TINY, hf_pair, topology

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
import tokenizers  # noqa: E402

from ulysses_cp.config import RunConfig  # noqa: E402
from ulysses_cp.core.batch import BatchPlan  # noqa: E402
from ulysses_cp.core.topology import Topology  # noqa: E402
from ulysses_cp.models import hf  # noqa: E402
from ulysses_cp.run_blocks import DataConfig, EvalConfig  # noqa: E402
from ulysses_cp.training import corpus as corpus_mod  # noqa: E402
from ulysses_cp.training.corpus import load_corpus  # noqa: E402
from ulysses_cp.training.data import data_vocab_size, global_batch  # noqa: E402
from ulysses_cp.training.evaluate import evaluate  # noqa: E402
from ulysses_cp.training.token_data import TokenDataset, make_token_datasets  # noqa: E402
from ulysses_cp.training.tokenizer import load_tokenizer  # noqa: E402

TEXT = "the a cat dog bird sat ran flew on under over mat log tree red blue big small"
WORDS = TEXT.split()
CHAT = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)


def make_docs(n: int, seed: int) -> list[str]:
    """Documents of 3..150 words (some longer than the rows the tests use)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 150))) for _ in range(n)]


def train_tokenizer(folder: Path, docs: list[str]) -> Path:
    """A small BPE (BOS added by its post-processor), saved as a transformers folder."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    special = ["<unk>", "<bos>", "<eos>", "<pad>"]
    tok.train_from_iterator(
        docs, tokenizers.trainers.BpeTrainer(vocab_size=90, special_tokens=special)
    )
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT,
    )
    fast.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("data")
    docs = make_docs(80, seed=0)
    held = make_docs(20, seed=1)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), root / "train.parquet")
    return {
        "root": root,
        "docs": docs,
        "held": held,
        "tok": train_tokenizer(root / "tok", docs),
        "jsonl": write_jsonl(
            root / "train.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)]
        ),
        "parquet": root / "train.parquet",
        "eval": write_jsonl(root / "eval.jsonl", [{"text": d} for d in held]),
    }


def reference_ids(folder: Path, docs: list[str]) -> list[list[int]]:
    """Each document as transformers tokenizes it, then EOS."""
    fast = transformers.AutoTokenizer.from_pretrained(str(folder))
    return [fast(d)["input_ids"] + [fast.eos_token_id] for d in docs]


def stream(c) -> list[list[int]]:
    off = c.offsets.tolist()
    return [c.tokens[a:b].tolist() for a, b in itertools.pairwise(off)]


def _built_corpus(data, path: Path, cache: Path, workers: int) -> None:
    """``path`` tokenized by ``workers`` processes gives the tokenizer's own ids, 2 bytes a
    token (vocabulary < 65536), BOS ... EOS per document."""
    tok = load_tokenizer(str(data["tok"]))
    want = reference_ids(data["tok"], data["docs"])
    assert all(ids[0] == 1 and ids[-1] == tok.eos_id == 2 for ids in want)  # BOS ... EOS
    c = load_corpus([str(path)], tok, text_field="text", cache_dir=str(cache), workers=workers)
    assert c.built and c.n_docs == len(want) and stream(c) == want, path
    assert c.tokens.dtype.name == "uint16"  # vocabulary < 65536: 2 bytes a token
    assert (cache / c.path.name / "tokens.bin").stat().st_size == 2 * sum(map(len, want))


def test_jsonl_parquet_and_saved_folder_give_the_tokenizers_ids(data, tmp_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": data["docs"]}).save_to_disk(str(saved))
    for path in (data["jsonl"], data["parquet"], saved):
        _built_corpus(data, path, tmp_path / "cache", workers=1)
    want = reference_ids(data["tok"], data["docs"])
    # a bare tokenizer.json (no config: the EOS token is named in data.eos_token)
    bare = load_tokenizer(str(data["tok"] / "tokenizer.json"), eos_token="<eos>")
    c = load_corpus([str(data["jsonl"])], bare, text_field="text", cache_dir=str(tmp_path / "c2"))
    assert stream(c) == want


def test_the_cache_is_reused_and_rebuilt_only_when_an_input_changes(data, tmp_path, monkeypatch):
    tok = load_tokenizer(str(data["tok"]))
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in data["docs"][:10]])
    kw = dict(text_field="text", cache_dir=str(tmp_path / "cache"), workers=1)
    first = load_corpus([str(path)], tok, **kw)
    built = []
    real = corpus_mod._build
    monkeypatch.setattr(corpus_mod, "_build", lambda *a, **k: (built.append(1), real(*a, **k)))
    again = load_corpus([str(path)], tok, **kw)
    assert first.built and not again.built and not built and again.path == first.path
    # an interrupted build (a temp folder without the rename) is not a cache
    other = write_jsonl(tmp_path / "b.jsonl", [{"text": d} for d in data["docs"][:5]])
    key = corpus_mod.cache_key([other], tok, "text")
    (tmp_path / "cache" / f"{key}.tmp-1-dead").mkdir()
    (tmp_path / "cache" / f"{key}.tmp-1-dead" / "tokens.bin").write_bytes(b"\0" * 8)
    assert load_corpus([str(other)], tok, **kw).built and built == [1]
    # a changed file, another text field, another tokenizer: new keys
    write_jsonl(path, [{"text": d, "body": d} for d in data["docs"][:11]])
    assert load_corpus([str(path)], tok, **kw).built and len(built) == 2
    assert load_corpus([str(path)], tok, **{**kw, "text_field": "body"}).built
    bare = load_tokenizer(str(data["tok"] / "tokenizer.json"), eos_token="<pad>")
    assert corpus_mod.cache_key([path], bare, "text") != corpus_mod.cache_key([path], tok, "text")
    # a build that fails half way leaves neither a cache nor a temp folder
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a cat"}] * 3 + [{"text": 5}])
    with pytest.raises(ValueError, match=r"record 3 field 'text' must be a string"):
        load_corpus([str(bad)], tok, **kw)
    left = [p.name for p in (tmp_path / "cache").iterdir() if not (p / "meta.json").is_file()]
    assert left == [f"{key}.tmp-1-dead"]


def test_chat_messages_go_through_the_chat_template(data, tmp_path):
    talks = [
        [{"role": "user", "content": d[:40]}, {"role": "assistant", "content": d[-30:]}]
        for d in data["docs"][:6]
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in talks])
    tok = load_tokenizer(str(data["tok"]))
    c = load_corpus([str(path)], tok, text_field="messages", cache_dir=str(tmp_path / "c"))
    fast = transformers.AutoTokenizer.from_pretrained(str(data["tok"]))
    want = []
    for m in talks:
        text = fast.apply_chat_template(m, tokenize=False)
        want.append(fast(text, add_special_tokens=False)["input_ids"])  # ends with <eos>
    assert all(w[0] == 1 and w[-1] == 2 and w.count(2) == 2 for w in want)
    assert stream(c) == want  # no BOS added twice, no second EOS


def test_progress_is_shown_only_where_asked(data, tmp_path, capsys):
    tok = load_tokenizer(str(data["tok"]))
    for i, progress in enumerate([False, True]):
        load_corpus(
            [str(data["jsonl"])],
            tok,
            text_field="text",
            progress=progress,
            cache_dir=str(tmp_path / f"c{i}"),
        )
        assert ("tokenizing" in capsys.readouterr().err) is progress


def dataset_config(data, tmp_path, **kw) -> DataConfig:
    kw = {"cache_dir": str(tmp_path / "cache"), "tokenize_workers": 1, **kw}
    return DataConfig(task="dataset", files=[str(data["jsonl"])], tokenizer=str(data["tok"]), **kw)


def test_windows_predict_the_next_token_and_resume_at_the_same_sample(data, tmp_path):
    dc = dataset_config(data, tmp_path, seq_len=32)
    ds, held = make_token_datasets(dc, EvalConfig())
    assert held is None
    flat = [t for ids in reference_ids(data["tok"], data["docs"]) for t in ids]
    n = (len(flat) - 1) // 32
    assert len(ds) == n
    seen = set()
    for i in range(n):  # one epoch: every window once
        tokens, labels = ds.sample(i)
        w = ds.unit(i)
        seen.add(w)
        assert tokens.tolist() == flat[w * 32 : w * 32 + 32]
        want = [(-100 if t == 2 else nxt) for t, nxt in zip(flat[w * 32 :], flat[w * 32 + 1 :])]
        assert labels.tolist() == want[:32]  # the next token; nothing after an EOS
    assert seen == set(range(n))
    assert [ds.unit(i) for i in range(n)] != [ds.unit(n + i) for i in range(n)]  # reshuffled
    # a new process (resume) reads the same samples at the same step; replicas differ
    again, _ = make_token_datasets(dc, EvalConfig())
    kw = dict(micro_step=1, grad_accum=2, micro_batch=2, dp_degree=2)
    for step in (0, 3, 7):
        a = global_batch(ds, step=step, dp_rank=1, **kw)
        assert torch.equal(
            a["input_ids"], global_batch(again, step=step, dp_rank=1, **kw)["input_ids"]
        )
        assert not torch.equal(
            a["input_ids"], global_batch(ds, step=step, dp_rank=0, **kw)["input_ids"]
        )


def test_packed_rows_hold_whole_documents_split_only_when_longer_than_a_row(data, tmp_path):
    dc = dataset_config(data, tmp_path, seq_len=64, packing=True, pack_multiple=8)
    ds, _ = make_token_datasets(dc, EvalConfig())
    docs = reference_ids(data["tok"], data["docs"])
    assert max(map(len, docs)) > 64 > min(map(len, docs))  # some documents must be split
    got = []  # every piece of the epoch, in corpus order
    for r in range(len(ds)):
        row = ds.packed_sample(r)
        cu = row["cu_seqlens"].tolist()
        ids, pos, tgt = (row[k].tolist() for k in ("input_ids", "position_ids", "shift_labels"))
        assert cu[0] == 0 and cu[-1] == len(ids) == 64 and all(c % 8 == 0 for c in cu)
        pieces = ds.pieces(r)
        assert len(cu) - 1 in (len(pieces), len(pieces) + 1)  # + the padding at the end
        for (a, b), (_, n) in zip(itertools.pairwise(cu), pieces):
            assert pos[a:b] == list(range(b - a))  # positions restart per document
            assert tgt[a : a + n - 1] == ids[a + 1 : a + n]  # the next token inside
            assert set(tgt[a + n - 1 : b]) == {-100}  # no target across the border
            got.append((ds.unit(r), ids[a : a + n]))
        assert set(tgt[cu[len(pieces)] :]) <= {-100}  # the padding row end has no target
    got.sort(key=lambda x: x[0])  # rows back in corpus order
    joined = [t for _, ids in got for t in ids]
    assert joined == [t for d in docs for t in d]  # every token once, documents in order
    pieces = [ids for _, ids in got]
    whole = sum(1 for d in docs if d in pieces)
    assert whole == sum(1 for d in docs if len(d) <= 64)  # short documents never cut


def _models(topo, vocab: int):
    sp, ref = hf_pair(transformers.LlamaConfig(**{**HF_TINY, "vocab_size": vocab}), topo)
    return hf.HFCausalLM(sp, topo=topo), ref


def _ce_sums(ref, ids: list[int], targets: list[int]) -> tuple[float, int]:
    """(summed cross-entropy, targets) of one row through the single-process model."""
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([ids])).logits[0]
    y = torch.tensor(targets)
    ce = torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    return float(ce), int((y != -100).sum())


def _per_document(ref, ds: TokenDataset, index: int) -> tuple[float, int]:
    """One document (piece) per row, each from position 0, its own next tokens."""
    total, count = 0.0, 0
    for start, n in ds.pieces(index):
        ids = ds.tokens[start : start + n].tolist()
        ce, c = _ce_sums(ref, ids, [*ids[1:], -100])
        total, count = total + ce, count + c
    return total, count


def test_the_packed_loss_equals_the_one_document_per_row_loss(data, tmp_path):
    dc = dataset_config(data, tmp_path, seq_len=64, packing=True, pack_multiple=8)
    ds, _ = make_token_datasets(dc, EvalConfig())
    topo = Topology(rank=0, world_size=1, ulysses_degree=1, ring_degree=1)
    model, ref = _models(topo, HF_TINY["vocab_size"])
    shared = [i for i in range(len(ds)) if len(ds.pieces(i)) >= 2][:4]
    assert len(shared) == 4  # rows where several documents share the row
    for i in shared:
        row = ds.packed_sample(i)
        args = (row["input_ids"][None], row["position_ids"][None], row["shift_labels"][None], topo)
        plan = BatchPlan.of(topo, "zigzag", (1, 64), row["cu_seqlens"])
        with torch.no_grad():
            packed = model.loss(*args, batch=plan).item()
            mixed = model.loss(*args).item()  # attention across documents: must differ
        total, count = _per_document(ref, ds, i)
        assert packed == pytest.approx(total / count, rel=1e-10), i
        assert abs(mixed - packed) > 1e-4


def _eval_under_sp(rank, files, tok, cache, u, r, packing, batches, micro):
    topo = topology(u, r)
    dc = DataConfig(
        task="dataset",
        files=files,
        tokenizer=tok,
        cache_dir=cache,
        seq_len=64,
        packing=packing,
        pack_multiple=8,
        tokenize_workers=1,
    )
    train, held = make_token_datasets(dc, EvalConfig(fraction=0.25, interval=1))
    assert held is not None and held.lo == train.hi  # the held-out documents follow
    model, ref = _models(topo, HF_TINY["vocab_size"])

    def loss_fn(local):
        return model.loss(
            local["input_ids"],
            local["position_ids"],
            local["shift_labels"],
            topo,
            batch=local.get("batch"),
        )

    got = evaluate(held, loss_fn, topo, batches=batches, micro_batch=micro)
    # single process: samples 0 .. batches * micro * dp - 1, one row at a time
    total, count = 0.0, 0
    for i in range(batches * micro * topo.dp_degree):
        if packing:
            ce, c = _per_document(ref, held, i)
        else:
            tokens, labels = held.sample(i)
            ce, c = _ce_sums(ref, tokens.tolist(), labels.tolist())
        total, count = total + ce, count + c
    return got, total / count, count


def test_held_out_files(data, tmp_path):
    dc = dataset_config(data, tmp_path, seq_len=32)
    train, held = make_token_datasets(dc, EvalConfig(files=[str(data["eval"])], interval=5))
    assert held is not None and train.n_docs == 80 and held.n_docs == 20
    flat = [t for ids in reference_ids(data["tok"], data["held"]) for t in ids]
    tokens, _ = held.sample(0)
    w = held.unit(0)
    assert tokens.tolist() == flat[w * 32 : w * 32 + 32]


def test_bad_input_is_refused_naming_the_value_and_the_fix(data, tmp_path, monkeypatch):
    def fails(match, dc=None, ev=None, **kw):
        with pytest.raises(ValueError, match=match):
            make_token_datasets(dc or dataset_config(data, tmp_path, **kw), ev or EvalConfig())

    fails(
        r"records have no field 'body' \(fields: \['id', 'text'\]\); set data.text_field",
        seq_len=32,
        text_field="body",
    )
    fails(
        r"data.tokenizer: .*nowhere not found",
        DataConfig(task="dataset", files=[str(data["jsonl"])], tokenizer=str(tmp_path / "nowhere")),
    )
    fails(
        r"data.files: not found: \[.*missing.jsonl'\]",
        DataConfig(
            task="dataset", files=[str(tmp_path / "missing.jsonl")], tokenizer=str(data["tok"])
        ),
    )
    (tmp_path / "a.csv").write_text("text\nhi\n")
    fails(
        r"unsupported suffix '.csv'",
        DataConfig(task="dataset", files=[str(tmp_path / "a.csv")], tokenizer=str(data["tok"])),
    )
    fails(r"eval.files: not found", ev=EvalConfig(files=["/no/such.jsonl"], interval=2), seq_len=32)
    fails(r"fewer than data.seq_len \+ 1 = 100001", seq_len=100_000)
    fails(
        r"eval.fraction 0.999 of data.files' 80 documents leaves none",
        ev=EvalConfig(fraction=0.999, interval=1),
        seq_len=32,
    )
    with pytest.raises(ValueError, match=r"no EOS token is configured; set data.eos_token .*<eos>"):
        load_tokenizer(str(data["tok"] / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"no token '</s>'"):
        load_tokenizer(str(data["tok"]), eos_token="</s>")
    with pytest.raises(ValueError, match=r"eval.fraction must be between 0 and 1"):
        EvalConfig.from_dict({"fraction": 1.5})
    with pytest.raises(ValueError, match=r"eval.interval 5 needs held-out data"):
        EvalConfig.from_dict({"interval": 5})
    with pytest.raises(ValueError, match=r"data.task 'dataset' needs data.tokenizer"):
        DataConfig.from_dict({"task": "dataset", "files": ["a.jsonl"]})
    with pytest.raises(ValueError, match=r'needs data.task\s+"dataset", got \'kv_recall\''):
        RunConfig.load({"eval": {"fraction": 0.1, "interval": 5}})
    messages = write_jsonl(tmp_path / "m.jsonl", [{"text": [{"role": "user", "content": "hi"}]}])
    fails(
        r"holds chat messages, but the tokenizer .* has no chat template",
        DataConfig(
            task="dataset",
            files=[str(messages)],
            tokenizer=str(data["tok"] / "tokenizer.json"),
            eos_token="<eos>",
            cache_dir=str(tmp_path / "c"),
        ),
    )
    assert (
        data_vocab_size(dataset_config(data, tmp_path))[0]
        == load_tokenizer(str(data["tok"])).vocab_size
    )
    real = corpus_mod.importlib.util.find_spec
    monkeypatch.setattr(
        corpus_mod.importlib.util, "find_spec", lambda n: None if n == "datasets" else real(n)
    )
    fails(r"pip install \.\[data\]", seq_len=32, cache_dir=str(tmp_path / "fresh"))


def test_the_shipped_config_points_at_the_example_corpus():
    from tests.support.helpers import ROOT

    run = RunConfig.load(ROOT / "configs" / "tiny_cpu_hf_dataset_u2r2.json")
    corpus = (ROOT / "runs" / "tiny_corpus").resolve()
    assert run.data.task == "dataset" and run.data.packing and run.eval.interval == 50
    assert [Path(f).resolve() for f in run.data.files] == [corpus / "train.jsonl"]
    assert Path(run.data.tokenizer).resolve() == corpus / "tokenizer"
    assert [Path(f).resolve() for f in run.eval.files] == [corpus / "eval.jsonl"]
    assert hf.load_config(run.model.hf_config).vocab_size == 512  # make_tiny_corpus.py's


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(data, tmp_path, monkeypatch):
    from ulysses_cp.config import HFModelConfig, SequenceParallelConfig
    from ulysses_cp.run_blocks import TrainingConfig
    from ulysses_cp.training import build

    monkeypatch.setattr(build.dist, "get_world_size", lambda: 1)
    dc = dataset_config(data, tmp_path, seq_len=32)
    n = load_tokenizer(str(data["tok"])).vocab_size
    sp = SequenceParallelConfig()
    for vocab in (n, n - 1):
        mc = HFModelConfig(hf_config={"model_type": "llama", **HF_TINY, "vocab_size": vocab})
        run = RunConfig({}, sp, mc, dc, TrainingConfig())
        if vocab == n:
            build.validate(run)
            continue
        with pytest.raises(ValueError) as err:
            build.validate(run)
        assert f"vocabulary ({n - 1}) is smaller than the data's ({n} tokenizer" in str(err.value)
        assert f"use vocab_size >= {n} in model.hf_config" in str(err.value)
