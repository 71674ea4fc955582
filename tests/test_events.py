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


def test_the_launcher_reads_why_torchrun_restarted_the_worker_group():
    from tasks.launch import _failure

    before = ["[train] epoch 1 ...", "Traceback (most recent call last):",
              "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
              "port: 41235, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
              "RuntimeError: Connection closed by peer [127.0.0.1]:3817"]  # the peer's error, after the first
    line = ("E1206 20:14:03.120000 3141 torch/distributed/elastic/multiprocessing/api.py:1003] failed (exitcode: 1) "
            "local_rank: 0 (pid: 3150) of binary: /usr/bin/python3")
    assert _failure(line, before) == "local rank 0 exited with code 1: " + before[2]
    killed = line.replace("exitcode: 1) local_rank: 0", "exitcode: -9) local_rank: 1")
    assert _failure(killed, []) == "local rank 1 was killed by SIGKILL"
    assert _failure(before[3], before) is None
