"""Pretraining: the streamed corpus (dedupe, exclusion of prepared val/test texts, held-out share, resume, errors),
whole-word masking, and `zhflow pretrain` under torchrun with 2 processes (DDP from scratch; FSDP2 continued from that
output, with a rank killed mid-epoch), its output fine-tuned by `zhflow run`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jieba
import numpy as np
import pytest

from tests.conftest import sentiment_rows, write_csv
from training.config import CorpusConfig, EncoderConfig
from training.corpus import SPECIAL, WORD_START, CorpusError, CorpusShards, prepare_corpus, read_and_clean, word_starts
from training.mlm import mask_tokens


def _zhflow(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("zhflow")), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "ZHFLOW_HOME": str(cwd / "home"),
                                                "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", **(env or {})})


def _texts(n: int) -> list[str]:
    return [text for text, _ in sentiment_rows(n // 2)]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """600 distinct review texts, 100 of them twice, a blank line and one that cleaning empties."""
    path = tmp_path_factory.mktemp("corpus") / "reviews.txt"
    texts = _texts(600)
    path.write_text("\n".join(texts + texts[:100] + ["", "\u200b\u200b"]) + "\n", encoding="utf-8")
    return path


def _tokenizer(texts: list[str]):
    from transformers import BertTokenizer

    chars = sorted({c for t in texts for c in t})
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars)}
    return BertTokenizer(vocab=vocab)


def test_whole_word_masking_masks_the_characters_of_a_jieba_word_together():
    text = "这本书的质量非常好，物流也很快，包装完整没有破损，下次还会购买"
    words = list(jieba.tokenize(text))
    from transformers import AutoTokenizer  # noqa: F401  (the fast tokenizer gives the offsets)
    from transformers import BertTokenizerFast

    slow = _tokenizer([text])
    fast = BertTokenizerFast.from_pretrained(_save(slow))
    enc = fast(text, return_offsets_mapping=True)
    ids, offsets = np.array(enc["input_ids"]), enc["offset_mapping"]
    flags = word_starts(text, offsets, jieba.tokenize)
    assert flags[0] == SPECIAL and flags[-1] == SPECIAL
    assert (flags == WORD_START).sum() == len(words)  # one start per jieba word (each character is one token here)
    word_of = np.cumsum(flags == WORD_START)  # the word each token belongs to
    masked_words, partial = 0, 0
    for seed in range(200):
        _, labels = mask_tokens(ids, flags, np.random.default_rng(seed), 0.15, fast.mask_token_id, len(fast), whole_word=True)
        chosen = labels != -100
        assert not chosen[flags == SPECIAL].any()
        for w in np.unique(word_of[chosen]):
            tokens = (word_of == w) & (flags != SPECIAL)
            partial += not chosen[tokens].all()
            masked_words += 1
        assert chosen.sum() >= 1 and chosen.sum() <= max(round(0.15 * (len(ids) - 2)), max(len(w[0]) for w in words))
    assert partial == 0 and masked_words > 200
    # per token: words are cut (a two-character word with one character chosen happens)
    cuts = 0
    for seed in range(200):
        _, labels = mask_tokens(ids, flags, np.random.default_rng(seed), 0.15, fast.mask_token_id, len(fast), whole_word=False)
        chosen = labels != -100
        cuts += sum(not chosen[(word_of == w) & (flags != SPECIAL)].all() for w in np.unique(word_of[chosen]))
        assert chosen.sum() == round(0.15 * (len(ids) - 2))
    assert cuts > 0
    # 80/10/10: of many chosen tokens about 80% become [MASK]
    inputs, labels = mask_tokens(np.tile(ids, 50), np.tile(flags, 50), np.random.default_rng(1), 0.15, fast.mask_token_id,
                                 len(fast), whole_word=False)
    chosen = labels != -100
    assert 0.7 < (inputs[chosen] == fast.mask_token_id).mean() < 0.9


def _save(tokenizer) -> str:
    import tempfile

    folder = tempfile.mkdtemp()
    tokenizer.save_pretrained(folder)
    return folder


def _shard_new_encoder(rank: int, world: int, store: str, out: str) -> None:
    """One rank: a new BERT built on the meta device, sharded by FSDP2, each rank initialising its own shards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForMaskedLM, BertConfig

    from training.distributed import DistInfo
    from training.mlm import materialise_shards, parameters_on_meta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        config = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            vocab_size=300, max_position_embeddings=40)
        with parameters_on_meta():
            model = AutoModelForMaskedLM.from_config(config)
        assert all(p.device.type == "meta" for p in model.parameters())
        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        materialise_shards(model, DistInfo(rank, rank, world, torch.device("cpu")), seed=13)
        full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
        # a checkpoint that rank 0 alone reads, broadcast into the shards of another model built on meta
        with parameters_on_meta():
            again = AutoModelForMaskedLM.from_config(config)
        for layer in again.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(again)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # as a loaded model's state_dict()
        source = {name: tensor * 2 if tensor.is_floating_point() else tensor for name, tensor in whole.items()} if rank == 0 else None
        materialise_shards(again, DistInfo(rank, rank, world, torch.device("cpu")), seed=99, from_checkpoint=True, checkpoint=source)
        copied = all(torch.equal(p.full_tensor().detach(), full[name] * 2) for name, p in again.named_parameters())
        ids = torch.randint(5, 300, (4, 12), generator=torch.Generator().manual_seed(rank))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        if rank == 0:
            torch.save({"full": full, "losses": losses, "position_ids": model.bert.embeddings.position_ids.clone(),
                        "tied": model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight,
                        "copied": copied}, out)
    finally:
        dist.destroy_process_group()


