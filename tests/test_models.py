import math
import pytest
import numpy as np
import torch

from training.config import ModelConfig
from training.data.dataset import pad_batch
from training.models import build_model, min_input_len
from training.prune import global_l1_prune, prunable_weights, sparsity

FAMILIES = ["textcnn", "bilstm", "transformer", "fasttext"]
VOCAB = {"word": 50, "char": 30}


def _cfg(name, **kw):
    return ModelConfig(name=name, embed_dim=16, num_filters=8, kernel_sizes=[2, 3, 5], hidden_size=8, num_heads=2,
                       dropout=0.1, **kw)


def _batch(cfg):
    items = [({"word": torch.tensor([4, 5]), "char": torch.tensor([3, 4, 5])}, 0),
             ({"word": torch.tensor([6, 7, 8, 9]), "char": torch.tensor([6, 7])}, 1),
             ({"word": torch.tensor([], dtype=torch.long), "char": torch.tensor([], dtype=torch.long)}, 1)]  # empty text
    return pad_batch(items, min_len=min_input_len(cfg))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("inputs", ["word", "char", "both"])
def test_shapes_gradients_and_padding(name, inputs):
    torch.manual_seed(0)
    cfg = _cfg(name, input=inputs)
    model = build_model(cfg, VOCAB, num_classes=3)
    batch, labels = _batch(cfg)
    logits = model(batch)
    assert logits.shape == (3, 3) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits, labels).backward()
    for name_, encoder in model.encoders.items():
        assert encoder.embedding.weight.grad[0].abs().sum() == 0  # padding row never learns
    assert set(model.encoders) == ({"word", "char"} if inputs == "both" else {inputs})


