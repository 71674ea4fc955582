"""Training until it stops improving: the stop rule, the learning-rate schedule and the time budget, with the real
worker in this process (one process, no torchrun) on small prepared datasets."""


import numpy as np
import pytest
import torch

from tests.conftest import sentiment_rows, write_csv
from training.job import WorkerJob
from training.overrides import apply_overrides
from training.presets import default, preset
from training.data.prepare import prepare_dataset
from training.evaluate import load_model, open_split, predict_proba
from training.worker import LRSchedule, improves
from training.worker import main as worker

TOPICS = {  # 12 classes, each with its own words; every text mixes two of them with shared filler
    "体育": ["足球", "篮球", "比赛", "冠军", "球员"], "财经": ["股票", "银行", "利率", "投资", "基金"],
    "科技": ["芯片", "手机", "软件", "网络", "电脑"], "娱乐": ["电影", "明星", "演唱会", "导演", "综艺"],
    "教育": ["学校", "考试", "老师", "学生", "课程"], "健康": ["医院", "医生", "药品", "疾病", "手术"],
    "旅游": ["景点", "酒店", "机票", "游客", "风景"], "美食": ["餐厅", "菜谱", "火锅", "甜点", "厨师"],
    "汽车": ["发动机", "轮胎", "油耗", "车型", "驾驶"], "房产": ["房价", "楼盘", "租金", "物业", "户型"],
    "军事": ["军舰", "导弹", "部队", "演习", "战机"], "农业": ["庄稼", "化肥", "农民", "收成", "种子"],
}
FILLER = ["今天", "我们", "发现", "这个", "非常", "一些", "已经", "开始", "关于", "新的", "消息", "大家"]

def topic_rows(per_class: int = 25, seed: int = 0) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    rows = []
    for label, words in TOPICS.items():
        for i in range(per_class):
            a, b = rng.choice(words, 2, replace=False)
            f1, f2, f3 = rng.choice(FILLER, 3)
            rows.append((f"{f1}{a}{f2}{b}{f3}，第{i}条", label))
    return rows

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    out = {}
    for name, rows in (("topics", topic_rows()), ("easy", sentiment_rows(40))):
        cfg = apply_overrides(default(), [f"data.dataset={write_csv(root / f'{name}.csv', rows)}", "preprocess.min_freq=1",
                                          "preprocess.num_workers=1"])
        prepare_dataset(cfg.data, cfg.preprocess, root / name)
        out[name] = root / name
    return out

def _train(prepared_dir, out, *overrides, deadline=None) -> dict:
    """The default preset's training settings on a small TextCNN (it runs in seconds and, unlike fastText, which
    separates these topics in 3 epochs, it needs more than the old budget of 5)."""
    cfg = apply_overrides(preset("default", "textcnn"), ["model.embed_dim=32", "model.num_filters=16", *overrides])
    job = WorkerJob(stage="train", prepared_dir=str(prepared_dir), out_dir=str(out), model=cfg.model, train=cfg.train,
                    max_len=64, deadline=deadline)
    (out.parent / f"{out.name}.json").write_text(job.model_dump_json())
    return worker(["--config", str(out.parent / f"{out.name}.json")])

def test_a_run_the_old_five_epochs_would_have_cut_short_goes_on_and_does_not_collapse(prepared, tmp_path):
    """12 classes of about 19 training texts each: 4 optimiser steps an epoch. Validation still rises after epoch 5
    (the old budget); the run goes on until it converges and ends with a model that tells the classes apart."""
    result = _train(prepared["topics"], tmp_path / "run")
    assert result["stop_reason"] == "converged" and not result["still_improving"]
    assert result["best_epoch"] > 5 and result["epochs_run"] < 100
    model, cfg, _ = load_model(result["best_checkpoint"])
    test = open_split(prepared["topics"], "test", cfg, 64)
    predicted = predict_proba(model, test, 64).argmax(1)
    assert len(set(predicted.tolist())) >= 8  # not one class for everything
    from sklearn.metrics import f1_score

    assert f1_score(test.labels, predicted, average="macro") > 0.5  # chance is 1/12

def test_a_run_that_plateaus_stops_long_before_the_maximum(prepared, tmp_path):
    result = _train(prepared["easy"], tmp_path / "run", "train.patience=2", "train.min_steps=0")
    assert result["stop_reason"] == "converged" and result["epochs_run"] < 40
    assert result["epochs_run"] - result["best_epoch"] == 2

def test_reaching_the_maximum_while_improving_is_reported(prepared, tmp_path):
    result = _train(prepared["topics"], tmp_path / "run", "train.epochs=2")
    assert result["stop_reason"] == "max_epochs" and result["still_improving"] and result["epochs_run"] == 2

def test_the_time_budget_ends_training_with_the_best_model_kept(prepared, tmp_path):
    import time

    result = _train(prepared["topics"], tmp_path / "run", "train.patience=1000", deadline=time.time() + 3)
    assert result["stop_reason"] == "timeout" and 1 <= result["epochs_run"] < 100
    assert load_model(result["best_checkpoint"])[0] is not None

def test_the_plateau_schedule_does_not_depend_on_the_maximum_and_resumes_its_decays():
    short, long = LRSchedule(100, 10, "plateau", 0.5), LRSchedule(100_000, 10, "plateau", 0.5)
    assert [short(s) for s in range(50)] == [long(s) for s in range(50)]
    assert short(5) == pytest.approx(0.6) and short(20) == 1.0
    short.decay()
    short.decay()
    assert short(20) == 0.25
    # LambdaLR keeps a callable object's attributes: a resumed run goes on at the decayed rate
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    state = torch.optim.lr_scheduler.LambdaLR(optimizer, short).state_dict()
    fresh = LRSchedule(100, 10, "plateau", 0.5)
    torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), fresh).load_state_dict(state)
    assert fresh.scale == 0.25
    linear = LRSchedule(100, 10, "linear")
    assert linear(99) < 0.02  # the decaying schedules still end at their maximum

def test_an_equal_macro_f1_with_a_lower_loss_counts_as_progress_short_of_perfect():
    best = {"val_macro_f1": 0.0, "val_loss": 4.0}
    assert improves({"val_macro_f1": 0.0, "val_loss": 3.9}, best)
    assert not improves({"val_macro_f1": 0.0, "val_loss": 4.1}, best)
    assert improves({"val_macro_f1": 0.1, "val_loss": 9.0}, best)
    assert not improves({"val_macro_f1": 1.0, "val_loss": 0.01}, {"val_macro_f1": 1.0, "val_loss": 0.02})
    assert improves({"val_macro_f1": 0.2, "val_loss": 1.0}, None)
