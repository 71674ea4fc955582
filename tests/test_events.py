"""The worker's one channel back: whole JSON lines only, in order, a line still being written kept for later."""

from training.events import EventReader, EventWriter, read_result


def test_a_reader_sees_whole_events_in_order_and_never_half_of_one(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read() == []  # no file yet: the worker has not started
    writer = EventWriter(path)
    writer.emit("epoch", epoch=1, val_macro_f1=0.5)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"event": "epoch", "epo')  # a line cut where a write is under way
    assert reader.read() == [{"event": "epoch", "epoch": 1, "val_macro_f1": 0.5}]
    with open(path, "a", encoding="utf-8") as f:
        f.write('ch": 2, "text": "好"}\n')
    writer.emit("result", best_epoch=2)
    assert reader.read() == [{"event": "epoch", "epoch": 2, "text": "好"}, {"event": "result", "best_epoch": 2}]
    assert reader.read() == []
    writer.close()
    (tmp_path / "job").mkdir()
    EventWriter(tmp_path / "job" / "events.jsonl").emit("result", best_epoch=7)
    assert read_result(tmp_path / "job") == {"best_epoch": 7}
    assert read_result(tmp_path / "nothing") is None