@pytest.mark.parametrize("name", FAMILIES)
def test_padding_does_not_change_the_prediction(name):
    """The same text padded to different widths gives the same logits (masks work)."""
    torch.manual_seed(0)
    cfg = _cfg(name)
    model = build_model(cfg, VOCAB, num_classes=2).eval()
    short = torch.tensor([[4, 5, 6, 7, 8]])
    long = torch.cat([short, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    assert torch.allclose(model({"word": short}), model({"word": long}), atol=1e-5)


def test_textcnn_pads_to_the_widest_kernel():
    cfg = _cfg("textcnn")
    batch, _ = pad_batch([(torch.tensor([4, 5]), 0)], min_len=min_input_len(cfg))
    assert batch["word"].shape == (1, 5)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_transformer_positions(positions):
    model = build_model(_cfg("transformer", positions=positions), VOCAB, 2).eval()
    x = torch.tensor([[4, 5, 6]])
    assert not torch.allclose(model({"word": x}), model({"word": x.flip(1)}))  # order matters


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_prunes_globally(name):
    model = build_model(_cfg(name), VOCAB, 2)
    with torch.no_grad():  # fastText's tables start at zero (already "pruned"): values as training gives them
        for table in (m for m in model.modules() if isinstance(m, torch.nn.Embedding) and not m.weight.any()):
            table.weight.normal_(std=0.1)
    assert prunable_weights(model)
    global_l1_prune(model, 0.5)
    assert sparsity(model)["sparsity_prunable"] == pytest.approx(0.5, abs=0.01)
    batch, _ = _batch(_cfg(name))
    assert torch.isfinite(model(batch)).all()  # still runs, no masks left
    assert not any("_orig" in n for n, _ in model.named_parameters())


def test_transformer_heads_must_divide_embedding():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ModelConfig(name="transformer", embed_dim=30, num_heads=4)


def test_the_learned_position_table_is_as_long_as_the_input_limit():
    """No rows the model can never see (an 8192-row table for 128 tokens was a million dead parameters)."""
    cfg = _cfg("transformer", input="both", max_char_len=96)
    model = build_model(cfg, VOCAB, 2, max_len=40)
    assert model.encoders["word"].positions.weight.shape[0] == 40
    assert model.encoders["char"].positions.weight.shape[0] == 96
    assert build_model(_cfg("transformer", positions="sinusoidal"), VOCAB, 2, max_len=40).encoders["word"].table.shape[0] == 40


def test_pad_batch_pads_with_the_given_id():
    batch, _ = pad_batch([({"tokens": torch.tensor([5, 6, 7])}, 0), ({"tokens": torch.tensor([8])}, 1)], pad_id=3)
    assert batch["tokens"].tolist() == [[5, 6, 7], [8, 3, 3]]


def test_every_registered_family_builds_from_its_own_module():
    from training.models import REGISTRY, family
    from training.models.base import Family

    for name in REGISTRY:
        fam = family(name)
        assert isinstance(fam, Family) and fam.name == name
    with pytest.raises(ValueError, match="unknown model family 'gpt'"):
        family("gpt")


def test_no_code_outside_the_family_modules_branches_on_a_family_name():
    """The worker, evaluation, pruning, registration and the pyfunc go through the family interface."""
    import re
    from pathlib import Path

    from training.models import REGISTRY

    root = Path(__file__).resolve().parents[1]
    names = "|".join(REGISTRY)
    pattern = re.compile(rf"""\.name\s*(==|!=|in)\s*[\(\[]?\s*["']({names})["']""")
    offenders = []
    for folder in ("training", "tasks", "flows"):
        for path in (root / folder).rglob("*.py"):
            if path.parent.name == "models" or path.name == "config.py":  # the families, and the schema's own check
                continue
            offenders += [f"{path.relative_to(root)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                          if pattern.search(line)]
    assert not offenders, offenders


def test_each_rank_and_epoch_has_its_own_reproducible_seed():
    from training.worker import epoch_seed

    seeds = {(rank, epoch): epoch_seed(13, rank, epoch) for rank in range(4) for epoch in range(3)}
    assert len(set(seeds.values())) == len(seeds)  # no two ranks (or epochs) draw the same dropout masks
    assert epoch_seed(13, 1, 2) == seeds[(1, 2)] and epoch_seed(14, 1, 2) != seeds[(1, 2)]


def test_no_weight_decay_on_biases_and_norms():
    from training.worker import parameter_groups

    model = build_model(_cfg("transformer"), VOCAB, 2)
    decay, no_decay = parameter_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("bias") or "norm" in names[id(p)] for p in no_decay["params"])
    assert any(names[id(p)].endswith("embedding.weight") for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_a_family_missing_part_of_the_interface_is_refused_when_it_is_made():
    from training.models.base import Family

    class Half(Family):
        name = "half"

        def inputs(self, cfg):
            return ("word",)

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_fasttext_learns_what_only_the_order_of_tokens_tells():
    """Texts "a b" and "b a" have the same tokens: only the hashed bigrams tell them apart."""
    from training.models.fasttext import ngram_ids
    from training.worker import make_optimizer

    tokens = torch.tensor([[2, 3, 0], [3, 2, 0]])
    assert torch.equal(ngram_ids(tokens, 2, 97), ngram_ids(tokens.clone(), 2, 97))  # deterministic
    assert ngram_ids(tokens, 2, 97)[:, 1].eq(0).all() and ngram_ids(tokens, 3, 97).eq(0).all()  # none into padding
    scores = {}
    for n in (1, 2):
        torch.manual_seed(0)
        cfg = ModelConfig(name="fasttext", input="word", embed_dim=8, ngrams=n, buckets=97, dropout=0.0)
        model = build_model(cfg, {"word": 5, "char": 5}, num_classes=2)
        opt = make_optimizer(model, 0.05, 0.0)
        labels = torch.tensor([0, 1])
        for _ in range(100):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model({"word": tokens}), labels).backward()
            opt.step()
        scores[n] = (model({"word": tokens}).argmax(1) == labels).float().mean().item()
    assert scores == {1: 0.5, 2: 1.0}


def test_fasttext_weighs_features_by_the_train_splits_idf_and_old_checkpoints_weigh_one():
    """fit_weights gives each token and n-gram scikit-learn's smoothed idf over the texts it is shown (a feature no
    text had, and padding, weigh 0); the text's vector is the idf-weighted sum over its L2 norm, which with every
    weight 1 is the plain sum over the square root of the count; a checkpoint without the weights loads with 1s."""
    from sklearn.feature_extraction.text import TfidfTransformer

    from training.models.fasttext import ngram_ids

    cfg = ModelConfig(name="fasttext", input="word", embed_dim=4, ngrams=2, buckets=97, dropout=0.0)
    model = build_model(cfg, {"word": 6, "char": 5}, num_classes=2)
    encoder = model.encoders["word"]
    tokens = torch.tensor([[2, 3, 2, 0], [3, 4, 0, 0], [2, 2, 2, 5]])
    torch.manual_seed(0)
    for table in (encoder.embedding, encoder.ngrams):
        torch.nn.init.normal_(table.weight)
        table.weight.data[0] = 0.0  # padding's row, as training keeps it
    plain = encoder(tokens)
    counts = (tokens != 0).sum(1, keepdim=True)
    bigrams = ngram_ids(tokens, 2, 97)
    expected = (encoder.embedding(tokens).sum(1) + encoder.ngrams(bigrams).sum(1)) / (counts + (bigrams != 0).sum(1, keepdim=True)).sqrt()
    assert torch.allclose(plain, expected, atol=1e-6)

    encoder.fit_weights([tokens[:2], tokens[2:]])  # batches: document frequencies add up over them
    docs = torch.zeros(3, 6)
    for i, row in enumerate(tokens):
        for t in row[row != 0]:
            docs[i, t] += 1
    idf = torch.tensor(TfidfTransformer(smooth_idf=True).fit(docs[:, 1:].numpy()).idf_, dtype=torch.float32)
    seen = docs[:, 1:].sum(0) > 0
    assert torch.allclose(encoder.token_weight[1:][seen], idf[seen]) and encoder.token_weight[1:][~seen].eq(0).all()
    assert encoder.token_weight[0] == 0 and encoder.ngram_weight[0] == 0
    assert encoder.ngram_weight[bigrams[0, 0]] == pytest.approx(1 + math.log(4 / 2))  # "2 3": in 1 of 3 texts
    w, wb = encoder.token_weight[tokens], encoder.ngram_weight[bigrams]
    weighted = ((w.unsqueeze(2) * encoder.embedding(tokens)).sum(1) + (wb.unsqueeze(2) * encoder.ngrams(bigrams)).sum(1))
    norm = (w.square().sum(1) + wb.square().sum(1)).sqrt().unsqueeze(1)
    assert torch.allclose(encoder(tokens), weighted / norm, atol=1e-6) and not torch.allclose(encoder(tokens), plain)

    old = {k: v for k, v in model.state_dict().items() if not k.endswith("_weight")}  # saved before the weights
    again = build_model(cfg, {"word": 6, "char": 5}, num_classes=2)
    again.load_state_dict(old)
    assert torch.allclose(again.encoders["word"](tokens), plain, atol=1e-6)


def test_fasttext_sublinear_tf_and_min_df_give_scikit_learns_tfidf_vector():
    """model.sublinear_tf and model.min_df: with one-hot tables the text's vector is scikit-learn's TF-IDF vector of its
    tokens and n-grams (sublinear tf, smoothed idf, L2 norm over distinct features), features in fewer than min_df
    train texts left out of both; a feature's repeats no longer add linearly."""
    from sklearn.feature_extraction.text import TfidfTransformer

    from training.models.fasttext import ngram_ids

    buckets, vocab = 13, 6
    cfg = ModelConfig(name="fasttext", input="word", embed_dim=vocab + buckets + 1, ngrams=2, buckets=buckets,
                      dropout=0.0, sublinear_tf=True, min_df=2)
    model = build_model(cfg, {"word": vocab, "char": 5}, num_classes=2)
    encoder = model.encoders["word"]
    tokens = torch.tensor([[2, 3, 2, 2, 0], [3, 4, 0, 0, 0], [2, 2, 2, 5, 0], [5, 3, 2, 2, 3]])
    with torch.no_grad():  # one-hot tables: the text's vector is its feature vector (tokens, then n-gram rows)
        encoder.embedding.weight.copy_(torch.eye(vocab, cfg.embed_dim))
        encoder.ngrams.weight.copy_(torch.cat([torch.zeros(buckets + 1, vocab), torch.eye(buckets + 1)], 1))
    encoder.fit_weights([tokens])
    counts = torch.zeros(len(tokens), cfg.embed_dim)
    bigrams = ngram_ids(tokens, 2, buckets)
    for i in range(len(tokens)):
        for t in tokens[i][tokens[i] != 0]:
            counts[i, t] += 1
        for b in bigrams[i][bigrams[i] != 0]:
            counts[i, vocab + b] += 1
    df = (counts > 0).sum(0)
    kept = (df >= 2).numpy()
    expected = TfidfTransformer(sublinear_tf=True).fit_transform(counts[:, kept].numpy()).toarray()
    got = encoder(tokens).detach().numpy()
    assert not got[:, ~kept].any()  # token 4 (in one text) and every bigram seen once
    np.testing.assert_allclose(got[:, kept], expected, atol=1e-6)
    raw = build_model(cfg.model_copy(update={"sublinear_tf": False, "min_df": 1}), {"word": vocab, "char": 5}, 2)
    raw.load_state_dict(model.state_dict())
    raw.encoders["word"].fit_weights([tokens])
    assert not np.allclose(raw.encoders["word"](tokens).detach().numpy(), got, atol=1e-3)


def test_fasttext_starts_as_the_nearest_centroid_classifier_of_the_train_split():
    """model.init=centroids (Family.fit): before any step, the logits are CENTROID_SCALE^2 times the cosine of each text's feature
    vector (words and characters side by side, each over its own norm) and each class's mean vector; unlabelled texts
    (label -1) take no part; dimensions beyond the classes keep zero tables."""
    from training.models.fasttext import CENTROID_SCALE

    torch.manual_seed(0)
    cfg = ModelConfig(name="fasttext", input="both", embed_dim=6, ngrams=2, buckets=31, dropout=0.0, init="centroids")
    model = build_model(cfg, {"word": 9, "char": 12}, num_classes=3).eval()
    words = torch.randint(1, 9, (12, 5)) * (torch.rand(12, 5) < 0.8)
    chars = torch.randint(1, 12, (12, 7))
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, -1, -1])
    batches = [({"word": words[:7], "char": chars[:7]}, labels[:7]), ({"word": words[7:], "char": chars[7:]}, labels[7:])]
    class Split(torch.utils.data.Dataset):  # what Family.fit reads of an EncodedSplit: (inputs, label) items, collate
        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            return {"word": words[i], "char": chars[i]}, labels[i]

        @staticmethod
        def collate(items):
            return {k: torch.stack([x[k] for x, _ in items]) for k in ("word", "char")}, torch.stack([y for _, y in items])

    from training.models import family_of

    family_of(cfg).fit(model, cfg, Split())
    zeros = build_model(cfg.model_copy(update={"init": "zeros"}), {"word": 9, "char": 12}, num_classes=3)
    family_of(cfg).fit(zeros, cfg.model_copy(update={"init": "zeros"}), Split())
    assert zeros.encoders["word"].embedding.weight.eq(0).all()  # the other start: tables at zero

    def vectors(name, tokens):  # each text's weights summed over the input's rows (tokens, then n-gram buckets)
        encoder = model.encoders[name]  # over the norm the encoder divides by: of every occurrence's weight
        rows = encoder.embedding.num_embeddings
        out = torch.zeros(len(tokens), rows + encoder.ngrams.num_embeddings, dtype=torch.float64)
        norm = torch.zeros(len(tokens), 1, dtype=torch.float64)
        for table, ids, weight in encoder.features(tokens):
            out.scatter_add_(1, ids + (0 if table is encoder.embedding else rows), weight[ids].double())
            norm += weight[ids].double().square().sum(1, keepdim=True)
        return out / norm.sqrt()

    x = torch.cat([vectors("word", words), vectors("char", chars)], 1)
    means = torch.stack([x[labels == c].mean(0) for c in range(3)])
    expected = CENTROID_SCALE ** 2 * x @ (means / means.norm(dim=1, keepdim=True)).T
    with torch.no_grad():
        logits = model({"word": words, "char": chars}).double()
    assert torch.allclose(logits, expected, atol=1e-3), (logits - expected).abs().max()
    assert (logits[:10].argmax(1) == labels[:10]).float().mean() > 0.5  # the train texts lie near their own class
    for name in ("word", "char"):  # 3 classes in 6 dimensions: the last 3 stay zero
        assert model.encoders[name].embedding.weight[:, 3:].eq(0).all() and model.encoders[name].ngrams.weight[:, 3:].eq(0).all()