def test_under_fsdp_an_encoder_is_built_on_meta_and_each_rank_fills_only_its_own_shards(tmp_path):
    import torch
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    mp.spawn(_shard_new_encoder, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    found = torch.load(out, weights_only=True)
    words = found["full"]["bert.embeddings.word_embeddings.weight"]
    assert not torch.equal(words[:150], words[150:])  # the two ranks' shards are not one draw twice
    assert 0.015 < float(words.std()) < 0.025  # normal(0, initializer_range 0.02), as init_weights draws it
    assert torch.equal(found["full"]["bert.encoder.layer.0.output.LayerNorm.weight"], torch.ones(32))
    assert torch.equal(found["full"]["bert.encoder.layer.0.output.dense.bias"], torch.zeros(32))
    assert torch.equal(found["position_ids"], torch.arange(40).unsqueeze(0))  # buffers kept, not left empty
    assert found["tied"]
    assert found["copied"]  # every rank's shards hold what rank 0 read
    assert all(np.isfinite(found["losses"])) and found["losses"][-1] < found["losses"][0]


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
def test_the_head_on_masked_positions_only_gives_the_full_models_loss_and_gradients(architecture):
    import copy

    import torch
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    from training.mlm import predict_masked_only

    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=70)
    full = (BertForMaskedLM(BertConfig(**shape)) if architecture == "bert"
            else RobertaForMaskedLM(RobertaConfig(pad_token_id=1, **shape))).eval()
    masked = copy.deepcopy(full)
    assert predict_masked_only(masked)
    ids = torch.randint(5, 300, (4, 20))
    attention = torch.ones_like(ids)
    attention[0, 15:] = 0
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(4, 20) < 0.2
    labels[chosen] = ids[chosen]
    expected = full(input_ids=ids, attention_mask=attention, labels=labels).loss
    found = masked(input_ids=ids, attention_mask=attention, labels=labels)
    assert torch.allclose(found, expected, atol=1e-6)
    expected.backward()
    found.backward()
    for (name, p), q in zip(full.named_parameters(), masked.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.allclose(p.grad, q.grad, atol=1e-6), name
    assert masked(input_ids=ids, attention_mask=attention, labels=torch.full_like(ids, -100)).item() == 0.0  # not NaN
    assert set(masked.state_dict()) == set(full.state_dict())


def test_fsdp_in_a_single_process_makes_a_group_of_one_for_its_mesh(corpus_file, tmp_path):
    """One GPU, or one process asked for: FSDP2 needs a process group for its device mesh even with one rank. The worker
    makes one, under torchrun as run plainly (here: a store of its own), and the encoder trains and exports."""
    from training.config import TrainConfig
    from training.job import PretrainJob

    prepare_corpus(CorpusConfig(files=[str(corpus_file)], held_out=0.1), EncoderConfig(size="tiny", max_len=32), tmp_path / "corpus",
                   progress=lambda _: None)
    job = PretrainJob(corpus_dir=str(tmp_path / "corpus"), out_dir=str(tmp_path / "out"), export_dir=str(tmp_path / "encoder"),
                      model=EncoderConfig(size="tiny", max_len=32),
                      train=TrainConfig(epochs=1, batch_size=32, lr=1e-3, strategy="fsdp", min_steps=0))
    (tmp_path / "job.json").write_text(job.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-m", "training.mlm", "--config", str(tmp_path / "job.json")], capture_output=True,
                         text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "1 process(es) on cpu (fsdp)" in run.stdout
    from training.events import EVENTS_FILE, EventReader
    from transformers import AutoModelForMaskedLM

    result = next(e for e in EventReader(tmp_path / "out" / EVENTS_FILE).read() if e["event"] == "result")
    assert result["strategy"] == "fsdp" and result["world_size"] == 1 and np.isfinite(result["heldout_loss"])
    AutoModelForMaskedLM.from_pretrained(result["export_dir"])


def test_the_corpus_is_deduplicated_held_out_and_tokenized_in_shards(corpus_file, tmp_path):
    manifest = prepare_corpus(CorpusConfig(files=[str(corpus_file)], shard_texts=150, held_out=0.05, num_workers=2),
                              EncoderConfig(size="tiny", max_len=16), tmp_path / "c", progress=lambda _: None)
    c = manifest["counts"]
    assert c["read"] == 702 and c["empty"] == 2 and c["duplicates"] == 100
    assert c["kept"] + c["held_out"] == 600 and 10 < c["held_out"] < 60
    assert manifest["shards"] == 4 and manifest["split_texts"] > 0  # texts longer than 16 tokens: several sequences
    train, held = CorpusShards(tmp_path / "c", "train"), CorpusShards(tmp_path / "c", "heldout")
    assert len(train) == manifest["train_sequences"] and len(held) == manifest["held_out_sequences"]
    lengths = [len(train[i][0]) for i in range(len(train))]
    assert max(lengths) <= 16 and sum(lengths) == manifest["train_tokens"]
    ids, flags = train[0]
    assert flags[0] == SPECIAL and flags[-1] == SPECIAL and (flags[1:-1] != SPECIAL).all()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "c" / "tokenizer")
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert tokenizer.convert_ids_to_tokens(tokenizer("非常好")["input_ids"])[1:-1] == ["非", "常", "好"]  # a character a token
    # held-out texts are never in training: the first pass alone, whose cleaned texts stay on disk
    read_and_clean(CorpusConfig(files=[str(corpus_file)], shard_texts=150, held_out=0.05), tmp_path / "p1", lambda _: None)
    held_texts = set((tmp_path / "c" / "heldout.txt").read_text(encoding="utf-8").splitlines())
    trained = {line for path in (tmp_path / "p1" / "text").glob("*.txt") for line in path.read_text(encoding="utf-8").splitlines()}
    assert len(held_texts) == c["held_out"] and len(trained) == c["kept"] and not held_texts & trained
    again = prepare_corpus(CorpusConfig(files=[str(corpus_file)]), EncoderConfig(size="tiny"), tmp_path / "c")
    assert again == manifest  # a finished folder is returned as it is


def test_prepared_validation_and_test_texts_are_removed_from_the_corpus(tmp_path):
    from training.config import DataConfig, PreprocessConfig
    from training.data.prepare import prepare_dataset

    rows = sentiment_rows(100)
    data = write_csv(tmp_path / "labelled.csv", rows)
    prepare_dataset(DataConfig(dataset=str(data), max_samples=None), PreprocessConfig(), tmp_path / "prepared")
    held = {json.loads(line)["clean"] for split in ("val", "test")
            for line in (tmp_path / "prepared" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()}
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(t for t, _ in rows) + "\n", encoding="utf-8")
    config = CorpusConfig(files=[str(corpus)], exclude_prepared=[str(tmp_path / "prepared")], held_out=0.0)
    counts = read_and_clean(config, tmp_path / "c", progress=lambda _: None)
    assert counts["excluded"] == len(held) > 0 and counts["kept"] == 200 - len(held)
    kept = set((tmp_path / "c" / "text" / "00000.txt").read_text(encoding="utf-8").splitlines())
    assert not kept & held
    # a prepared folder as the corpus: its train split
    counts = read_and_clean(CorpusConfig(files=[str(tmp_path / "prepared")], held_out=0.0), tmp_path / "c2", lambda _: None)
    assert counts["kept"] == 200 - len(held)


def test_an_interrupted_preparation_goes_on_at_the_next_shard(tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("\n".join(_texts(300)) + "\n", encoding="utf-8")
    bad.write_bytes("\n".join(_texts(40)[::-1]).encode("utf-8") + b"\n\xff\xfe broken\n")
    config = CorpusConfig(files=[str(good), str(bad)], shard_texts=100, held_out=0.0)
    with pytest.raises(CorpusError, match=r"b.txt: line 41: .*not valid UTF-8"):
        read_and_clean(config, tmp_path / "c", progress=lambda _: None)
    state = json.loads((tmp_path / "c" / "state.json").read_text())
    assert state["file"] == 1 and state["shards"] == 3  # the first file's shards are kept
    bad.write_text("\n".join(_texts(340)[300:]) + "\n", encoding="utf-8")  # the second file, mended
    said = []
    counts = read_and_clean(config, tmp_path / "c", progress=said.append)
    assert "going on after shard 3" in said[0]
    assert counts["kept"] == 340 and counts["read"] == 340 and counts["duplicates"] == 0
    fresh = read_and_clean(config, tmp_path / "fresh", progress=lambda _: None)
    assert fresh == counts


@pytest.mark.parametrize("content, message", [
    (b"", "the file is empty"),
    (b"\n  \n\xe2\x80\x8b\n", "no text left to pretrain on after cleaning"),
    (b"\x00\x01\x02binary\x00" * 50, "not a text file"),
], ids=["empty", "empty-after-cleaning", "binary"])
def test_a_corpus_with_nothing_to_learn_is_one_clear_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    out = _zhflow(["pretrain", "--corpus", str(path), "--size", "tiny", "--nproc", "1"], tmp_path, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("zhflow: error: ") and str(path) in line and message in line, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_bad_pretraining_settings_name_the_field(tmp_path, corpus_file, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setenv("ZHFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    for args, message in ((["--size", "huge"], "model.size"), (["--set", "model.mask_prob=1.5"], "model.mask_prob"),
                          (["--set", "corpus.nothing=1"], "corpus has no setting 'nothing'"),
                          (["--from", str(tmp_path / "nope")], "model.init_from"),
                          (["--exclude-prepared", str(tmp_path)], "corpus.exclude_prepared"),
                          (None, "train.strategy")):
        with pytest.raises(SystemExit) as exit_:
            main(["pretrain", "--corpus", str(corpus_file), *args] if args else
                 ["run", "--preset", "tiny", "--set", "train.strategy=fsdp"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, (args, err[-1500:])
        assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "home").exists()  # refused before anything was recorded


@pytest.fixture(scope="module")
def pretrained_ddp(corpus_file, tmp_path_factory, prefect_api):
    """`zhflow pretrain` from scratch, 2 DDP processes on gloo: (working folder, summary)."""
    cwd = tmp_path_factory.mktemp("pretrain-ddp")
    out = _zhflow(["pretrain", "--corpus", str(corpus_file), "--size", "tiny", "--nproc", "2", "--out", str(cwd / "zh-tiny"),
                   "--set", "model.max_len=32", "--set", "train.epochs=4", "--set", "train.batch_size=16",
                   "--set", "train.lr=3e-3", "--set", "corpus.held_out=0.1", "--json-out", str(cwd / "summary.json")], cwd,
                  env={"PREFECT_API_URL": prefect_api})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "encoder: " in out.stdout and "zhflow run --pretrained" in out.stdout
    return cwd, json.loads((cwd / "summary.json").read_text())


@pytest.mark.slow
def test_pretraining_from_scratch_with_two_processes_is_tracked_and_loads_with_from_pretrained(pretrained_ddp):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from tasks.tracking import PARENT_KIND_TAG

    cwd, summary = pretrained_ddp
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["epochs_run"] == 4
    assert summary["corpus"]["duplicates"] == 100
    assert summary["restarts"] == 0, summary["restart_causes"]
    import math

    assert summary["perplexity"] < 0.5 * summary["vocab_size"]  # a model that learned nothing: about the vocabulary's size
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    pretrain_run = client.get_run(summary["pretrain_run_id"])
    history = client.get_metric_history(summary["pretrain_run_id"], "heldout_perplexity")
    assert len(history) == 4 and history[-1].value < history[0].value  # it learns
    assert math.isfinite(history[-1].value)
    assert pretrain_run.data.params["train.strategy"] == "ddp" and "peak_memory_mb_rank1" in pretrain_run.data.metrics
    assert "tokens_per_second" in pretrain_run.data.metrics
    corpus_run = client.get_run(summary["corpus_run_id"])
    assert corpus_run.inputs.dataset_inputs and corpus_run.data.metrics["count_duplicates"] == 100
    parent = client.get_run(summary["run_id"])
    assert parent.data.tags[PARENT_KIND_TAG] == "pretrain" and parent.data.params["model.masking"] == "wwm"
    artifacts = {a.path for a in client.list_artifacts(summary["pretrain_run_id"], "encoder")}
    assert "encoder/model.safetensors" in artifacts and "encoder/config.json" in artifacts
    model = AutoModelForMaskedLM.from_pretrained(summary["output"])
    tokenizer = AutoTokenizer.from_pretrained(summary["output"])
    import torch

    enc = tokenizer("物流很快[MASK]装很好", return_tensors="pt")
    with torch.no_grad():
        assert model(**enc).logits.shape[-1] == len(tokenizer)


@pytest.mark.slow
def test_fsdp_continues_pretraining_resumes_a_killed_rank_and_the_result_fine_tunes(pretrained_ddp, corpus_file, prefect_api):
    """FSDP2 on 2 gloo processes, continued from the DDP run's encoder (--from, its tokenizer); rank 1 is SIGKILLed at
    step 5, torchrun restarts the group, and it resumes from the last sharded checkpoint without logging a step twice.
    Then `zhflow run --pretrained` fine-tunes the output."""
    from mlflow.tracking import MlflowClient

    cwd, first = pretrained_ddp
    out = _zhflow(["pretrain", "--corpus", str(corpus_file), "--from", first["output"], "--strategy", "fsdp", "--nproc", "2",
                   "--out", str(cwd / "zh-tiny-2"), "--set", "train.epochs=2", "--set", "train.batch_size=16",
                   "--set", "train.lr=1e-3", "--set", "train.max_restarts=1", "--set", "model.max_len=32",
                   "--set", "checkpoint_minutes=1e-6",
                   "--json-out", str(cwd / "fsdp.json")], cwd,
                  env={"ZHFLOW_TEST_KILL_AT_STEP": "5", "ZHFLOW_TEST_KILL_ONCE_FILE": str(cwd / "killed"),
                       "PREFECT_API_URL": prefect_api})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((cwd / "fsdp.json").read_text())
    assert (cwd / "killed").exists() and summary["restarts"] == 1 and summary["strategy"] == "fsdp"
    # why it restarted, as torchrun saw it: in the summary, the printed report and the run's tags
    assert [c.split(":")[0] for c in summary["restart_causes"]] == ["local rank 1 was killed by SIGKILL"], summary["restart_causes"]
    assert "worker group failure 1: local rank 1 was killed by SIGKILL" in out.stdout
    assert summary["resumed_at_step"] == 4  # from the checkpoint after step 4 (one after every step here)
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(summary["pretrain_run_id"], "mlm_loss")]
    assert steps == sorted(set(steps)) and steps  # every step once
    assert summary["perplexity"] < first["perplexity"] * 1.5  # continued, not restarted from random weights
    tags = client.get_run(summary["pretrain_run_id"]).data.tags
    assert tags["restarts"] == "1" and tags["restart_causes"] == summary["restart_causes"][0]
    data = write_csv(cwd / "labelled.csv", sentiment_rows(60))
    run = _zhflow(["run", "--preset", "tiny", "--pretrained", summary["output"], "--dataset", str(data), "--nproc", "1",
                   "--set", "data.max_samples=null", "--set", "train.epochs=10", "--set", "train.patience=10", "--set", "train.lr=2e-3",
                   "--set", "train.batch_size=8", "--set", "prune.amount=0", "--set", "select.candidates=neural",
                   "--set", "preprocess.max_len=32", "--json-out", str(cwd / "run.json")], cwd, env={"PREFECT_API_URL": prefect_api})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    fine = json.loads((cwd / "run.json").read_text())
    assert fine["metrics"]["test_macro_f1"] > 0.7  # templated reviews: a model that learned nothing scores ~0.33-0.5