def test_fasttext_refuses_a_table_too_large():
    from training.config import ConfigError
    from training.models import check_model

    with pytest.raises(ConfigError, match="model.buckets"):
        check_model(ModelConfig(name="fasttext", embed_dim=2048, buckets=16_777_216))


def test_fasttext_tables_train_with_sparse_gradients_clipped_and_resumed_like_dense_ones():
    """Its tables get sparse gradients: clipped to the same norm as the same gradients made dense, and the optimiser
    (AdamW beside SparseAdam) saved and loaded mid-run steps exactly as the one that went on."""
    import copy

    from training.worker import DenseAndSparse, clip_gradients, make_optimizer

    torch.manual_seed(0)
    cfg = ModelConfig(name="fasttext", input="both", embed_dim=8, buckets=101, dropout=0.0)
    sparse = build_model(cfg, VOCAB, num_classes=3)
    dense = copy.deepcopy(sparse)
    for table in dense.modules():
        if isinstance(table, torch.nn.Embedding):
            table.sparse = False
    batch, labels = _batch(cfg)
    for model in (sparse, dense):
        (10 * torch.nn.functional.cross_entropy(model(batch), labels)).backward()
    assert sparse.encoders["char"].ngrams.weight.grad.is_sparse
    norm = clip_gradients(sparse.parameters(), 0.5)
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)), rel=1e-5) and norm > 0.5
    for (name, a), b in zip(sparse.named_parameters(), dense.parameters()):
        assert torch.allclose(a.grad.to_dense(), b.grad, atol=1e-6), name

    opt = make_optimizer(sparse, 0.01, 0.01)
    assert isinstance(opt, DenseAndSparse)
    opt.step()
    saved, state = copy.deepcopy(sparse), copy.deepcopy(opt.state_dict())
    again = make_optimizer(saved, 0.01, 0.01)
    again.load_state_dict(state)
    for model, optimizer in ((sparse, opt), (saved, again)):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch), labels).backward()
        optimizer.step()
    for a, b in zip(sparse.parameters(), saved.parameters()):
        assert torch.equal(a, b)


def test_on_a_cpu_machine_fasttext_trains_in_one_process_unless_told_otherwise():
    import os

    from tasks.launch import resolve_nproc
    from training.models import family_of

    cores = os.cpu_count()
    fasttext, textcnn = family_of(ModelConfig(name="fasttext")), family_of(ModelConfig(name="textcnn"))
    assert resolve_nproc(None, family=fasttext) == 1
    assert resolve_nproc(None, family=textcnn) == cores  # a process per core
    assert resolve_nproc(None, cores=1, family=textcnn) == 1  # a parallel sweep trial's share of the cores
    assert resolve_nproc(cores, family=fasttext) == cores  # train.nproc given: as given


def test_row_sparse_adam_steps_as_torchs_sparse_adam():
    """zhflow's SparseAdam reads and writes the touched rows by index: the same parameters and moments as torch's,
    step for step (repeated rows in a batch, rows untouched for a while, a learning rate that changes), and the
    same state layout, so either loads the other's checkpoint."""
    from training.worker import RowSparseAdam

    tables = [torch.nn.Embedding(40, 6, sparse=True) for _ in range(2)]
    tables[1].load_state_dict(tables[0].state_dict())
    start = tables[0].weight.detach().clone()
    ours, theirs = RowSparseAdam([tables[0].weight], lr=0.05), torch.optim.SparseAdam([tables[1].weight], lr=0.05)
    g = torch.Generator().manual_seed(3)
    for step in range(8):
        ids = torch.randint(0, 10 if step % 2 else 40, (25,), generator=g)  # repeats; rows 10-39 only every other step
        target = torch.randn(25, 6, generator=g)
        for table, optimizer in zip(tables, (ours, theirs)):
            optimizer.param_groups[0]["lr"] = 0.05 / (1 + step)
            optimizer.zero_grad()
            ((table(ids) - target) ** 2).sum().backward()
            optimizer.step()
        assert torch.allclose(tables[0].weight, tables[1].weight, rtol=1e-6, atol=1e-7), step
    assert (tables[0].weight - start).abs().max() > 0.05  # they moved, together
    a, b = ours.state_dict(), theirs.state_dict()
    assert a["state"][0].keys() == b["state"][0].keys() and a["state"][0]["step"] == b["state"][0]["step"] == 8
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.allclose(a["state"][0][key], b["state"][0][key], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("share", [1, 24], ids=["active-rows", "whole-table"])
def test_the_l2_penalty_steps_every_row_as_dense_adam_with_coupled_decay(share, monkeypatch):
    """``train.l2`` on a table with sparse gradients: the lazy optimiser moves every row touched so far (and every row
    not at zero at the start), each step, as torch's dense Adam with ``weight_decay`` (an L2 penalty in the gradient)
    moves the whole table, by the active rows' path and by the whole table's; rows at zero that no batch touched stay
    at zero; saved and loaded mid-run (the state's mask of active rows comes back as floats), it goes on exactly as
    the one that was not; and the dense parameters' penalty is Adam's coupled decay too."""
    import copy

    from training import worker
    from training.worker import PenalisedAdamW, RowSparseAdam

    monkeypatch.setattr(worker, "DENSE_SHARE", share)  # 1: never the whole table (its 60 rows are never all active)

    g = torch.Generator().manual_seed(5)
    sparse = torch.nn.Embedding(60, 4, sparse=True)
    with torch.no_grad():
        sparse.weight.zero_()
        sparse.weight[50:53] = torch.randn(3, 4, generator=g)  # not at zero from the start, never touched by a batch
        start = sparse.weight[50:53].clone()
    dense = torch.nn.Embedding(60, 4)
    dense.load_state_dict(sparse.state_dict())
    ours, theirs = RowSparseAdam([sparse.weight], lr=0.05, l2=0.3), torch.optim.Adam([dense.weight], lr=0.05, weight_decay=0.3)
    for step in range(10):
        ids = torch.randint(0, 10 if step < 5 else 30, (12,), generator=g)  # rows 30-49 never; 10-29 from step 5
        target = torch.randn(12, 4, generator=g)
        for table, optimizer in ((sparse, ours), (dense, theirs)):
            optimizer.zero_grad()
            ((table(ids) - target) ** 2).sum().backward()
            optimizer.step()
        assert torch.allclose(sparse.weight, dense.weight, rtol=1e-5, atol=1e-6), step
        if step == 4:  # a resume: the state through a checkpoint
            state = copy.deepcopy(ours.state_dict())
            ours = RowSparseAdam([sparse.weight], lr=0.05, l2=0.3)
            ours.load_state_dict(state)
    assert torch.count_nonzero(sparse.weight[30:50]) == 0
    assert 0 < sparse.weight[50:53].norm() < start.norm()  # never touched by a batch: shrunk by the penalty alone

    linear = torch.nn.Linear(5, 3)
    twin = copy.deepcopy(linear)
    a = PenalisedAdamW([{"params": [linear.weight], "l2": 0.2, "weight_decay": 0.0}], lr=0.02)
    b = torch.optim.Adam([twin.weight], lr=0.02, weight_decay=0.2)
    for _ in range(5):
        x = torch.randn(7, 5, generator=g)
        for layer, optimizer in ((linear, a), (twin, b)):
            optimizer.zero_grad()
            layer(x).square().sum().backward()
            optimizer.step()
    assert torch.allclose(linear.weight, twin.weight, rtol=1e-5, atol=1e-7)
